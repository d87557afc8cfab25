"""eyas doctor: read a training log (eyas, speculators, SpecForge, torchrun, generic) and say what it shows.

For each log: the format, how many ranks write it and so how many steps each rank has run, the dataset size
and world size (stated, given, or inferred), the verdict on data sharding with the evidence (line numbers and
values) and, when undecidable, what would decide it; the step rate, elapsed time, progress and ETA; anomalies
(restarts, duplicated lines, an lr schedule whose length disagrees with the run, stalls, crashes).

The modules, from the bytes up:
- `eyas.doctor.settings`: `DoctorConfig`;
- here: reading a log or an eyas run folder (`Tail`, `open_log`, `--follow`), `analyse` (one
  log's report) and `render`;
- `eyas.doctor.logformats`: the per-format line parsers, lines -> `Step` and `Fact` records (eyas.doctor.records),
  with their line patterns (eyas.doctor.patterns) and timestamps (eyas.doctor.clock);
- `eyas.doctor.series`: one rank's series of steps (writers, restarts, rate, lr schedule);
- `eyas.doctor.figures`: the figures a verdict needs, each with its source;
- `eyas.doctor.verdict`: the sharding verdict (every rule is in `decide`), progress, ETA and anomalies.
"""

from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path
from typing import NamedTuple

from eyas.core.errors import EyasError
from eyas.core.files import read_json
from eyas.core.log import Console, fmt_duration, fmt_int
from eyas.doctor.figures import cite, figures, latest
from eyas.doctor.logformats import MAX_LINE, LogParser
from eyas.doctor.records import Fact
from eyas.doctor.series import (
    anomaly,
    bar_steps,
    log_every,
    measure_rate,
    normalise,
    schedule_length,
    writers_of,
)
from eyas.doctor.settings import DoctorConfig
from eyas.doctor.verdict import (
    compare,
    crash_story,
    decide,
    fact_anomalies,
    liveness,
    lr_anomalies,
    progress,
    stalls,
    why_ended,
)

CHUNK = 1 << 20  # bytes read at a time


class Seen(NamedTuple):
    """When the log was looked at: its modification time (None while following), now, and --follow's idle time."""

    mtime: float | None
    now: float
    follow_idle: float | None = None


# -- one log -------------------------------------------------------------------------------------------------------
def analyse(parser: LogParser, cfg: DoctorConfig, name: str, extra: list[Fact], seen: Seen) -> dict:
    """The report of one parsed log (a JSON-ready dict)."""
    facts = extra + parser.facts
    rep = {"log": name, "lines": parser.lines, "formats": dict(parser.formats), "steps_found": 0,
           "truncated_lines": parser.truncated, "anomalies": []}
    steps = parser.steps or bar_steps(facts)
    rep["steps_found"] = parser.step_records or len(steps)
    if steps and not parser.steps:
        rep["formats"].setdefault(steps[0].fmt, steps[0].line)
    if not steps:
        return _no_steps(rep, facts, parser, cfg)
    writers, series, how, dups = writers_of(steps)
    done, restarts, counter, zero = normalise(series)
    fig = figures(facts, cfg, writers, parser.ranks, done, counter)
    rate, span, rate_how = measure_rate(done)
    n_done = done[-1][0]
    t_lr, lr_how = schedule_length(done)
    ended = why_ended(facts, done, t_lr, lr_how, _run_total(fig))
    finished = bool(ended) and not ended.startswith("it crashed")
    verdict = decide(fig, facts, n_done if finished else None, done)
    prog = progress(fig, verdict, n_done, rate if not ended else None, finished)  # no ETA for a run that is over
    if prog.get("boundary_in_s") and verdict["decide_by"] and verdict["decide_by"][0].startswith("the epoch b"):
        verdict["decide_by"][0] += " (" + ", ".join(f"{h} in {fmt_duration(t)}" for h, t in
                                                    prog.pop("boundary_in_s").items()) + " at the current rate)"
    prog.pop("boundary_in_s", None)
    last = done[-1][1]
    live, stalled = liveness(rate, ended, parser.wall, parser.wall_line, seen.mtime, seen.now, seen.follow_idle,
                             last.line, done[-min(len(done), 16)][1].line)
    world_note = [anomaly("world size", 0, f"world size {fig['world_size'][0]}: {fig['world_size'][1]}")
                  if fig["world_size"][1].startswith("the log, not") else None]
    per_rank = None if finished else prog["total_steps_per_rank"]
    rep["anomalies"] = (restarts + [anomaly("duplicate", 0, d) for d in dups[:5]]
                        + lr_anomalies(done, t_lr, lr_how, per_rank, finished)
                        + stalls(parser.gaps, last.rank, done[0][1].line, (last.line, last.time), rate, ended,
                                 parser.clock.last)
                        + stalled + fact_anomalies(facts, last.line) + [a for a in world_note if a])
    for key, (value, source) in fig.items():
        rep[key], rep[key + "_source"] = value, source
    rep.update(writers=writers, writers_evidence=how, steps_per_rank=n_done, counter_starts_at_0=zero,
               first_step_line=done[0][1].line, last_step_line=last.line,
               log_every=log_every(parser.deltas), rate_steps_per_s=rate, rate_source=rate_how, elapsed_s=span,
               lr_schedule_steps=t_lr, lr_schedule_evidence=lr_how, ended=ended, finished=finished, liveness=live,
               **verdict, **prog)
    return rep


