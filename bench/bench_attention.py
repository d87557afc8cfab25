"""The lean runner's CPU attention (eyas.speculate.target_forward._attend: torch's fused attention in float64 over
a float64 cache) against the path it replaced on 2026-12-06 (a float32 product for the scores, then masking,
softmax and the sum of values as separate float64 ops over a float64 copy of the values made at every layer),
side by side in one run:

- why float64: of the rows of a T-row call, how many differ from a one-row call over the keys that row sees, by
  the fused kernel in float32, bf16 and float64 (random queries and keys, the target's head shapes);
- one layer's attention by each path, T rows after S keys, alternated;
- with --forward, the target's whole forward t(q) by each (the same projections), after --prefix tokens, and
  a prompt's prefill.

    python bench/bench_attention.py --forward

Prints the CPU, the machine's load before and after (measure on a quiet machine), and the ratios.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import torch
import torch.nn.functional as F
from bench_linear import cpu_name  # (this folder)

from eyas.core.config import opt, parse
from eyas.core.options import Dtype, dtype_opt, target_opt
from eyas.core.precision import FULL
from eyas.speculate.target_forward import attention_mask


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    target: str = target_opt()
    dtype: Dtype = dtype_opt("the target", auto="fp32 here")
    forward: bool = opt(False, "also time the target's whole forward by each path (loads the target)")
    prefix: int = opt(600, "--forward: tokens already in the cache")
    reps: int = opt(200, "calls per timing of one layer's attention")


_MADE: dict = {}  # the masks split_fp64 made last: the old runner repeated its mask once per forward, not per layer


def split_fp64(q, k, v, mask, causal=False):
    """The path before 2026-12-06: k, v in the model dtype; True in mask = may attend (a prompt from the cache's
    start, causal, as the mask it was)."""
    _, nh, T, d = q.shape
    nkv = k.shape[1]
    rep = nh // nkv
    if causal:
        if _MADE.get("causal", (None,))[0] != T:
            _MADE["causal"] = (T, attention_mask(0, None, T, q.device))
        mask = _MADE["causal"][1]
    if mask is not None and _MADE.get("masked", (None,))[0] is not mask:
        _MADE["masked"] = (mask, ~mask.repeat(1, 1, rep, 1))
    qg = q.reshape(1, nkv, rep * T, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).to(torch.float64) * d ** -0.5
    if mask is not None:
        scores = scores.masked_fill(_MADE["masked"][1], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.to(torch.float64))
    return out.to(q.dtype).reshape(1, nh, T, d)


def differing_rows(dtype, kernel, heads, g) -> tuple[int, int]:
    """Rows of T-row fused calls (inputs in `dtype`, computed in `kernel`, rounded back to `dtype`) unequal to the
    one-row call over the same keys, and rows compared."""
    nh, nkv, d = heads
    bad = total = 0
    for prefix in (37, 600, 1001):
        for rows in (2, 4, 8):
            q = torch.randn(1, nh, rows, d, generator=g).to(dtype).to(kernel)
            k, v = (torch.randn(1, nkv, prefix + rows, d, generator=g).to(dtype).to(kernel) for _ in range(2))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(prefix, None, rows, "cpu"),
                                                 enable_gqa=True).to(dtype)
            for t in range(rows):
                n = prefix + t + 1
                one = F.scaled_dot_product_attention(q[:, :, t:t + 1], k[:, :, :n], v[:, :, :n], enable_gqa=True)
                bad += not torch.equal(out[:, :, t:t + 1], one.to(dtype))
                total += 1
    return bad, total


@contextlib.contextmanager
def attention(module, fn):
    """The lean runner's CPU attention replaced by `fn` for the block."""
    kept, module._attend = module._attend, fn
    try:
        yield
    finally:
        module._attend = kept


