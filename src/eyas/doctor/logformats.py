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
- Hugging Face Trainer (TRL, Axolotl, LLaMA-Factory): `{'loss': '4.87', 'learning_rate': '0.001', 'epoch': '0.04'}`,
  numbered by the tqdm bar redrawn after it; its `***** Running training *****` header states the figures
- Lightning's and torchtune's bars (`Epoch 0:  4%|..| 1/26 [...]`, rich `Epoch 1/1 ━━ 26/26 0:00:01 •`,
  `1|7|Loss: 4.9: 27%|..| 7/26`); torchtune's `Step 7 | loss:4.9 lr:0.001` is a generic line
- DeepSpeed: `[Rank 0] step=12, skipped=0, lr=[0.001], ...`, and its config dump `world_size ....... 2`
- Megatron-LM / NeMo: ` iteration  12/  52 | consumed samples: 48 | elapsed time per iteration (ms): 250.0 | ...`,
  and its arguments block `data_parallel_size ....... 2`
- torchrun: `[rank3]: ...` (or `[default3]: ...`) prefixes name the writing rank, also where one starts in the middle
  of another process's line; glog lines `W1129 16:41:34.71 ...`
- generic: a line with a step (`step 12`, `global_step=12`, `iter 12/500`) or epoch counter and an lr.

