"""bench_peers.py's runs: each trainer's command line, one run in fresh processes (through peers_shim.py), its
record read back, and --accuracy's snapshots scored by one evaluator."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from peers_shim import REPORT

SHIM = Path(__file__).resolve().with_name("peers_shim.py")  # every trainer process starts through it


def eyas_args(args, d, out: Path, nproc: int, threads: int) -> list[str]:
    return ["--store", str(d["store"]), "--target", args.target, "--out", str(out), "--epochs", str(args.epochs),
            "--num-layers", "1", "--draft-vocab", str(args.draft_vocab), "--ttt-steps", str(args.ttt_steps),
            "--lr", str(args.lr), "--threads", str(threads), "--seed", str(args.seed),
            *(["--data-fraction", repr(args.data_fraction)] if args.store and args.data_fraction < 1 else []),
            "--json", *args.eyas_args.split()]


def speculators_args(args, d, out: Path, nproc: int, threads: int) -> list[str]:
    n = len(d["lengths"])
    return [str(Path(args.peers_dir) / "spec_cpu_train.py"), "--verifier-name-or-path", str(d["verifier"]),
            "--data-path", str(d["speculators"]), "--save-path", str(out / "checkpoints"), "--log-dir", str(out),
            "--speculator-type", "eagle3", "--num-layers", "1", "--draft-vocab-size", str(args.draft_vocab),
            "--target-layer-ids", *map(str, args.layers), "--ttt-steps", str(args.ttt_steps), "--lr", str(args.lr),
            "--optimizer", "adamw", "--scheduler-type", "cosine", "--epochs", str(args.epochs),
            "--total-seq-len", str(max(args.spec_total_seq_len, max(d["lengths"]))),  # never truncates a sample
            "--train-data-ratio", repr((n + 0.5) / (n + 1)),  # rows 0..n-1 train, the copy of row 0 validates
            "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers", "0",
            "--on-missing", "raise", "--no-resume-from-checkpoint", "--seed", str(args.seed),
            # --accuracy, --export: the EAGLE-3 draft eyas imports (its 0.9.0 defaults add three norm variants and a
            # 2,048-token window)
            *(["--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output", "--full-attention-indices", "0"]
              if args.snapshots else []),
            *args.spec_args.split()]


def specforge_args(args, d, out: Path, nproc: int, threads: int) -> list[str]:
    cfg = {"model": {"target_model_path": str(d["verifier"]), "draft_num_hidden_layers": 1,
                     "lm_head_key": args.sf_lm_head_key, "aux_hidden_state_layer_ids": args.layers},
           "data": {"hidden_states_path": str(d["specforge"]), "cache_dir": str(d["root"] / "specforge-cache")},
           "training": {"num_epochs": args.epochs, "batch_size": args.sf_batch_size, "learning_rate": args.lr,
                        "ttt_length": args.ttt_steps, "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD",
                        "seed": args.seed},  # draft vocabulary: its default for EAGLE-3 is 32,000
           "deployment": {"trainer": {"nproc_per_node": nproc}}, "output_dir": str(out), "run_id": "bench"}
    if args.snapshots:  # a snapshot at every epoch's end (the shim takes it in place of its checkpoint)
        cfg["training"]["save_interval"] = max(1, len(d["lengths"]) // (args.sf_batch_size * nproc))
    out.mkdir(parents=True)
    (out / "specforge.json").write_text(json.dumps(cfg, indent=1))
    return [str(Path(args.peers_dir) / "sf_cpu_train.py"), "train", "-c", str(out / "specforge.json"),
            *args.sf_args.split()]


ARGS = {"eyas": eyas_args, "speculators": speculators_args, "specforge": specforge_args}


def run_one(args, d, trainer: str, nproc: int, threads: int, run_dir: Path) -> dict:
    """One epoch of one trainer in fresh processes; the parsed record (EyasError when it fails)."""
    shutil.rmtree(run_dir, ignore_errors=True)  # this bench's own earlier output
    run_dir.mkdir(parents=True)
    out = run_dir / "output"
    python = sys.executable if trainer == "eyas" else args.peers_python
    launch = [python] if nproc == 1 else [python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                          "--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    cmd = [*launch, str(SHIM), trainer, str(threads),
           *ARGS[trainer](args, d, out, nproc, threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", BENCH_SPEC_AUTOCAST=args.spec_autocast, BENCH_REPORT_DIR=str(run_dir),
               BENCH_SF_DRAFT_VOCAB=str(args.draft_vocab))
    if args.snapshots:
        env["BENCH_SNAPSHOT_DIR"] = str(run_dir / "snapshots")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=run_dir, check=False)
    wall = time.perf_counter() - t0
    (run_dir / "log.txt").write_text(f"$ {' '.join(cmd)}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}")
    if p.returncode != 0:
        from eyas.core.errors import EyasError

        raise EyasError(f"bench: {trainer} ({nproc} x {threads}) failed with status {p.returncode}",
                        p.stderr[-2500:], f"read {run_dir / 'log.txt'}")
    rec = parse_run(trainer, nproc, p.stdout, d, run_dir)
    rec.update(threads=threads, process_wall_s=wall, startup_and_teardown_s=wall - rec["epoch_s"],
               log=str(run_dir / "log.txt"))
    if args.accuracy:
        rec["curve"] = score_snapshots(args, d, trainer, run_dir / "snapshots")
    if args.export:
        rec["export"] = str(export_last(args, trainer, run_dir / "snapshots", Path(args.export) / run_dir.name))
    if args.snapshots and not args.keep_outputs:
        shutil.rmtree(run_dir / "snapshots", ignore_errors=True)  # a draft per epoch, tens of MB each
    if not args.keep_outputs:
        shutil.rmtree(out, ignore_errors=True)  # checkpoints, up to hundreds of MB per run
    return rec


def _snapshots(folder: Path) -> list[Path]:
    """A run's snapshots as its trainer saved them, oldest first (not the -eyas copies made of them)."""
    return sorted(p for p in folder.glob("*") if p.is_dir() and not p.name.endswith("-eyas"))