def timed(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    a = parse(AttentionConfig, description=__doc__.split("\n\n")[0])
    from eyas.core.weights import load_target_shell
    from eyas.speculate.target_forward import _attend

    print(f"{cpu_name()}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f} before")
    dtype = getattr(torch, FULL.get(a.dtype, "float32"))
    cfg = load_target_shell(a.target).text_config
    nh = int(cfg.num_attention_heads)
    nkv = int(getattr(cfg, "num_key_value_heads", nh))
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // nh)
    g = torch.Generator().manual_seed(0)
    print(f"{a.target}: {nh} query heads, {nkv} kv heads, head dim {d}; rows of T-row fused calls that differ from "
          "a one-row call, in the model dtype:")
    for dt in (torch.float32, torch.bfloat16):
        for kernel in (dt, torch.float64):
            bad, total = differing_rows(dt, kernel, (nh, nkv, d), g)
            name = str(dt).removeprefix("torch.")
            print(f"  {name + (' computed in float64' if kernel != dt else ''):<30} {bad:>3} of {total}")
    print(f"one layer's attention, {dtype}, us (median of 5 alternated timings of {a.reps} calls):")
    print(f"{'keys':>5} {'rows':>4} {'before':>8} {'fused f64':>10} {'ratio':>6}")
    for prefix in (300, 600, 1200):
        for rows in (1, 2, 4, 8):
            n = prefix + rows
            q = torch.randn(1, nh, rows, d, generator=g).to(dtype)
            k, v = (torch.randn(1, nkv, n, d, generator=g).to(dtype) for _ in range(2))
            k64, v64 = k.double(), v.double()
            mask = attention_mask(prefix, None, rows, "cpu")
            ways = {"before": lambda: split_fp64(q, k, v, mask), "fused": lambda: _attend(q, k64, v64, mask)}
            assert torch.allclose(ways["before"]().float(), ways["fused"]().float(), atol=1e-2)
            times = {w: [] for w in ways}
            for r in range(6):
                for w in (ways if r % 2 else list(ways)[::-1]):
                    t = timed(ways[w], a.reps)
                    if r:  # the first round warms up
                        times[w].append(t)
            med = {w: sorted(ts)[len(ts) // 2] * 1e6 for w, ts in times.items()}
            print(f"{prefix:>5} {rows:>4} {med['before']:>8.1f} {med['fused']:>10.1f} "
                  f"{med['before'] / med['fused']:>5.2f}x")
    if a.forward:
        forward(a, dtype)
    print(f"load {os.getloadavg()[0]:.2f} after; {time.strftime('%Y-%m-%d %H:%M')}")


def forward(a: AttentionConfig, dtype) -> None:
    """The whole forward t(q) by each path: two runners over one target, the same fixed projections."""
    import eyas.speculate.target_forward as tf
    from eyas.core.target import load_target

    target = load_target(a.target, dtype=str(dtype).removeprefix("torch."))
    plan = ((1, "torch"),)
    fused = tf.LeanRunner(target, target.default_feature_layers(), linear=plan)
    before = tf.LeanRunner(target, target.default_feature_layers(), linear=plan)
    before.cache_dtype, before.k, before.v, before.capacity = target.dtype, [], [], 0
    before._ensure(2048)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, target.vocab_size, (a.prefix,), generator=g)
    fused.prefill(prompt)
    with attention(tf, split_fp64):
        before.prefill(prompt)
    qs = (1, 2, 3, 4, 6, 8)
    ids = {q: torch.randint(0, target.vocab_size, (q,), generator=g) for q in qs}
    times = {w: {q: [] for q in qs} for w in ("before", "fused")}
    worst = 0.0
    def run(name, call):  # -> (seconds, result) of `call` on the runner of `name`, by its attention
        with attention(tf, split_fp64) if name == "before" else contextlib.nullcontext():
            t0 = time.perf_counter()
            out = call(before if name == "before" else fused)
            return time.perf_counter() - t0, out

    for rep in range(8):
        for q in qs:
            logits = {}
            for name in (("before", "fused") if rep % 2 else ("fused", "before")):  # alternated
                t, (logits[name], _) = run(name, lambda r: r.forward(ids[q]))
                if rep:
                    times[name][q].append(t)
            worst = max(worst, (logits["before"].float() - logits["fused"].float()).abs().max().item())
    print(f"{target.name} {target.dtype}, the whole forward after {a.prefix} tokens (projections by F.linear), ms "
          "(median of 7, alternated):")
    print(f"{'rows':>4} {'before':>8} {'fused f64':>10} {'ratio':>6}")
    for q in qs:
        b, f = (sorted(times[w][q])[len(times[w][q]) // 2] * 1e3 for w in ("before", "fused"))
        print(f"{q:>4} {b:>8.1f} {f:>10.1f} {b / f:>5.2f}x")
    print(f"largest logit difference between the paths: {worst:.2e} (scores now a float64 product)")
    print("a prompt's prefill, ms (the fastest of 3 alternated):")
    print(f"{'tokens':>6} {'before':>8} {'fused f64':>10} {'ratio':>6}")
    for n in (300, 800, 1600):
        prompt = torch.randint(0, target.vocab_size, (n,), generator=g)
        best = {"before": float("inf"), "fused": float("inf")}
        for rep in range(3):
            for name in (("before", "fused") if rep % 2 else ("fused", "before")):
                (before if name == "before" else fused).reset()
                best[name] = min(best[name], run(name, lambda r: r.prefill(prompt))[0])
        b, f = best["before"], best["fused"]
        print(f"{n:>6} {b * 1e3:>8.0f} {f * 1e3:>10.0f} {b / f:>5.2f}x")


if __name__ == "__main__":
    main()
