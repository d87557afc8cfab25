"""Line parsers for training logs: eyas, speculators, SpecForge, torchrun prefixes and a generic fallback.

`LogParser.feed(lineno, text)` turns each line into `Step` records (one per logged optimizer step, from any
rank) and `Fact` records (what a log states: dataset size, world size, epochs, batches per epoch, plan and audit
lines, progress-bar totals, end and crash markers). The doctor (`eyas.doctor.diagnose*`) draws its conclusions from
these alone.

Formats (what each line looks like):
- eyas `metrics.jsonl`: `{"step": 12, "epoch": 0, "lr": ..., "loss": ..., "samples_seen_global": ..., "elapsed_s": ...}`
- eyas console: `data: 35,446 samples over 4 ranks -> 8,862 per rank per epoch (2 padded), disjoint: yes`, the
  `plan: ...` block of `eyas.train.plan.Plan.lines()`, `epoch 1: 35,448 samples processed (global) of 35,446`
- speculators (rich console, rank 0 only): `[16:41:23] INFO  train/loss_0=0.026, ...` wrapped over many lines,
  ending with `epoch=0, lr=9.23e-04, global_step=1`
- SpecForge (every rank writes): `step 12: {'loss': 2.1, 'lr': 9.9e-05, 'perf/optimizer_step_time_s': 0.03, ...}`;
  two ranks' records may share one line
- torchrun: `[rank3]: ...` (or `[default3]: ...`) prefixes name the writing rank; glog lines `W1129 16:41:34.71 ...`
- generic: a line with a step (`step 12`, `global_step=12`, `iter 12/500`) or epoch counter and an lr.

Parsers are linear in the line length: lines are capped at MAX_LINE characters, no regex has nested
quantifiers, and nothing is evaluated (SpecForge's dict reprs and JSON values are read with regexes or `json`).
Memory is bounded whatever the log's length: `StepSample` keeps every step record of the first and last stretch
of the log and, in between, a thinning sample that never drops what a verdict rests on (epoch boundaries, restarts,
repeated lines, the lr reaching 0); pauses and the logging interval are measured as the lines stream past.
"""

from __future__ import annotations

import dataclasses
import datetime
import heapq
import json
import math
import re
from collections import Counter, deque

MAX_LINE = 65536  # characters kept of one line; the rest is ignored (and counted)

_NUM = r"[-+]?(?:\d{1,20}(?:\.\d{0,20})?|\.\d{1,20})(?:[eE][-+]?\d{1,3})?"
_INT = r"\d[\d,]{0,18}"

RANK_PREFIX = re.compile(r"^\[(?:rank|default)(\d{1,5})\]:\s?")
ANSI = re.compile(r"\x1b\[[0-9;?]{0,32}[ -/]{0,4}[@-~]")
ISO_TS = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?")
GLOG_TS = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?\s")
TIME_TS = re.compile(r"^\[?(\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?\]?\s")

SF_STEP = re.compile(r"step (\d{1,12}): \{")
SF_KV = re.compile(r"'([\w/.\-]{1,80})': (" + _NUM + r"|nan|inf|-inf)")
RICH_HEAD = re.compile(r"^(?:\[\d\d:\d\d:\d\d\]|\s{11})\s?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s{1,9}(\S.*)$")
RICH_CONT = re.compile(r"^ {20}(\S.*)$")
RICH_SOURCE = re.compile(r"\s{2,80}[\w.\-]{1,80}\.py:\d{1,6}\s{0,80}$")
KV_EQ = re.compile(r"([\w/.\-]{1,80})=([^\s,]{1,80})")

GEN_STEP = re.compile(r"(?<![\w/])(?:global[_ ]step|step|iter(?:ation)?)['\"]?\s{0,3}[:=#]?\s{0,3}(\d{1,12})"
                      r"(?:\s{0,3}/\s{0,3}(\d{1,12}))?", re.I)
GEN_EPOCH = re.compile(r"(?<![\w/])epoch['\"]?\s{0,3}[:=]?\s{0,3}(\d{1,9}(?:\.\d{1,12})?)(?:\s{0,3}/\s{0,3}(\d{1,9}))?",
                       re.I)