def _run_total(fig: dict) -> tuple[int, str] | None:
    """The steps a rank runs in all: eyas's plan, else the epochs times the steps per epoch the log shows."""
    if fig["plan_steps"][0]:
        return fig["plan_steps"][0][1], "planned"
    (e, _), (p, _) = fig["epochs"], fig["steps_per_epoch_seen"]
    return (e * p, f"{e} epochs x {fmt_int(p)} per rank") if e and p else None


def _no_steps(rep: dict, facts: list[Fact], parser: LogParser, cfg: DoctorConfig) -> dict:
    """A log without steps: say so, and what its audit (eyas prints it before the first step) or crash shows."""
    none = (f"no training step lines in {parser.lines} lines: none of eyas metrics.jsonl, the eyas console, "
            "speculators, SpecForge, or a line with a step or epoch counter and an lr")
    rep.update(verdict="undecidable", trivial=False, predictions={}, decide_by=[], reasons=[none])
    if latest(facts, "audit"):
        rep.update(decide(figures(facts, cfg, 1, parser.ranks, [], None), facts, None))
        rep["reasons"].append(none)
    rep["anomalies"] = [anomaly("crash", f.line, f"before the first step: {cite(f)}")
                        for f in facts if f.name == "crash"][-1:]
    return rep


# -- the human report -----------------------------------------------------------------------------------------------
FIGURE_LABELS = (("samples", "dataset"), ("world_size", "world size"),
                 ("samples_per_step", "samples per step per rank"), ("epochs", "epochs"),
                 ("steps_per_epoch_seen", "steps per epoch per rank (seen)"))


def render(rep: dict) -> list[str]:
    """The human report of one log."""
    out = [f"doctor: {rep['log']} ({fmt_int(rep['lines'])} lines)"]
    fmts = ", ".join(f"{k} (from line {v})" for k, v in rep["formats"].items()) or "none recognised"
    out.append(f"  format: {fmts}")
    if rep["steps_found"]:
        out.append(f"  writers: {fmt_int(rep['steps_found'])} step records from {rep['writers']} writer(s) "
                   f"({rep['writers_evidence']}) -> {fmt_int(rep['steps_per_rank'])} steps per rank so far "
                   f"(lines {rep['first_step_line']}-{rep['last_step_line']}"
                   f"{', a line every %d steps' % rep['log_every'] if rep['log_every'] > 1 else ''})")
        for key, label in FIGURE_LABELS:
            if rep.get(key):
                out.append(f"  {label}: {fmt_int(rep[key])} ({rep[key + '_source']})")
    trivial = " (trivially)" if rep.get("trivial") else ""
    out.append(f"  verdict: {rep['verdict'].upper()}{trivial}")
    out += [f"    because {r}" for r in rep["reasons"]]
    out += [f"    would decide it: {d}" for d in rep["decide_by"]]
    if rep["steps_found"]:
        out += _render_progress(rep)
    out += _render_anomalies(rep["anomalies"])
    return out


