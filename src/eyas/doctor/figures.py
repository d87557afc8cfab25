"""The figures a sharding verdict needs, each with where it came from.

A figure is (value, source): the value None when unknown, the source a hint flag, a cited log line
(`line 12: ...`) or the reasoning that inferred it. Precedence, highest first: what the user passes
(--samples, --world-size, ...), eyas's own audit and plan, what the log states, what its shape implies
(rank prefixes, per-process warnings, epoch counters, progress-bar totals). `eyas.doctor.verdict` judges with these.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter

from eyas.core.log import fmt_int
from eyas.doctor.records import Fact
from eyas.doctor.settings import DoctorConfig


def cite(f: Fact) -> str:
    """Where a fact comes from: its line and text, or (line 0) the file that states it."""
    return f"line {f.line}: `{f.text[:120]}`" if f.line else f.text


def latest(facts: list[Fact], name: str) -> Fact | None:
    """The last fact of this name (a later statement overrides an earlier one)."""
    return next((f for f in reversed(facts) if f.name == name), None)


def _sourced(f: Fact | None) -> tuple:
    return (f.value, cite(f)) if f else (None, "")


# -- the figures a verdict needs, with where each came from ----------------------------------------------------
def figures(facts: list[Fact], cfg: DoctorConfig, writers: int, ranks: set[int], done, counter) -> dict:
    """Each figure as (value, where it came from); value None when unknown."""
    n = latest(facts, "plan_samples")
    samples, world = _samples(facts, cfg), _world(facts, cfg, writers, ranks)
    ep = latest(facts, "epochs")
    epochs = ((cfg.epochs, "--epochs") if cfg.epochs else (n.value[1], cite(n)) if n else
              (ep.value, cite(ep)) if ep else (None, ""))
    plan_steps, plan_run = latest(facts, "plan_steps"), latest(facts, "plan_run")
    if plan_steps and plan_run:  # the trainer's own count when --max-steps or packing changes it
        plan_steps = Fact(plan_run.line, "plan_steps", (plan_steps.value[0], plan_run.value[0]), plan_run.text)
    per, total = _stated(facts, "batches_per_epoch"), _stated(facts, "total_steps")
    if epochs[0] is None and per[0] and total[0] and total[0] % per[0] == 0:
        epochs = (total[0] // per[0], "stated total steps / stated batches per epoch")
    return {"samples": samples, "world_size": world, "samples_per_step": _samples_per_step(facts, cfg, done, world[0]),
            "epochs": epochs, "steps_per_epoch_seen": _observed_per_epoch(facts, done, counter),
            "plan_steps": _sourced(plan_steps),
            "stated_per_epoch": per, "stated_total": total,
            "run_bar": _bar_total(facts, done, ("train", "step"), ("epoch",))}


def _stated(facts: list[Fact], name: str) -> tuple[int | None, str]:
    return _sourced(latest(facts, name))


def _samples(facts: list[Fact], cfg: DoctorConfig) -> tuple[int | None, str]:
    n, e = latest(facts, "plan_samples"), latest(facts, "audit")
    if cfg.samples:
        return cfg.samples, "--samples"
    if e and isinstance(e.value.get("samples"), int):
        return e.value["samples"], cite(e)
    if n:
        return n.value[0], cite(n)
    stated = latest(facts, "samples") or latest(facts, "epoch_samples")
    value = (stated.value if stated.name == "samples" else stated.value[2]) if stated else None
    return value, cite(stated) if stated else ""


def _world(facts: list[Fact], cfg: DoctorConfig, writers: int, ranks: set[int]) -> tuple[int | None, str]:
    given = _given_world(cfg, writers, ranks)
    if given:
        return given
    audit, batching = latest(facts, "audit"), latest(facts, "plan_batching")
    stated = latest(facts, "dp_size") or latest(facts, "world_size")  # the data-parallel ranks first
    if audit and isinstance(audit.value.get("world_size"), int):
        return audit.value["world_size"], cite(audit)
    if batching:
        return batching.value[0], cite(batching)
    if stated:
        return stated.value, cite(stated)
    derived = _world_from_global_batch(facts)
    if derived:
        return derived
    if ranks and max(ranks) + 1 >= writers:
        return max(ranks) + 1, f"torchrun prefixes name ranks up to [rank{max(ranks)}]"
    if writers > 1:
        return writers, f"{writers} ranks write the step lines (assuming every rank writes)"
    warned = _per_process_warnings(facts)
    if warned:
        return warned
    if latest(facts, "torchrun"):
        return None, f"torchrun started several processes ({cite(latest(facts, 'torchrun'))}), how many is not stated"
    return 1, "assumed: no rank prefixes, repeated steps, per-process warnings or torchrun banner"


def _world_from_global_batch(facts: list[Fact]) -> tuple[int, str] | None:
    """World size = the stated global batch / (per-device batch x accumulation), when it divides exactly."""
    gb, mb, ga = latest(facts, "global_batch"), latest(facts, "micro_batch"), latest(facts, "grad_accum")
    if not (gb and mb):
        return None
    per_rank = mb.value * (ga.value if ga else 1)
    if gb.value % per_rank:
        return None
    accum = f" x {ga.value} accumulation ({cite(ga)})" if ga else ""
    return gb.value // per_rank, (f"global batch {gb.value} ({cite(gb)}) / ({mb.value} per device ({cite(mb)})"
                                  f"{accum})")


def _given_world(cfg: DoctorConfig, writers: int, ranks: set[int]) -> tuple[int, str] | None:
    """--world-size, unless the log proves otherwise; either way the report says which it believes and why."""
    w = cfg.world_size
    if not w:
        return None
    named = max(ranks) + 1 if ranks else 0
    if named > w:
        return named, (f"the log, not --world-size {w}: its [rankK]: prefixes name rank {named - 1}, so at least "
                       f"{named} ranks ran")
    if writers > 1 and writers != w:
        return writers, (f"the log, not --world-size {w}: {writers} processes write every step, and a trainer whose "
                         f"ranks all log has every rank write (if {w} is right, some ranks were silent)")
    if writers == 1 and named and named < w:
        return w, (f"--world-size (the log's prefixes name only ranks up to [rank{named - 1}]: the others printed "
                   "nothing)")
    return w, "--world-size"


def _per_process_warnings(facts: list[Fact]) -> tuple[int, str] | None:
    """Python warnings each process prints once: k copies of the same warning close together are k processes."""
    seen: dict[str, list[int]] = {}
    for f in facts:
        if f.name == "warning" and len(seen.get(f.value, ())) < 4096:
            seen.setdefault(f.value, []).append(f.line)
    bursts = {text: len(at) for text, at in seen.items()
              if len(at) > 1 and at[-1] - at[0] <= 8 * len(at) + 16}  # together, not once per step
    mult = Counter(bursts.values())
    if not mult:
        return None
    k = max(mult, key=lambda n: (mult[n], n))
    text = next(t for t, n in bursts.items() if n == k)
    if mult[k] >= 2:
        return k, f"{mult[k]} Python warnings each appear {k} times (once per process), e.g. line {seen[text][0]}"
    return k, f"a Python warning appears {k} times together (once per process), lines {seen[text][0]}-{seen[text][-1]}"


def _samples_per_step(facts: list[Fact], cfg: DoctorConfig, done, world: int | None) -> tuple[int | None, str]:
    batching, mb, ga = latest(facts, "plan_batching"), latest(facts, "micro_batch"), latest(facts, "grad_accum")
    if cfg.micro_batch:
        return cfg.micro_batch * cfg.grad_accum, f"--micro-batch {cfg.micro_batch} x --grad-accum {cfg.grad_accum}"
    if batching:
        return batching.value[1] * batching.value[2], cite(batching)
    seen = next(((v, s) for v, s in reversed(done) if s.samples_seen), None)
    if seen and world:
        spb = seen[1].samples_seen / (seen[0] * world)
        return max(1, round(spb)), f"{fmt_int(seen[1].samples_seen)} samples seen (global) after {seen[0]} steps " \
                                   f"on {world} ranks (line {seen[1].line})"
    if mb:
        return mb.value * (ga.value if ga else 1), cite(mb) + (f" and {cite(ga)}" if ga else "")
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
    bounds = [(a, b) for a, b in itertools.pairwise(epochs) if int(b[1].epoch) == int(a[1].epoch) + 1]
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
                return round(before[-1] / f.value[0]), f"{fmt_int(before[-1])} steps when {cite(f)}"
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
    return (top.value[1], f"the progress bar's total, {cite(top)}") if top else (None, "")
