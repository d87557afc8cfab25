"""The adaptive controller with its latency table fixed at start-up against the same controller learning t(q) from
its rounds (eyas.speculate.drafters.Controller, `learn`), side by side on a real target and draft: the draft's
chain and the hybrid, each adaptive on both sides, alternated prompt by prompt on one runner, outputs compared token
for token. Both sides start from one table measured at start-up; `--skew F` multiplies that table by F at q > 1
(a start-up measured in a slow spell of the machine: the side that learns should recover, the fixed one not).

    python bench/bench_controller.py --draft runs/smollm2-recipe/train/final --bench mt_bench --per-category 2
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch
from bench_hybrid import HybridConfig
from bench_widen import load, side_by_side

from eyas.core.config import opt, parse


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControllerConfig(HybridConfig):
    skew: float = opt(1.0, "the start-up table times this at q > 1")


def main() -> None:
    a = parse(ControllerConfig, description=__doc__.split("\n\n")[0])

    from eyas.speculate.controller import Controller
    from eyas.speculate.drafters import Eagle3Drafter, HybridDrafter, PromptLookupDrafter
    from eyas.speculate.evaluate import Method, load_bench
    from eyas.speculate.target_forward import effective_latency

    target, draft, runner, dtype, latency, widths = load(a, sorted(set(range(1, a.chain + a.lookup + 2)) | {24, 32}))
    cost = {q: t * (a.skew if q > 1 else 1.0) for q, t in effective_latency(latency, widths).items()}

    def methods(**learn) -> list[Method]:
        chain = Controller(cost, a.chain, **learn)
        own = Controller(cost, a.chain, **learn)
        hybrid = HybridDrafter(Eagle3Drafter(draft, k=a.chain), PromptLookupDrafter(a.lookup), controller=own)
        return [Method(f"eagle3 chain k={a.chain}", Eagle3Drafter(draft, k=a.chain), chain, "chain", a.chain,
                       "eagle3"),
                Method(f"hybrid k={a.chain} + prompt-lookup k={a.lookup}", hybrid, own, "chain", a.chain, "hybrid")]

    sides = {"fixed": (widths, methods(learn=0.0)), "learned": (widths, methods())}
    items = load_bench(a.bench, a.prompts, a.per_category)
    rows, plain_tps = side_by_side(target, runner, sides, items, a.new)
    shown = sorted({1, 2, 4, a.chain + 1} & set(cost))
    print("\nt(q) ms at the end    " + "  ".join(f"q={q:<3}" for q in shown))
    print(f"{'start-up':<22}" + "  ".join(f"{1e3 * cost[q]:5.1f}" for q in shown))
    learned = {}
    for side, (_, ms) in sides.items():
        for m in ms:
            lat = m.controller.latency()
            learned[f"{side}: {m.name}"] = {q: 1e3 * t for q, t in lat.items()}
            drafted = getattr(m.drafter, "used", None)
            print(f"{side + ' ' + m.name.split()[0]:<22}" + "  ".join(f"{1e3 * m.controller.t(q):5.1f}" for q in shown)
                  + (f"   rounds by drafter {drafted}" if drafted else ""))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"latency_ms": {q: 1e3 * t for q, t in latency.items()}, "skew": a.skew, "widths": widths,
                       "learned_latency_ms": learned, "plain_tokens_per_s": plain_tps, "methods": rows,
                       "threads": torch.get_num_threads(), "dtype": dtype, "bench": a.bench, "prompts": len(items),
                       "when": time.strftime("%Y-%m-%d %H:%M")}, f, indent=1)


if __name__ == "__main__":
    main()