SHOWN_PER_KIND = 3  # anomalies of one kind printed before the rest are counted (--json lists them all)


def _render_anomalies(anomalies: list[dict]) -> list[str]:
    """Anomalies grouped by kind in the order first seen: the first few of each, then how many more and where."""
    if not anomalies:
        return ["  anomalies: none"]
    kinds: dict[str, list[dict]] = {}
    for a in anomalies:
        kinds.setdefault(a["kind"], []).append(a)
    out = []
    for kind, group in kinds.items():
        out += [f"  anomaly ({kind}): {a['message']}" for a in group[:SHOWN_PER_KIND]]
        rest = group[SHOWN_PER_KIND:]
        if rest:
            lines = [a["line"] for a in rest if a.get("line")]
            where = f", lines {min(lines):,}-{max(lines):,}" if lines else ""
            out.append(f"  anomaly ({kind}): {len(rest):,} more of this kind{where} (--json lists every one)")
    return out


def _render_progress(rep: dict) -> list[str]:
    out = []
    if rep["rate_steps_per_s"]:
        out.append(f"  rate: {rep['rate_steps_per_s']:.3g} steps/s per rank ({rep['rate_source']}); "
                   f"elapsed {fmt_duration(rep['elapsed_s'])}")
    else:
        out.append(f"  rate: unknown ({rep['rate_source']}; --follow times the lines as they arrive)")
    if rep["epoch"]:
        of = f" of {rep['epochs']}" if rep.get("epochs") else ""
        out.append(f"  progress: epoch {rep['epoch']}{of}, step {fmt_int(rep['step_in_epoch'])} of "
                   f"{fmt_int(rep['steps_per_epoch_per_rank'])} per rank in this epoch")
    if rep["total_steps_per_rank"]:
        out.append(f"  run: {fmt_int(rep['steps_per_rank'])} of {fmt_int(rep['total_steps_per_rank'])} steps per rank "
                   f"({100 * rep['progress_run']:.1f}%)")
    if rep["ended"]:
        out.append(f"  ended: {rep['ended']}")
    elif rep["eta_s"] is not None:
        out.append(f"  ETA: {fmt_duration(rep['eta_s'])}")
    for h, t in rep["eta_by_hypothesis"].items():
        out.append(f"  ETA if {h}: {fmt_duration(t)}")
    out += [f"  ruled out: {r}" for r in rep["ruled_out"]]
    if rep["liveness"]:
        out.append(f"  liveness: {rep['liveness']}")
    return out


def _one_line(rep: dict) -> str:
    eta = f", ETA {fmt_duration(rep['eta_s'])}" if rep.get("eta_s") else ""
    eta += "".join(f", ETA {fmt_duration(t)} if {h}" for h, t in rep.get("eta_by_hypothesis", {}).items())
    steps = f", {fmt_int(rep['steps_per_rank'])} steps per rank" if rep.get("steps_per_rank") else ""
    return f"doctor: {rep['log']}: {rep['verdict']}{steps}{eta}, {len(rep['anomalies'])} anomalies"


