"""The sharding verdict, progress and ETA, and the anomalies of one log; the comparison of several logs.

The verdict compares what each rank runs per epoch with two predictions (N samples, W ranks, s samples per
optimizer step per rank): sharded, ceil(N/W)/s steps per rank per epoch; not sharded, N/s. Every rule is in
`decide`; the figures it reads come from `eyas.doctor.figures`, the series of steps from `eyas.doctor.series`.
"""

from __future__ import annotations

import itertools
import math

from eyas.core.log import fmt_duration, fmt_int
from eyas.doctor.figures import cite, latest
from eyas.doctor.logformats import Fact
from eyas.doctor.series import anomaly

TOL = 0.15  # relative distance within which an observed count matches a prediction


# -- the verdict -------------------------------------------------------------------------------------------------
def _close(a: float, b: float) -> bool:
    return a > 0 and b > 0 and abs(math.log(a / b)) <= math.log1p(TOL)


def _beyond(a: float, b: float) -> bool:
    """`a` exceeds `b` by more than the tolerance."""
    return a > b * (1 + TOL)


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


def why_ended(facts: list[Fact], done: list, t_lr: int | None, lr_how: str, plan_total: int | None) -> str:
    """Why the run is over ('' if it may still be running): only what comes after its last step counts."""
    n, last = done[-1][0], done[-1][1].line
    for f in reversed(facts):
        if f.line < last:
            break
        if f.name == "crash":
            return f"it crashed ({cite(f)})"
        if f.name == "end" or (f.name == "epoch_done" and f.value[0] == f.value[1]):
            return f"the log says so ({cite(f)})"
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
    elif finished and _beyond(t_lr, last_v) and last.lr is not None:
        out.append(f"the run ended at step {fmt_int(last_v)} with the lr still at {last.lr:.3g} ({lr_how})")
    elif lr_how.startswith("lr reached 0") and last_v > t_lr + 2:
        out.append(f"{lr_how} but training went on to step {fmt_int(last_v)}")
    return [anomaly("lr schedule", last.line, m) for m in out]


def stalls(done: list, timed: list[tuple[int, float]], rate: float | None, ended: str, idle: float | None,
           clock_last: float | None) -> list[dict]:
    """Pauses between step lines, and a run that stopped writing steps while it should not have."""
    if not rate:
        return []
    interval = 1 / rate
    limit = max(10 * interval, 30.0)  # "much longer than a step": ten steps, and never under half a minute
    out = [anomaly("pause", b[0], f"no step line for {fmt_duration(b[1] - a[1])} between line {a[0]} and line "
                   f"{b[0]} (a step takes {fmt_duration(interval)})")
           for a, b in itertools.pairwise(timed) if b[1] - a[1] > limit][:3]
    last = done[-1][1].line
    if not ended and idle is not None and idle > limit:
        out.append(anomaly("stall", last, f"the log has not grown for {fmt_duration(idle)} while a step takes "
                           f"{fmt_duration(interval)}: the run is stalled or dead"))
    elif not ended and timed and clock_last is not None and clock_last - timed[-1][1] > limit:
        out.append(anomaly("stall", last, f"the last step line (line {last}) is "
                           f"{fmt_duration(clock_last - timed[-1][1])} older than the log's last timestamp: steps "
                           f"stopped while the log went on"))
    return out


def fact_anomalies(facts: list[Fact]) -> list[dict]:
    """The first crash the log shows, and the first sign the run was let train on duplicate data."""
    return ([anomaly("crash", f.line, cite(f)) for f in facts if f.name == "crash"][:1]
            + [anomaly("duplicate data", f.line, f"the run was allowed to train on duplicate data "
                       f"(--allow-duplicate-data): {cite(f)}") for f in facts if f.name == "duplicate_data"][:1])


# -- several logs ---------------------------------------------------------------------------------------------------
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
