"""Verification in a wider forward (eyas.speculate.runner.verify_widths) against q-row verification, side by side
on a real target and draft: the latency table t(q) and the widths it picks, then each method's decode tokens/s
with and without widening, alternated prompt by prompt on one runner, outputs compared token for token.

    python bench/bench_widen.py --draft runs/packing-gsm8k/unpacked/final --bench gsm8k --prompts 10

Each method runs twice: "narrow" (every q verified as q rows; its adaptive controller priced with t(q)) and
"wide" (q verified in the measured-fastest forward of at least q rows; the controller priced with that). Where
t(q) grows with q nothing is widened and the script says so.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = common_args(bench="gsm8k")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--chain", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--no-adaptive", dest="adaptive", action="store_false", help="every round drafts in full")
    a = ap.parse_args()

    from eyas.speculate.evaluate import EvalConfig, build_methods, load_bench
    from eyas.speculate.runner import effective_latency

    target, draft, runner, dtype, latency, widths = load(a, sorted(set(range(1, max(a.chain + [7]) + 2)) | {12, 16}))
    if not widths:
        return
    cfg = EvalConfig(draft=a.draft, chain=tuple(a.chain), tree=False, adaptive=a.adaptive,
                     baselines=("prompt-lookup", "hybrid"))
    sides = {"narrow": ({}, build_methods(cfg, draft, {}, latency, target.vocab_size)),
             "wide": (widths, build_methods(cfg, draft, {}, effective_latency(latency, widths), target.vocab_size))}
    rows, plain_tps = side_by_side(target, runner, sides, load_bench(a.bench, a.prompts), a.new)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"latency_ms": {q: 1e3 * t for q, t in latency.items()}, "widths": widths,
                       "plain_tokens_per_s": plain_tps, "methods": rows, "threads": torch.get_num_threads(),
                       "dtype": dtype, "when": time.strftime("%Y-%m-%d %H:%M")}, f, indent=1)


def common_args(bench: str, doc: str = __doc__) -> argparse.ArgumentParser:
    """The arguments every side-by-side decoding bench takes (`doc`: the bench's docstring, for --help)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", required=True, help="an eyas draft checkpoint folder (train's final/)")
    ap.add_argument("--bench", default=bench, help="mt_bench, gsm8k or a JSONL file (first turns only)")
    ap.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, every core)")
    ap.add_argument("--out", default="", help="write the figures here as JSON")
    return ap


def load(a, qs: list[int]):
    """Target, draft and runner as `eyas evaluate` makes them, t(q) measured for qs and the verify widths it picks,
    printed. -> (target, draft, runner, dtype, latency, widths)"""
    from eyas.core.precision import choose_dtype
    from eyas.core.target import load_target
    from eyas.speculate.evaluate import load_draft
    from eyas.speculate.runner import make_runner, measure_latency, verify_widths

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
