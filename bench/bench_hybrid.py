"""The hybrid drafter with and without its "both" option, side by side on a real target and draft: per round
either the draft's chain or prompt lookup's match ("one"), against the same plus both as two branches of one tree
verified in one forward ("both"; eyas.speculate.drafters.HybridDrafter, join_chains). Both sides are adaptive (the
option is priced with measured latencies), verify in the same widths as `eyas evaluate`, and run alternated
prompt by prompt on one runner; outputs are compared token for token.

    python bench/bench_hybrid.py --draft runs/smollm2-recipe/train/final --bench mt_bench --per-category 2
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch
from bench_widen import BENCH_HELP, SideBySide, load, side_by_side

from eyas.core.config import opt, parse


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridConfig(SideBySide):
    """The settings of a side-by-side bench of the hybrid on MT-Bench's (or another bench's) first turns."""

    bench: str = opt("mt_bench", BENCH_HELP)
    prompts: int = opt(0, "the first N prompts (0: every one the bench selects)")
    per_category: int = opt(0, "MT-Bench: the first N questions of each category")
    chain: int = opt(7, "the draft's longest chain")
    lookup: int = opt(7, "prompt lookup's longest match")


def main() -> None:
    a = parse(HybridConfig, description=__doc__.split("\n\n")[0])

    from eyas.speculate.controller import Controller
    from eyas.speculate.drafters import Eagle3Drafter, HybridDrafter, PromptLookupDrafter
    from eyas.speculate.evaluate import Method, load_bench
    from eyas.speculate.target_forward import effective_latency

    target, draft, runner, dtype, latency, widths = load(a, sorted(set(range(1, a.chain + a.lookup + 2)) | {24, 32}))
    cost = effective_latency(latency, widths)

    def hybrid(union: bool) -> Method:
        own = Controller(cost, a.chain)
        drafter = HybridDrafter(Eagle3Drafter(draft, k=a.chain), PromptLookupDrafter(a.lookup), controller=own,
                                union=union)
        return Method("hybrid", drafter, own, "chain", a.chain, "hybrid")

    sides = {"one": (widths, [hybrid(False)]), "both": (widths, [hybrid(True)])}
    items = load_bench(a.bench, a.prompts, a.per_category)
    rows, plain_tps = side_by_side(target, runner, sides, items, a.new)
    used = {s: dict(m.drafter.used) for s, (_, ms) in sides.items() for m in ms}
    print("rounds by option: " + "; ".join(f"{s}: {u}" for s, u in used.items()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"latency_ms": {q: 1e3 * t for q, t in latency.items()}, "widths": widths,
                       "plain_tokens_per_s": plain_tps, "methods": rows, "rounds_by_option": used,
                       "threads": torch.get_num_threads(), "dtype": dtype, "bench": a.bench, "prompts": len(items),
                       "when": time.strftime("%Y-%m-%d %H:%M")}, f, indent=1)


if __name__ == "__main__":
    main()
