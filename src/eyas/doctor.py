"""eyas doctor: read a training log (eyas, speculators, SpecForge, torchrun, generic) and say what it shows.

For each log: the format, how many ranks write it and so how many steps each rank has run, the dataset size
and world size (stated, given, or inferred), the verdict on data sharding with the evidence (line numbers and
values) and, when undecidable, what would decide it; the step rate, elapsed time, progress and ETA; anomalies
(restarts, duplicated lines, an lr schedule whose length disagrees with the run, stalls, crashes).

The verdict compares what each rank runs per epoch with two predictions (N samples, W ranks, s samples per
optimizer step per rank): sharded, ceil(N/W)/s steps per rank per epoch; not sharded, N/s. Every rule is in
`decide`; the lines are parsed by `eyas.logformats`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import sys
import time
from collections import Counter

from eyas.config import StageConfig, check, opt
from eyas.errors import EyasError
from eyas.log import Console, fmt_duration, fmt_int
from eyas.logformats import Fact, LogParser, Step, Tail, normalise, open_log, writers_of

TOL = 0.15  # relative distance within which an observed count matches a prediction


@dataclasses.dataclass(frozen=True, kw_only=True)
class DoctorConfig(StageConfig):
    """Settings of `eyas doctor`. The hints stand in for figures a log does not state."""

    logs: tuple[str, ...] = opt((), "training logs or eyas run folders (RUN/metrics.jsonl)", positional=True)
    samples: int = opt(0, "dataset samples, if the log does not state them (0 = unknown)")
    world_size: int = opt(0, "ranks, if the log does not show them (0 = unknown)")
    micro_batch: int = opt(0, "samples per micro-batch per rank, if the log does not state it (0 = unknown)")
    grad_accum: int = opt(1, "micro-batches per optimizer step (used with --micro-batch)")
    epochs: int = opt(0, "epochs of the run, if the log does not state them (0 = unknown)")
    follow: bool = opt(False, "keep reading a log that is still being written, printing progress as steps arrive")
    follow_timeout: float = opt(600.0, "with --follow: stop after this many seconds without a new line (0 = never)")
    poll: float = opt(1.0, "with --follow: seconds between reads of the log")

    def __post_init__(self):
        check(len(self.logs) > 0, "doctor: no log given", "give one or more log files or eyas run folders")
        check(not self.follow or len(self.logs) == 1, "doctor: --follow reads one log", "give a single log")
        for name in ("samples", "world_size", "micro_batch", "epochs"):
            check(getattr(self, name) >= 0, f"doctor: --{name.replace('_', '-')} must be >= 0", "give 0 for unknown")
        check(self.grad_accum >= 1, "doctor: --grad-accum must be >= 1", "give a whole number >= 1")
        check(self.follow_timeout >= 0 and self.poll > 0, "doctor: --follow-timeout >= 0 and --poll > 0 required",
              "give seconds, e.g. --follow-timeout 60 --poll 1")


# -- rates and schedules --------------------------------------------------------------------------------------
def measure_rate(done: list[tuple[int, Step]]) -> tuple[float | None, float | None, str, list[tuple[int, float]]]:
    """(optimizer steps per second per rank, seconds covered, how, [(line, time)]) over the final segment."""
    pts = done[1:] if len(done) >= 3 else done  # the first step carries start-up and compilation
    clock = {"eyas metrics.jsonl": "elapsed_s", "progress bar (tqdm/rich)": "the bar's elapsed time"}
    sources = (("time", clock.get(done[-1][1].fmt, "log timestamps")), ("arrival", "arrival times of the lines"))
    for attr, how in sources:
        tp = [(v, s.line, t) for v, s in pts if (t := getattr(s, attr)) is not None and math.isfinite(t)]
        if len(tp) >= 2 and tp[-1][2] - tp[0][2] >= 1.0 and tp[-1][0] > tp[0][0]:
            span = tp[-1][2] - tp[0][2]
            where = f"lines {tp[0][1]}-{tp[-1][1]}" if tp[0][1] != tp[-1][1] else f"line {tp[0][1]}"
            return ((tp[-1][0] - tp[0][0]) / span, span, f"{how}, {where}",
                    [(line, t) for _, line, t in tp])
    durs = [s.duration for _, s in done if s.duration is not None and 0 < s.duration < 1e7]
    if durs and len(durs) >= len(done) // 2:
        recent = durs[-200:][1:] or durs
        return len(recent) / sum(recent), sum(durs), "the step durations the log states", []
    return None, None, "no timestamps or step durations in the log", []


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
    if len(decay) < 3 or decay[-1][0] == decay[0][0]:
        return None, ""
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


# -- the figures a verdict needs, with where each came from ----------------------------------------------------
def _src(f: Fact) -> str:
    return f"line {f.line}: `{f.text[:120]}`" if f.line else f.text


def _last(facts: list[Fact], name: str) -> Fact | None:
    return next((f for f in reversed(facts) if f.name == name), None)


def _world(facts: list[Fact], cfg: DoctorConfig, writers: int, ranks: set[int]) -> tuple[int | None, str]:
    audit, batching, stated = _last(facts, "audit"), _last(facts, "plan_batching"), _last(facts, "world_size")
    if cfg.world_size:
        return cfg.world_size, "--world-size"
    if audit and isinstance(audit.value.get("world_size"), int):
        return audit.value["world_size"], _src(audit)
    if batching:
        return batching.value[0], _src(batching)
    if stated:
        return stated.value, _src(stated)
    if ranks and max(ranks) + 1 >= writers:
        return max(ranks) + 1, f"torchrun prefixes name ranks up to [rank{max(ranks)}]"
    if writers > 1:
        return writers, f"{writers} ranks write the step lines (assuming every rank writes)"
    warns = Counter(f.value for f in facts if f.name == "warning")
    mult = Counter(warns.values())
    k = max(mult, key=lambda n: (mult[n], n), default=1)
    if k > 1 and mult[k] >= 2:
        first = next(f for f in facts if f.name == "warning" and warns[f.value] == k)
        return k, f"{mult[k]} Python warnings each appear {k} times (once per process), e.g. line {first.line}"
    if _last(facts, "torchrun"):
        return None, f"torchrun started several processes ({_src(_last(facts, 'torchrun'))}), how many is not stated"
    return 1, "assumed: no rank prefixes, repeated steps, per-process warnings or torchrun banner"


def _samples_per_step(facts: list[Fact], cfg: DoctorConfig, done, world: int | None) -> tuple[int | None, str]:
    batching, mb, ga = _last(facts, "plan_batching"), _last(facts, "micro_batch"), _last(facts, "grad_accum")
    if cfg.micro_batch:
        return cfg.micro_batch * cfg.grad_accum, f"--micro-batch {cfg.micro_batch} x --grad-accum {cfg.grad_accum}"
    if batching:
        return batching.value[1] * batching.value[2], _src(batching)
    seen = next(((v, s) for v, s in reversed(done) if s.samples_seen), None)
    if seen and world:
        spb = seen[1].samples_seen / (seen[0] * world)
        return max(1, round(spb)), f"{fmt_int(seen[1].samples_seen)} samples seen (global) after {seen[0]} steps " \
                                   f"on {world} ranks (line {seen[1].line})"
    if mb:
        return mb.value * (ga.value if ga else 1), _src(mb) + (f" and {_src(ga)}" if ga else "")
    return None, ""


def _observed_per_epoch(facts, done, per_epoch_counter) -> tuple[int | None, str]:
    """Optimizer steps per rank per epoch as the log shows them (not as a trainer claims)."""
    p, how = _seen_per_epoch(facts, done, per_epoch_counter)
    return (p, how) if p and p >= 1 else (None, "")


def _seen_per_epoch(facts, done, per_epoch_counter) -> tuple[int | None, str]:
    epochs = [(v, s) for v, s in done if s.epoch is not None]
    if epochs and any(s.epoch != int(s.epoch) for _, s in epochs):  # fractional epochs (HF Trainer)
        est = [v / s.epoch for v, s in epochs if s.epoch >= 0.02]
        if est:
            return round(statistics.median(est)), f"fractional epochs (step/epoch), e.g. line {epochs[-1][1].line}"
    bounds = [(a, b) for a, b in zip(epochs, epochs[1:]) if int(b[1].epoch) == int(a[1].epoch) + 1]
    if len(bounds) >= 2:  # a whole epoch between two advances of the counter
        (v1, s1), (v2, s2) = bounds[-2][0], bounds[-1][0]
        return v2 - v1, f"the epoch counter advanced after steps {fmt_int(v1)} and {fmt_int(v2)} (lines {s1.line}, " \
                        f"{s2.line})"
    if bounds and epochs[0][0] <= 2 and epochs[0][1].epoch in (0, 1):  # the log starts with the run
        (v, s), (_, s2) = bounds[0]
        return v, f"the epoch counter advanced after step {fmt_int(v)} (lines {s.line}-{s2.line})"
    if per_epoch_counter:
        return per_epoch_counter, "the step counter restarts each epoch"
    for f in facts:
        if f.name == "epoch_done" and f.value[0] >= 1:
            before = [v for v, s in done if s.line < f.line]
            if before:
                return round(before[-1] / f.value[0]), f"{fmt_int(before[-1])} steps when {_src(f)}"
    return _bar_total(facts, done, ("epoch",), ())


def _train_bars(facts: list[Fact], done, words: tuple, without: tuple = ()) -> list[Fact]:
    """Progress bars of the training loop (a description with one of `words`, not during validation)."""
    bars = []
    for f in facts:
        desc = f.value[2].lower() if f.name == "bar" else ""
        if f.name == "bar" and f.value[1] > 1 and any(w in desc for w in words) and not any(w in desc for w in without):
            last_step = max((s.line for _, s in done if s.line < f.line), default=0)
            if not any(g.name == "validation" and last_step < g.line < f.line for g in facts):
                bars.append(f)
    return bars


def _bar_total(facts: list[Fact], done, words: tuple, without: tuple) -> tuple[int | None, str]:
    """The largest total of a training progress bar (a rank's own loop)."""
    top = max(_train_bars(facts, done, words, without), key=lambda f: f.value[1], default=None)
    return (top.value[1], f"the progress bar's total, {_src(top)}") if top else (None, "")


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
        v = steps0 + n
        if not out or v > out[-1].step:
            out.append(Step(f.line, "progress bar (tqdm/rich)", step=v, of=steps0 + total,
                            time=None if elapsed is None else time0 + elapsed, key=f.text))
            prev = f.value
    return out


def figures(facts: list[Fact], cfg: DoctorConfig, writers: int, ranks: set[int], done, counter) -> dict:
    """Each figure as (value, where it came from); value None when unknown."""
    n, e = _last(facts, "plan_samples"), _last(facts, "audit")
    if cfg.samples:
        samples = (cfg.samples, "--samples")
    elif e and isinstance(e.value.get("samples"), int):
        samples = (e.value["samples"], _src(e))
    elif n:
        samples = (n.value[0], _src(n))
    else:
        stated = _last(facts, "samples") or _last(facts, "epoch_samples")
        value = (stated.value if stated.name == "samples" else stated.value[2]) if stated else None
        samples = (value, _src(stated) if stated else "")
    world = _world(facts, cfg, writers, ranks)
    ep = _last(facts, "epochs")
    epochs = ((cfg.epochs, "--epochs") if cfg.epochs else (n.value[1], _src(n)) if n else
              (ep.value, _src(ep)) if ep else (None, ""))
    plan_steps, plan_run = _last(facts, "plan_steps"), _last(facts, "plan_run")
    if plan_steps and plan_run:  # the trainer's own count when --max-steps or packing changes it
        plan_steps = Fact(plan_run.line, "plan_steps", (plan_steps.value[0], plan_run.value[0]), plan_run.text)
    per, total = _stated(facts, "batches_per_epoch"), _stated(facts, "total_steps")
    if epochs[0] is None and per[0] and total[0] and total[0] % per[0] == 0:
        epochs = (total[0] // per[0], "stated total steps / stated batches per epoch")
    return {"samples": samples, "world_size": world, "samples_per_step": _samples_per_step(facts, cfg, done, world[0]),
            "epochs": epochs, "steps_per_epoch_seen": _observed_per_epoch(facts, done, counter),
            "plan_steps": (plan_steps.value, _src(plan_steps)) if plan_steps else (None, ""),
            "stated_per_epoch": per, "stated_total": total,
            "run_bar": _bar_total(facts, done, ("train", "step"), ("epoch",))}


def _stated(facts: list[Fact], name: str) -> tuple[int | None, str]:
    f = _last(facts, name)
    return (f.value, _src(f)) if f else (None, "")


# -- the verdict -------------------------------------------------------------------------------------------------
def _close(a: float, b: float) -> bool:
    return a > 0 and b > 0 and abs(math.log(a / b)) <= math.log1p(TOL)


def predictions(n, w, spb, epochs) -> dict:
    """Steps per rank per epoch (and in all) if sharded and if not."""
    if not (n and w and spb):
        return {}
    out = {}
    for name, per_rank in (("sharded", -(-n // w)), ("not sharded", n)):
        p = -(-per_rank // spb)
        out[name] = {"samples_per_rank_per_epoch": per_rank, "steps_per_epoch": p,
                     "total": p * epochs if epochs else None}
    return out


def decide(fig: dict, facts: list[Fact], ended_at: int | None) -> dict:
    """verdict (sharded / not sharded / undecidable), trivial, reasons, decide_by, predictions."""
    (n, n_src), (w, w_src), (e, _) = fig["samples"], fig["world_size"], fig["epochs"]
    spb, spb_src = fig["samples_per_step"]
    p, p_src = fig["steps_per_epoch_seen"]
    preds = predictions(n, w, spb, e)
    out = {"verdict": "undecidable", "trivial": False, "reasons": [], "decide_by": [], "predictions": preds}

    def say(verdict: str, *reasons: str) -> dict:
        out["verdict"] = verdict
        out["reasons"] += list(reasons)
        return out

    audit, processed = _last(facts, "audit"), _last(facts, "epoch_samples")
    if audit and isinstance(audit.value.get("disjoint"), bool):  # eyas.sharding.Audit: the ranks' own sample ids
        a = audit.value
        missing = a.get("missing") or (0 if a.get("covers", True) is not False else "some")
        allowed = " (--allow-duplicate-data)" if a.get("allowed") else ""
        return say("sharded" if a["disjoint"] and not missing else "not sharded",
                   f"the sharding audit says disjoint: {'yes' if a['disjoint'] else 'no'}{allowed}"
                   f"{f', {missing} samples on no rank' if missing else ''} ({_src(audit)})")
    if processed and w and w > 1:
        x, total = processed.value[1], processed.value[2]
        if _close(x, total) or _close(x, w * total):
            return say("sharded" if _close(x, total) else "not sharded",
                       f"{fmt_int(x)} samples processed (global) in an epoch of {fmt_int(total)} ({_src(processed)})")
    if w == 1:
        out["trivial"] = True
        return say("sharded", f"world size 1 ({w_src}): a single rank sees the whole dataset, sharded or not")
    if not n:
        out["decide_by"].append("the dataset size: the log does not state it; pass --samples N")
    if not w:
        out["decide_by"].append(f"the number of ranks: {w_src or 'not shown'}; pass --world-size W")
    if not (n and w):
        out["decide_by"] += _deciders({})[1:]
        return out
    share = -(-n // w)
    bar, bar_src = fig["run_bar"]
    if not p and spb and (ended_at or bar):
        how = f"the run ended after {fmt_int(ended_at)}" if ended_at else f"{bar_src}: {fmt_int(bar)}"
        p, p_src = _per_epoch_from_total(ended_at or bar, e, preds, how)
    if p:
        return _judge_observed(out, say, p, p_src, spb, spb_src, n, n_src, share, w)
    return _judge_stated(out, say, fig, n, share, w, spb)


def _per_epoch_from_total(total: int, epochs: int | None, preds: dict, how: str) -> tuple[int | None, str]:
    """A rank runs `total` steps in all (`how` says why we know): per-epoch steps, given epochs or whole epochs."""
    if epochs:
        return round(total / epochs), f"{how} steps per rank over {epochs} epoch(s)"
    whole = [h for h, pr in preds.items() if total % pr["steps_per_epoch"] == 0]
    if len(whole) == 1:
        k = total // preds[whole[0]]["steps_per_epoch"]
        return total // k, f"{how} steps per rank, a whole number of epochs only if {whole[0]} ({k} epoch(s))"
    return None, ""


def _judge_observed(out, say, p, p_src, spb, spb_src, n, n_src, share, w) -> dict:
    seen = f"each rank runs {fmt_int(p)} optimizer steps per epoch ({p_src})"
    if spb:
        s = p * spb
        basis = f"{seen}, {spb} sample(s) each ({spb_src}) = {fmt_int(s)} samples per rank per epoch"
        if _close(s, share):
            return say("sharded", basis + f" = the dataset's {fmt_int(n)} ({n_src}) / {w} ranks")
        if _close(s, n):
            return say("not sharded", basis + f" = the whole dataset ({fmt_int(n)}, {n_src}) on every rank")
        out["reasons"].append(basis + f": neither {fmt_int(share)} (sharded) nor {fmt_int(n)} (not sharded)")
        out["decide_by"].append("check the samples per step per rank (--micro-batch, --grad-accum) and --samples")
        return out
    if p > share * (1 + TOL):
        return say("not sharded", f"{seen}: even at one sample per step that is more than a rank's share "
                                  f"{fmt_int(share)} of {fmt_int(n)} samples ({n_src}) over {w} ranks")
    out["reasons"].append(f"{seen}: sharded if a step takes about {share / p:.1f} samples per rank, not sharded if "
                          f"about {n / p:.1f}")
    out["decide_by"] += ["the samples per optimizer step per rank: pass --micro-batch B (and --grad-accum G) if fixed",
                         "a log of the same data run on another number of ranks: give both logs to compare"]
    return out


def _judge_stated(out, say, fig, n, share, w, spb) -> dict:
    (b, b_src), (t, t_src), (e, _) = fig["stated_per_epoch"], fig["stated_total"], fig["epochs"]
    if not b and t and e:
        b, b_src = t // e, f"{t_src} over {e} epochs"
    if b:
        s = spb or (1 if b in (n, share) else None)
        assumed = "" if spb else " (assuming one sample per batch)"
        if s and _close(b * s, share):
            return say("sharded", f"the log states {fmt_int(b)} batches per epoch ({b_src}){assumed} = a rank's share "
                                  f"of {fmt_int(n)} samples over {w} ranks")
        if s and _close(b * s, w * n):
            return say("not sharded", f"the log states {fmt_int(b)} batches per epoch ({b_src}) = {w} x the dataset")
        if s and _close(b * s, n):
            out["reasons"].append(
                f"the log states {fmt_int(b)} batches per epoch ({b_src}){assumed} = the whole dataset of "
                f"{fmt_int(n)}: "
                f"if that is each rank's dataloader length, every rank iterates all of it (not sharded); if it counts "
                f"all {w} ranks' batches, each rank runs {fmt_int(-(-share // s))} (sharded)")
            if not spb:
                out["predictions"] = predictions(n, w, 1, e)
            sharded_total = out["predictions"].get("sharded", {}).get("total")
            if t and sharded_total and t > sharded_total * (1 + TOL):
                out["reasons"].append(f"if sharded, the stated total of {fmt_int(t)} steps ({t_src}) is "
                                      f"{t / sharded_total:.1f}x the {fmt_int(sharded_total)} each rank will run: "
                                      f"an lr schedule sized from it would stop at {sharded_total / t:.0%} of its "
                                      f"length")
    out["decide_by"] += _deciders(out["predictions"])
    return out


def _deciders(preds: dict) -> list[str]:
    out = []
    if preds:
        sh, un = preds["sharded"]["steps_per_epoch"], preds["not sharded"]["steps_per_epoch"]
        out.append(f"the epoch boundary: each rank's epoch counter advances after {fmt_int(sh)} steps if sharded, "
                   f"after {fmt_int(un)} if not")
    else:
        out.append("the samples per optimizer step per rank (--micro-batch, --grad-accum), to predict the epoch length")
    return out + ["the total of a per-rank progress bar, or len(dataloader) printed on every rank",
                  "eyas prints a sharding audit line at start-up (`data: ... disjoint: yes`) that settles it"]


# -- progress, ETA and anomalies ---------------------------------------------------------------------------------
def progress(fig: dict, verdict: dict, done: int, rate: float | None, ended: bool) -> dict:
    """Where each rank is in its epoch and in the run, and the ETA (per hypothesis when undecidable)."""
    (p, _), (plan, _), (e, _) = fig["steps_per_epoch_seen"], fig["plan_steps"], fig["epochs"]
    preds, v = verdict["predictions"], verdict["verdict"]
    if not p and v == "not sharded" and v in preds:  # a plan block assumes sharding: not what this run does
        p = preds[v]["steps_per_epoch"]
    if not p and plan:
        p = plan[0]
    if not p and v in preds:
        p = preds[v]["steps_per_epoch"]
    total = plan[1] if plan else fig["run_bar"][0] or (p * e if p and e else None)
    if ended:
        total = done
    out = {"steps_per_epoch_per_rank": p, "total_steps_per_rank": total, "epoch": None, "step_in_epoch": None,
           "progress_run": done / total if total else None, "eta_s": None, "eta_by_hypothesis": {}}
    if p:
        k = (max(done, 1) - 1) // p  # whole epochs behind the current step
        out["epoch"], out["step_in_epoch"] = min(k + 1, e or k + 1), done - k * p
    if rate and total and total > done:
        out["eta_s"] = (total - done) / rate
    if rate and v == "undecidable":
        out["eta_by_hypothesis"] = {h: (pr["total"] - done) / rate for h, pr in preds.items()
                                    if pr["total"] and pr["total"] > done}
        out["boundary_in_s"] = {h: (pr["steps_per_epoch"] - done) / rate for h, pr in preds.items()
                                if pr["steps_per_epoch"] > done}
        stated = fig["stated_total"][0]
        if not preds and stated and stated > done:  # no dataset size: at least what the stated total implies
            out["eta_by_hypothesis"][f"the stated {fmt_int(stated)} total steps are per rank"] = (stated - done) / rate
    return out


def _ended(facts: list[Fact], done: list, t_lr: int | None, lr_how: str, plan_total: int | None) -> str:
    """Why the run is over ('' if it may still be running): only what comes after its last step counts."""
    n, last = done[-1][0], done[-1][1].line
    for f in reversed(facts):
        if f.line < last:
            break
        if f.name == "crash":
            return f"it crashed ({_src(f)})"
        if f.name == "end" or (f.name == "epoch_done" and f.value[0] == f.value[1]):
            return f"the log says so ({_src(f)})"
    if t_lr and abs(t_lr - n) <= 1 and lr_how.startswith("lr reached 0"):
        return f"{lr_how}, its last step"
    if plan_total and n >= plan_total:
        return f"all {fmt_int(plan_total)} planned steps ran"
    return ""


def lr_anomalies(done: list, t_lr: int | None, lr_how: str, total: int | None, finished: bool) -> list[dict]:
    if not t_lr:
        return []
    last_v, last = done[-1]
    out = []
    if total and not _close(t_lr, total) and abs(t_lr - total) > 2:
        out.append(f"{lr_how}, but each rank runs {fmt_int(total)} steps: the schedule was sized for "
                   f"{t_lr / total:.2f}x the run")
    elif finished and t_lr > last_v * (1 + TOL) and last.lr is not None:
        out.append(f"the run ended at step {fmt_int(last_v)} with the lr still at {last.lr:.3g} ({lr_how})")
    elif lr_how.startswith("lr reached 0") and last_v > t_lr + 2:
        out.append(f"{lr_how} but training went on to step {fmt_int(last_v)}")
    return [{"kind": "lr schedule", "line": last.line, "message": m} for m in out]


def stalls(done: list, timed: list[tuple[int, float]], rate: float | None, ended: str, idle: float | None,
           clock_last: float | None) -> list[dict]:
    """Pauses between step lines, and a run that stopped writing steps while it should not have."""
    if not rate:
        return []
    interval = 1 / rate
    limit = max(10 * interval, 30.0)  # "much longer than a step": ten steps, and never under half a minute
    out = [{"kind": "pause", "line": b[0], "message": f"no step line for {fmt_duration(b[1] - a[1])} between line "
            f"{a[0]} and line {b[0]} (a step takes {fmt_duration(interval)})"}
           for a, b in itertools.pairwise(timed) if b[1] - a[1] > limit][:3]
    last = done[-1][1].line
    if not ended and idle is not None and idle > limit:
        out.append({"kind": "stall", "line": last, "message": f"the log has not grown for {fmt_duration(idle)} while "
                    f"a step takes {fmt_duration(interval)}: the run is stalled or dead"})
    elif not ended and timed and clock_last is not None and clock_last - timed[-1][1] > limit:
        out.append({"kind": "stall", "line": last, "message": f"the last step line (line {last}) is "
                    f"{fmt_duration(clock_last - timed[-1][1])} older than the log's last timestamp: steps stopped "
                    f"while the log went on"})
    return out


# -- one log -------------------------------------------------------------------------------------------------------
def analyse(parser: LogParser, cfg: DoctorConfig, name: str, extra: list[Fact], idle: float | None) -> dict:
    """The report of one parsed log (a JSON-ready dict)."""
    facts = extra + parser.facts
    rep = {"log": name, "lines": parser.lines, "formats": dict(parser.formats), "steps_found": 0,
           "truncated_lines": parser.truncated, "anomalies": []}
    steps = parser.steps or bar_steps(facts)
    rep["steps_found"] = len(steps)
    if steps and not parser.steps:
        rep["formats"].setdefault(steps[0].fmt, steps[0].line)
    if not steps:
        return _no_steps(rep, facts, parser, cfg)
    writers, series, how, dups = writers_of(steps)
    done, restarts, counter, zero = normalise(series)
    fig = figures(facts, cfg, writers, parser.ranks, done, counter)
    rate, span, rate_how, timed = measure_rate(done)
    n_done = done[-1][0]
    t_lr, lr_how = schedule_length(done)
    ended = _ended(facts, done, t_lr, lr_how, fig["plan_steps"][0][1] if fig["plan_steps"][0] else None)
    finished = bool(ended) and not ended.startswith("it crashed")
    verdict = decide(fig, facts, n_done if finished else None)
    prog = progress(fig, verdict, n_done, rate if not ended else None, finished)  # no ETA for a run that is over
    if prog.get("boundary_in_s") and verdict["decide_by"] and verdict["decide_by"][0].startswith("the epoch b"):
        verdict["decide_by"][0] += " (" + ", ".join(f"{h} in {fmt_duration(t)}" for h, t in
                                                    prog.pop("boundary_in_s").items()) + " at the current rate)"
    prog.pop("boundary_in_s", None)
    rep["anomalies"] = (restarts + [{"kind": "duplicate", "line": 0, "message": d} for d in dups[:5]]
                        + lr_anomalies(done, t_lr, lr_how, None if finished else prog["total_steps_per_rank"], finished)
                        + stalls(done, timed, rate, ended, idle, parser.clock.last)
                        + [{"kind": "crash", "line": f.line, "message": _src(f)}
                           for f in facts if f.name == "crash"][:1]
                        + [{"kind": "duplicate data", "line": f.line, "message": f"the run was allowed to train on "
                            f"duplicate data (--allow-duplicate-data): {_src(f)}"}
                           for f in facts if f.name == "duplicate_data"][:1])
    for key, (value, source) in fig.items():
        rep[key], rep[key + "_source"] = value, source
    rep.update(writers=writers, writers_evidence=how, steps_per_rank=n_done, counter_starts_at_0=zero,
               first_step_line=done[0][1].line, last_step_line=done[-1][1].line,
               log_every=_log_every(done), rate_steps_per_s=rate, rate_source=rate_how, elapsed_s=span,
               lr_schedule_steps=t_lr, lr_schedule_evidence=lr_how, ended=ended, **verdict, **prog)
    return rep


def _no_steps(rep: dict, facts: list[Fact], parser: LogParser, cfg: DoctorConfig) -> dict:
    """A log without steps: say so, and what its audit (eyas prints it before the first step) or crash shows."""
    none = (f"no training step lines in {parser.lines} lines: none of eyas metrics.jsonl, the eyas console, "
            "speculators, SpecForge, or a line with a step or epoch counter and an lr")
    rep.update(verdict="undecidable", trivial=False, predictions={}, decide_by=[], reasons=[none])
    if _last(facts, "audit"):
        rep.update(decide(figures(facts, cfg, 1, parser.ranks, [], None), facts, None))
        rep["reasons"].append(none)
    rep["anomalies"] = [{"kind": "crash", "line": f.line, "message": f"before the first step: {_src(f)}"}
                        for f in facts if f.name == "crash"][-1:]
    return rep


def _log_every(done: list) -> int:
    diffs = [b - a for (a, _), (b, _) in itertools.pairwise(done) if b > a]
    return int(statistics.median(diffs)) if diffs else 1


def compare(reports: list[dict]) -> dict | None:
    """Several logs of the same data on different world sizes: per-rank steps per epoch decide sharding."""
    same_data = [r for r in reports if r.get("samples") == reports[0].get("samples")]
    pts = sorted((r["world_size"], r["steps_per_epoch_seen"], r["log"]) for r in same_data
                 if r.get("world_size") and r.get("steps_per_epoch_seen"))
    if len(pts) < 2 or pts[0][0] == pts[-1][0]:
        return None
    (w1, p1, a), (w2, p2, b) = pts[0], pts[-1]
    said = f"{a}: {w1} rank(s) x {fmt_int(p1)} steps per epoch; {b}: {w2} ranks x {fmt_int(p2)} steps per epoch"
    verdict = "sharded" if _close(p1 / p2, w2 / w1) else "not sharded" if _close(p1, p2) else "undecidable"
    for r in same_data:
        if r["verdict"] == "undecidable" and (r.get("world_size") or 1) > 1 and verdict != "undecidable":
            r["verdict"] = verdict
            r["reasons"].append(f"compared with the other log: {said}")
            r["decide_by"] = []
    return {"verdict": verdict, "evidence": said}


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
    out += [f"  anomaly ({a['kind']}): {a['message']}" for a in rep["anomalies"]] or ["  anomalies: none"]
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
    return out


def _one_line(rep: dict) -> str:
    eta = f", ETA {fmt_duration(rep['eta_s'])}" if rep.get("eta_s") else ""
    eta += "".join(f", ETA {fmt_duration(t)} if {h}" for h, t in rep.get("eta_by_hypothesis", {}).items())
    steps = f", {fmt_int(rep['steps_per_rank'])} steps per rank" if rep.get("steps_per_rank") else ""
    return f"doctor: {rep['log']}: {rep['verdict']}{steps}{eta}, {len(rep['anomalies'])} anomalies"


# -- the command ---------------------------------------------------------------------------------------------------
def _read_whole(path_str: str, cfg: DoctorConfig) -> dict:
    path, extra = open_log(path_str)
    if path.stat().st_size == 0:
        raise EyasError(f"{path} is empty", "the run has written nothing yet",
                        "wait for the first step lines, or use --follow")
    parser, tail = LogParser(), Tail(path)
    tail.read(parser, final=True)
    parser.finish()
    return analyse(parser, cfg, path_str, extra, time.time() - path.stat().st_mtime)


def follow(cfg: DoctorConfig, con: Console) -> dict:
    """Read a growing log until the run ends or no line arrives for follow_timeout seconds."""
    path, extra = open_log(cfg.logs[0])
    parser, tail = LogParser(), Tail(path)
    tail.read(parser)
    last_line, shown = time.monotonic(), -1
    try:
        while True:
            if tail.read(parser, arrival=time.time()) or shown < 0:
                last_line = time.monotonic()
                rep = analyse(parser, cfg, cfg.logs[0], extra, None)
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
    return analyse(parser, cfg, cfg.logs[0], extra, time.monotonic() - last_line)


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
