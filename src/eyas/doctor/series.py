"""One rank's series of logged steps: who writes them, how many steps each rank has done, how fast, and the lr.

`writers_of` tells how many ranks write each step and picks one rank's series; `normalise` turns that series
into steps done per rank, splitting at restarts and joining epoch-local counters; `bar_steps` reads the steps of
a log whose only progress record is a training progress bar. Over the series: `measure_rate` (steps per second),
`schedule_length` (where the lr schedule ends) and `log_every` (steps between two logged lines). No verdict here:
`eyas.doctor.figures` and `eyas.doctor.verdict` draw conclusions from these.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter

from eyas.core.log import fmt_int
from eyas.doctor.patterns import RICH_EPOCH_DESC
from eyas.doctor.records import Fact, Step


def anomaly(kind: str, line: int, message: str) -> dict:
    """One anomaly of a report: its kind, the log line it is seen at (0: none in particular), and what it is."""
    return {"kind": kind, "line": line, "message": message}


# -- the series of one writer --------------------------------------------------------------------------------------
def writers_of(steps: list[Step]) -> tuple[int, list[Step], str, list[str]]:
    """(writers, one writer's records in order, evidence, duplicate notes)."""
    ranks = sorted({s.rank for s in steps if s.rank is not None})
    dups = []
    if ranks:
        series = [s for s in steps if s.rank == ranks[0]]
        for r in ranks:
            mine = [s for s in steps if s.rank == r]
            dups += [f"line {b.line}: rank {r} repeats line {a.line}"
                     for a, b in itertools.pairwise(mine) if a.key == b.key]
        return len(ranks), series, f"[rankK]: prefixes name {len(ranks)} ranks ({_list(ranks)})", dups
    if any(s.step is None for s in steps):
        return 1, steps, "lines carry no step counter; one writer assumed", []
    clusters: dict[tuple, list[list[int]]] = {}
    for i, s in enumerate(steps):  # the same step again, nearby and before the counter moved on: another writer
        runs = clusters.setdefault((s.epoch, s.step), [])
        j = runs[-1][-1] if runs else -1
        if runs and i - j <= 64 and max((t.step for t in steps[j + 1:i]), default=s.step) <= s.step + 2:
            runs[-1].append(i)
        else:
            runs.append([i])
    sizes = Counter(len(c) for runs in clusters.values() for c in runs)
    k = max(sizes, key=lambda n: (sizes[n], -n))
    firsts = sorted(c[0] for runs in clusters.values() for c in runs)
    for (_, v), runs in clusters.items():
        dups += [f"step {v} appears {len(c)} times (lines {_list([steps[i].line for i in c])}), not {k}"
                 for c in runs if len(c) > k]
    ex = next((c for runs in clusters.values() for c in runs if len(c) == k), [0])
    how = (f"every step value appears {k} times, e.g. step {steps[ex[0]].step} at lines "
           f"{_list([steps[i].line for i in ex])}" if k > 1 else "each step value appears once")
    return k, [steps[i] for i in firsts], how, dups


def _list(xs, n: int = 6) -> str:
    xs = list(xs)
    return ", ".join(str(x) for x in xs[:n]) + (", ..." if len(xs) > n else "")


def normalise(series: list[Step]) -> tuple[list[tuple[int, Step]], list[dict], int | None, bool]:
    """Per-rank steps done at each record of the final run segment, restarts, steps per epoch if the counter
    restarts each epoch, and whether the counter starts at 0."""
    zero = min((s.step for s in series if s.step is not None), default=1) == 0
    done, restarts, offset, per_epoch, prev = [], [], 0, None, None
    for s in series:
        count = (s.step + (1 if zero else 0)) if s.step is not None else s.seq + 1  # steps (records, if no counter)
        v = count + offset
        if prev is not None and v < prev[0]:
            if s.epoch is not None and prev[1].epoch is not None and s.epoch > prev[1].epoch and count <= 1:
                per_epoch = per_epoch or prev[0] - offset  # an epoch-local counter, not a restart
                offset = prev[0]
                v = count + offset
            else:
                restarts.append(anomaly("restart", s.line, f"step went back from {prev[1].step} (line {prev[1].line}) "
                                        f"to {s.step} (line {s.line}): a restart or resume"))
                done = []
        done.append((v, s))
        prev = (v, s)
    return done, restarts, per_epoch, zero


def log_every(deltas: Counter) -> int:
    """Steps between two logged lines: the commonest increment of a rank's step counter (as the lines streamed)."""
    return max(deltas, key=lambda d: (deltas[d], -d)) if deltas else 1


def bar_steps(facts: list[Fact]) -> list[Step]:
    """For a log whose only progress record is a training bar (eyas's console, HF Trainer): its updates as steps.
    A bar with a new description starting again from 0 is the next epoch's; other redraws that go back are not
    the training loop's (validation)."""
    out, steps0, time0, prev = [], 0, 0, None
    for f in facts:
        n, total, desc, elapsed = f.value if f.name == "bar" else (0, 0, "", None)
        if n < 1 or not any(w in desc.lower() for w in ("train", "step", "epoch")) or "valid" in desc.lower():
            continue
        if prev and desc != prev[2] and n <= prev[0] < prev[1] + 1 and prev[0] == prev[1]:
            steps0, time0 = steps0 + prev[1], time0 + (prev[3] or 0)  # the previous epoch's bar was complete
        indexed = RICH_EPOCH_DESC.match(desc)  # Lightning's rich bar names its epoch (0-based): those before it ran
        if indexed and steps0 < int(indexed.group(1)) * total:  # whole, though a log not on a terminal shows only
            steps0 = int(indexed.group(1)) * total  # the last
        v = steps0 + n
        if not out or v > out[-1].step:
            out.append(Step(f.line, "progress bar (tqdm/rich)", step=v, of=steps0 + total,
                            time=None if elapsed is None else time0 + elapsed, key=hash(f.text)))
            prev = f.value
    return out


# -- rates and schedules --------------------------------------------------------------------------------------
def measure_rate(done: list[tuple[int, Step]]) -> tuple[float | None, float | None, str]:
    """(optimizer steps per second per rank, seconds covered, how) over the final segment."""
    pts = done[1:] if len(done) >= 3 else done  # the first step carries start-up and compilation
    clock = {"eyas metrics.jsonl": "elapsed_s", "progress bar (tqdm/rich)": "the bar's elapsed time",
             "Hugging Face Trainer": "the training bar's elapsed time"}
    sources = (("time", clock.get(done[-1][1].fmt, "log timestamps")), ("arrival", "arrival times of the lines"))
    for attr, how in sources:
        tp = [(v, s.line, t) for v, s in pts if (t := getattr(s, attr)) is not None and math.isfinite(t)]
        if len(tp) >= 2 and tp[-1][2] - tp[0][2] >= 1.0 and tp[-1][0] > tp[0][0]:
            span = tp[-1][2] - tp[0][2]
            where = f"lines {tp[0][1]}-{tp[-1][1]}" if tp[0][1] != tp[-1][1] else f"line {tp[0][1]}"
            return (tp[-1][0] - tp[0][0]) / span, span, f"{how}, {where}"
    durs = [s.duration for _, s in done if s.duration is not None and 0 < s.duration < 1e7]
    if durs and len(durs) >= len(done) // 2:
        recent = durs[-200:][1:] or durs
        return len(recent) / sum(recent), sum(durs), "the step durations the log states"
    return None, None, "no timestamps or step durations in the log"


def schedule_length(done: list[tuple[int, Step]]) -> tuple[int | None, str]:
    """Steps per rank after which the lr schedule ends, from the logged lr values (None if they do not say)."""
    pts = [(v, s.lr, s.line) for v, s in done if s.lr is not None and math.isfinite(s.lr)]
    if len(pts) < 4:
        return None, ""
    peak = max(lr for _, lr, _ in pts)
    if peak <= 0:
        return None, ""
    i0 = next(i for i, p in enumerate(pts) if p[1] == peak)
    end = next((p for p in pts[i0:] if p[1] <= 1e-6 * peak), None)
    if end is not None:
        return end[0], f"lr reached 0 at step {fmt_int(end[0])} (line {end[2]})"
    decay = [(v, lr / peak) for v, lr, _ in pts[i0:] if 0.02 < lr / peak < 0.995]
    if len(decay) < 3 or decay[-1][0] == decay[0][0] or decay[-1][1] > 0.9:
        return None, ""  # under a tenth of the decay seen: the start of a cosine looks like any slow line
    best = None
    for shape, y in (("linear", lambda r: 1 - r), ("cosine", lambda r: math.acos(2 * r - 1) / math.pi)):
        xs, ys = [v for v, _ in decay], [y(r) for _, r in decay]
        a, c = _fit(xs, ys)
        err = max(abs(a * x + c - yy) for x, yy in zip(xs, ys))
        if a > 0 and (best is None or err < best[0]):
            best = (err, shape, (1 - c) / a)
    if best is None or best[0] > 0.02 or not math.isfinite(best[2]):
        return None, ""
    return round(best[2]), f"the lr follows a {best[1]} decay reaching 0 near step {fmt_int(best[2])}"


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return a, my - a * mx
