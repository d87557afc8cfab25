"""The sharding verdict, progress and ETA, and the anomalies of one log; the comparison of several logs.

The verdict compares what each rank runs per epoch with two predictions (N samples, W ranks, s samples per
optimizer step per rank): sharded, ceil(N/W)/s steps per rank per epoch; not sharded, N/s. Every rule is in
`decide`; the figures it reads come from `eyas.doctor.figures`, the series of steps from `eyas.doctor.series`.
"""

from __future__ import annotations

import datetime
import itertools
import math

from eyas.core.log import fmt_duration, fmt_int
from eyas.doctor.figures import cite, latest
from eyas.doctor.records import Fact
from eyas.doctor.series import anomaly

TOL = 0.15  # relative distance within which an observed count matches a prediction


# -- the verdict -------------------------------------------------------------------------------------------------
def _close(a: float, b: float) -> bool:
    return a > 0 and b > 0 and abs(math.log(a / b)) <= math.log1p(TOL)


def _beyond(a: float, b: float) -> bool:
    """`a` exceeds `b` by more than the tolerance."""
    return a > b * (1 + TOL)


def _within(p: float, lo: float, hi: float) -> bool:
    """`p` lies in [lo, hi], give or take the tolerance."""
    return lo > 0 and lo / (1 + TOL) <= p <= hi * (1 + TOL)