def _as_eyas(args, trainer: str, snap: Path) -> Path:
    """The snapshot as an eyas draft folder: eyas's own, or a peer's read once with `eyas import` into <snap>-eyas."""
    if trainer == "eyas":
        return snap
    from eyas.draft.importer import ImportConfig, run_import

    imported = snap.with_name(snap.name + "-eyas")
    if not imported.is_dir():  # run_one starts every run in an empty folder: an existing one is this run's
        run_import(ImportConfig(source=str(snap), out=str(imported), target=args.target, layers=tuple(args.layers),
                                overwrite=True, quiet=True))
    return imported


def export_last(args, trainer: str, folder: Path, out: Path) -> Path:
    """--export: the run's last snapshot (its final draft) as an eyas draft folder at `out`, a peer's read with
    `eyas import`, for `eyas evaluate --baselines`."""
    from eyas.core.errors import EyasError

    snaps = _snapshots(folder)
    if not snaps:
        raise EyasError(f"bench: {trainer} saved no draft in {folder}", fix="read its log.txt beside that folder")
    if out.exists():
        if not (out / "bench-source.json").is_file():
            raise EyasError(f"bench: --export would replace {out}, which this bench did not write",
                            fix="pass another --export folder, or move that one away")
        shutil.rmtree(out)  # this bench's own earlier export of the same run name
    shutil.copytree(_as_eyas(args, trainer, snaps[-1]), out)
    (out / "bench-source.json").write_text(json.dumps({"trainer": trainer, "snapshot": snaps[-1].name,
                                                       "command": " ".join(sys.argv)}, indent=1))
    return out


def score_snapshots(args, d: dict, trainer: str, folder: Path) -> list[dict]:
    """Every snapshot of a run scored on the held-out store by one evaluator, eyas's validation pass
    (eyas.train.heldout): a peer's snapshot is first read with `eyas import`. -> [{tag, train_s, acc_i, ...}]"""
    from eyas.draft.checkpoint import read_draft
    from eyas.train.heldout import held_out_accuracy

    curve, tags = [], set()
    for snap in _snapshots(folder):
        clock = json.loads((snap / "bench-clock.json").read_text())
        if clock["tag"] in tags:  # the same step saved twice
            continue
        tags.add(clock["tag"])
        got = held_out_accuracy(read_draft(_as_eyas(args, trainer, snap)), str(d["heldout"]), args.target,
                                args.ttt_steps)
        curve.append({"tag": clock["tag"], "train_s": clock["train_s"], **got})
    return curve


