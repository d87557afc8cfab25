"""Local regeneration throughput: eyas's batched lean decoder against transformers' `generate`, alternated in one run.

Both decode the same left-padded batch of random prompts greedily for exactly `--new` tokens (no stop token), so
they do the same work; tokens/s counts new tokens over the wall time, prefill included (as regenerate pays it).

    python bench/bench_regenerate.py --target smollm2-135m --batch 32 --new 32 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompt-min", type=int, default=80)
    ap.add_argument("--prompt-max", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from eyas.core.generate import BatchGenerator
    from eyas.core.target import load_target

    target = load_target(args.target, dtype=args.dtype)
    lean = BatchGenerator(target)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (args.batch,), generator=g).tolist()
    prompts = [torch.randint(100, target.vocab_size - 100, (n,), generator=g).tolist() for n in lengths]
    width = max(lengths)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def hf() -> list[list[int]]:
        with torch.inference_mode():
            out = target.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new,
                                        min_new_tokens=args.new, do_sample=False, pad_token_id=0)
        return out[:, width:].tolist()

    def eyas() -> list[list[int]]:
        return lean.generate(prompts, args.new, stops=set())

    rates: dict[str, list[float]] = {"hf": [], "lean": []}
    outputs = {}
    for _ in range(args.repeats):
        for name, fn in (("hf", hf), ("lean", eyas)):  # alternated: a slow spell of the machine hits both
            t0 = time.perf_counter()
            outputs[name] = fn()
            rates[name].append(args.batch * args.new / (time.perf_counter() - t0))
    same = sum(a == b for x, y in zip(outputs["hf"], outputs["lean"]) for a, b in zip(x, y))
    print(f"target {target.name} {args.dtype}, {args.batch} rows of {args.prompt_min}-{args.prompt_max} prompt "
          f"tokens, {args.new} new tokens, {torch.get_num_threads()} threads, {args.repeats} alternated repeats")
    for name, r in rates.items():
        print(f"{name:5s} {statistics.median(r):7.1f} tokens/s (median; range {min(r):.1f}-{max(r):.1f})")
    print(f"lean / hf: {statistics.median(rates['lean']) / statistics.median(rates['hf']):.2f}x; "
          f"tokens equal in both: {same / (args.batch * args.new):.1%} (bf16 rounding differs between the two)")


if __name__ == "__main__":
    main()
