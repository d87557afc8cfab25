"""Verification in a wider forward (eyas.speculate.target_forward.verify_widths) against q-row verification, side
by side on a real target and draft: the latency table t(q) and the widths it picks, then each method's decode tokens/s
with and without widening, alternated prompt by prompt on one runner, outputs compared token for token.

    python bench/bench_widen.py --draft runs/packing-gsm8k/unpacked/final --bench gsm8k --prompts 10

Each method runs twice: "narrow" (every q verified as q rows; its adaptive controller priced with t(q)) and
"wide" (q verified in the measured-fastest forward of at least q rows; the controller priced with that). Where
t(q) grows with q nothing is widened and the script says so.
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch

from eyas.core.config import check, opt, parse
from eyas.core.options import Dtype, dtype_opt, target_opt

BENCH_HELP = "mt_bench, gsm8k or a JSONL file (first turns only)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SideBySide:
    """The settings every side-by-side decoding bench takes."""

    target: str = target_opt()
    draft: str = opt("", "an eyas draft checkpoint folder (train's final/); required")
    bench: str = opt("gsm8k", BENCH_HELP)
    new: int = opt(128, "new tokens per prompt")
    dtype: Dtype = dtype_opt("the target and the draft")
    threads: int = opt(0, "torch threads (0: torch's default, every core)")
    out: str = opt("", "write the figures here as JSON")

    def __post_init__(self):
        check(bool(self.draft), "--draft is required", "give an eyas draft checkpoint folder (train's final/)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WidenConfig(SideBySide):
    prompts: int = opt(10, "the first N prompts")
    chain: tuple[int, ...] = opt((3, 7), "the draft's chain lengths, one method each")
    adaptive: bool = opt(True, "the adaptive controller (--no-adaptive: every round drafts in full)")

    def __post_init__(self):
        super().__post_init__()
        check(bool(self.chain), "--chain is empty", "give one chain length or more, e.g. --chain 3 7")


def main() -> None:
    a = parse(WidenConfig, description=__doc__.split("\n\n")[0])

    from eyas.speculate.evaluate import EvalConfig, build_methods, load_bench
    from eyas.speculate.target_forward import effective_latency

    target, draft, runner, dtype, latency, widths = load(a, sorted(set(range(1, max((*a.chain, 7)) + 2)) | {12, 16}))
    if not widths:
        return
    cfg = EvalConfig(draft=a.draft, chain=a.chain, tree=False, adaptive=a.adaptive,
                     baselines=("prompt-lookup", "hybrid"))
    sides = {"narrow": ({}, build_methods(cfg, draft, {}, latency, target.vocab_size)),
             "wide": (widths, build_methods(cfg, draft, {}, effective_latency(latency, widths), target.vocab_size))}
    rows, plain_tps = side_by_side(target, runner, sides, load_bench(a.bench, a.prompts), a.new)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"latency_ms": {q: 1e3 * t for q, t in latency.items()}, "widths": widths,
                       "plain_tokens_per_s": plain_tps, "methods": rows, "threads": torch.get_num_threads(),
                       "dtype": dtype, "when": time.strftime("%Y-%m-%d %H:%M")}, f, indent=1)


def load(a, qs: list[int]):
    """Target, draft and runner as `eyas evaluate` makes them, t(q) measured for qs and the verify widths it picks,
    printed. -> (target, draft, runner, dtype, latency, widths)"""
    from eyas.core.precision import choose_dtype
    from eyas.core.target import load_target
    from eyas.speculate.evaluate import load_draft
    from eyas.speculate.target_forward import make_runner, measure_latency, verify_widths

    if a.threads:
        torch.set_num_threads(a.threads)
    dtype, why = choose_dtype(a.dtype, "cpu")
    if why:
        print(why)
    target = load_target(a.target, dtype=dtype)
    draft = load_draft(a.draft, target, target.device, target.dtype)
    runner = make_runner(target, draft.cfg.feature_layers)
    latency = measure_latency(runner, qs)
    widths = verify_widths(latency)
    print(f"{target.name} {dtype}, {torch.get_num_threads()} threads, runner {type(runner).__name__}")
    print("t(q) ms:   " + "  ".join(f"{q}:{1e3 * t:.1f}" for q, t in latency.items()))
    print("widths:    " + ("  ".join(f"{q}->{w}" for q, w in widths.items()) or "none (t(q) grows with q here)"))
    return target, draft, runner, dtype, latency, widths


def side_by_side(target, runner, sides: dict, items, new: int) -> tuple[dict, float]:
    """Plain greedy, then every side's methods (sides: name -> (verify widths, [Method]), the same method names on
    every side) on each prompt's first turn, the sides' order alternated prompt by prompt so that noise hits both.
    Prints the table; -> ({method: figures by side}, plain greedy tokens/s)."""
    from eyas.data.chat import ChatRenderer
    from eyas.speculate.decode import plain_generate, speculative_generate
    from eyas.speculate.evaluate import stop_ids

    renderer = ChatRenderer(target.tokenizer)
    stop = stop_ids(target, renderer)
    order = list(sides)
    names = [m.name for m in sides[order[0]][1]]
    tally = {(s, n): {"tokens": 0, "s": 0.0, "rounds": 0} for s in sides for n in names}
    same, plain = {n: 0 for n in names}, {"tokens": 0, "s": 0.0}
    for i, item in enumerate(items):
        prompt = renderer.prompt_ids([{"role": "user", "content": item.turns[0]}])
        runner.widths = {}
        base = plain_generate(runner, prompt, new, stop=stop)
        plain["tokens"] += len(base.tokens)
        plain["s"] += base.decode_s
        out = {}
        for side in (order if i % 2 == 0 else order[::-1]):
            runner.widths, methods = sides[side]
            for m in methods:
                g = speculative_generate(runner, m.drafter, prompt, new, stop=stop, controller=m.round_controller)
                t = tally[side, m.name]
                t["tokens"] += len(g.tokens)
                t["s"] += g.decode_s
                t["rounds"] += len(g.rounds)
                out[side, m.name] = g.tokens
        for n in names:
            same[n] += all(out[s, n] == out[order[0], n] for s in order)
        print(f"prompt {i + 1}/{len(items)} done", flush=True)
    plain_tps = plain["tokens"] / plain["s"]
    a, b = order
    print(f"\nplain greedy {plain_tps:.1f} tokens/s; {len(items)} prompts x {new} new tokens at most")
    print(f"{'method':<40} {a + ' tok/s':>12} {b + ' tok/s':>12} {b + '/' + a:>11} {'tau':>11} {'same output':>11}")
    rows = {}
    for n in names:
        tps = {s: tally[s, n]["tokens"] / tally[s, n]["s"] for s in sides}
        tau = {s: tally[s, n]["tokens"] / max(1, tally[s, n]["rounds"]) for s in sides}
        rows[n] = {"tokens_per_s": tps, "tau": tau, "speedup": {s: tps[s] / plain_tps for s in sides},
                   "same_output": same[n], "tokens": {s: tally[s, n]["tokens"] for s in sides}}
        print(f"{n:<40} {tps[a]:>12.1f} {tps[b]:>12.1f} {tps[b] / tps[a]:>10.2f}x "
              f"{tau[a]:>5.2f}/{tau[b]:<5.2f} {same[n]:>6}/{len(items)}")
    return rows, plain_tps


if __name__ == "__main__":
    main()
