"""The lean forward of a Llama-family decoder layer, outside transformers: fused [q|k|v] and [gate|up] projections,
rotary embeddings, single-query attention over a preallocated cache, and the few-rows linear. The generators
(`eyas.models.generation`) and speculative decoding's target forward (`eyas.speculate.target_forward`) run the
target through these functions; which targets qualify is `supports`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eyas.core.memory import to_hugepages

FEW_ROWS = 16  # few_rows_linear's limit: where it measured faster (bench/bench_linear.py, docs/results/2026-12.md)
LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2")  # pre-norm, RoPE, SiLU-gated MLP, no extra norms


def fuse_projections(layers) -> tuple[list, list, list]:
    """Per layer: [q|k|v] weight, its bias (or None) and [gate|up] weight, one matmul each instead of five."""
    wqkv, bqkv, wgu = [], [], []
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        wqkv.append(torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)))
        b = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
        bqkv.append(torch.cat(b) if b[0] is not None else None)
        wgu.append(torch.cat((m.gate_proj.weight, m.up_proj.weight)))
    packed = iter(to_hugepages([w for w in (*wqkv, *bqkv, *wgu) if w is not None]))  # eyas.core.memory
    return ([next(packed) for _ in wqkv], [None if b is None else next(packed) for b in bqkv],
            [next(packed) for _ in wgu])


def few_rows_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ b) for a few rows, computed as (w @ x.T).T, one row doubled into two. The same product as
    F.linear, by another BLAS call: on an AMD EPYC (AVX2, float32, MKL) F.linear over 1-8 rows streamed a model's
    weights at about 11 GB/s, this at about 25 GB/s (a one-row product is a matrix-vector call there, slower than
    the two-row matrix product); in SmolLM2-135M's whole forward t(1) fell from 66 to 38-53 ms, t(4) from 89-93
    to 62-70 ms, and t(8) stayed within noise (bench/bench_linear.py). Whether it is faster is measured per
    machine (eyas.speculate.target_forward); it is not used for more than FEW_ROWS rows, where F.linear is the fast
    one."""
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    if m > FEW_ROWS:
        return F.linear(x, w, b)
    y = (w @ (flat if m > 1 else torch.cat((flat, flat))).T).T[:m]
    if b is not None:
        y = y + b
    return y.reshape(*x.shape[:-1], w.shape[0])


PACK_ROWS = 16  # the row count oneDNN's packed layout is chosen for (any count computes; few rows measured alike)


def packing_unsupported(dtype: torch.dtype, device) -> str:
    """'' where oneDNN can pack a linear weight of `dtype` on `device` for `packed_linear`, else why not."""
    if torch.device(device).type != "cpu":
        return "oneDNN packing is a CPU path"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no bf16 oneDNN kernels"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN packing here is for float32 and bfloat16, not {dtype}"
    return ""


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """w [N,K] copied once into oneDNN's blocked layout for `packed_linear` (the layout torch's own CPU compiler
    packs a frozen linear weight into; vLLM's CPU backend keeps its linear weights prepacked for oneDNN too)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ b) by oneDNN over `pack_weight(w)`: the product F.linear computes, up to the order of the sums.
    F.linear hands the weight to the BLAS in its plain layout at every call; over a few rows that streamed
    SmolLM2-135M's weights 1.5x slower in bf16 (every row count) and float32 (4 rows or more) on an Intel Xeon with
    AMX (bench/bench_linear.py, docs/evaluate.md). Any leading shape."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


MKL_ROWS = 16  # the most rows MKL's packed product is prepared for (a copy of the weights per row count)


def mkl_unsupported(dtype: torch.dtype, device) -> str:
    """'' where MKL's packed single-precision product (`mkl_pack`, `mkl_linear`) runs for `dtype` on `device`, else
    why not."""
    if torch.device(device).type != "cpu":
        return "MKL's packed product is a CPU path"
    if not torch.backends.mkl.is_available() or not hasattr(torch.ops.mkl, "_mkl_linear"):
        return "this torch build has no MKL"
    if dtype != torch.float32:
        return f"MKL's packed product is single precision (float32), not {dtype}"
    return ""


def mkl_pack(w: torch.Tensor, rows: int) -> torch.Tensor:
    """w [N,K] copied once into MKL's packed layout for products over exactly `rows` rows (`mkl_linear`): what
    torch's own CPU compiler makes of a frozen float32 linear weight. Each row count takes its own copy."""
    return torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), rows)