Parsers are linear in the line length: lines are capped at MAX_LINE characters, no regex has nested
quantifiers (the patterns are in eyas.doctor.patterns, the timestamps read by eyas.doctor.clock), and nothing is
evaluated (SpecForge's dict reprs and JSON values are read with regexes or `json`). Memory is bounded whatever the
log's length: the step records go into a `StepSample` (eyas.doctor.records), and pauses and the logging interval are
measured as the lines stream past.
"""

from __future__ import annotations

import heapq
import json
import math
import re
from collections import Counter

from eyas.doctor.clock import Clock
from eyas.doctor.patterns import (
    ANSI,
    BAR,
    BAR_ELAPSED,
    CRASH,
    DOTTED,
    DS_STEP,
    DUPLICATE_DATA,
    EPOCH_DONE,
    EYAS_DATA,
    EYAS_EPOCH_END,
    EYAS_PLAN,
    GEN_EPOCH,
    GEN_LOSS,
    GEN_LR,
    GEN_STEP,
    HF_KV,
    HF_RECORD,
    KV_EQ,
    MEGATRON_KV,
    MEGATRON_STEP,
    NCCL_RANK,
    PY_WARNING,
    RANK_ANYWHERE,
    RANK_PREFIX,
    RICH_CONT,
    RICH_EPOCH_BAR,
    RICH_HEAD,
    RICH_SOURCE,
    ROOT_CAUSE,
    ROOT_RANK,
    RUN_END,
    SF_KV,
    SF_STEP,
    STATED,
    TB_ERROR,
    TB_FRAME,
    TORCHRUN,
    TORCHTUNE_DESC,
    TRACEBACK,
    VALIDATION,
    WATCHDOG,
)
from eyas.doctor.records import Fact, Step, StepSample

# settings dumps (DeepSpeed's config, Megatron's arguments) -> facts; data_parallel_size is the ranks that share
# the data (Megatron's world_size also counts tensor- and pipeline-parallel ranks)
DOTTED_FACTS = {"world_size": "world_size", "data_parallel_size": "dp_size", "train_batch_size": "global_batch",
                "global_batch_size": "global_batch", "train_micro_batch_size_per_gpu": "micro_batch",
                "micro_batch_size": "micro_batch", "gradient_accumulation_steps": "grad_accum",
                "train_iters": "total_steps", "num_train_epochs": "epochs", "train_samples": "run_samples"}
MAX_LINE = 65536  # characters kept of one line; the rest is ignored (and counted)


def _search(rx: re.Pattern, text: str, low: str, word: str, other: str = "") -> re.Match | None:
    """`rx.search(text)`, started just before the first of the words it needs (found in lower-cased `low`): no
    match can begin more than 8 characters before it, and most lines lack the words altogether."""
    at = low.find(word)
    if other:
        j = low.find(other)
        if j >= 0 and (at < 0 or j < at):
            at = j
    return rx.search(text, at - 8 if at > 8 else 0) if at >= 0 else None


def _inner_prefix(text: str) -> int:
    """Where a `]:` that may close a rank prefix stands after the line's own prefix (-1: none, the common case)."""
    at = text.find("]:", 1)
    if 0 <= at < 16 and text.startswith(("[rank", "[default")):
        at = text.find("]:", at + 2)
    return at


def _rank_parts(segment: str) -> list[str]:
    """The segment cut before each `[rankK]:` prefix that does not begin it (two processes writing one terminal)."""
    cuts = [m.start() for m in RANK_ANYWHERE.finditer(segment, 1)] if _inner_prefix(segment) >= 0 else []
    return [segment[a:b] for a, b in zip([0, *cuts], [*cuts, len(segment)])]


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
        self._hf: Step | None = None  # the HF Trainer record waiting for the bar drawn after it (its step)
        self._hf_last: int | None = None  # the step of the last HF Trainer record

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
        if "\r" not in text and _inner_prefix(text) < 0:
            text = text.rstrip()
            if text:
                self._segment(lineno, text)
            return
        for segment in text.split("\r"):  # progress bars redraw with carriage returns inside one line
            for part in _rank_parts(segment):  # and another rank's line may start where a bar stopped
                if part.strip():
                    self._segment(lineno, part.rstrip())

    def finish(self) -> None:
        """Flush a record still being assembled (call at the end of the file)."""
        self._flush_rich()
        self._flush_hf()

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
        if (self._json_step(lineno, seg, rank) or self._specforge(lineno, seg, rank, own_time)
                    or self._hf_trainer(lineno, seg, rank, own_time) or self._deepspeed(lineno, seg, rank, own_time)
                or self._megatron(lineno, seg, rank, own_time)):
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

    # -- Hugging Face Trainer (and TRL, Axolotl, LLaMA-Factory) ----------------------------------------------------
    def _hf_trainer(self, lineno: int, seg: str, rank: int | None, own_time: float | None) -> bool:
        """`{'loss': 4.87, 'grad_norm': 1.1, 'learning_rate': 0.001, 'epoch': 0.04}` (values quoted from transformers
        5 on): a logged step, numbered by the training bar's position when it was written (the dict has no step);
        `{'eval_loss': ...}` is a validation pass, `{'train_runtime': ...}` the end of training."""
        m = HF_RECORD.match(seg)
        if not m:
            return False
        kv = dict(HF_KV.findall(seg))
        kind = m.group(1)
        self._flush_hf()
        if kind == "train_runtime":
            self._format("Hugging Face Trainer", lineno)
            self._fact(lineno, "end", True, seg)
        elif kind.startswith("eval_"):
            self._fact(lineno, "validation", True, seg)
        else:
            self._hf = Step(lineno, "Hugging Face Trainer", rank=rank, epoch=_float(kv.get("epoch")),
                            lr=_float(kv.get("learning_rate")), loss=_float(kv.get("loss")), time=own_time,
                            key=hash(seg.strip()))
        return True

    def _flush_hf(self, bar: int | None = None) -> None:
        """Number the pending HF record and add it. The Trainer prints a record through tqdm's `write`, which
        redraws the bar at once with the step just logged: that bar's position is the record's step. A record
        with no bar after it (bars off) counts as the step after the previous one, or has no number if none has."""
        step, self._hf = self._hf, None
        if step is None:
            return
        if bar is not None:
            step.step = bar
        elif self._hf_last is not None:
            step.step = self._hf_last + 1
        self._hf_last = step.step
        self._add(step)

    # -- DeepSpeed and Megatron-LM / NeMo ------------------------------------------------------------------------
    def _deepspeed(self, lineno: int, seg: str, rank: int | None, own_time: float | None) -> bool:
        """`[Rank 0] step=12, skipped=0, lr=[0.001], ...` every `steps_per_print` steps (the engine's `step=0` line
        at start-up is no step). Its timer line's `epoch=0/micro_step=..` is not read: that epoch never advances."""
        if "] step=" not in seg:
            return False
        m = DS_STEP.search(seg)
        if not m:
            return False
        self._format("DeepSpeed", lineno)
        if int(m.group(2)) > 0:
            self._add(Step(lineno, "DeepSpeed", step=int(m.group(2)), rank=rank,
                           lr=_float(m.group(4)), time=own_time, key=hash(seg[m.start():].strip())))
        return True

    def _megatron(self, lineno: int, seg: str, rank: int | None, own_time: float | None) -> bool:
        """` iteration  100/ 1000 | consumed samples: 12800 | elapsed time per iteration (ms): 123.4 | learning
        rate: 1.0E-04 | global batch size: 128 | lm loss: 2.3E+00 | ...`: the step, its stated total, the global
        samples consumed and the step's own duration."""
        if "iteration" not in seg or " |" not in seg:
            return False
        m = MEGATRON_STEP.search(seg)
        if not m:
            return False
        kv = {k.strip().lower(): v for k, v in MEGATRON_KV.findall(seg, m.end() - 2)}
        consumed = kv.get("consumed samples")
        ms = _float(kv.get("elapsed time per iteration (ms)"))
        loss = next((v for k, v in kv.items() if k.endswith("loss") and "scale" not in k), None)
        self._add(Step(lineno, "Megatron-LM", step=int(m.group(1)), of=int(m.group(2)), rank=rank,
                       lr=_float(kv.get("learning rate")), loss=_float(loss), time=own_time,
                       duration=ms / 1000 if ms is not None else None,
                       samples_seen=int(float(consumed)) if consumed and float(consumed) > 0 else None,
                       key=hash(seg[m.start():].strip())))
        if kv.get("global batch size") and _float(kv["global batch size"]):
            gb = int(float(kv["global batch size"]))
            if not self.facts or self.facts[-1].name != "global_batch" or self.facts[-1].value != gb:
                self._fact(lineno, "global_batch", gb, seg)
        return True

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
        dotted = DOTTED.search(seg) if " .." in seg or "_per_gpu  " in seg else None
        if dotted and dotted.group(1) in DOTTED_FACTS:
            self._fact(lineno, DOTTED_FACTS[dotted.group(1)], _int(dotted.group(2)), seg)
            return
        for name, rx in STATED:
            for m in rx.finditer(seg):
                self._fact(lineno, name, _int(next(g for g in m.groups() if g)), seg)
        self._bar(lineno, seg, rank)
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

    def _bar(self, lineno: int, seg: str, rank: int | None) -> None:
        """A progress bar's redraw -> a `bar` fact (position, total, description, elapsed seconds): tqdm's
        `desc: 12%|##  | 3/26 [00:01<00:07, ...]`, Lightning's rich `Epoch 1/1 ━━━ 26/26 0:00:01 • ...` (0-based
        epoch index / last index: an `epochs` fact too), torchtune's `1|7|Loss: 4.9: 27%|...` (epoch|step)."""
        rich = RICH_EPOCH_BAR.match(seg)
        if rich:
            last = int(rich.group(2)) + 1
            if last != self._epochs_stated:
                self._epochs_stated = last
                self._fact(lineno, "epochs", last, seg)
            n, total, desc = int(rich.group(3)), int(rich.group(4)), f"Epoch {rich.group(1)}/{rich.group(2)}"
            h, m_, sec = rich.group(5, 6, 7)
            elapsed = int(h or 0) * 3600 + int(m_) * 60 + int(sec)
        else:
            bar = BAR.search(seg)
            if not bar:
                return
            desc = seg[:bar.start()].strip()[-80:]
            if TORCHTUNE_DESC.match(desc):
                desc = "epoch " + desc  # its first figure is the epoch (1-based)
            t = BAR_ELAPSED.match(seg, bar.end())
            elapsed = int(t.group(1) or 0) * 3600 + int(t.group(2)) * 60 + int(t.group(3)) if t else None
            n, total = int(bar.group(2)), int(bar.group(3))
        self._fact(lineno, "bar", (n, total, desc, elapsed), seg)
        if self._hf is not None and self._hf.rank == rank:
            self._hf.time = elapsed if self._hf.time is None else self._hf.time
            self._flush_hf(n)

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
