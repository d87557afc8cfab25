"""The lean runner's projections by F.linear against few_rows_linear ((W @ x.T).T, float32), oneDNN over packed
weights and MKL over weights packed per row count (float32; each where this machine has it), side by side on a
real target: t(q) for each, measured in alternation, and plain greedy decoding on the same prompts with each,
outputs compared token for token with F.linear's. With --draft, also the draft's chain of 3 (speculative decoding,
temperature 0, not adaptive) under each way from 4 rows on (F.linear below, as `auto` plans it here), alternated
prompt by prompt, the faster of two decodes each. What `eyas evaluate --projections auto` decides by a shorter
measurement of its own.

    python bench/bench_linear.py --bench gsm8k --prompts 6 --new 64
    python bench/bench_linear.py --bench mt_bench --prompts 8 --new 128 --draft runs/smollm2-recipe/train/final

Prints the CPU, the machine's load before and after (measure on a quiet machine), and the ratios.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time

import torch

from eyas.core.config import opt, parse
from eyas.core.options import Dtype, dtype_opt, target_opt
from eyas.core.precision import FULL


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearConfig:
    target: str = target_opt()
    bench: str = opt("gsm8k", "mt_bench, gsm8k or a JSONL file (first turns only)")
    prompts: int = opt(6, "the first N prompts")
    new: int = opt(64, "new tokens per prompt")
    rounds: int = opt(3, "latency tables per side, alternated")
    dtype: Dtype = dtype_opt("the target", auto="fp32 here, the bench's reference")
    draft: str = opt("", "a trained draft (its directory): also its chain of 3 under each way from 4 rows on")
    chain: int = opt(3, "the chain's length with --draft")

    @property
    def torch_dtype(self) -> str:
        """The dtype's full name; auto is float32 (this bench's figures so far)."""
        return FULL.get(self.dtype, "float32")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    a = parse(LinearConfig, description=__doc__.split("\n\n")[0])

    from eyas.core.target import load_target
    from eyas.data.chat import ChatRenderer
    from eyas.models.llama import mkl_unsupported, packing_unsupported
    from eyas.speculate.decode import plain_generate
    from eyas.speculate.evaluate import load_bench, stop_ids
    from eyas.speculate.target_forward import LeanRunner, Projections, measure_latency

    print(f"{cpu_name()}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f} before")
    target = load_target(a.target, dtype=a.torch_dtype)
    runner = LeanRunner(target, target.default_feature_layers())
    sides = ["torch"] + (["few-rows"] if target.dtype == torch.float32 else [])
    why = packing_unsupported(target.dtype, runner.device)
    sides += [] if why else ["packed"]
    why_mkl = mkl_unsupported(target.dtype, runner.device)
    sides += [] if why_mkl else ["mkl"]
    ways = {s: Projections.of(s) for s in sides}  # packed once (mkl: once per row count)
    qs = (1, 2, 3, 4, 5, 8, 16)
    lat = {s: {q: [] for q in qs} for s in sides}
    for r in range(a.rounds):
        for s in (sides if r % 2 == 0 else sides[::-1]):
            runner.use_projections(ways[s])
            for q, t in measure_latency(runner, qs, reps=5).items():
                lat[s][q].append(t)
    renderer = ChatRenderer(target.tokenizer)
    stop = stop_ids(target, renderer)
    tally = {s: [0, 0.0] for s in sides}
    same = {s: 0 for s in sides}
    items = load_bench(a.bench, a.prompts)
    for i, item in enumerate(items):
        prompt = renderer.prompt_ids([{"role": "user", "content": item.turns[0]}])
        out = {}
        for s in (sides if i % 2 == 0 else sides[::-1]):
            runner.use_projections(ways[s])
            g = plain_generate(runner, prompt, a.new, stop=stop)
            tally[s][0] += len(g.tokens)
            tally[s][1] += g.decode_s
            out[s] = g.tokens
        for s in sides:
            same[s] += out[s] == out["torch"]
    print(f"{target.name} {a.torch_dtype}; t(q) ms, the median of {a.rounds} rounds of 5 alternated"
          + (f" (no packed side: {why})" if why else "") + (f" (no mkl side: {why_mkl})" if why_mkl else ""))
    print(f"{'q':>3} {'F.linear':>9}" + "".join(f" {s:>9} {'ratio':>6}" for s in sides[1:]))
    med = {s: {q: sorted(lat[s][q])[len(lat[s][q]) // 2] * 1e3 for q in qs} for s in sides}
    for q in qs:
        print(f"{q:>3} {med['torch'][q]:>9.1f}"
              + "".join(f" {med[s][q]:>9.1f} {med['torch'][q] / med[s][q]:>5.2f}x" for s in sides[1:]))
    tps = {s: tally[s][0] / tally[s][1] for s in sides}
    print(f"plain greedy, {len(items)} {a.bench} prompts x {a.new} tokens at most: F.linear {tps['torch']:.1f} "
          "tokens/s" + "".join(f", {s} {tps[s]:.1f} ({tps[s] / tps['torch']:.2f}x; the same tokens as F.linear on "
                               f"{same[s]} of {len(items)} prompts)" for s in sides[1:]))
    if a.draft:
        chain_side_by_side(a, target, runner, renderer, stop, items, sides)
    print(f"load {os.getloadavg()[0]:.2f} after; {time.strftime('%Y-%m-%d %H:%M')}")


def chain_side_by_side(a: LinearConfig, target, runner, renderer, stop, items, sides: list[str]) -> None:
    """The draft's chain under each way from 4 rows on (F.linear below), its linears following the plan as in
    `eyas evaluate`: tokens/s over every prompt and the outputs against F.linear's."""
    from eyas.speculate.decode import speculative_generate
    from eyas.speculate.drafters import Eagle3Drafter
    from eyas.speculate.evaluate import load_draft
    from eyas.speculate.quantize import projected_draft
    from eyas.speculate.target_forward import Projections

    draft = load_draft(a.draft, target, runner.device, target.dtype)
    plans = {s: Projections.of(s) if s == "torch" else Projections(((1, "torch"), (4, s))) for s in sides}
    drafters = {s: Eagle3Drafter(projected_draft(draft, plans[s]) if s != "torch" else draft, k=a.chain)
                for s in sides}
    tally = {s: [0, 0.0, 0, 0] for s in sides}  # tokens, seconds, rounds, tokens the rounds made
    same = {s: 0 for s in sides}
    for i, item in enumerate(items):
        prompt = renderer.prompt_ids([{"role": "user", "content": item.turns[0]}])
        out = {}
        for s in (sides if i % 2 == 0 else sides[::-1]):
            runner.use_projections(plans[s])
            if i == 0:  # the first calls of each plan build its kernels: untimed
                speculative_generate(runner, drafters[s], prompt, 16, stop=stop)
            g = min((speculative_generate(runner, drafters[s], prompt, a.new, stop=stop) for _ in range(2)),
                    key=lambda g: g.decode_s)
            tally[s][0] += len(g.tokens)
            tally[s][1] += g.decode_s
            tally[s][2] += len(g.rounds)
            tally[s][3] += sum(r.accepted + 1 for r in g.rounds)
            out[s] = g.tokens
        for s in sides:
            same[s] += out[s] == out["torch"]
    tps = {s: tally[s][0] / tally[s][1] for s in sides}
    print(f"the draft's chain of {a.chain}, {len(items)} {a.bench} prompts x {a.new} tokens at most, each way from 4 "
          f"rows on: F.linear {tps['torch']:.1f} tokens/s (tau {tally['torch'][3] / tally['torch'][2]:.3f})"
          + "".join(f", {s} {tps[s]:.1f} ({tps[s] / tps['torch']:.2f}x; the same tokens as F.linear on {same[s]} of "
                    f"{len(items)} prompts)" for s in sides[1:]))


if __name__ == "__main__":
    main()
