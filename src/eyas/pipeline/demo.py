"""`eyas demo` (the whole pipeline on the embedded default target) and `eyas run CONFIG.toml` (the same from a file).

Both build a list of `pipeline.Stage`s and run them in one run folder; a second run skips finished stages.

A config file lists stages as tables in the order they run. A table named after a command is that command;
any other table names its command with `command = "..."`. `nproc = N` launches a stage (train, extract) under
torchrun with N processes. `{run}` in a string setting stands for the run folder.

    [run]
    name = "smollm2"
    [regenerate]
    target = "smollm2-135m"
    data = ["gsm8k-train"]
    out = "{run}/regenerated.jsonl"
    [prepare]
    data = ["{run}/regenerated.jsonl"]
    out = "{run}/prepared"
    ...
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from eyas.core.config import StageConfig, check, from_mapping, load_toml, opt
from eyas.core.errors import EyasError
from eyas.core.log import console
from eyas.pipeline.registry import COMMANDS, load_stage
from eyas.pipeline.stages import Stage, run_pipeline
from eyas.speculate.results import lossless_word


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig(StageConfig):
    quick: bool = opt(False, "the tiny random target and a few dozen samples (CI uses it; docs/demo.md gives its time)")
    name: str = opt("", "run name: the run folder is RUNS_DIR/NAME (default: demo, or demo-quick with --quick)")
    runs_dir: str = opt("runs", "folder holding the runs")
    target: str = opt("", "the target (default: tiny with --quick, else smollm2-135m); e.g. tiny-deepseek-v3")
    samples: int = opt(0, "training conversations (0: 320, or 48 with --quick)")
    eval_prompts: int = opt(0, "MT-Bench questions evaluated (0: 6, or 4 with --quick)")
    nproc: int = opt(2, "extraction and training processes under torchrun (on a CPU, one per core: docs/threads.md; "
                        "on GPUs at most one per GPU)")
    parallel: str = opt("ddp", "training's data parallelism: ddp, or fsdp (FSDP2)", choices=("ddp", "fsdp"))
    force: bool = opt(False, "rerun every stage even when it finished before with the same settings")

    def validate(self):
        check(self.nproc >= 1, f"--nproc must be at least 1, got {self.nproc}", "pass --nproc 1 or 2")
        check(self.samples >= 0 and self.eval_prompts >= 0, "--samples and --eval-prompts cannot be negative",
              "pass 0 for the defaults")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig(StageConfig):
    config: str = opt(None, "a TOML file listing the stages (see examples/)", positional=True)
    runs_dir: str = opt("runs", "folder holding the runs")
    force: bool = opt(False, "rerun every stage even when it finished before with the same settings")


def gpu_ranks(nproc: int) -> int:
    """The demo's ranks: --nproc, but at most one per GPU where CUDA is (each rank takes cuda:LOCAL_RANK)."""
    import torch  # heavy (seconds to import): only the demo asks it, `eyas run` need not load it

    return min(nproc, torch.cuda.device_count()) if torch.cuda.is_available() else nproc