# -- reading a log ---------------------------------------------------------------------------------------------------
class Tail:
    """Reads a log in chunks from where it stopped: complete lines only, each capped at MAX_LINE bytes."""

    def __init__(self, path: Path):
        self.path, self.offset, self.lineno, self.partial, self.skipping = path, 0, 0, b"", False

    def read(self, parser: LogParser, arrival: float | None = None, final: bool = False) -> int:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:
                    raise EyasError(f"{self.path} shrank while being read", "it was truncated or rotated",
                                    "run eyas doctor again on the new file")
                if self.offset:
                    f.seek(self.offset)  # not at 0: a named pipe cannot seek
                before = self.lineno
                while chunk := f.read(CHUNK):
                    if self.offset == 0:
                        _check_text(self.path, chunk)
                    self.offset += len(chunk)
                    self._lines(chunk, parser, arrival)
        except OSError as e:
            raise EyasError(f"cannot read {self.path}: {e.strerror}",
                            fix="check the path and its permissions") from None
        if final and self.partial:
            self.lineno += 1
            parser.feed(self.lineno, self.partial.decode("utf-8", "replace"), arrival)
            self.partial = b""
        return self.lineno - before

    def _lines(self, chunk: bytes, parser: LogParser, arrival: float | None) -> None:
        if self.skipping:  # the rest of an over-long line: drop it up to its newline
            cut = chunk.find(b"\n")
            if cut < 0:
                return
            chunk, self.skipping = chunk[cut:], False
        parts = (self.partial + chunk).split(b"\n")
        self.partial = parts.pop()
        if len(self.partial) > MAX_LINE:
            self.partial, self.skipping = self.partial[:MAX_LINE], True
            parser.truncated += 1
        for raw in parts:
            self.lineno += 1
            if len(raw) > MAX_LINE:
                parser.truncated += 1
            parser.feed(self.lineno, raw[:MAX_LINE].decode("utf-8", "replace"), arrival)


def _check_text(path: Path, head: bytes) -> None:
    head = head[:65536]
    control = sum(1 for b in head if b < 32 and b not in (9, 10, 12, 13, 27, 8))
    if b"\x00" in head or control > len(head) // 20:
        raise EyasError(f"{path} is not a text log", "it holds binary data (NUL or control bytes)",
                        "give the training console output or metrics.jsonl (a UTF-16 log: convert it to UTF-8)")


def _run_folder_facts(folder: Path) -> list[Fact]:
    """An eyas run folder's plan.json and audit.json as facts (line 0: not from the log itself)."""
    facts = []
    for name in ("plan.json", "audit.json"):
        p = folder / name
        if not p.is_file():
            continue
        d = read_json(p, "delete it or re-run the trainer", expect=None)
        if not isinstance(d, dict):
            continue
        try:
            if name == "audit.json":
                facts.append(Fact(0, "audit", d, f"{p}"))
            else:  # eyas.train.plan.Plan.to_dict(), plus what the trainer adds (the steps this run really takes)
                total = int(d.get("optimizer_steps_run") or d["optimizer_steps_total"])
                facts += [Fact(0, "plan_samples", (int(d["samples"]), int(d["epochs"])), str(p)),
                          Fact(0, "plan_batching", (int(d["world_size"]), int(d["micro_batch"]), int(d["grad_accum"])),
                               str(p)),
                          Fact(0, "plan_steps", (int(d["optimizer_steps_per_epoch"]), total), str(p))]
        except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: int(1e999)
            raise EyasError(f"{p} lacks the plan fields", fix="it should hold eyas.train.plan.Plan.to_dict()") from None
    return facts


