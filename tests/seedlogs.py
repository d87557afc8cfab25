"""Long, realistic logs of the seed run (4 ranks, 35,446 samples, 1.4 steps/s), written the way the tools write them.

Three formats: speculators' rich console (rank 0 only, records wrapped over several lines, a `[HH:MM:SS]`
stamp only when the second changes), SpecForge (every rank prints every `step N: {...}`), and a torchrun log in
which every line carries a `[rankK]:` prefix. Each starts with the seed script's own header (`Train files`,
`Train batches/epoch`, `Total training steps`) and stops wherever the run is cut: mid-epoch, after an epoch
boundary, or in a crash (one rank out of memory, then NCCL watchdog timeouts on the others).

Everything a test asserts is computed from the `SeedRun` it wrote (`per_rank_epoch`, `total`), never read back
from the log. `python -m tests.seedlogs --format specforge --steps 200000 --out big.log` writes a large log for
`bench/bench_doctor.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
from collections.abc import Iterator
from pathlib import Path

FORMATS = ("speculators", "specforge", "torchrun")
T0 = datetime.datetime(2025, 3, 1, 21, 14, 5)


@dataclasses.dataclass(frozen=True)
class SeedRun:
    fmt: str = "torchrun"
    samples: int = 35_446
    world: int = 4
    micro_batch: int = 1
    epochs: int = 5
    sharded: bool = True
    drop_last: bool = False  # the loader drops the last partial batch (else it is kept, smaller)
    stop_at: int = 12_000  # steps each rank has run when the log ends (capped at the run's total)
    rate: float = 1.4  # optimizer steps per second per rank
    log_every: int = 1
    header: bool = True  # the seed script's `Train files / Train batches/epoch / Total training steps`
    crash_rank: int | None = None  # this rank runs out of memory at stop_at; the others time out
    start: datetime.datetime = T0

    @property
    def per_rank_epoch(self) -> int:
        """Steps per rank per epoch: the sampler pads to ceil(N/W); the loader keeps or drops the last batch."""
        share = math.ceil(self.samples / self.world) if self.sharded else self.samples
        return share // self.micro_batch if self.drop_last else math.ceil(share / self.micro_batch)

    @property
    def total(self) -> int:
        return self.per_rank_epoch * self.epochs

    @property
    def last_step(self) -> int:
        return min(self.stop_at, self.total)

    def stamp(self, step: float) -> datetime.datetime:
        return self.start + datetime.timedelta(seconds=30 + step / self.rate)

    def steps(self) -> Iterator[tuple[int, int, float, datetime.datetime]]:
        """(step 1-based, epoch 0-based, lr, time) for every logged step."""
        for i in range(1, self.last_step + 1):
            if i % self.log_every and i != self.last_step and i % self.per_rank_epoch:
                continue
            lr = 1e-4 * 0.5 * (1 + math.cos(math.pi * (i - 1) / max(1, self.total - 1)))
            yield i, (i - 1) // self.per_rank_epoch, lr, self.stamp(i)


def _header(run: SeedRun) -> list[str]:
    if not run.header:
        return []
    batches = math.ceil(run.samples / run.micro_batch)  # what the seed's script printed: len(dataset) / batch
    return [f"Train files: {run.samples}", f"Train batches/epoch: {batches}",
            f"Total training steps: {batches * run.epochs}"]


def _loss(i: int) -> float:
    return 3.1 * math.exp(-i / 20000) + 0.4 + 0.05 * math.sin(i)


# -- speculators: rank 0, rich console ------------------------------------------------------------------------------
def _speculators(run: SeedRun) -> Iterator[str]:
    yield f"[{run.start:%H:%M:%S}] INFO     speculator_type='eagle3', dry_run=0, seed=42,  logger.py:736"
    yield "                    trainer/epochs=%d, trainer/log_freq=%d,               " % (run.epochs, run.log_every)
    for text in _header(run):
        yield f"           INFO     {text:<41}train.py:88"
    for w in ("site-packages/torch/utils/data/dataloader.py:759: UserWarning: 'pin_memory' argument is set as true"
              " but no accelerator is found",):
        for _ in range(run.world):
            yield w
            yield "  super().__init__(loader)"
    last = None
    for i, e, lr, t in run.steps():
        if (i - 1) % run.per_rank_epoch == 0:
            yield f"           INFO     Training epoch {e + 1}/{run.epochs} started        trainer.py:737"
        head = f"[{t:%H:%M:%S}]" if t.replace(microsecond=0) != last else " " * 10
        last = t.replace(microsecond=0)
        yield f"{head} INFO     train/loss_0={_loss(i):.3f},                         trainer.py:587"
        yield f"                    train/full_acc_0={0.3 + i / 1e6:.3f}, train/loss={3 * _loss(i):.3f},       "
        yield f"                    profile/step_ms={1000 / run.rate:.3f}, epoch={e}, lr={lr:.2e},         "
        yield f"                    global_step={i - 1}                                            "
        if i % run.per_rank_epoch == 0:
            yield f"           INFO     Training epoch {e + 1}/{run.epochs} completed      trainer.py:739"


# -- SpecForge: every rank prints every step ---------------------------------------------------------------------------
def _specforge(run: SeedRun) -> Iterator[str]:
    yield f"W{run.start:%m%d %H:%M:%S}.561000 12456 torch/distributed/run.py:874] Setting OMP_NUM_THREADS " \
          "environment variable for each process to be 1 in default"
    for _ in range(run.world):
        yield "site-packages/specforge/modeling/draft/llama3_eagle.py:33: UserWarning: flash_attn is not found"
        yield "  warnings.warn("
    yield from _header(run)
    for i, _, lr, _ in run.steps():
        rec = (f"step {i}: {{'acc_0': {0.3 + i / 1e6!r}, 'ploss_0': {_loss(i)!r}, 'loss': {3 * _loss(i)!r}, "
               f"'lr': {lr!r}, 'perf/optimizer_step_time_s': {1 / run.rate!r}}}")
        yield from [rec] * run.world


# -- torchrun: every line prefixed with its rank ---------------------------------------------------------------------
def _iso(t: datetime.datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S,") + f"{t.microsecond // 1000:03d}"


def _torchrun(run: SeedRun) -> Iterator[str]:
    yield f"W{run.start:%m%d %H:%M:%S}.561000 12456 torch/distributed/run.py:874] Setting OMP_NUM_THREADS " \
          "environment variable for each process to be 1 in default"
    yield from (f"[rank0]: {text}" for text in _header(run))
    for i, e, lr, t in run.steps():
        for r in range(run.world):
            yield (f"[rank{r}]: {_iso(t + datetime.timedelta(milliseconds=3 * r))} INFO step {i} epoch {e} "
                   f"lr {lr:.4e} loss {_loss(i):.4f}")
    if run.crash_rank is not None:
        yield from _crash(run, run.stamp(run.last_step + 1))


def _crash(run: SeedRun, t: datetime.datetime) -> Iterator[str]:
    """Rank `crash_rank` runs out of memory; 10 minutes later the others' NCCL watchdogs time out; torchrun reports."""
    r = run.crash_rank
    for text in ("Traceback (most recent call last):",
                 '  File "/workspace/train_eagle3.py", line 412, in <module>',
                 "    main()",
                 '  File "/workspace/train_eagle3.py", line 367, in train_step',
                 "    loss.backward()",
                 "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.50 GiB. GPU 2 has a total capacity "
                 "of 79.15 GiB of which 1.02 GiB is free."):
        yield f"[rank{r}]: {text}"
    late = t + datetime.timedelta(minutes=10)
    others = [k for k in range(run.world) if k != r]
    for k in others:
        yield (f"[rank{k}]:[E{late:%m%d %H:%M:%S}.118000 2231 ProcessGroupNCCL.cpp:632] [Rank {k}] Watchdog caught "
               "collective operation timeout: WorkNCCL(SeqNum=48011, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
               "Timeout(ms)=600000) ran for 600021 milliseconds before timing out.")
    yield (f"E{late:%m%d %H:%M:%S}.921000 12456 torch/distributed/elastic/multiprocessing/api.py:869] failed "
           f"(exitcode: 1) local_rank: {r} (pid: 2235) of binary: /usr/bin/python3")
    yield "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "
    yield "Root Cause (first observed failure):"
    yield "[0]:"
    yield f"  rank      : {r} (local_rank: {r})"
    yield "  exitcode  : 1 (pid: 2235)"


WRITERS = {"speculators": _speculators, "specforge": _specforge, "torchrun": _torchrun}


def lines(run: SeedRun) -> Iterator[str]:
    return WRITERS[run.fmt](run)


def write(path: Path, run: SeedRun) -> Path:
    with open(path, "w") as f:
        for line in lines(run):
            f.write(line + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description="write a long log of the seed run")
    ap.add_argument("--format", choices=FORMATS, default="specforge")
    ap.add_argument("--steps", type=int, default=12_000, help="steps each rank has run when the log stops")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--not-sharded", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    run = SeedRun(fmt=a.format, stop_at=a.steps, epochs=a.epochs, sharded=not a.not_sharded)
    write(a.out, run)
    print(f"{a.out}: {a.out.stat().st_size / 1e6:.1f} MB, {run.last_step} steps per rank")


if __name__ == "__main__":
    main()
