"""Which samples each rank trains on, per epoch: disjoint by construction, and proven so by an audit.

Pure functions of (dataset size, lengths, seed, epoch, rank, world size): nothing here reads the environment,
so every rank's share can be computed and checked in one process by looping over ranks.

One epoch, N samples, W ranks, b units per micro-batch per rank, g micro-batches per optimizer step:
1. order: a permutation of 0..N-1 seeded by (seed, epoch) (identity when not shuffling); it does not depend
   on W, so one process with grad accum W sees the same optimizer steps as W ranks.
2. units: without packing one unit = one sample; with `max_tokens` > 0, samples are packed in order into units
   of at most max_tokens tokens (first fit among a few open units: length-aware, nearly order-preserving).
3. remainder: padded (default) with repeats of the first units, marked `padded`, to W*ceil(U/W) units; or
   dropped down to whole global batches. The figures are `eyas.train.plan.compute_plan`'s (U units as its samples).
4. steps: chunks of W*b*g units form the optimizer steps. Length grouping: within each window of
   `group_window` steps the units are sorted by length, cut into steps, and the steps' order is shuffled
   (seeded), so a micro-batch holds similar lengths (little padding) and the order stays random. Inside a step
   each rank gets exactly chunk/W units, dealt longest first to the rank with the fewest tokens (balanced work,
   so no rank waits at the all-reduce), then split into micro-batches of b. Windows and steps are counted in
   units of W*b*g, so a step's samples are the same for W ranks as for one process with g*W accumulation.

The audit gathers every rank's sample ids (`EpochShard.sample_ids()`, the very lists the loader iterates) and
checks that the non-padded ids are disjoint across ranks and cover the dataset (minus what was dropped).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from eyas.core.log import fmt_int

Unit = tuple[int, ...]  # sample indices packed into one sequence (one index without packing)


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How an epoch is cut up; identical on every rank (the run's settings)."""

    world_size: int
    micro_batch: int = 1  # units per micro-batch, per rank
    grad_accum: int = 1  # micro-batches per optimizer step
    seed: int = 0
    shuffle: bool = True
    drop_remainder: bool = False
    max_tokens: int = 0  # > 0: pack samples into units of at most this many tokens
    balance: bool = True  # deal each step's units to ranks by tokens (else strided, in order)
    group_window: int = 32  # > 1: sort this many steps' units by length, cut them into steps, shuffle the steps
    sharded: bool = True  # False: every rank takes ALL units (the failure the audit exists to catch)

    def __post_init__(self):
        for name in ("world_size", "micro_batch", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def step_units(self) -> int:
        """Units per optimizer step over all ranks (the global batch, in units)."""
        return self.world_size * self.micro_batch * self.grad_accum


@dataclasses.dataclass(frozen=True)
class EpochShard:
    """One rank's share of one epoch: its micro-batches, grouped by optimizer step."""

    epoch: int
    rank: int
    spec: ShardSpec
    steps: tuple[tuple[tuple[Unit, ...], ...], ...]  # [optimizer step][micro-batch][unit] -> sample indices
    padded: frozenset  # (step, micro, unit) positions that are padding repeats
    dataset_size: int
    total_units: int  # units in the epoch before padding or dropping (global)
    padded_units: int  # repeats added (global)
    dropped_units: int  # units left out (global)
    dropped_samples: int  # samples in the dropped units (global)

    @property
    def micro_batches(self) -> list[tuple[Unit, ...]]:
        return [mb for step in self.steps for mb in step]

    def sample_ids(self) -> tuple[list[int], list[int]]:
        """(own, repeats): the sample indices this rank trains on this epoch, split into first occurrences
        and padding repeats. The audit gathers exactly these."""
        own, rep = [], []
        for s, step in enumerate(self.steps):
            for m, mb in enumerate(step):
                for u, unit in enumerate(mb):
                    (rep if (s, m, u) in self.padded else own).extend(unit)
        return own, rep

    @property
    def num_samples(self) -> int:
        return sum(len(unit) for mb in self.micro_batches for unit in mb)


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """A permutation of 0..n-1, the same on every rank, different every epoch."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def pack(order: np.ndarray, lengths: np.ndarray, max_tokens: int, open_units: int = 8) -> list[Unit]:
    """Pack samples, in `order`, into units of at most `max_tokens` tokens: each sample goes to the first of the
    last `open_units` units it fits in, else starts a new one. A sample longer than max_tokens is its own unit."""
    units: list[list[int]] = []
    room: list[int] = []
    first_open = 0
    for i in order.tolist():
        n = int(lengths[i])
        for u in range(first_open, len(units)):
            if room[u] >= n:
                units[u].append(i)
                room[u] -= n
                break
        else:
            units.append([i])
            room.append(max_tokens - n)
            first_open = max(first_open, len(units) - open_units)
    return [tuple(u) for u in units]


def epoch_units(lengths: np.ndarray, epoch: int, spec: ShardSpec) -> list[Unit]:
    """The epoch's units in global order (before padding/dropping)."""
    order = epoch_order(len(lengths), epoch, spec.seed, spec.shuffle)
    if spec.max_tokens > 0:
        return pack(order, lengths, spec.max_tokens)
    return [(int(i),) for i in order]


def _steps(n: int, S: int, tokens: np.ndarray, spec: ShardSpec, epoch: int) -> list[list[int]]:
    """Cut positions 0..n-1 into optimizer steps of S (the last may be shorter), grouped by length."""
    if spec.group_window <= 1:
        return [list(range(s, min(s + S, n))) for s in range(0, n, S)]
    steps: list[list[int]] = []
    span = S * spec.group_window
    for w in range(0, n, span):
        ranked = sorted(range(w, min(w + span, n)), key=lambda p: (-tokens[p], p))
        pieces = [ranked[s:s + S] for s in range(0, len(ranked), S)]
        order = np.random.default_rng([spec.seed, epoch, w, 1]).permutation(len(pieces))
        steps += [pieces[i] for i in order]
    return steps


def _deal(chunk: list[int], tokens: np.ndarray, ranks: int, balance: bool) -> list[list[int]]:
    """Split the positions `chunk` (a multiple of `ranks` long) into `ranks` equal shares."""
    if not balance:
        return [chunk[r::ranks] for r in range(ranks)]
    per = len(chunk) // ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for p in sorted(chunk, key=lambda p: (-tokens[p], p)):  # longest first, ties by position: deterministic
        r = min((r for r in range(ranks) if len(shares[r]) < per), key=lambda r: (load[r], r))
        shares[r].append(p)
        load[r] += int(tokens[p])
    return shares


def shard_epoch(lengths: np.ndarray, epoch: int, rank: int, spec: ShardSpec) -> EpochShard:
    """This rank's micro-batches for `epoch`. `lengths[i]` = tokens of sample i (for packing and balance)."""
    if not 0 <= rank < spec.world_size:
        raise ValueError(f"rank {rank} outside world size {spec.world_size}")
    lengths = np.asarray(lengths)
    units = epoch_units(lengths, epoch, spec)
    world = spec.world_size if spec.sharded else 1
    S = world * spec.micro_batch * spec.grad_accum  # units per optimizer step (global)
    U = len(units)
    positions = list(range(U))
    padded_units = dropped_units = dropped_samples = 0
    if spec.drop_remainder:
        keep = (U // S) * S
        dropped_units, positions = U - keep, positions[:keep]
        dropped_samples = sum(len(units[p]) for p in range(keep, U))
    else:
        target = math.ceil(U / world) * world
        padded_units = target - U
        positions += [i % U for i in range(padded_units)]  # repeats of the first units
    tokens = np.array([sum(int(lengths[i]) for i in units[p]) for p in positions] or [0])
    steps, padded = [], set()
    my_rank = rank if spec.sharded else 0
    for chunk in _steps(len(positions), S, tokens, spec, epoch):  # indices into `positions`
        mine = _deal(chunk, tokens, world, spec.balance and world > 1)[my_rank]
        if spec.balance:
            mine.sort(key=lambda p: (-tokens[p], p))  # similar lengths share a micro-batch
        micro = []
        for m in range(0, len(mine), spec.micro_batch):
            group = mine[m:m + spec.micro_batch]
            for u, p in enumerate(group):
                if p >= U:
                    padded.add((len(steps), len(micro), u))
            micro.append(tuple(units[positions[p]] for p in group))
        steps.append(tuple(micro))
    return EpochShard(epoch=epoch, rank=rank, spec=spec, steps=tuple(steps), padded=frozenset(padded),
                      dataset_size=len(lengths), total_units=U, padded_units=padded_units, dropped_units=dropped_units,
                      dropped_samples=dropped_samples)


# -- the audit -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Audit:
    """The check that the ranks' shares of one epoch are disjoint and together cover the dataset."""

    epoch: int
    samples: int  # dataset size (global)
    world_size: int
    per_rank: tuple[int, ...]  # samples each rank trains on this epoch, repeats included
    padded: int  # repeated samples (global)
    dropped: int  # samples in no rank's share (global), by design when the remainder is dropped
    expected_dropped: int
    duplicates: int  # distinct samples that more than one rank (or one rank twice) trains on as its own
    duplicate_examples: tuple[int, ...]
    missing: int  # samples that should be trained on but are in no share
    units: int  # packed sequences per epoch (global), 0 without packing
    allowed: bool = False  # --allow-duplicate-data

    @property
    def disjoint(self) -> bool:
        return self.duplicates == 0

    @property
    def ok(self) -> bool:
        return self.disjoint and self.missing == 0 and self.dropped == self.expected_dropped

    def line(self) -> str:
        lo, hi = min(self.per_rank), max(self.per_rank)
        per = fmt_int(lo) if lo == hi else f"{fmt_int(lo)}-{fmt_int(hi)}"
        rest = f"{fmt_int(self.padded)} padded" if not self.dropped else f"{fmt_int(self.dropped)} dropped"
        packed = f" in {fmt_int(self.units)} packed sequences (global)" if self.units else ""
        verdict = "yes" if self.disjoint else (
            f"NO: {fmt_int(self.duplicates)} samples on more than one rank, e.g. "
            f"{', '.join(map(str, self.duplicate_examples))}")
        if self.missing:
            verdict += f"; {fmt_int(self.missing)} samples on no rank"
        return (f"data: {fmt_int(self.samples)} samples over {self.world_size} ranks -> {per} per rank per epoch"
                f" ({rest}){packed}, disjoint: {verdict}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(disjoint=self.disjoint, covers=self.missing == 0, ok=self.ok, line=self.line())
        return d


def audit(gathered: list[tuple[list[int], list[int]]], samples: int, epoch: int = 0, expected_dropped: int = 0,
          units: int = 0, allowed: bool = False) -> Audit:
    """Check the gathered `(own, repeats)` sample ids of every rank (index = rank) for one epoch."""
    counts = np.zeros(samples, dtype=np.int64)
    for own, _ in gathered:
        np.add.at(counts, np.asarray(own, dtype=np.int64), 1)
    dup = np.flatnonzero(counts > 1)
    absent = int((counts == 0).sum())
    return Audit(epoch=epoch, samples=samples, world_size=len(gathered),
                 per_rank=tuple(len(o) + len(r) for o, r in gathered),
                 padded=sum(len(r) for _, r in gathered), dropped=min(absent, expected_dropped),
                 expected_dropped=expected_dropped, duplicates=len(dup),
                 duplicate_examples=tuple(int(i) for i in dup[:5]), missing=max(0, absent - expected_dropped),
                 units=units, allowed=allowed)