def time_to(curve: list[dict], acc: float) -> float | None:
    """Training seconds at which acc_0 on the held-out samples first reaches `acc`, interpolated linearly between
    snapshots (the first snapshot's time when it is already there); None if never."""
    before = None
    for pt in curve:
        a = pt["acc_i"][0]
        if a >= acc:
            if before is None or before[1] >= acc:
                return pt["train_s"]
            t0, a0 = before
            return t0 + (acc - a0) / (a - a0) * (pt["train_s"] - t0)
        before = (pt["train_s"], a)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_run(trainer: str, nproc: int, stdout: str, d: dict, run_dir: Path) -> dict:
    """Epoch time (slowest rank), tokens and samples per rank (the shim), steps per rank (the trainer's own log)."""
    ranks = sorted((json.loads(p.read_text()) for p in run_dir.glob(REPORT + "*.json")), key=lambda r: r["rank"])
    if len(ranks) != nproc:
        raise RuntimeError(f"bench: {trainer}: {len(ranks)} timed epochs reported for {nproc} ranks")
    if trainer == "specforge":  # feature-file index -> store row
        for r in ranks:
            r["samples"] = [int(Path(d["sf_files"][i]).stem.split("_")[1]) for i in r["samples"]]
    seen = [i for r in ranks for i in r["samples"]]
    epoch = max(r["epoch_s"] for r in ranks)
    rec = {"trainer": trainer, "nproc": nproc, "epoch_s": epoch, "epoch_s_per_rank": [r["epoch_s"] for r in ranks],
           "tokens": sum(d["lengths"][i] for i in seen), "samples_per_rank": [len(r["samples"]) for r in ranks],
           "coverage": {"distinct": len(set(seen)), "of": len(d["lengths"]), "repeats": len(seen) - len(set(seen))},
           "steps_per_rank": _steps(trainer, nproc, stdout), "threads_seen": [r["threads"] for r in ranks],
           "trainable_params": ranks[0]["trainable"], "peak_rss_mb": [round(r["peak_rss_mb"]) for r in ranks],
           "epoch_cpu_s": [r["cpu_s"] for r in ranks], "probe": re.findall(r"\[probe\][^\n]*", stdout)}
    rec["tokens_per_s"] = rec["tokens"] / epoch
    rec["others_cores"] = (ranks[0]["machine_busy_s"] - sum(rec["epoch_cpu_s"])) / ranks[0]["epoch_s"]
    return rec


def _steps(trainer: str, nproc: int, stdout: str) -> list[int]:
    if trainer == "eyas":
        summary = json.loads([x for x in stdout.splitlines() if x.startswith("{")][-1])
        return [summary["steps"]] * nproc  # every rank takes every optimizer step
    key = "steps_run" if trainer == "speculators" else "micro_steps_run"  # one write each, even if lines interleave
    found = {int(r): int(n) for r, n in re.findall(rf"\[probe\] rank=(\d+) (?:epoch=\d+ )?{key}=(\d+)", stdout)}
    return [found.get(r, -1) for r in range(nproc)]


def run_all(args, d: dict) -> list[dict]:
    """Every trainer and layout, `repeats` times, alternating; the order rotates every repeat."""
    plan = [(t, *map(int, lay.split("x"))) for lay in args.layouts for t in args.trainers]
    records = []
    for k in range(args.repeats):
        for trainer, nproc, threads in plan[k % len(plan):] + plan[:k % len(plan)]:
            name = f"{trainer}-{nproc}x{threads}-r{k + 1}"
            rec = {**run_one(args, d, trainer, nproc, threads, Path(args.out) / "runs" / name), "repeat": k + 1}
            records.append(rec)
            print(f"{name}: epoch {rec['epoch_s']:.1f} s, {rec['tokens']:,} tokens, {rec['tokens_per_s']:,.0f} tokens/s"
                  f"; steps/rank {rec['steps_per_rank']}, samples/rank {rec['samples_per_rank']}, threads "
                  f"{rec['threads_seen']}; process {rec['process_wall_s']:.0f} s; other processes used "
                  f"{rec['others_cores']:.2f} cores", flush=True)
    return records
