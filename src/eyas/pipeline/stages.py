"""Running stages in order inside one run folder, skipping those already done with the same settings.

A run is one folder `runs/<name>/`: each stage's output, `stages/<stage>.json` (its settings, summary and
wall time: the proof a stage finished), logs, metrics and the report. A stage whose marker holds the same
settings is skipped and says so; change a setting (or pass --force) and it runs again. So does a stage whose
input an earlier stage rewrote since: B reads A's output when one of B's path settings and A's output path
(`out`; `store` for extract) are the same path or one holds the other, and B is stale when A finished after B.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from eyas.core.config import from_mapping, to_argv
from eyas.core.errors import EyasError
from eyas.core.files import move_aside, read_json, write_json
from eyas.core.log import Console, fmt_duration
from eyas.core.threads import OMP_DEFAULTED
from eyas.data.vllm_backend import SharedEngine
from eyas.doctor.diagnose import crash_cause
from eyas.pipeline.registry import load_stage
from eyas.store.extract import SUMMARY_FILE as EXTRACT_SUMMARY
from eyas.train.trainer import SUMMARY_FILE as TRAIN_SUMMARY


@dataclasses.dataclass(frozen=True)
class Stage:
    """One step of a pipeline: an eyas command with its settings (the fields of its config dataclass)."""

    name: str  # label in the run folder, e.g. "prepare-train"
    command: str  # eyas subcommand, e.g. "prepare"
    settings: dict
    nproc: int = 1  # >1: launched under torchrun with this many processes
    fresh: tuple[str, ...] = ()  # folders the stage resumes into: --force removes them first (inside the run only)


def settings_key(stage: Stage) -> str:
    blob = json.dumps({"command": stage.command, "settings": stage.settings, "nproc": stage.nproc},  # not `fresh`
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


OUTPUT_KEYS = {"extract": ("store",)}  # the settings naming what a command writes (default: `out`)


def _output_keys(stage: Stage) -> tuple[str, ...]:
    return OUTPUT_KEYS.get(stage.command, ("out",))


def outputs(stage: Stage) -> list[Path]:
    return [Path(stage.settings[k]).resolve() for k in _output_keys(stage) if isinstance(stage.settings.get(k), str)]


def reads(later: Stage, earlier: Stage) -> bool:
    """Whether `later` reads what `earlier` writes: one of its other path-like settings and `earlier`'s output
    are the same path, or one holds the other (a checkpoint inside a run folder, a run folder holding a store)."""
    mine = set(_output_keys(later))
    values = [v for k, v in later.settings.items() if k not in mine]
    paths = [Path(x).resolve() for v in values for x in (v if isinstance(v, (list, tuple)) else [v])
             if isinstance(x, str) and os.sep in x]
    return any(a == o or a.is_relative_to(o) or o.is_relative_to(a) for a in paths for o in outputs(earlier))


def _finished(marker: Path, done: dict | None = None) -> float:
    """When the stage of `marker` (its content `done`, when already read) finished (markers written before
    "finished" was kept: the file's time; 0 when it never finished)."""
    if not marker.exists():
        return 0.0
    done = done if done is not None else read_json(marker, f"remove {marker} to run its stage again")
    return done.get("finished") or marker.stat().st_mtime


def _summary_file(stage: Stage, cfg) -> Path:
    """Where a torchrun stage's rank 0 writes its summary (the console shows the human lines meanwhile)."""
    if stage.command == "train":
        return Path(cfg.out) / TRAIN_SUMMARY
    return Path(cfg.store) / EXTRACT_SUMMARY


def _launch_torchrun(stage: Stage, cfg, log_path: Path, con: Console) -> dict:
    """Run a stage under torchrun, its output shown (rank 0's plan and audit lines) and kept in the log."""
    entry = ["eyas.train"] if stage.command == "train" else ["eyas", stage.command]  # python -m ENTRY
    port = 29500 + (os.getpid() % 2000)
    cmd = [sys.executable, "-m", "eyas.torchrun", "--nproc_per_node", str(stage.nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", *entry, *to_argv(cfg)]
    con.print(f"[{stage.name}] torchrun --nproc_per_node {stage.nproc} -m {' '.join(entry)} ... (log: {log_path})")
    summary_path = _summary_file(stage, cfg)
    summary_path.unlink(missing_ok=True)
    env = dict(os.environ)
    if not env.get("OMP_NUM_THREADS"):  # else torchrun sets 1; marked as eyas's so the ranks still adapt it
        env["OMP_NUM_THREADS"] = env[OMP_DEFAULTED] = str(max(1, (os.cpu_count() or 2) // stage.nproc))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                con.print(line.rstrip("\n"))
            proc.wait()
        except BaseException:  # this process stopped (Ctrl-C, SIGTERM): torchrun stops its ranks, then ends
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    if proc.returncode != 0 or not summary_path.is_file():
        cause = crash_cause(log_path) if proc.returncode != 0 else None
        raise EyasError(f"stage {stage.name} failed under torchrun (exit {proc.returncode})",
                        f"{cause} (the log: {log_path})" if cause else f"see the log {log_path}",
                        "fix the error shown there and rerun: completed stages are kept")
    return read_json(summary_path, f"see the log {log_path}, and rerun the stage")


def shares_engine(stage: Stage) -> bool:
    """A stage that can take its vLLM server from the run's SharedEngine: regenerate --engine vllm, one process."""
    return stage.command == "regenerate" and stage.nproc == 1 and stage.settings.get("engine") == "vllm"


def run_stage(stage: Stage, run_dir: Path, con: Console, force: bool = False, upstream: tuple[Stage, ...] = (),
              engine: SharedEngine | None = None) -> dict:
    """Run one stage, or skip it when it finished with the same settings after every stage in `upstream` (those
    whose output it reads) finished. `engine`: the run's shared vLLM server, for a stage that shares_engine."""

    marker = run_dir / "stages" / f"{stage.name}.json"
    key = settings_key(stage)
    done = read_json(marker, f"remove {marker} to run the stage again") if marker.exists() else None
    same = bool(done) and done.get("key") == key
    mine = _finished(marker, done) if same else 0.0
    newer = [u.name for u in upstream if same and _finished(run_dir / "stages" / f"{u.name}.json") > mine]
    if same and not force and not newer:
        con.print(f"[{stage.name}] cached: finished earlier with the same settings "
                  f"({fmt_duration(done.get('elapsed_s', 0))}), skipped (rerun with --force to redo)")
        return done["summary"]
    if same and newer:
        con.print(f"[{stage.name}] its input changed: {', '.join(newer)} finished after it; running it again")
    # a run that began and did not finish; not *.json, which name finished stages
    started = run_dir / "stages" / f"{stage.name}.started"
    began = read_json(started, f"remove {started} to run the stage again") if started.exists() else None
    if force or done or (began and began.get("key") != key):
        # redo, or begun or finished with other settings: what it left cannot be resumed under these
        _clear(stage, run_dir, con, "--force" if force else "input changed" if newer else "settings changed")
    write_json(started, {"key": key})
    cls, run = load_stage(stage.command)
    cfg = from_mapping(cls, stage.settings, f"stage {stage.name}")
    con.print(f"[{stage.name}] eyas {stage.command} {' '.join(to_argv(cfg))}")
    t0 = time.perf_counter()
    if stage.nproc > 1:
        summary = _launch_torchrun(stage, cfg, run_dir / "logs" / f"{stage.name}.log", con)
    elif engine is not None and shares_engine(stage):
        summary = run(cfg, engine)
    else:
        summary = run(cfg)
    elapsed = time.perf_counter() - t0
    write_json(marker, {"key": key, "command": stage.command, "settings": stage.settings, "nproc": stage.nproc,
                        "summary": summary, "elapsed_s": elapsed, "finished": time.time()})
    started.unlink(missing_ok=True)
    return summary


def _clear(stage: Stage, run_dir: Path, con: Console, why: str) -> None:
    """Set aside what a resuming stage would otherwise continue from: renamed beside itself (when and why in its
    name), never deleted, and never anything outside the run."""
    root = run_dir.resolve()
    for folder in stage.fresh:
        path = Path(folder).resolve()
        if not path.is_relative_to(root) or path == root:
            raise EyasError(f"stage {stage.name} would clear {path}, which is not inside the run folder {root}",
                            fix="give the stage an output folder inside the run")
        if path.exists():
            kept = move_aside(path, why)
            con.print(f"[{stage.name}] {why}: the earlier output is kept as {kept} (remove it when you no longer "
                      "need it); the stage starts afresh", force=True)


def run_pipeline(stages: list[Stage], run_dir: Path, con: Console, force: bool = False) -> dict[str, dict]:
    """Every stage in order. Consecutive regenerate stages through vLLM that would start the same server share
    one, started by the first and stopped before any other stage runs (and on every way out)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    write_json(run_dir / "pipeline.json", [dataclasses.asdict(s) for s in stages])
    summaries = {}
    with SharedEngine() as engine:
        for i, s in enumerate(stages):
            if not shares_engine(s):
                engine.close()  # the next stages need the memory and cores
            summaries[s.name] = run_stage(s, run_dir, con, force, tuple(u for u in stages[:i] if reads(s, u)), engine)
    return summaries