def predictions(n, w, spb, epochs) -> dict:
    """Steps per rank per epoch (and in all) if sharded and if not, under both rules for the remainder: `pad`
    (a DistributedSampler pads each rank to ceil(N/W), the loader keeps the last partial batch) and `drop`
    (floor(N/W) samples, partial batch dropped). Formats that do not say which get both."""
    if not (n and w and spb and n > 0 and w > 0 and spb > 0):  # a damaged plan.json can say -1 samples
        return {}
    out = {}
    for name, (most, least) in (("sharded", (-(-n // w), n // w)), ("not sharded", (n, n))):
        pad, drop = -(-most // spb), max(1, least // spb)
        out[name] = {"samples_per_rank_per_epoch": most, "steps_per_epoch": pad, "steps_per_epoch_drop": drop,
                     "total": pad * epochs if epochs else None, "total_drop": drop * epochs if epochs else None}
    return out


def steps_text(pr: dict, key: str = "steps_per_epoch") -> str:
    """'8,862' or '11 (last partial batch kept) or 10 (dropped)': a prediction and the remainder rule it assumes."""
    pad, drop = pr[key], pr[key + "_drop" if key == "steps_per_epoch" else "total_drop"]
    return fmt_int(pad) if pad == drop else f"{fmt_int(pad)} (last partial batch kept) or {fmt_int(drop)} (dropped)"


def decide(fig: dict, facts: list[Fact], ended_at: int | None, done: list | None = None) -> dict:
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

    audit, processed = latest(facts, "audit"), latest(facts, "epoch_samples")
    if audit and isinstance(audit.value.get("disjoint"), bool):  # eyas.train.sharding.Audit: the ranks' own sample ids
        a = audit.value
        missing = a.get("missing") or (0 if a.get("covers", True) is not False else "some")
        allowed = " (--allow-duplicate-data)" if a.get("allowed") else ""
        return say("sharded" if a["disjoint"] and not missing else "not sharded",
                   f"the sharding audit says disjoint: {'yes' if a['disjoint'] else 'no'}{allowed}"
                   f"{f', {missing} samples on no rank' if missing else ''} ({cite(audit)})")
    if processed and w and w > 1:
        x, total = processed.value[1], processed.value[2]
        if _close(x, total) or _close(x, w * total):
            return say("sharded" if _close(x, total) else "not sharded",
                       f"{fmt_int(x)} samples processed (global) in an epoch of {fmt_int(total)} ({cite(processed)})")
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
    past = _past_a_sharded_epoch(done or [], share, spb)
    if past:
        return say("not sharded", past + f" ({fmt_int(n)} samples, {n_src}, over {w} ranks, {w_src})")
    return _judge_stated(out, say, fig, n, share, w, spb)


def _past_a_sharded_epoch(done: list, share: int, spb: int | None) -> str:
    """Proof of a rank still in one epoch after more steps than a sharded rank runs in a whole one ('' if none).
    A sharded rank takes at most ceil(N/W) samples per epoch, so at most that many steps at one sample each (packing
    only lowers it); with the samples per step known, ceil(ceil(N/W) / s)."""
    epochs = [(v, st) for v, st in done if st.epoch is not None]
    if not epochs:
        return ""
    start = None
    for (_, a), (v, b) in itertools.pairwise(epochs):
        if int(b.epoch) != int(a.epoch):
            start = v - 1  # steps done when this epoch began, at most (its first logged step may come later)
    if start is None and (epochs[0][0] <= 2 or epochs[-1][1].epoch == 0):
        start = 0  # the log begins with the run, or this is the first epoch (0-based) on a counter from the start
    if start is None:
        return ""  # the log does not show where this epoch began
    bound = -(-share // spb) if spb else share
    first = next(((v, st) for v, st in epochs if v - start > bound and st.epoch == epochs[-1][1].epoch), None)
    if first is None:
        return ""
    v, st = first
    e = int(st.epoch)
    per = (f"ceil({fmt_int(share)} / {spb}) = {fmt_int(bound)} steps" if spb else
           f"{fmt_int(bound)} steps, its {fmt_int(share)} samples at one per step (packing makes it fewer)")
    counter = ("" if st.step is None else f"step counter {fmt_int(st.step)}" +
               (" (counted from 0)" if st.step + 1 == v else "") + ", ")
    return (f"each rank was still in epoch {e} after {fmt_int(v - start)} steps of it (line {st.line}: "
            f"{counter}epoch={st.epoch:g}), more than a sharded rank can run in an epoch: {per}")


def _per_epoch_from_total(total: int, epochs: int | None, preds: dict, how: str) -> tuple[int | None, str]:
    """A rank runs `total` steps in all (`how` says why we know): per-epoch steps, given epochs or whole epochs."""
    if epochs:
        return round(total / epochs), f"{how} steps per rank over {epochs} epoch(s)"
    whole = [h for h, pr in preds.items() if pr["steps_per_epoch"] > 0 and total % pr["steps_per_epoch"] == 0]
    if len(whole) == 1:
        k = total // preds[whole[0]]["steps_per_epoch"]
        return total // k, f"{how} steps per rank, a whole number of epochs only if {whole[0]} ({k} epoch(s))"
    return None, ""


def _judge_observed(out, say, p, p_src, spb, spb_src, n, n_src, share, w) -> dict:
    seen = f"each rank runs {fmt_int(p)} optimizer steps per epoch ({p_src})"
    if spb:
        s = p * spb
        basis = f"{seen}, {spb} sample(s) each ({spb_src}) = {fmt_int(s)} samples per rank per epoch"
        if _within(p, max(1, (n // w) // spb), -(-share // spb)):
            return say("sharded", basis + f" = the dataset's {fmt_int(n)} ({n_src}) / {w} ranks")
        if _within(p, max(1, n // spb), -(-n // spb)):
            return say("not sharded", basis + f" = the whole dataset ({fmt_int(n)}, {n_src}) on every rank")
        out["reasons"].append(basis + f": neither {fmt_int(share)} (sharded) nor {fmt_int(n)} (not sharded)")
        out["decide_by"].append("check the samples per step per rank (--micro-batch, --grad-accum) and --samples")
        return out
    if _beyond(p, share):
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
            if t and sharded_total and _beyond(t, sharded_total):
                out["reasons"].append(f"if sharded, the stated total of {fmt_int(t)} steps ({t_src}) is "
                                      f"{t / sharded_total:.1f}x the {fmt_int(sharded_total)} each rank will run: "
                                      f"an lr schedule sized from it would stop at {sharded_total / t:.0%} of its "
                                      f"length")
    out["decide_by"] += _deciders(out["predictions"])
    return out


def _deciders(preds: dict) -> list[str]:
    out = []
    if preds:
        out.append(f"the epoch boundary: each rank's epoch counter advances after {steps_text(preds['sharded'])} "
                   f"steps if sharded, after {steps_text(preds['not sharded'])} if not")
    else:
        out.append("the samples per optimizer step per rank (--micro-batch, --grad-accum), to predict the epoch length")
    return out + ["the total of a per-rank progress bar, or len(dataloader) printed on every rank",
                  "eyas prints a sharding audit line at start-up (`data: ... disjoint: yes`) that settles it"]


# -- progress, ETA and anomalies ---------------------------------------------------------------------------------
def progress(fig: dict, verdict: dict, done: int, rate: float | None, ended: bool) -> dict:
    """Where each rank is in its epoch and in the run, and the ETA: one figure once the log shows each rank's epoch
    length (every hypothesis it contradicts is said to be ruled out), one per hypothesis while the verdict is open."""
    (seen, seen_src), (plan, _), (e, _) = fig["steps_per_epoch_seen"], fig["plan_steps"], fig["epochs"]
    preds, v = verdict["predictions"], verdict["verdict"]
    p = seen
    if not p and v == "not sharded" and v in preds:  # a plan block assumes sharding: not what this run does
        p = preds[v]["steps_per_epoch"]
    stated_epoch = fig["stated_per_epoch"][0]
    if not p and v == "not sharded" and not preds and stated_epoch:  # unsharded: each rank's loader has that length
        p = stated_epoch
    if not p and plan:
        p = plan[0]
    if not p and v in preds:
        p = preds[v]["steps_per_epoch"]
    total = plan[1] if plan else fig["run_bar"][0] or (p * e if p and e else None)
    if ended:
        total = done
    out = {"steps_per_epoch_per_rank": p, "total_steps_per_rank": total, "epoch": None, "step_in_epoch": None,
           "progress_run": done / total if total else None, "eta_s": None, "eta_by_hypothesis": {}, "ruled_out": []}
    if p:
        k = (max(done, 1) - 1) // p  # whole epochs behind the current step
        out["epoch"], out["step_in_epoch"] = min(k + 1, e or k + 1), done - k * p
    if rate and total and total > done:
        out["eta_s"] = (total - done) / rate
    if v != "undecidable" or ended:
        return out
    hyps = {h: (pr["total"], steps_text(pr, "total")) for h, pr in preds.items() if pr["total"]}
    stated = fig["stated_total"]
    if not preds and stated[0]:  # no dataset size: at least what the stated total implies
        hyps[f"the stated {fmt_int(stated[0])} total steps are per rank"] = (stated[0], fmt_int(stated[0]))
    for h, (t, text) in hyps.items():
        if seen and e and not _close(t, seen * e):
            out["ruled_out"].append(f"{h} ({text} steps per rank in all): each rank's epoch is {fmt_int(seen)} steps "
                                    f"({seen_src}), {fmt_int(seen * e)} in {e} epochs")
        elif rate and not seen and t > done:
            out["eta_by_hypothesis"][h] = (t - done) / rate
    if rate and not seen:
        out["boundary_in_s"] = {h: (pr["steps_per_epoch"] - done) / rate for h, pr in preds.items()
                                if pr["steps_per_epoch"] > done}
    return out


def why_ended(facts: list[Fact], done: list, t_lr: int | None, lr_how: str, total: tuple[int, str] | None) -> str:
    """Why the run is over ('' if it may still be running): only what comes after its last step counts."""
    n, last = done[-1][0], done[-1][1].line
    for f in reversed(facts):
        if f.line < last:
            break
        if f.name in CRASH_FACTS:
            return f"it crashed: {crash_story(facts, last)[0] or cite(f)}"
        if f.name == "end" or (f.name == "epoch_done" and f.value[0] == f.value[1]):
            return f"the log says so ({cite(f)})"
    if t_lr and abs(t_lr - n) <= 1 and lr_how.startswith("lr reached 0"):
        return f"{lr_how}, its last step"
    if total and n >= total[0]:
        return f"all {fmt_int(total[0])} steps ran ({total[1]})" if total[1] != "planned" else \
            f"all {fmt_int(total[0])} planned steps ran"
    return ""


def lr_anomalies(done: list, t_lr: int | None, lr_how: str, total: int | None, finished: bool) -> list[dict]:
    if not t_lr:
        return []
    last_v, last = done[-1]
    out = []
    if total and not _close(t_lr, total) and abs(t_lr - total) > 2:
        out.append(f"{lr_how}, but each rank runs {fmt_int(total)} steps: the schedule was sized for "
                   f"{t_lr / total:.2f}x the run")
    elif finished and _beyond(t_lr, last_v) and last.lr is not None:
        out.append(f"the run ended at step {fmt_int(last_v)} with the lr still at {last.lr:.3g} ({lr_how})")
    elif lr_how.startswith("lr reached 0") and last_v > t_lr + 2:
        out.append(f"{lr_how} but training went on to step {fmt_int(last_v)}")
    return [anomaly("lr schedule", last.line, m) for m in out]


def _limit(rate: float) -> float:
    """"Much longer than a step": ten steps, and never under half a minute."""
    return max(10 / rate, 30.0)


def stalls(gaps: list[tuple], rank: int | None, first_line: int, last: tuple[int, float | None],
           rate: float | None, ended: str, clock_last: float | None) -> list[dict]:
    """Pauses between the step lines of `rank` (measured as the log streamed past), and steps that stopped while
    the log's own clock went on. `last`: the last step's line and time."""
    if not rate:
        return []
    interval, limit, r = 1 / rate, _limit(rate), -1 if rank is None else rank
    out = [anomaly("pause", b, f"no step line for {fmt_duration(g)} between line {a} and line {b} (a step takes "
                   f"{fmt_duration(interval)})")
           for g, a, b, _ in sorted(x for x in gaps if x[0] > limit and x[1] >= first_line and x[3] == r)[-3:]]
    out.sort(key=lambda x: x["line"])
    line, t = last
    if not ended and t is not None and clock_last is not None and clock_last - t > limit:
        out.append(anomaly("stall", line, f"the last step line (line {line}) is {fmt_duration(clock_last - t)} "
                           f"older than the log's last timestamp: steps stopped while the log went on"))
    return out


def _stamp_lag(wall: tuple, mtime: float) -> float | None:
    """Seconds from the log's last stamp to the file's modification time, if the two agree (else None). A local
    time of day agrees if it matches mtime in some time zone (offsets are whole quarter hours); a dated stamp must
    also lie within a day of it."""
    if wall[0] == "unix":
        lag = mtime - wall[1]
    else:
        _, tod, date, guessed = wall
        if date is not None and not guessed:
            naive = datetime.datetime.combine(date, datetime.time()).replace(tzinfo=datetime.UTC).timestamp() + tod
            if abs(mtime - naive) > 14.5 * 3600:
                return None
        lag = (mtime - tod) % 900
        lag = lag - 900 if lag > 450 else lag
    return lag if -5 <= lag <= 120 else None  # written when stamped, or after a buffered flush; never before


def liveness(rate: float | None, ended: str, wall: tuple | None, wall_line: int, mtime: float | None,
             now: float, follow_idle: float | None, last_line: int, recent_line: int) -> tuple[str, list[dict]]:
    """Is the run still writing? (what the judgement is based on, [a stall anomaly]). A file's age alone says
    nothing (a log copied off a cluster is new); it counts only when the log's last timestamp, stamped among its
    last steps (at or after `recent_line`), agrees with it."""
    if ended or not rate:
        return "", []
    limit = _limit(rate)
    if follow_idle is not None:
        idle, basis = follow_idle, f"no new line for {fmt_duration(follow_idle)} while following it"
    elif wall is None or wall_line < recent_line:
        return ("not judged: the log's step lines carry no wall-clock timestamps to set against the file's "
                "modification time (--follow watches a live log)"), []
    elif mtime is None or (lag := _stamp_lag(wall, mtime)) is None:
        return (f"not judged: the file's modification time does not match its last timestamp (line {wall_line}), as "
                f"for a copied or moved log; its age says nothing of the run (--follow watches a live log)"), []
    else:
        idle = now - mtime
        basis = (f"the file was last written {fmt_duration(max(0.0, idle))} ago (its modification time agrees with "
                 f"its last timestamp, line {wall_line}, {lag:+.0f} s)")
    if idle > limit:
        return (f"stalled or dead: {basis}",
                [anomaly("stall", last_line, f"{basis}, while a step takes {fmt_duration(1 / rate)}: the run is "
                                             "stalled or dead")])
    return f"running: {basis}", []


CRASH_FACTS = ("crash", "crash_error", "crash_timeout")


def crash_story(facts: list[Fact], since: int = 0) -> tuple[str, int]:
    """(which rank died first, of what, where, and which died after it; the line of the first death), or ('', 0)
    if the log shows no traceback or timeout. Only facts from line `since` on count (the crash that ended the run,
    not an earlier attempt's)."""
    facts = [f for f in facts if f.line >= since]
    errors = [f for f in facts if f.name == "crash_error"]
    timeouts = [f for f in facts if f.name == "crash_timeout"]
    root = latest(facts, "root_cause")
    if not errors and not timeouts:
        return "", 0
    first = next((f for f in errors if root and f.value["rank"] == root.value["rank"]), errors[0] if errors else None)
    parts = []
    if first:
        e = first.value
        who = f"rank {e['rank']}" if e["rank"] is not None else "a process"
        where = f"raised at {e['where']}; " if e["where"] else ""
        msg = f": {e['message'][:160]}" if e["message"] else ""
        parts.append(f"{who} died first: {e['type']}{msg} ({where}line {first.line}, traceback from line "
                     f"{e['traceback_line']})")
    after = sorted({f.value["rank"] for f in timeouts if f.value["rank"] is not None}
                   | {f.value["rank"] for f in errors if f is not first and f.value["rank"] is not None}
                   - ({first.value["rank"]} if first else set()))
    if after:
        lines = ", ".join(str(f.line) for f in timeouts[:4])
        parts.append(f"then rank{'s' if len(after) > 1 else ''} {', '.join(map(str, after))} "
                     f"{'were' if len(after) > 1 else 'was'} stopped (NCCL watchdog timeouts, lines {lines})"
                     if timeouts else f"then ranks {', '.join(map(str, after))} failed")
    if root:
        parts.append(f"torchrun names rank {root.value['rank']} as the root cause (line {root.line})")
    return "; ".join(parts), (first or timeouts[0]).line


def fact_anomalies(facts: list[Fact], last_step_line: int = 0) -> list[dict]:
    """The crash the log shows (the one after the last step, else the first: who died first, of what, and who
    after), and the first sign the run was let train on duplicate data."""
    since = last_step_line if any(f.line >= last_step_line for f in facts if f.name in CRASH_FACTS) else 0
    story, line = crash_story(facts, since)
    crash = [anomaly("crash", line or f.line, story or cite(f)) for f in facts
             if f.name in CRASH_FACTS and f.line >= since][:1]
    return (crash + [anomaly("duplicate data", f.line, f"the run was allowed to train on duplicate data "
                             f"(--allow-duplicate-data): {cite(f)}") for f in facts if f.name == "duplicate_data"][:1])


# -- several logs ---------------------------------------------------------------------------------------------------
def compare(reports: list[dict]) -> dict | None:
    """Several logs of the same data on different world sizes: per-rank steps per epoch decide sharding; for runs
    that finished without showing an epoch, their steps per rank in all (the same epochs assumed)."""
    same_data = [r for r in reports if r.get("samples") == reports[0].get("samples")]
    pts = sorted((r["world_size"], r["steps_per_epoch_seen"], r["log"]) for r in same_data
                 if r.get("world_size") and r.get("steps_per_epoch_seen"))
    what, unit = "steps per epoch", ""
    if len(pts) < 2 or pts[0][0] == pts[-1][0]:
        pts = sorted((r["world_size"], r["steps_per_rank"], r["log"]) for r in same_data
                     if r.get("world_size") and r.get("finished") and r.get("steps_per_rank"))
        what, unit = "steps per rank in the whole run", " (both runs finished; the same epochs assumed)"
    if len(pts) < 2 or pts[0][0] == pts[-1][0]:
        return None
    (w1, p1, a), (w2, p2, b) = pts[0], pts[-1]
    said = f"{a}: {w1} rank(s) x {fmt_int(p1)} {what}; {b}: {w2} ranks x {fmt_int(p2)} {what}{unit}"
    verdict = "sharded" if _close(p1 / p2, w2 / w1) else "not sharded" if _close(p1, p2) else "undecidable"
    for r in same_data:
        if r["verdict"] == "undecidable" and (r.get("world_size") or 1) > 1 and verdict != "undecidable":
            r["verdict"] = verdict
            r["reasons"].append(f"compared with the other log: {said}")
            r["decide_by"] = []
            r["eta_by_hypothesis"] = {}
    return {"verdict": verdict, "evidence": said}