def demo_stages(cfg: DemoConfig, run: Path) -> list[Stage]:
    """The demo: regenerate answers, prepare, extract and train on 2 ranks, evaluate, export, report."""
    quick = cfg.quick
    target = cfg.target or ("tiny" if quick else "smollm2-135m")
    n = cfg.samples or (48 if quick else 320)
    n_chat = max(2, n // 8)  # some chitchat dialogues (their first 3 turns, answered in turn), the rest GSM8K
    # generation is bound by per-step overhead on a CPU, so a wide batch costs little more per step than a narrow one
    regen = dict(target=target, dtype="auto", max_new_tokens=48 if quick else 160, batch_size=32, quiet=cfg.quiet)
    r = str(run)
    ranks = gpu_ranks(cfg.nproc)
    return [
        Stage("regenerate-gsm8k", "regenerate", dict(regen, data=("gsm8k-train",), max_samples=n - n_chat,
                                                      out=f"{r}/regenerated/gsm8k.jsonl")),
        Stage("regenerate-chitchat", "regenerate", dict(regen, data=("chitchat",), max_samples=n_chat,
                                                         max_new_tokens=16 if quick else 64, max_turns=3,
                                                         out=f"{r}/regenerated/chitchat.jsonl")),
        Stage("prepare", "prepare", dict(target=target, data=(f"{r}/regenerated/gsm8k.jsonl",
                                                              f"{r}/regenerated/chitchat.jsonl"),
                                         out=f"{r}/prepared", max_length=1024, overwrite=True, quiet=cfg.quiet)),
        Stage("extract", "extract", dict(target=target, data=f"{r}/prepared", store=f"{r}/store", quiet=cfg.quiet),
              nproc=ranks),
        Stage("train", "train", dict(target=target, store=f"{r}/store", out=f"{r}/train", epochs=2 if quick else 3,
                                     ttt_steps=3, lr=1e-3, micro_batch=1, max_tokens=1024,
                                     draft_vocab=2048 if quick else 8192, checkpoint_every=50, resume=True,
                                     parallel=cfg.parallel, quiet=cfg.quiet),
              nproc=ranks, fresh=(f"{r}/train",)),
        Stage("evaluate", "evaluate", dict(target=target, draft=f"{r}/train/final", bench="mt_bench",
                                           out=f"{r}/evaluate", num_prompts=cfg.eval_prompts or (4 if quick else 6),
                                           max_new_tokens=48 if quick else 64, chain=(3, 5) if quick else (3, 5, 7),
                                           hf_generate=False,  # the lean greedy decoder is the baseline either way
                                           quiet=cfg.quiet)),
        Stage("export-eagle3", "export", dict(checkpoint=f"{r}/train/final", format="eagle3",
                                              out=f"{r}/export/eagle3", overwrite=True, quiet=cfg.quiet)),
        Stage("export-speculators", "export", dict(checkpoint=f"{r}/train/final", format="speculators",
                                                   out=f"{r}/export/speculators", overwrite=True, quiet=cfg.quiet)),
        Stage("report", "report", dict(run=r, quiet=cfg.quiet)),
    ]


def _final_lines(summaries: dict, run: Path) -> list[str]:
    """tau, speedup and the lossless verdict of the trained draft's fastest configuration, and the report's path."""
    ev = summaries.get("evaluate") or {}
    configs = ev.get("configs") or []
    drafted = [c for c in configs if c.get("drafter") == "eagle3"]
    checked = [c["lossless"] for c in configs if (c.get("lossless") or {}).get("checked")]
    lines = [f"run folder: {run}"]
    if drafted:
        best = max(drafted, key=lambda c: c.get("speedup") or 0.0)
        words = {lossless_word(x) for x in checked}
        verdict = ("not checked" if not checked else "NO" if "NO" in words else "yes" if words == {"yes"}
                   else "yes (every token the target's top-1; near-ties rounded otherwise than plain greedy)")
        lines.append(f"draft {best['name']}: acceptance length tau {best['tau']:.2f}, "
                     f"speedup {best['speedup']:.2f}x over plain greedy decoding, lossless: {verdict}")
    lookup = [c for c in configs if c.get("drafter") == "prompt-lookup"]
    if drafted and lookup:  # the yardstick a newcomer needs beside a demo draft's small figures
        pl = lookup[0]
        lines.append(f"prompt lookup (no training) on the same prompts: tau {pl['tau']:.2f}, {pl['speedup']:.2f}x. "
                     "The demo's draft learns from a few hundred conversations: it shows the pipeline, "
                     "not a draft worth serving; docs/recipe.md trains one (eyas run examples/smollm2-recipe.toml)")
    rep = summaries.get("report") or {}
    if rep.get("path"):
        lines.append(f"report: {rep['path']}")
    return lines


def run(cfg: DemoConfig) -> dict:
    con = console(0, cfg.quiet, cfg.json)
    name = cfg.name or ("demo-quick" if cfg.quick else "demo")
    run_dir = Path(cfg.runs_dir) / name
    con.print(f"eyas demo: {'tiny target (quick)' if cfg.quick else 'SmolLM2-135M-Instruct'} -> {run_dir}")
    summaries = run_pipeline(demo_stages(cfg, run_dir), run_dir, con, cfg.force)
    for line in _final_lines(summaries, run_dir):
        con.summary(line)
    return {"run": str(run_dir), "stages": summaries}


def stages_from_toml(doc: dict, run: Path, source: str) -> list[Stage]:
    stages = []
    for name, table in doc.items():
        if name == "run":
            continue
        if not isinstance(table, dict):
            raise EyasError(f"{source}: [{name}] is not a table", fix="write each stage as a [table] of settings")
        table = dict(table)
        command = table.pop("command", name)
        nproc = int(table.pop("nproc", 1))
        if command not in COMMANDS:
            raise EyasError(f"{source}: [{name}] names no eyas command ({command!r})",
                            fix=f"name the table after a command or add command = one of {', '.join(COMMANDS)}")
        settings = {k: _substitute(v, run) for k, v in table.items()}
        # refused now, before the run folder holds a copy of it (an `api_key = ...` is no setting, and not kept)
        from_mapping(load_stage(command)[0], settings, f"{source} [{name}]")
        fresh = (settings["out"],) if command == "train" and settings.get("resume") and "out" in settings else ()
        stages.append(Stage(name, command, settings, nproc, fresh))
    if not stages:
        raise EyasError(f"{source} lists no stages", fix="add tables such as [prepare], [extract], [train]")
    return stages


def _substitute(value, run: Path):
    if isinstance(value, str):
        return value.replace("{run}", str(run))
    if isinstance(value, list):
        return tuple(_substitute(v, run) for v in value)
    return value


def run_config(cfg: RunConfig) -> dict:
    con = console(0, cfg.quiet, cfg.json)
    doc = load_toml(cfg.config)
    name = (doc.get("run") or {}).get("name") or Path(cfg.config).stem
    run_dir = Path(cfg.runs_dir) / name
    stages = stages_from_toml(doc, run_dir, cfg.config)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(Path(cfg.config).read_text())
    summaries = run_pipeline(stages, run_dir, con, cfg.force)
    for line in _final_lines(summaries, run_dir):
        con.summary(line)
    return {"run": str(run_dir), "stages": json.loads(json.dumps(summaries, default=str))}