GEN_LR = re.compile(r"(?<![\w/])(?:lr|learning[_ ]rate)['\"]?\s{0,3}[:=]?\s{0,3}(" + _NUM + ")", re.I)
GEN_LOSS = re.compile(r"(?<![\w/])(?:train[_/ ])?loss['\"]?\s{0,3}[:=]?\s{0,3}(" + _NUM + ")", re.I)

EYAS_DATA = re.compile(r"data: (" + _INT + r") samples over (\d{1,6}) ranks? -> (" + _INT + r")(?:-(" + _INT +
                       r"))? per rank per epoch \((" + _INT + r") (padded|dropped)\)(?: in (" + _INT +
                       r") packed sequences \(global\))?, disjoint: (yes|no)", re.I)
EYAS_PLAN = [
    ("samples", re.compile(r"plan: dataset (" + _INT + r") samples \(global\), (\d{1,6}) epochs")),
    ("batching", re.compile(r"plan: (\d{1,6}) ranks x micro-batch (\d{1,9}) \(per rank\) x grad accum (\d{1,9})")),
    ("micro", re.compile(r"plan: micro-batches per rank: (" + _INT + r") per epoch, (" + _INT + r") in all")),
    ("steps", re.compile(r"plan: optimizer steps \(global[^)]{0,60}\): (" + _INT + r") per epoch, (" + _INT +
                         r") in all")),
    ("run", re.compile(r"plan: this run takes (" + _INT + r") optimizer steps")),  # --max-steps or packing
]
EYAS_EPOCH_END = re.compile(r"epoch (\d{1,6}): (" + _INT + r") samples processed \(global\) of (" + _INT + r")")

# (fact name, pattern): the first group is the value. Phrases logs use for the figures doctor needs.
STATED = [
    ("samples", re.compile(r"(?:num[_ ]?(?:train[_ ]?)?samples|dataset[_ ]size|"
                           r"train(?:ing)?[_ ](?:samples|files|examples|conversations|dataset[_ ]size)|"
                           r"len\((?:train_?)?dataset\))\s{0,3}[:=]\s{0,3}(" + _INT + ")", re.I)),
    ("samples", re.compile(r"(?:loaded|found|using)\s{1,3}(" + _INT + r")\s{1,3}(?:train(?:ing)?\s{1,3})?"
                           r"(?:samples|examples|conversations)\b", re.I)),
    ("world_size", re.compile(r"world[_ ]size\s{0,3}[:=]?\s{0,3}(\d{1,6})\b", re.I)),
    ("world_size", re.compile(r"(?:nproc[_-]per[_-]node|num[_ ]processes|num[_ ]gpus)\s{0,3}[:= ]\s{0,3}(\d{1,6})\b",
                              re.I)),
    ("batches_per_epoch", re.compile(r"(?:batches|steps|iterations|iters)\s{0,3}(?:/|per)\s{0,3}epoch\s{0,3}[:=]?"
                                     r"\s{0,3}(" + _INT + ")", re.I)),
    ("batches_per_epoch", re.compile(r"len\((?:train_?)?(?:data_?)?loader\)\s{0,3}[:=]?\s{0,3}(" + _INT + ")", re.I)),
    ("total_steps", re.compile(r"total\s{1,3}(?:training\s{1,3}|optimi[sz](?:ation|er)\s{1,3})?steps\s{0,3}[:=]?"
                               r"\s{0,3}(" + _INT + ")", re.I)),
    ("total_steps", re.compile(r"(?:max_steps|num_training_steps|total_steps)\s{0,3}[:=]\s{0,3}(" + _INT + ")", re.I)),
    ("epochs", re.compile(r"(?:num[_ ]?(?:train[_ ])?epochs|n_epochs|epochs)\s{0,3}[:=]\s{0,3}(\d{1,6})\b", re.I)),
    ("epochs", re.compile(r"\bepoch\s{1,3}\d{1,6}\s{0,2}/\s{0,2}(\d{1,6})\b", re.I)),
    ("micro_batch", re.compile(r"(?:micro[_ -]batch(?:[_ ]size)?|per[_ ]device[_ ]train[_ ]batch[_ ]size|"
                               r"(?<![\w/])batch[_ ]size)\s{0,3}[:=]\s{0,3}(\d{1,6})\b", re.I)),
    ("grad_accum", re.compile(r"grad(?:ient)?[_ ]accum(?:ulation)?(?:[_ ]steps)?\s{0,3}[:=]\s{0,3}(\d{1,6})\b", re.I)),
]
BAR = re.compile(r"(\d{1,3})%\s?\|?[^\d\r]{0,400}?\|?\s{0,3}(\d{1,12})/(\d{1,12})\s{0,3}\[")
BAR_ELAPSED = re.compile(r"\s?(?:(\d{1,5}):)?(\d{1,2}):(\d\d)\s?<")  # tqdm `[01:02<...`, rich `[ 0:00:06 < ...`
EPOCH_DONE = re.compile(r"training epoch (\d{1,6})/(\d{1,6}) (?:completed|complete|finished|done)", re.I)
RUN_END = re.compile(r"(?:training|train)\b.{0,40}?\b(?:completed|complete|finished|done)\b|finished training", re.I)
TRACEBACK = re.compile(r"^Traceback \(most recent call last\):")
TB_FRAME = re.compile(r'^\s{1,8}File "([^"]{1,300})", line (\d{1,7})(?:, in (\S{1,100}))?')
TB_ERROR = re.compile(r"^([A-Za-z_][\w.]{0,120}(?:Error|Exception|Exit|Interrupt|Fault))(?:: (.{0,300}))?$")
WATCHDOG = re.compile(r"Watchdog caught collective operation timeout|NCCL (?:communicator|operation).{0,40}timed? ?out"
                      r"|DistBackendError|ProcessGroupNCCL.{0,80}(?:timeout|Terminating the process)", re.I)
