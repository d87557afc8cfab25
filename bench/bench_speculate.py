"""Benchmark of the speculative decoding engine on a real target (default SmolLM2-135M, bf16, batch 1).

    python bench/bench_speculate.py                      # latency tables + draft step + engine check
    python bench/bench_speculate.py --threads 2 --prompts 4 --new 96

Prints, and writes to --out (JSON):
1. t(q) for q = 1, 4, 8, 16, 32 after a 300-token prefix, for eyas's lean runner, the HF-forward runner and
   plain transformers (model(...) with a DynamicCache), interleaved so machine noise hits them alike;
2. the time of one proposal (a catch-up of 4 positions, then k-1 chain steps; or a dynamic tree) of an untrained
   EAGLE-3 draft with a 32000-entry head, in bf16 and with int8 weight-only linears, with the draft's preallocated
   cache and with the concatenating cache it replaced, side by side;
3. end to end on MT-Bench prompts (via `eyas evaluate`'s run): plain greedy (eyas and transformers' generate),
   the untrained draft with the adaptive controller (the poor-draft case: must stay within 10% of plain), the
   oracle drafter (the engine's upper bound: efficiency and overhead), prompt lookup.
The machine is shared: every figure is a median or a sum over interleaved repetitions; rerun for a second look.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch

from eyas.core.config import opt, parse
from eyas.core.options import Dtype, dtype_opt, target_opt
from eyas.core.precision import FULL


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculateBenchConfig:
    target: str = target_opt()
    dtype: Dtype = dtype_opt("the target and the draft", auto="bf16 here, the bench's reference")
    threads: int = opt(2, "torch threads")
    reps: int = opt(7, "interleaved repetitions of the latency tables")
    prompts: int = opt(3, "MT-Bench prompts of the end-to-end and quant parts")
    new: int = opt(96, "new tokens per prompt")
    skip: tuple[str, ...] = opt((), "parts to skip", choices=("latency", "draft", "e2e", "quant"))
    draft: str = opt("untrained", "draft for the quant part (a trained one: its tau moves)")
    draft_prefix: int = opt(300, "committed positions before the timed proposals")
    out: str = opt("/tmp/eyas-bench-speculate", "the bench's folder (bench.json, the evaluations)")

    @property
    def torch_dtype(self) -> str:
        """The dtype's full name; auto is bfloat16 (this bench's figures so far)."""
        return FULL.get(self.dtype, "bfloat16")


def latency_tables(target, layers, qs, reps, prefix):
    from transformers import DynamicCache

    from eyas.speculate.target_forward import HFRunner, LeanRunner, measure_latency

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


def concat_forward(self, input_ids, hidden, position_ids, cache=None, mask=None):
    """Eagle3Draft.forward as it was before its cache was preallocated: every call concatenates the new keys and
    values onto copies of the old ones (the reference the in-place cache is timed against, side by side)."""
    from eyas.draft.model import attend

    if hidden.shape[-1] == 3 * self.cfg.target_hidden_size:
        hidden = self.fuse(hidden)
    embeds = self.embed_tokens(input_ids).to(hidden.dtype)
    cos, sin = self.rope(position_ids, hidden.dtype)
    cache = cache or [None] * len(self.all_layers())
    T = input_ids.shape[1]
    if mask is None:
        S = 0 if cache[0] is None else cache[0][0].shape[2]
        mask = torch.ones(T, S + T, dtype=torch.bool, device=hidden.device).tril(S)[None, None]
    new_cache = []
    for layer, kv in zip(self.all_layers(), cache):
        q, k, v, residual = layer.qkv(hidden, embeds, cos, sin)
        if kv is not None:
            k, v = torch.cat((kv[0], k), dim=2), torch.cat((kv[1], v), dim=2)
        new_cache.append((k, v))
        hidden = layer.finish(attend(q, k, v, mask), residual)
    return hidden, new_cache


@torch.inference_mode()
def draft_times(target, draft, reps=20, prefix=300):
    """Median ms of one propose (a catch-up of 4 positions, as after a round that accepted 3, then k-1 chain steps)
    and of one dynamic-tree proposal, with the draft's preallocated cache and with the concatenating one it
    replaced, interleaved rep by rep so machine noise hits both alike."""
    import contextlib
    from unittest import mock

    from eyas.draft.model import Eagle3Draft
    from eyas.speculate.drafters import Eagle3Drafter, TreeShape
    from eyas.speculate.target_forward import LeanRunner

    def way_of(way: str):  # the concatenating reference, patched in for its own calls only
        if way == "concat":
            return mock.patch.object(Eagle3Draft, "forward", concat_forward)
        return contextlib.nullcontext()

    runner = LeanRunner(target, draft.cfg.feature_layers)
    ids = torch.randint(0, 40000, (prefix,))
    _, feats = runner.prefill(ids)
    seq = ids.tolist() + [1]
    res = {}
    shapes = [(f"k{k}", dict(k=k)) for k in (1, 3, 7)] + [("tree", dict(tree=TreeShape(topk=4, depth=5, size=16)))]
    for name, kw in shapes:
        ts = {"inplace": [], "concat": []}
        drafters = {}
        for way in ts:
            with way_of(way):
                d = Eagle3Drafter(draft, **kw)
                d.start(seq[:-4], feats[:-4])  # the committed cache of positions 0..prefix-5
            drafters[way] = (d, d.cache, d.done)
        for _ in range(reps):
            for way, (d, base_cache, base_done) in drafters.items():
                with way_of(way):
                    d.cache, d.done, d.pending, d.ready = base_cache, base_done, [feats[-4:]], None
                    t0 = time.perf_counter()
                    d.propose(seq, 0.0, None, None)
                    ts[way].append(time.perf_counter() - t0)
        for way, t in ts.items():
            res[f"propose_{name}_{way}_ms"] = 1000 * sorted(t)[len(t) // 2]
        ratio = res[f"propose_{name}_concat_ms"] / res[f"propose_{name}_inplace_ms"]
        res[f"propose_{name}_concat_over_inplace"] = ratio
    return res


def main(argv=None):
    args = parse(SpeculateBenchConfig, argv, description=__doc__)
    torch.set_num_threads(args.threads)
    from eyas.core.target import load_target
    from eyas.speculate.evaluate import EvalConfig, load_draft, run

    target = load_target(args.target, dtype=args.torch_dtype)
    draft = load_draft("untrained", target, target.device, target.dtype)
    res = {"threads": args.threads, "target": args.target, "dtype": args.torch_dtype}
    if "latency" not in args.skip:
        tables = latency_tables(target, draft.cfg.feature_layers, (1, 4, 8, 16, 32), args.reps, 300)
        res["latency_ms"] = {k: {q: round(1000 * v, 2) for q, v in t.items()} for k, t in tables.items()}
        for k, t in tables.items():
            print(f"t(q) ms {k:>13}: " + "  ".join(f"{q}:{1000 * v:6.1f} ({v / t[1]:.2f})" for q, v in t.items()))
    if "draft" not in args.skip:
        from eyas.speculate.quantize import quantize_int8

        for name, d in (("draft", draft), ("draft_int8", quantize_int8(draft))):
            res[name] = draft_times(target, d, prefix=args.draft_prefix)
            print(f"{name} propose ms after {args.draft_prefix} positions (catch-up of 4 + chain k, or a tree), "
                  "preallocated cache vs concatenation:")
            for shape in ("k1", "k3", "k7", "tree"):
                r = res[name]
                print(f"  {shape:>4}: in place {r[f'propose_{shape}_inplace_ms']:7.2f}  concatenating "
                      f"{r[f'propose_{shape}_concat_ms']:7.2f}  ratio {r[f'propose_{shape}_concat_over_inplace']:.2f}x")
    if "e2e" not in args.skip:
        for name, kw in (("untrained adaptive", dict(adaptive=True, baselines=("oracle", "prompt-lookup"))),
                         ("untrained fixed k", dict(adaptive=False, baselines=("oracle",)))):
            cfg = EvalConfig(target=args.target, draft="untrained", bench="mt_bench", num_prompts=args.prompts,
                             max_new_tokens=args.new, chain=(3, 5, 7), dtype=args.torch_dtype, threads=args.threads,
                             out=os.path.join(args.out, name.replace(" ", "_")), quiet=True, **kw)
            r = run(cfg)
            res[name] = {"baseline": r["baseline"], "configs": [{k: c[k] for k in (
                "name", "tau", "tokens_per_s", "speedup", "predicted_speedup", "efficiency", "overhead_share",
                "draft_step_ms", "verify_ms")} | {"lossless": c["lossless"]["identical"]} for c in r["configs"]]}
            print(f"== {name}")
            print(json.dumps(res[name], indent=1))
    if "quant" not in args.skip:  # int8 draft linears against the draft as trained: same prompts, fixed k
        runs = {}
        for quant in ("none", "int8"):
            cfg = EvalConfig(target=args.target, draft=args.draft, bench="mt_bench", num_prompts=args.prompts,
                             max_new_tokens=args.new, chain=(3,), baselines=(), adaptive=False, hf_generate=False,
                             dtype=args.torch_dtype, threads=args.threads, draft_quant=quant, quiet=True,
                             out=os.path.join(args.out, f"quant_{quant}"))
            runs[quant] = run(cfg)["configs"][0]
        res["quant"] = {q: {k: c[k] for k in ("tau", "speedup", "draft_step_ms")} for q, c in runs.items()}
        n, q = res["quant"]["none"], res["quant"]["int8"]
        print(f"draft precision ({args.draft}, chain k=3, {args.prompts} MT-Bench prompts): as trained tau "
              f"{n['tau']:.3f} speedup {n['speedup']:.2f}x, draft step {n['draft_step_ms']:.2f} ms; int8 linears tau "
              f"{q['tau']:.3f} speedup {q['speedup']:.2f}x, draft step {q['draft_step_ms']:.2f} ms; "
              f"tau int8/as trained {q['tau'] / n['tau']:.3f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
