"""The lean runner's projections by F.linear against few_rows_linear ((W @ x.T).T), side by side on a real target:
t(q) for each, measured in alternation, and plain greedy decoding on the same prompts with each, outputs compared
token for token. What `eyas evaluate --projections auto` decides by a shorter measurement of its own.

    python bench/bench_linear.py --bench gsm8k --prompts 6 --new 64

Prints the CPU, the machine's load before and after (measure on a quiet machine), and the ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--bench", default="gsm8k", help="mt_bench, gsm8k or a JSONL file (first turns only)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--rounds", type=int, default=3, help="latency tables per side, alternated")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()

    from eyas.core.target import load_target
    from eyas.data.chat import ChatRenderer
    from eyas.speculate.decode import plain_generate
    from eyas.speculate.evaluate import load_bench, stop_ids
    from eyas.speculate.runner import LeanRunner, measure_latency

    print(f"{cpu_name()}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f} before")
    target = load_target(a.target, dtype=a.dtype)
    runner = LeanRunner(target, target.default_feature_layers())
    sides = ("torch", "few-rows")
    qs = (1, 2, 3, 4, 5, 8, 16)
    lat = {s: {q: [] for q in qs} for s in sides}
    for r in range(a.rounds):
        for s in (sides if r % 2 == 0 else sides[::-1]):
            runner.choose_linear(s)
            for q, t in measure_latency(runner, qs, reps=5).items():
                lat[s][q].append(t)
    renderer = ChatRenderer(target.tokenizer)
    stop = stop_ids(target, renderer)
    tally = {s: [0, 0.0] for s in sides}
    same = 0
    items = load_bench(a.bench, a.prompts)
    for i, item in enumerate(items):
        prompt = renderer.prompt_ids([{"role": "user", "content": item.turns[0]}])
        out = {}
        for s in (sides if i % 2 == 0 else sides[::-1]):
            runner.choose_linear(s)
            g = plain_generate(runner, prompt, a.new, stop=stop)
            tally[s][0] += len(g.tokens)
            tally[s][1] += g.decode_s
            out[s] = g.tokens
        same += out["torch"] == out["few-rows"]
    print(f"{target.name} {a.dtype}; t(q) ms, the median of {a.rounds} rounds of 5 alternated")
    print(f"{'q':>3} {'F.linear':>9} {'few-rows':>9} {'ratio':>6}")
    for q in qs:
        t0, t1 = (sorted(lat[s][q])[len(lat[s][q]) // 2] * 1e3 for s in sides)
        print(f"{q:>3} {t0:>9.1f} {t1:>9.1f} {t0 / t1:>5.2f}x")
    tps = {s: tally[s][0] / tally[s][1] for s in sides}
    print(f"plain greedy, {len(items)} {a.bench} prompts x {a.new} tokens at most: F.linear {tps['torch']:.1f} "
          f"tokens/s, few-rows {tps['few-rows']:.1f} ({tps['few-rows'] / tps['torch']:.2f}x); the same tokens on "
          f"{same} of {len(items)} prompts")
    print(f"load {os.getloadavg()[0]:.2f} after; {time.strftime('%Y-%m-%d %H:%M')}")


if __name__ == "__main__":
    main()