NCCL_RANK = re.compile(r"\[Rank (\d{1,5})\]")
ROOT_CAUSE = re.compile(r"^Root Cause \(first observed failure\)")
ROOT_RANK = re.compile(r"^\s{0,4}rank\s{0,8}: (\d{1,5}) \(local_rank")
CRASH = re.compile(r"Traceback \(most recent call last\)|out of memory|OutOfMemoryError|ChildFailedError|"
                   r"Watchdog caught collective operation timeout", re.I)
VALIDATION = re.compile(r"\b(?:validation|validating|evaluating|evaluation)\b", re.I)
TORCHRUN = re.compile(r"Setting OMP_NUM_THREADS environment variable for each process")
PY_WARNING = re.compile(r"^\S{0,300}\.py:\d{1,6}: [A-Z]\w{0,40}Warning: ")
DUPLICATE_DATA = re.compile(r"allow[-_]duplicate[-_]data|\[DUPLICATE DATA\]")


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


def _search(rx: re.Pattern, text: str, low: str, word: str, other: str = "") -> re.Match | None:
    """`rx.search(text)`, started just before the first of the words it needs (found in lower-cased `low`): no
    match can begin more than 8 characters before it, and most lines lack the words altogether."""
    at = low.find(word)
    if other:
        j = low.find(other)
        if j >= 0 and (at < 0 or j < at):
            at = j
    return rx.search(text, at - 8 if at > 8 else 0) if at >= 0 else None


def _int(s: str) -> int:
    return int(s.replace(",", ""))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _float(s) -> float | None:
    """A finite float, or None (logs print nan and inf; nothing downstream wants them)."""
    if s is None:
        return None
    try:
        v = float(s)
    except (TypeError, ValueError, OverflowError):
        return None
    return v if math.isfinite(v) else None


