"""Training throughput of `eyas train` on a store, measured in one session:

1. one process (all cores as threads) against two ranks under torchrun (the cores split between them), each for
   one epoch: tokens per second over the training loop's wall time, samples per rank (from RUN/audit.json), and
   the epoch's wall time;
2. the time the loop waited for data, as a share of the loop's time (both runs);
3. the trainer's overhead over a bare loop (sparse target distribution, TTT forward, weighted loss, backward,
   AdamW step) on the same model and the same batches, alternated `--repeats` times, medians.

    python bench/bench_train.py --store runs/demo/store --target smollm2-135m --ttt-steps 3

Writes OUT/bench_train.json and prints one line per figure. Extra `eyas train` flags after `--`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from eyas.core.config import check, opt, parse
from eyas.core.options import target_opt


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainBenchConfig:
    store: str = opt("", "the eyas store trained on; required")
    target: str = target_opt()
    ttt_steps: int = opt(3, "eyas train --ttt-steps")
    draft_vocab: int = opt(32000, "eyas train --draft-vocab")
    out: str = opt("/tmp/eyas-bench-train", "the bench's folder: the runs and bench_train.json")
    repeats: int = opt(3, "alternations of the overhead measurement")
    overhead_steps: int = opt(12, "optimizer steps of each overhead measurement")
    skip: tuple[str, ...] = opt((), "parts to skip", choices=("scaling", "overhead"))

    def __post_init__(self):
        check(bool(self.store), "--store is required", "give an eyas store folder, e.g. --store runs/demo/store")


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def train_cli(args, out: Path, nproc: int, threads: int, extra: list[str]) -> dict:
    """One epoch of `eyas train` (torchrun when nproc > 1); its JSON summary plus the run folder's audit."""
    if out.exists():
        shutil.rmtree(out)
    flags = ["--store", args.store, "--target", args.target, "--out", str(out), "--ttt-steps", str(args.ttt_steps),
             "--draft-vocab", str(args.draft_vocab), "--threads", str(threads), "--json", *extra]
    if nproc == 1:
        cmd = [sys.executable, "-m", "eyas.train", *flags]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
               "127.0.0.1", "--master_port", str(29400 + os.getpid() % 500), "-m", "eyas.train", *flags]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    summary = json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])
    audit = json.loads((out / "audit.json").read_text())
    return {"nproc": nproc, "threads_per_rank": threads, "tokens": summary["tokens"],
            "train_loop_s": summary["train_loop_s"], "tokens_per_s": summary["tokens_per_s"],
            "data_wait_share": summary["data_wait_share"], "samples_global": summary["samples"],
            "samples_per_rank": audit["per_rank"], "steps": summary["steps"], "process_wall_s": wall}


def overhead(args, work: Path, extra: list[str]) -> dict:
    """Median wall time of the trainer's loop vs a bare loop over the same batches (one process)."""
    import torch

    from eyas.core import dist
    from eyas.core.config import from_mapping
    from eyas.core.log import NullConsole
    from eyas.train.batches import load_micro_batch, needed_rows, sparse_target_logp
    from eyas.train.objective import autocast
    from eyas.train.settings import TrainConfig
    from eyas.train.sharding import shard_epoch
    from eyas.train.trainer import Trainer

    def trainer(tag: str) -> Trainer:
        out = work / f"overhead-{tag}"
        if out.exists():
            shutil.rmtree(out)
        cfg = TrainConfig(store=args.store, target=args.target, out=str(out), ttt_steps=args.ttt_steps,
                          draft_vocab=args.draft_vocab, threads=cores(), max_steps=args.overhead_steps, quiet=True,
                          checkpoint_every=0, **_flags(extra, from_mapping))
        return Trainer(cfg, dist.init("cpu"), NullConsole())

    def trainer_loop() -> float:
        t = trainer("loop")
        shard = shard_epoch(t.train_src.lengths, 0, 0, t.spec)
        t.bar = None
        t.train_epoch(0, shard, 0, NullConsole().progress(total=1))
        return t.epoch_loop_s  # excludes the checkpoint written when max_steps stops the epoch

    def bare_loop() -> float:
        t = trainer("bare")
        shard = shard_epoch(t.train_src.lengths, 0, 0, t.spec)
        windows = [[load_micro_batch(t.train_src, mb) for mb in shard.steps[s]] for s in range(t.total_steps)]
        model, opt = t.model, t.optimizer
        t0 = time.perf_counter()
        for window in windows:
            for b in window:
                b = t.to_device(b)
                with autocast(t.env.device, t.dtype):
                    v = t.valid(b)
                    with torch.no_grad():
                        logp, index = sparse_target_logp(b.final, t.head_rows, needed_rows(v))
                    loss_sum, _, count = model(b.input_ids, b.aux, logp, index, b.loss_mask, b.position_ids,
                                               b.doc_ids)
                    loss = (loss_sum.float() * t.weights / count.clamp(min=1)).sum()
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    runs = {"trainer": [], "bare": []}
    for _ in range(args.repeats):
        runs["trainer"].append(trainer_loop())
        runs["bare"].append(bare_loop())
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"steps": args.overhead_steps, "runs_s": runs, "median_s": med,
            "overhead": med["trainer"] / med["bare"] - 1}


def _flags(extra: list[str], from_mapping) -> dict:
    """`--micro-batch 2 --max-tokens 1024` -> {"micro_batch": 2, ...} (ints and floats; for the in-process runs)."""
    out, i = {}, 0
    while i < len(extra):
        key = extra[i].removeprefix("--").replace("-", "_")
        if i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            v = extra[i + 1]
            out[key] = int(v) if v.lstrip("-").isdigit() else float(v) if v.replace(".", "", 1).isdigit() else v
            i += 2
        else:
            out[key] = True
            i += 1
    return out


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    args = parse(TrainBenchConfig, argv, description=__doc__)
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    n = cores()
    result = {"store": args.store, "target": args.target, "ttt_steps": args.ttt_steps, "cores": n, "extra": extra}
    if "scaling" not in args.skip:
        one = train_cli(args, work / "one", 1, n, extra)
        two = train_cli(args, work / "two", 2, max(1, n // 2), extra)
        result.update(one_process=one, two_ranks=two, speedup=two["tokens_per_s"] / one["tokens_per_s"],
                      epoch_time_ratio=two["train_loop_s"] / one["train_loop_s"])
        for r in (one, two):
            print(f"{r['nproc']} x {r['threads_per_rank']} threads: {r['tokens_per_s']:,.0f} tokens/s, epoch loop "
                  f"{r['train_loop_s']:.1f} s, samples per rank {r['samples_per_rank']}, data wait "
                  f"{100 * r['data_wait_share']:.2f}% of the loop")
        print(f"two ranks / one process: {result['speedup']:.2f}x tokens/s, epoch time "
              f"{result['epoch_time_ratio']:.2f}x")
    if "overhead" not in args.skip:
        o = overhead(args, work, extra)
        result["overhead"] = o
        print(f"trainer overhead over a bare loop: {100 * o['overhead']:+.1f}% (median of {args.repeats}: "
              f"{o['median_s']['trainer']:.2f} s vs {o['median_s']['bare']:.2f} s for {o['steps']} steps)")
    (work / "bench_train.json").write_text(json.dumps(result, indent=2))
    print(f"-> {work / 'bench_train.json'}")


if __name__ == "__main__":
    main()
