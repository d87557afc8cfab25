"""What `eyas doctor` reads a training log into: `Step` (one logged optimizer step), `Fact` (something the log
states), and `StepSample`, the step records of a log of any length kept in bounded memory.

`StepSample` keeps every step record of the first and last stretch of the log and, in between, a thinning sample
that never drops what a verdict rests on (epoch boundaries, restarts, repeated lines, the lr reaching 0).
"""

from __future__ import annotations

import dataclasses
from collections import deque


@dataclasses.dataclass(slots=True)
class Step:
    """One logged optimizer step, as one rank wrote it."""

    line: int  # 1-based line number in the file
    fmt: str  # the format that recognised it
    step: int | None = None  # the step counter, as logged (0- or 1-based, per epoch or per run)
    of: int | None = None  # `step 12/500`: the counter's stated total
    rank: int | None = None  # from a torchrun `[rankK]:` prefix
    epoch: float | None = None
    lr: float | None = None
    loss: float | None = None
    time: float | None = None  # seconds on the log's own clock (time of day + days, or elapsed_s)
    duration: float | None = None  # this step's own duration, when the log states it
    samples_seen: int | None = None  # global samples seen so far, when the log states it
    arrival: float | None = None  # wall-clock time the line was read (--follow), for logs without timestamps
    key: int = 0  # hash of the record's text without the rank prefix (duplicate detection)
    seq: int = 0  # 0-based index among all step records of the log (kept or not)
    keep: bool = False  # StepSample: never thinned away (evidence a verdict may rest on)


@dataclasses.dataclass(slots=True)
class Fact:
    """Something a log states, with its line number and the text that says it."""

    line: int
    name: str
    value: object
    text: str


class StepSample:
    """The step records a log keeps, in order, in bounded memory.

    Every record of the last TAIL is kept; older ones are kept if they are evidence (`Step.keep`: the first HEAD
    records, an epoch change and the record before it, a restart, a repeated line, the lr reaching 0) or if their
    step value is a multiple of the stride, which doubles whenever more than LIMIT records are kept. All copies of
    a step value (one per writer) share its fate, so writers are still counted on what is kept."""

    HEAD, TAIL, LIMIT = 4096, 4096, 60_000

    def __init__(self):
        self.kept: list[Step] = []
        self.tail: deque[Step] = deque()
        self.stride = 1
        self.count = 0  # records seen
        self._last: dict[int | None, Step] = {}  # the previous record of each rank (None: unprefixed)
        self._lr_peak = 0.0
        self.evidence = 0  # records marked as evidence after the head

    def add(self, step: Step) -> None:
        step.seq = self.count
        self.count += 1
        prev = self._last.get(step.rank)
        if self.count <= self.HEAD:
            step.keep = True
        elif prev is not None and self.evidence < self.LIMIT // 2:  # evidence is bounded too (hostile logs)
            if prev.epoch is not None and step.epoch is not None and int(step.epoch) != int(prev.epoch):
                self._mark(step, prev)
            elif step.step is not None and prev.step is not None and step.step < prev.step - 2:
                self._mark(step, prev)  # a restart, or an epoch-local counter starting again
            elif step.rank is not None and step.key == prev.key:
                self._mark(step, prev)  # a rank repeating its line (unprefixed writers repeat each other's)
            elif step.lr is not None and prev.lr is not None and step.lr <= 1e-6 * self._lr_peak < prev.lr:
                self._mark(step)  # the lr reached 0
        if step.lr is not None:
            self._lr_peak = max(self._lr_peak, step.lr)
        self._last[step.rank] = step
        self.tail.append(step)
        if len(self.tail) > self.TAIL:
            self._retire(self.tail.popleft())

    def _mark(self, *steps: Step) -> None:
        for s in steps:
            if not s.keep:
                s.keep = True
                self.evidence += 1

    def _retire(self, s: Step) -> None:
        if self._wanted(s):
            self.kept.append(s)
            while len(self.kept) > self.LIMIT:
                self.stride *= 2
                self.kept = [k for k in self.kept if self._wanted(k)]

    def _wanted(self, s: Step) -> bool:
        return s.keep or (s.step if s.step is not None else s.seq) % self.stride == 0

    def steps(self) -> list[Step]:
        return self.kept + list(self.tail)