class Clock:
    """Log timestamps -> seconds: time of day plus whole days, so stamps with and without dates mix."""

    def __init__(self):
        self.date: datetime.date | None = None
        self.guessed = False  # the date's year is a guess (glog stamps carry month and day only)
        self.days = 0
        self.last: float | None = None
        self.tod = 0.0
        self._day: tuple | None = None  # the last ISO date read, as text
        self.end = 0  # where the stamp ended in the text last read (0: no stamp)

    def read(self, text: str) -> float | None:
        """The timestamp at the start of `text` in seconds, or None; updates `last`."""
        head = text[:48]
        self.end = 0
        m = ISO_TS.search(head)
        if m:
            self.end = m.end()
            day = m.group(1, 2, 3)
            if day != self._day:  # a new date (most stamps repeat the last one)
                if not self._date(int(day[0]), int(day[1]), int(day[2]), guessed=False):
                    return None
                self._day = day
            return self._time(int(m.group(4)), int(m.group(5)), int(m.group(6)), m.group(7))
        m = GLOG_TS.match(head) or TIME_TS.match(head)
        if not m:
            return None
        self._day, self.end = None, m.end()
        g = m.groups()
        if len(g) == 6:  # glog: month, day, h, m, s, fraction (no year)
            if not self._date(self.date.year if self.date else 2000, int(g[0]), int(g[1]), guessed=True):
                return None
            g = g[2:]
        return self._time(int(g[0]), int(g[1]), int(g[2]), g[3])

    def _date(self, y: int, mo: int, d: int, guessed: bool) -> bool:
        try:
            date = datetime.date(y, mo, d)
            seen = self.date
            if seen is not None and (guessed or self.guessed):  # compare month and day only
                seen = seen.replace(year=y)
        except ValueError:
            return False
        if seen is not None and date != seen:
            delta = (date - seen).days
            if delta < -300:  # December -> January with a guessed year
                delta += 365
            self.days += max(-1, min(366, delta))
        if not (guessed and self.date is not None and not self.guessed):  # keep a real year once known
            self.date, self.guessed = date, guessed
        else:
            self.date = date.replace(year=self.date.year)
        return True

    def _time(self, h: int, mi: int, s: int, frac: str | None) -> float | None:
        if h > 23 or mi > 59 or s > 60:
            return None
        self.tod = h * 3600 + mi * 60 + s + (float("0." + frac) if frac else 0.0)  # time of day, writer's zone
        t = self.days * 86400 + self.tod
        if self.last is not None and t < self.last - 43200:  # time of day wrapped past midnight
            self.days += 1
            t += 86400
        self.last = t
        return t


