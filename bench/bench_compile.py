"""The lean runner's forward compiled (`eyas evaluate --compile`: torch.compile graphs around the runner's own
projections) against the same runner eager, side by side in one run over one target and one projection plan:

- the forward t(q) after --prefix tokens, by each, alternated;
- plain greedy decoding of --tokens tokens from a random prompt, by each, alternated: tokens/s and the tokens
  (the same by both, or the first position where they differ).

    python bench/bench_compile.py

Prints the CPU, the time compiling took, the machine's load before and after (measure on a quiet machine), and
the ratios.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch
from bench_linear import cpu_name  # (this folder)

from eyas.core.config import opt, parse
from eyas.core.options import Dtype, dtype_opt, target_opt
from eyas.core.precision import FULL


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileConfig:
    target: str = target_opt()
    dtype: Dtype = dtype_opt("the target", auto="fp32 here")
    projections: str = opt("auto", "the plan both runners use: auto (measured by the eager runner), or one kind",
                           choices=("auto", "torch", "few-rows", "packed", "mkl"))
    prefix: int = opt(300, "tokens already in the cache when t(q) is timed")
    tokens: int = opt(128, "tokens of each plain greedy decode")
    reps: int = opt(9, "alternated timings of each forward (the median is printed)")


def main() -> None:
    a = parse(CompileConfig, description=__doc__.split("\n\n")[0])
    from eyas.core.target import load_target
    from eyas.speculate.decode import plain_generate
    from eyas.speculate.target_forward import LeanRunner

    print(f"{cpu_name()}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f} before")
    target = load_target(a.target, dtype=FULL.get(a.dtype, "float32"))
    layers = target.default_feature_layers()
    eager = LeanRunner(target, layers, linear=a.projections)
    t0 = time.perf_counter()
    compiled = LeanRunner(target, layers, linear=eager.projections.plan, compiled=True)
    g = torch.Generator().manual_seed(0)
    compiled.prefill(torch.randint(0, target.vocab_size, (a.prefix,), generator=g))
    for q in (1, 2):  # the one-row graph and the graph of any other row count
        compiled.forward(torch.randint(0, target.vocab_size, (q,), generator=g))
    print(f"{target.name} {target.dtype}, projections {eager.projections.describe()}; compiling took "
          f"{time.perf_counter() - t0:.0f} s (both graphs, with the runner's start-up)")
    runners = {"eager": eager, "compiled": compiled}
    prompt = torch.randint(0, target.vocab_size, (a.prefix,), generator=g)
    for r in runners.values():
        r.reset()
        r.prefill(prompt)
    qs = (1, 2, 3, 4, 8)
    ids = {q: torch.randint(0, target.vocab_size, (q,), generator=g) for q in qs}
    times = {n: {q: [] for q in qs} for n in runners}
    worst = 0.0
    with torch.inference_mode():
        for rep in range(a.reps + 1):  # the first round warms up, untimed
            for q in qs:
                out = {}
                for n in (("eager", "compiled") if rep % 2 else ("compiled", "eager")):
                    t0 = time.perf_counter()
                    out[n] = runners[n].forward(ids[q])[0]
                    if rep:
                        times[n][q].append(time.perf_counter() - t0)
                worst = max(worst, (out["eager"].float() - out["compiled"].float()).abs().max().item())
    print(f"the forward after {a.prefix} tokens, ms (median of {a.reps}, alternated):")
    print(f"{'rows':>4} {'eager':>8} {'compiled':>9} {'ratio':>6}")
    for q in qs:
        e, c = (sorted(times[n][q])[len(times[n][q]) // 2] * 1e3 for n in runners)
        print(f"{q:>4} {e:>8.1f} {c:>9.1f} {e / c:>5.2f}x")
    print(f"largest logit difference: {worst:.2e}")
    tokens = torch.randint(0, target.vocab_size, (64,), generator=g).tolist()
    best, got = {n: float("inf") for n in runners}, {}
    for rep in range(3):
        for n in (("eager", "compiled") if rep % 2 else ("compiled", "eager")):
            gen = plain_generate(runners[n], tokens, a.tokens)
            got[n], best[n] = gen.tokens, min(best[n], gen.decode_s)  # after the (eager) prompt, as evaluate times
    same = got["eager"] == got["compiled"]
    first = next((i for i, (x, y) in enumerate(zip(got["eager"], got["compiled"])) if x != y), None)
    e, c = ((len(got[n]) - 1) / best[n] for n in runners)
    print(f"plain greedy decoding, {a.tokens} tokens after a 64-token prompt (the fastest of 3 alternated): eager "
          f"{e:.1f} tokens/s, compiled {c:.1f} ({c / e:.2f}x); the same tokens: "
          f"{'yes' if same else f'no, from position {first}'}")
    print(f"load {os.getloadavg()[0]:.2f} after; {time.strftime('%Y-%m-%d %H:%M')}")


if __name__ == "__main__":
    main()
