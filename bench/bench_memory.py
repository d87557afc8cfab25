"""Weights in 2 MiB pages against the same weights in 4 KiB pages, side by side in one run (eyas.core.memory).

Times a one-token forward step (B=1) of the target's lean decoder and its output head alone, with the weights
as transformers loaded them and after `eyas.core.memory` moved them into huge pages, alternating the two.

    python bench/bench_memory.py      # sets EYAS_HUGEPAGES=0 itself, so that load_target leaves the weights alone
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

os.environ["EYAS_HUGEPAGES"] = "0"  # the bench moves the weights itself, for the second copy only

import torch  # noqa: E402

from eyas.core import memory  # noqa: E402
from eyas.core.config import opt, parse  # noqa: E402
from eyas.core.options import target_opt  # noqa: E402
from eyas.core.target import load_target  # noqa: E402
from eyas.models.generation import BatchGenerator  # noqa: E402


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    target: str = target_opt()
    repeats: int = opt(5, "alternated repeats of both page sizes (medians shown)")


def timed(fn, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> None:
    args = parse(MemoryConfig, description=__doc__.splitlines()[0])
    small = load_target(args.target, dtype="bfloat16")
    huge = load_target(args.target, dtype="bfloat16")
    gens = {"4 KiB pages": BatchGenerator(small)}  # its fused weights too stay in 4 KiB pages
    os.environ["EYAS_HUGEPAGES"] = "1"
    memory.pack_module(huge.model)
    gens["2 MiB pages"] = BatchGenerator(huge)
    heads = {"4 KiB pages": small.model.lm_head, "2 MiB pages": huge.model.lm_head}
    x = torch.randn(1, small.hidden_size, dtype=torch.bfloat16)
    prompt = [list(range(100, 300))]
    step, head = {k: [] for k in gens}, {k: [] for k in gens}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for k in gens:  # alternated: a slow spell of the machine hits both
                t1 = timed(lambda: gens[k].generate(prompt, 1, stops=set()), 2)
                t17 = timed(lambda: gens[k].generate(prompt, 17, stops=set()), 2)
                step[k].append((t17 - t1) / 16)
                head[k].append(timed(lambda: heads[k](x), 20))
    print(f"target {small.name} bf16, {torch.get_num_threads()} threads, {args.repeats} alternated repeats (medians)")
    for k in gens:
        print(f"{k}: decode step (B=1) {statistics.median(step[k]) * 1e3:6.1f} ms   "
              f"output head {statistics.median(head[k]) * 1e3:6.2f} ms")
    a, b = "4 KiB pages", "2 MiB pages"
    print(f"2 MiB / 4 KiB speedup: decode step {statistics.median(step[a]) / statistics.median(step[b]):.2f}x, "
          f"output head {statistics.median(head[a]) / statistics.median(head[b]):.2f}x")


if __name__ == "__main__":
    main()