class LogParser:
    """Feed lines in order; read `steps`, `facts` and `formats` (format name -> first line) at any time."""

    def __init__(self):
        self.sample = StepSample()
        self.facts: list[Fact] = []
        self.formats: dict[str, int] = {}
        self.lines = 0
        self.truncated = 0
        self.ranks: set[int] = set()  # ranks named by torchrun prefixes on any line
        self.clock = Clock()
        self._rich: list[tuple[int, str]] = []  # the speculators record being assembled: (line, text)
        self._rich_rank: int | None = None
        self._rich_time: float | None = None
        self._arrival: float | None = None
        self.wall_line = 0  # the line of the last wall-clock stamp (0: none)
        self._unix: float | None = None  # that stamp, if it was a Unix time (metrics.jsonl's "time")
        self.gaps: list[tuple] = []  # the largest (seconds, line, line, rank or -1) between a rank's timed steps
        self.deltas: Counter = Counter()  # step-counter increments between a rank's consecutive records
        self._timed: dict[int | None, tuple[float, int]] = {}
        self._counter: dict[int | None, int] = {}
        self._tb: dict[int | None, dict] = {}  # tracebacks being read, by rank
        self._generic: tuple[str | None, tuple | None] = (None, None)  # the last generic record read, and its values
        self._epochs_stated: int | None = None  # the last `epoch i/E` total recorded as a fact
        self._root_cause = False

    @property
    def steps(self) -> list[Step]:
        """The step records kept (all of a short log; a bounded sample of a long one), in order."""
        return self.sample.steps()

    @property
    def wall(self) -> tuple | None:
        """The last wall-clock stamp: ("unix", seconds), ("local", time of day, date, date guessed), or None."""
        if not self.wall_line:
            return None
        if self._unix is not None:
            return ("unix", self._unix)
        return ("local", self.clock.tod, self.clock.date, self.clock.guessed)

    @property
    def step_records(self) -> int:
        """Step records seen, kept or not."""
        return self.sample.count

    def feed(self, lineno: int, text: str, arrival: float | None = None) -> None:
        self.lines = max(self.lines, lineno)
        self._arrival = arrival
        if len(text) > MAX_LINE:
            text, self.truncated = text[:MAX_LINE], self.truncated + 1
        if "\x1b" in text:
            text = ANSI.sub("", text)
        if "\r" not in text:
            text = text.rstrip()
            if text:
                self._segment(lineno, text)
            return
        for segment in text.split("\r"):  # progress bars redraw with carriage returns inside one line
            if segment.strip():
                self._segment(lineno, segment.rstrip())

    def finish(self) -> None:
        """Flush a record still being assembled (call at the end of the file)."""
        self._flush_rich()

    # -- one segment ------------------------------------------------------------------------------------------
    def _segment(self, lineno: int, seg: str) -> None:
        rank = None
        m = RANK_PREFIX.match(seg)
        if m:
            rank, seg = int(m.group(1)), seg[m.end():]
            if rank not in self.ranks:
                self._format("torchrun [rankK]: prefixes", lineno)
                if len(self.ranks) < 4096:
                    self.ranks.add(rank)
        if self._rich and self._rich_rank == rank and len(self._rich) < 400:  # records are bounded
            cont = RICH_CONT.match(seg)
            if cont:
                self._rich.append((lineno, RICH_SOURCE.sub("", cont.group(1))))
                return
        self._flush_rich()
        own_time = self.clock.read(seg)
        if own_time is not None:
            self._unix, self.wall_line = None, lineno
        head = RICH_HEAD.match(seg)
        if head:
            self._rich, self._rich_rank = [(lineno, RICH_SOURCE.sub("", head.group(1)))], rank
            self._rich_time = self.clock.last
            return
        if self._json_step(lineno, seg, rank) or self._specforge(lineno, seg, rank, own_time):
            return
        if not self._eyas_console(lineno, seg) and not self._generic_step(lineno, seg, rank, own_time):
            self._facts(lineno, seg, rank)

    def _format(self, name: str, lineno: int) -> None:
        if name not in self.formats:
            self.formats[name] = lineno

    def _fact(self, lineno: int, name: str, value, text: str) -> None:
        if _is_int(value) and value < 1:
            return  # "world_size: 0", "batches/epoch: 0": not a figure to divide by
        self.facts.append(Fact(lineno, name, value, text.strip()[:200]))

    def _add(self, step: Step) -> None:
        step.arrival = self._arrival
        r = step.rank
        if step.step is not None:
            before = self._counter.get(r)
            if before is not None and step.step > before and len(self.deltas) < 256:
                self.deltas[step.step - before] += 1
            self._counter[r] = step.step
        if step.time is not None:
            before = self._timed.get(r)
            if before is not None and step.time > before[0]:
                gap = (step.time - before[0], before[1], step.line, r if r is not None else -1)
                if len(self.gaps) < 64:
                    heapq.heappush(self.gaps, gap)
                elif gap > self.gaps[0]:
                    heapq.heapreplace(self.gaps, gap)
            self._timed[r] = (step.time, step.line)
        self.sample.add(step)
        self._format(step.fmt, step.line)

    # -- eyas metrics.jsonl ---------------------------------------------------------------------------------
    def _json_step(self, lineno: int, seg: str, rank: int | None) -> bool:
        s = seg.strip()
        if not (s.startswith("{") and s.endswith("}") and '"step"' in s):
            return False
        try:
            rec = json.loads(s)
        except (ValueError, RecursionError):
            return False
        if not isinstance(rec, dict) or not _is_int(rec.get("step")) or rec["step"] < 0:
            return False
        num = {k: _float(v) for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if rec.get("duplicate_data") is True and not any(f.name == "duplicate_data" for f in self.facts[-1:]):
            self._fact(lineno, "duplicate_data", True, s)
        self._add(Step(lineno, "eyas metrics.jsonl", step=int(rec["step"]), rank=rank, epoch=num.get("epoch"),
                       lr=num.get("lr"), loss=num.get("loss"), time=num.get("elapsed_s"),
                       samples_seen=rec["samples_seen_global"] if _is_int(rec.get("samples_seen_global")) and
                       rec["samples_seen_global"] > 0 else None,
                       key=hash(s)))
        if isinstance(rec.get("time"), (int, float)) and math.isfinite(rec["time"]):
            self._unix, self.wall_line = float(rec["time"]), lineno
        return True

    # -- SpecForge ------------------------------------------------------------------------------------------
    def _specforge(self, lineno: int, seg: str, rank: int | None, own_time: float | None) -> bool:
        if ": {" not in seg:
            return False
        matches = list(SF_STEP.finditer(seg))
        for i, m in enumerate(matches):
            end = matches[i + 1].start() if i + 1 < len(matches) else len(seg)
            kv = dict(SF_KV.findall(seg, m.end(), end))
            self._add(Step(lineno, "SpecForge `step N: {...}`", step=int(m.group(1)), rank=rank,
                           epoch=_float(kv.get("epoch")), lr=_float(kv.get("lr")), loss=_float(kv.get("loss")),
                           time=own_time, duration=_float(kv.get("perf/optimizer_step_time_s")),
                           key=hash(seg[m.start():end].strip())))
        return bool(matches)

    # -- speculators (rich console records over several lines) ----------------------------------------------
    def _flush_rich(self) -> None:
        if not self._rich:
            return
        parts, rank, self._rich = self._rich, self._rich_rank, []
        msg = " ".join(text for _, text in parts)
        first = parts[0][0]
        if "global_step=" in msg and "train/" in msg:
            kv = dict(KV_EQ.findall(msg))
            step = kv.get("global_step", "")
            if step.isdigit():
                dur = _float(kv.get("profile/step_ms", ""))
                self._add(Step(first, "speculators console", step=int(step), rank=rank,
                               epoch=_float(kv.get("epoch", "")), lr=_float(kv.get("lr", "")),
                               loss=_float(kv.get("train/loss", "")), time=self._rich_time,
                               duration=dur / 1000 if dur is not None else None, key=hash(msg)))
                return
        for lineno, text in parts:  # facts keep the line where they are written
            self._facts(lineno, text, rank)

    # -- eyas console -----------------------------------------------------------------------------------------
    def _eyas_console(self, lineno: int, seg: str) -> bool:
        if "data: " not in seg and "plan: " not in seg and " processed (global)" not in seg:
            return False
        m = EYAS_DATA.search(seg)
        if m:  # eyas.train.sharding.Audit.line()
            n, w, lo, hi, k, how, units, dis = m.groups()
            self._format("eyas console", lineno)
            if min(_int(n), int(w), _int(lo)) < 1:
                return True
            self._fact(lineno, "audit", {"samples": _int(n), "world_size": int(w), "per_rank": _int(lo),
                                         "per_rank_max": _int(hi or lo), how.lower(): _int(k),
                                         "units": _int(units) if units else 0, "disjoint": dis.lower() == "yes"},
                       seg[m.start():])
            return True
        for name, rx in EYAS_PLAN:
            m = rx.search(seg)
            if m:
                self._format("eyas console", lineno)
                values = tuple(_int(g) for g in m.groups())
                if min(values) >= 1:
                    self._fact(lineno, "plan_" + name, values, seg)
                return True
        m = EYAS_EPOCH_END.search(seg)
        if m:
            values = tuple(_int(g) for g in m.groups())
            if min(values[1:]) >= 1:
                self._fact(lineno, "epoch_samples", values, seg)
            return True
        return False

    # -- generic step lines -----------------------------------------------------------------------------------
    def _generic_step(self, lineno: int, seg: str, rank: int | None, own_time: float | None) -> bool:
        body = seg[self.clock.end:] if own_time is not None else seg
        if body == self._generic[0]:  # another rank's copy of the record just read (only the stamp differs)
            values = self._generic[1]
        else:
            values = self._generic_values(lineno, seg)
            self._generic = (body, values)
        if values is None:
            return False
        step, of, epoch, lr, loss = values
        self._add(Step(lineno, "generic (step/epoch and lr)", step=step, of=of, rank=rank, epoch=epoch, lr=lr,
                       loss=loss, time=own_time, key=hash(seg.strip())))
        return True

    def _generic_values(self, lineno: int, seg: str) -> tuple | None:
        """(step, of, epoch, lr, loss) of a generic step line, or None if it is not one."""
        low = seg.lower()
        lr = _search(GEN_LR, seg, low, "lr", "learning")
        if not lr:
            return None
        st, ep = _search(GEN_STEP, seg, low, "step", "iter"), _search(GEN_EPOCH, seg, low, "epoch")
        if not (st or ep):
            return None
        loss = _search(GEN_LOSS, seg, low, "loss")
        if ep and ep.group(2) and int(ep.group(2)) != self._epochs_stated:  # once per value, not once per line
            self._epochs_stated = int(ep.group(2))
            self._fact(lineno, "epochs", self._epochs_stated, seg)
        return (int(st.group(1)) if st else None, int(st.group(2)) if st and st.group(2) else None,
                _float(ep.group(1)) if ep else None, _float(lr.group(1)), _float(loss.group(1)) if loss else None)

    # -- stated figures and markers -----------------------------------------------------------------------------
    def _facts(self, lineno: int, seg: str, rank: int | None = None) -> None:
        self._crash(lineno, seg, rank)
        for name, rx in STATED:
            for m in rx.finditer(seg):
                self._fact(lineno, name, _int(m.group(1)), seg)
        bar = BAR.search(seg)
        if bar:
            desc = seg[:bar.start()].strip()[-80:]
            t = BAR_ELAPSED.match(seg, bar.end())
            elapsed = int(t.group(1) or 0) * 3600 + int(t.group(2)) * 60 + int(t.group(3)) if t else None
            self._fact(lineno, "bar", (int(bar.group(2)), int(bar.group(3)), desc, elapsed), seg)
        m = EPOCH_DONE.search(seg)
        if m and 1 <= int(m.group(1)) <= int(m.group(2)):
            self._fact(lineno, "epoch_done", (int(m.group(1)), int(m.group(2))), seg)
        elif RUN_END.search(seg):
            self._fact(lineno, "end", True, seg)
        for name, rx in (("crash", CRASH), ("validation", VALIDATION), ("torchrun", TORCHRUN),
                         ("duplicate_data", DUPLICATE_DATA)):
            if rx.search(seg):
                self._fact(lineno, name, True, seg)
        if PY_WARNING.match(seg):
            self._fact(lineno, "warning", seg.strip()[:300], seg)

    def _crash(self, lineno: int, seg: str, rank: int | None) -> None:
        """Tracebacks (per rank: the exception, its message, its innermost frame), NCCL timeouts, the root cause."""
        if TRACEBACK.match(seg):
            self._tb[rank] = {"line": lineno, "where": ""}
            return
        tb = self._tb.get(rank)
        if tb is not None:
            frame = TB_FRAME.match(seg)
            if frame:
                tb["where"] = f'{frame.group(1)}, line {frame.group(2)}' + (f", in {frame.group(3)}" if frame.group(3)
                                                                          else "")
                return
            err = TB_ERROR.match(seg)
            if err:
                del self._tb[rank]
                self._fact(lineno, "crash_error", {"rank": rank, "type": err.group(1), "message": err.group(2) or "",
                                                   "where": tb["where"], "traceback_line": tb["line"]}, seg)
                return
            if not seg.startswith(" "):  # the traceback ended without an exception line we know
                del self._tb[rank]
        if WATCHDOG.search(seg):
            m = NCCL_RANK.search(seg)
            who = rank if rank is not None else int(m.group(1)) if m else None
            self._fact(lineno, "crash_timeout", {"rank": who}, seg)
        if ROOT_CAUSE.match(seg):
            self._root_cause = True
        elif self._root_cause and (m := ROOT_RANK.match(seg)):
            self._root_cause = False
            self._fact(lineno, "root_cause", {"rank": int(m.group(1))}, seg)