def open_log(path_str: str) -> tuple[Path, list[Fact]]:
    """(the log to read, facts from outside it): a log file, or an eyas run folder's metrics.jsonl and its plans."""
    p = Path(path_str)
    if p.is_dir():
        if not (p / "metrics.jsonl").is_file():
            raise EyasError(f"{p} is a folder without metrics.jsonl", fix="give a log file or an eyas run folder")
        return p / "metrics.jsonl", _run_folder_facts(p)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise EyasError(f"log {p} not found", fix="give the path of a training log or an eyas run folder") from None
    except OSError as e:
        raise EyasError(f"cannot read {p}: {e.strerror}", fix="check the path and its permissions") from None
    if stat.S_ISFIFO(mode):
        return p, []  # a named pipe is read to its end, as it is written
    if not stat.S_ISREG(mode):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise EyasError(f"{p} is {kind}, not a log", "doctor reads text files (or a named pipe) that a run wrote",
                        "give the path of a training log or an eyas run folder")
    return p, []


# -- the command ---------------------------------------------------------------------------------------------------
def _read_whole(path_str: str, cfg: DoctorConfig) -> dict:
    path, extra = open_log(path_str)
    fifo = stat.S_ISFIFO(path.stat().st_mode)
    if not fifo and path.stat().st_size == 0:
        raise EyasError(f"{path} is empty", "the run has written nothing yet",
                        "wait for the first step lines, or use --follow")
    parser, tail = LogParser(), Tail(path)
    tail.read(parser, final=True)
    parser.finish()
    if fifo and not parser.lines:
        raise EyasError(f"{path} (a named pipe) gave no lines before its writer closed it",
                        fix="start the writer first, or give the log file itself")
    mtime = None if fifo else path.stat().st_mtime  # a pipe's clock says nothing of the run
    return analyse(parser, cfg, path_str, extra, Seen(mtime, time.time()))


def crash_cause(path: Path) -> str | None:
    """What a failed run's log says killed it (the rank that died first, its error and where, the ranks stopped
    after it), or None when the log names no crash or cannot be read. Under NCCL a rank whose peer died is
    aborted by the watchdog without a Python exception, so its own output never says why: this does."""
    parser = LogParser()
    try:
        Tail(Path(path)).read(parser, final=True)
        parser.finish()
    except (EyasError, OSError, ValueError):
        return None
    return crash_story(parser.facts)[0] or None


def follow(cfg: DoctorConfig, con: Console) -> dict:
    """Read a growing log until the run ends or no line arrives for follow_timeout seconds."""
    path, extra = open_log(cfg.logs[0])
    if stat.S_ISFIFO(path.stat().st_mode):
        raise EyasError(f"--follow on {path}, a named pipe", "a pipe is read once, to its end: there is nothing to "
                        "come back to", "drop --follow (doctor reads the pipe until its writer closes it)")
    parser, tail = LogParser(), Tail(path)
    tail.read(parser)
    last_line, shown = time.monotonic(), -1
    try:
        while True:
            if tail.read(parser, arrival=time.time()) or shown < 0:
                last_line = time.monotonic()
                rep = analyse(parser, cfg, cfg.logs[0], extra, Seen(None, time.time(), 0.0))
                if rep.get("steps_per_rank", 0) != shown:
                    shown = rep.get("steps_per_rank", 0)
                    con.print(_one_line(rep))
                if rep.get("ended"):
                    break
            if cfg.follow_timeout and time.monotonic() - last_line > cfg.follow_timeout:
                break
            time.sleep(cfg.poll)
    except KeyboardInterrupt:
        pass
    parser.finish()
    return analyse(parser, cfg, cfg.logs[0], extra, Seen(None, time.time(), time.monotonic() - last_line))


def run(cfg: DoctorConfig) -> dict:
    con = Console(quiet=cfg.quiet or cfg.json, stream=sys.stdout)
    reports = [follow(cfg, con)] if cfg.follow else [_read_whole(p, cfg) for p in cfg.logs]
    comparison = compare(reports) if len(reports) > 1 else None
    for rep in reports:
        for line in render(rep):
            con.print(line)
    if comparison:
        con.print(f"comparison: {comparison['verdict'].upper()}: {comparison['evidence']}")
    if not cfg.json:
        for rep in reports:
            con.summary(_one_line(rep))
    return {"logs": reports, "comparison": comparison}
