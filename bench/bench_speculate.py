"""Benchmark of the speculative decoding engine on a real target (default SmolLM2-135M, bf16, batch 1).

    python bench/bench_speculate.py                      # latency tables + draft step + engine check
    python bench/bench_speculate.py --threads 2 --prompts 4 --new 96

Prints, and writes to --out (JSON):
1. t(q) for q = 1, 4, 8, 16, 32 after a 300-token prefix, for eyas's lean runner, the HF-forward runner and
   plain transformers (model(...) with a DynamicCache), interleaved so machine noise hits them alike;
2. the time of one proposal (a catch-up of 4 positions, then k-1 chain steps) of an untrained EAGLE-3 draft with a
   32000-entry head, in bf16 and with int8 weight-only linears;
3. end to end on MT-Bench prompts (via `eyas evaluate`'s run): plain greedy (eyas and transformers' generate),
   the untrained draft with the adaptive controller (the poor-draft case: must stay within 10% of plain), the
   oracle drafter (the engine's upper bound: efficiency and overhead), prompt lookup.
The machine is shared: every figure is a median or a sum over interleaved repetitions; rerun for a second look.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def latency_tables(target, layers, qs, reps, prefix):
    from transformers import DynamicCache

    from eyas.speculate.runner import HFRunner, LeanRunner, measure_latency

    out = {"lean": measure_latency(LeanRunner(target, layers), qs, prefix=prefix, reps=reps)}
    hf = HFRunner(target, layers)
    out["hf_runner"] = measure_latency(hf, qs, prefix=prefix, reps=reps)
    hf.close()
    model, g = target.model, torch.Generator().manual_seed(0)
    times = {q: [] for q in qs}
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(torch.randint(0, 40000, (1, prefix), generator=g), cache=cache, use_cache=True, logits_to_keep=1)
        for _ in range(reps):
            for q in qs:
                t0 = time.perf_counter()
                model(torch.randint(0, 40000, (1, q), generator=g), cache=cache, use_cache=True, logits_to_keep=q)
                times[q].append(time.perf_counter() - t0)
                cache.crop(-q)
    out["transformers"] = {q: sorted(t)[len(t) // 2] for q, t in times.items()}
    return out


@torch.inference_mode()
def draft_times(target, draft, reps=20, prefix=300):
    """Median ms of one propose: a catch-up of 4 positions (a round that accepted 3) then k-1 chain steps."""
    from eyas.speculate.drafters import Eagle3Drafter
    from eyas.speculate.runner import LeanRunner

    runner = LeanRunner(target, draft.cfg.feature_layers)
    ids = torch.randint(0, 40000, (prefix,))
    _, feats = runner.prefill(ids)
    seq = ids.tolist() + [1]
    res = {}
    for k in (1, 3, 7):
        d = Eagle3Drafter(draft, k=k)
        d.start(seq[:-4], feats[:-4])  # the committed cache of positions 0..prefix-5
        base_cache, base_done = d.cache, d.done
        ts = []
        for _ in range(reps):
            d.cache, d.done, d.pending, d.ready = base_cache, base_done, [feats[-4:]], None
            t0 = time.perf_counter()
            d.propose(seq, 0.0, None, None)
            ts.append(time.perf_counter() - t0)
        res[f"propose_k{k}_ms"] = 1000 * sorted(ts)[len(ts) // 2]
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--skip", nargs="*", default=(), help="parts to skip: latency draft e2e")
    ap.add_argument("--out", default="/tmp/eyas-bench-speculate")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from eyas.core.target import load_target
    from eyas.speculate.evaluate import EvalConfig, load_draft, run

    target = load_target(args.target, dtype=args.dtype)
    draft = load_draft("untrained", target, target.device, target.dtype)
    res = {"threads": args.threads, "target": args.target, "dtype": args.dtype}
    if "latency" not in args.skip:
        tables = latency_tables(target, draft.cfg.feature_layers, (1, 4, 8, 16, 32), args.reps, 300)
        res["latency_ms"] = {k: {q: round(1000 * v, 2) for q, v in t.items()} for k, t in tables.items()}
        for k, t in tables.items():
            print(f"t(q) ms {k:>13}: " + "  ".join(f"{q}:{1000 * v:6.1f} ({v / t[1]:.2f})" for q, v in t.items()))
    if "draft" not in args.skip:
        from eyas.speculate.drafters import quantize_int8

        for name, d in (("draft", draft), ("draft_int8", quantize_int8(draft))):
            res[name] = draft_times(target, d)
            print(f"{name} propose ms (catch-up of 4 + chain):", {k: round(v, 2) for k, v in res[name].items()})
    if "e2e" not in args.skip:
        for name, kw in (("untrained adaptive", dict(adaptive=True, baselines=("oracle", "prompt-lookup"))),
                         ("untrained fixed k", dict(adaptive=False, baselines=("oracle",)))):
            cfg = EvalConfig(target=args.target, draft="untrained", bench="mt_bench", num_prompts=args.prompts,
                             max_new_tokens=args.new, chain=(3, 5, 7), dtype=args.dtype, threads=args.threads,
                             out=os.path.join(args.out, name.replace(" ", "_")), quiet=True, **kw)
            r = run(cfg)
            res[name] = {"baseline": r["baseline"], "configs": [{k: c[k] for k in (
                "name", "tau", "tokens_per_s", "speedup", "predicted_speedup", "efficiency", "overhead_share",
                "draft_step_ms", "verify_ms")} | {"lossless": c["lossless"]["identical"]} for c in r["configs"]]}
            print(f"== {name}")
            print(json.dumps(res[name], indent=1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