def mkl_linear(x: torch.Tensor, packed: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
               rows: int) -> torch.Tensor:
    """x @ w.T (+ b) by MKL over `mkl_pack(w, rows)`, x holding `rows` rows: MKL's float32 product over weights laid
    out once instead of at every call (F.linear's numbers to float32's rounding; on an Intel Xeon with AMX, where
    SmolLM2-135M's float32 forward over 4 rows took 30.4 ms against 35.1 by F.linear and the draft's chain of 3 ran
    1.06-1.09x faster than over oneDNN's packed weights; docs/evaluate.md). Any leading shape."""
    return torch.ops.mkl._mkl_linear(x, packed, w, b, rows)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, the rotate-half convention of transformers' Llama."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def layer_forward(layer, weights: tuple, heads: tuple[int, int, int], x: torch.Tensor, cos, sin,
                  k: torch.Tensor, v: torch.Tensor, start: int | tuple[torch.Tensor, torch.Tensor],
                  attend, linear=F.linear) -> torch.Tensor:
    """One pre-norm Llama decoder layer over x [B,q,H]; its keys and values are written into k, v [R,nkv,cap,hd]
    in place. `start` is either the cache column of x's first position, the same for every row (an int: rows
    B = R, columns start..start+q are written and `attend(q, k, v)` [B,nh,q,hd] gets columns :start+q), or the
    cache (row, column) of each of x's B*q positions in order (two [B*q] tensors: `attend` gets the whole cache
    and picks and masks its columns itself).
    `weights` = (fused [q|k|v], its bias or None, fused [gate|up]) from fuse_projections; heads = (nh, nkv, hd);
    `linear(x, w, b)` computes every projection (F.linear, or the runner's Projections)."""
    wqkv, bqkv, wgu = weights
    nh, nkv, hd = heads
    B, q, _ = x.shape
    qs, ks, vs = linear(layer.input_layernorm(x), wqkv, bqkv).split((nh * hd, nkv * hd, nkv * hd), dim=-1)
    qs = rotate(qs.view(B, q, nh, hd).transpose(1, 2), cos, sin)  # [B,nh,q,hd]
    if isinstance(start, int):
        ks = rotate(ks.view(B, q, nkv, hd).transpose(1, 2), cos, sin)  # [B,nkv,q,hd]
        end = start + q
        k[:, :, start:end], v[:, :, start:end] = ks, vs.view(B, q, nkv, hd).transpose(1, 2)
        o = attend(qs, k[:, :, :end], v[:, :, :end])
    else:
        rows, cols = start
        ks = rotate(ks.view(B * q, nkv, hd), cos.reshape(B * q, 1, hd), sin.reshape(B * q, 1, hd))
        k[rows, :, cols], v[rows, :, cols] = ks, vs.view(B * q, nkv, hd)
        o = attend(qs, k, v)
    o_proj, down = layer.self_attn.o_proj, layer.mlp.down_proj
    x = x + linear(o.transpose(1, 2).reshape(B, q, nh * hd), o_proj.weight, o_proj.bias)
    g, u = linear(layer.post_attention_layernorm(x), wgu).chunk(2, dim=-1)
    return x + linear(F.silu(g) * u, down.weight, down.bias)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Attention of one new token per row: q [B,nh,1,hd] over k, v [B,nkv,W,hd]; bias [B,1,1,W] is added to the
    scores (0: attend, -inf: masked; one tensor for every layer of a step, from `mask_bias`).
    Two batched matmuls with the query heads of each kv head side by side, the mask added inside the first; the
    batched attention of many rows in one call (`bench/bench_regenerate.py --attention` times it on SmolLM2's
    shapes)."""
    B, nh, _, hd = q.shape
    nkv, W = k.shape[1], k.shape[2]
    g = nh // nkv
    # A column slice of the cache is copied whole first: bmm over the strided slice measured slower than the copy
    # plus a bmm over contiguous rows (6,380 against 5,233 us, docs/results/2026-12.md)
    k3, v3 = k.contiguous().view(B * nkv, W, hd), v.contiguous().view(B * nkv, W, hd)
    # the scale and the mask inside the matmul: one pass over the scores
    scores = torch.baddbmm(bias.expand(B, nkv, g, W).reshape(B * nkv, g, W), q.reshape(B * nkv, g, hd),
                           k3.transpose(1, 2), alpha=hd ** -0.5)
    o = torch.bmm(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v3)  # [B*nkv,g,hd]
    return o.view(B, nh, 1, hd)


def mask_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as the additive bias decode_attention takes: 0 or -inf."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def supports(target) -> bool:
    return getattr(target.text_config, "model_type", "") in LEAN_MODEL_TYPES
