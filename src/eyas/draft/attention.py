"""The attention of training-time test (eyas.draft.ttt), in memory linear in the sequence length.

At TTT step i the query at position t attends to
    - the step-0 keys k_0[s] at s <= t of its document (doc_ids[s] == doc_ids[t], in index order), and
    - its own chain: the step-j keys k_j[t] at the same position, j = 1..i (one score each, the "diagonal").

Flash-style, in plain PyTorch (CPU and CUDA alike): the queries go in chunks of C rows; chunk [a, b) scores only
the step-0 keys lo..b-1 (causal; lo = the first position of any document in the chunk, found once per call), its
mask is built from doc_ids on the fly, and the softmax runs in float32 over [step-0 scores | diagonal scores].
The forward keeps the output and the log-sum-exp of each row; the backward recomputes each chunk's probabilities
from q, k, v and lse:

    P = exp(S - lse)        dP = dO V^T        dS = P * (dP - rowsum(dO * O))
    dQ = scale dS K         dK = scale dS^T Q  dV = P^T dO        (summed over the query heads of a kv head)

On a GPU the same attention runs through `flex_attention` (`flex_chain_attention`): step i's keys are laid end to
end, [k_0 | k_1 | ... | k_i] (length (i + 1) T), and a block mask keeps causal same-document keys in the first T and
the diagonal in the others, so the fused kernel skips every empty block, runs in the compute dtype on tensor cores
and needs no host synchronisation. PyTorch has no flex backward on the CPU, where the chunked kernel below trains.

Memory: one chunk's scores [B, nh, C, T] float32 (a few such temporaries) instead of [B, nh, T, T] and a
[B, 1, T, T] mask; saved for backward: out, lse [B, nh, T], nothing quadratic. Grouped-query attention views q
as [B, nkv, rep, T, d], so K and V are never repeated.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

# Query rows per chunk. CPU: 32-64 rows were fastest at T = 1024 and 4096 (the chunk's scores stay in cache and the
# causal skip saves more; 1024 rows took twice as long); GPUs want larger blocks to fill the device (not measured
# here: 512 rows keep one chunk's float32 scores at 512 MiB for 32 heads at T = 8192).
CHUNK = {"cpu": 64, "cuda": 512}


def static_chunks(T: int, size: int) -> list[tuple[int, int, int]]:
    """query_chunks without reading doc_ids: every chunk scores the keys 0..b-1 (causal only), so the chunks depend
    on T alone and nothing waits for the device (the documents are still masked, at the cost of scoring keys that an
    earlier document holds)."""
    return [(a, min(a + size, T), 0) for a in range(0, T, size)]


def query_chunks(doc_ids: torch.Tensor, size: int) -> list[tuple[int, int, int]]:
    """doc_ids [B,T] -> (a, b, lo) for the query rows a..b-1 of each chunk of `size` rows: lo is the first
    position any of their documents starts at in any row, so keys before lo are masked for the whole chunk."""
    B, T = doc_ids.shape
    docs, inverse = torch.unique(doc_ids, return_inverse=True)  # inverse [B,T] in 0..U-1
    where = torch.arange(T, device=doc_ids.device).expand(B, T)
    first = torch.full((B, len(docs)), T, device=doc_ids.device).scatter_reduce(1, inverse, where, "amin")
    start = first.gather(1, inverse)  # [B,T] first position of t's document
    n = -(-T // size)
    start = torch.nn.functional.pad(start, (0, n * size - T), value=T).view(B, n, size)
    lows = start.amin((0, 2)).tolist()  # one host sync per call
    return [(a, min(a + size, T), lo) for a, lo in zip(range(0, T, size), lows)]


class ChainAttention(torch.autograd.Function):
    """See the module docstring. forward(q [B,nh,T,d], doc_ids [B,T], chunks from query_chunks, n = i + 1,
    k_0..k_i, v_0..v_i [B,nkv,T,d]) -> [B,nh,T,d] in q's dtype; every product in float32."""

    @staticmethod
    def forward(ctx, q, doc_ids, chunks, n, *kv):
        out, lse = _chain_forward(q, doc_ids, chunks, n, kv)
        ctx.save_for_backward(q, doc_ids, out, lse, *kv)
        ctx.chunks, ctx.n = chunks, n
        return out.view(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, doc_ids, out, lse, *kv = ctx.saved_tensors
        n, (B, nh, T, d) = ctx.n, q.shape
        with torch.autocast(q.device.type, enabled=False):
            q5, keys, values = _float(q, kv, n)
            do = grad_out.float().reshape(out.shape)  # [B,nkv,rep,T,d]
            delta = (do * out).sum(-1, keepdim=True)  # [B,nkv,rep,T,1] rowsum(dO * O)
            dq = torch.empty_like(q5)
            dk, dv = [torch.zeros_like(k) for k in keys], [torch.zeros_like(v) for v in values]  # [B,nkv,T,d]
            for a, b, lo in ctx.chunks:
                s0, sd = _scores(q5, keys, doc_ids, a, b, lo)
                p0 = s0.sub_(lse[:, :, :, a:b, None]).exp_()  # [B,nkv,rep,c,L]
                pd = sd.sub_(lse[:, :, :, a:b, None]).exp_()  # [B,nkv,rep,c,i]
                qc, dob, dl = q5[:, :, :, a:b], do[:, :, :, a:b], delta[:, :, :, a:b]  # [B,nkv,rep,c,d|1]
                dv[0][:, :, lo:b] += _fold(p0).transpose(-1, -2) @ _fold(dob)
                ds0 = p0.mul_(_fold(dob).matmul(values[0][:, :, lo:b].transpose(-1, -2)).view_as(p0).sub_(dl))
                dq[:, :, :, a:b] = (_fold(ds0) @ keys[0][:, :, lo:b]).view_as(qc)
                dk[0][:, :, lo:b] += _fold(ds0).transpose(-1, -2) @ _fold(qc)
                for j in range(1, n):
                    pj = pd[..., j - 1, None]  # [B,nkv,rep,c,1]
                    dsj = pj * ((dob * values[j][:, :, None, a:b]).sum(-1, keepdim=True) - dl)
                    dq[:, :, :, a:b] += dsj * keys[j][:, :, None, a:b]
                    dk[j][:, :, a:b] = (dsj * qc).sum(2)
                    dv[j][:, :, a:b] = (pj * dob).sum(2)
        scale = d ** -0.5
        grads = [g.mul_(scale).to(k.dtype) for g, k in zip(dk, kv[:n])] + [g.to(v.dtype) for g, v in zip(dv, kv[n:])]
        return dq.mul_(scale).view(B, nh, T, d).to(q.dtype), None, None, None, *grads


def chain_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], doc_ids: torch.Tensor,
                    chunks: list[tuple[int, int, int]] | None = None) -> torch.Tensor:
    """Attention of TTT step i = len(keys) - 1: q [B,nh,T,d] over the step-0 keys (causal within the documents of
    doc_ids [B,T]) and the diagonal of steps 1..i; keys[j], values[j] [B,nkv,T,d]. Returns [B,nh,T,d].
    `chunks`: query_chunks(doc_ids, ...), computed once by a caller that attends many times."""
    if chunks is None:
        chunks = query_chunks(doc_ids, CHUNK.get(q.device.type, CHUNK["cuda"]))
    if not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, *keys, *values))):  # validation
        return _chain_forward(q, doc_ids, chunks, len(keys), (*keys, *values))[0].view(q.shape).to(q.dtype)
    return ChainAttention.apply(q, doc_ids, chunks, len(keys), *keys, *values)


def _chain_forward(q, doc_ids, chunks, n: int, kv):
    """ChainAttention's forward -> (out [B,nkv,rep,T,d] float32, lse [B,nkv,rep,T] float32)."""
    with torch.autocast(q.device.type, enabled=False):
        q5, keys, values = _float(q, kv, n)
        out = torch.empty_like(q5)  # [B,nkv,rep,T,d]
        lse = q5.new_empty(q5.shape[:-1])  # [B,nkv,rep,T]
        for a, b, lo in chunks:
            s0, sd = _scores(q5, keys, doc_ids, a, b, lo)
            m = s0.amax(-1) if n == 1 else torch.maximum(s0.amax(-1), sd.amax(-1))  # [B,nkv,rep,c]
            p0, pd = s0.sub_(m[..., None]).exp_(), sd.sub_(m[..., None]).exp_()
            total = p0.sum(-1) + pd.sum(-1)
            out[:, :, :, a:b] = _weighted(p0, pd, values, a, b, lo).div_(total[..., None])
            lse[:, :, :, a:b] = m + total.log()
    return out, lse


def _float(q, kv, n):
    """q as float32 [B,nkv,rep,T,d]; the keys and values as float32 lists, all contiguous (one copy each at most)."""
    B, nh, T, d = q.shape
    f = [x.float().contiguous() for x in (q, *kv)]
    return f[0].view(B, kv[0].shape[1], -1, T, d), f[1:n + 1], f[n + 1:]


def _fold(x: torch.Tensor) -> torch.Tensor:
    """[B,nkv,rep,c,X] -> [B,nkv,rep*c,X]: the query heads of a kv head as more rows of one matmul."""
    B, nkv, rep, c, X = x.shape
    return x.reshape(B, nkv, rep * c, X)


def _scores(q5, keys, doc_ids, a, b, lo):
    """Float32 scaled scores of the query rows a..b-1 (q5 [B,nkv,rep,T,d], keys [B,nkv,T,d]): step-0 scores
    [B,nkv,rep,c,L] over the keys lo..b-1 (L = b - lo), -inf where masked, and diagonal scores [B,nkv,rep,c,i]."""
    qc = q5[:, :, :, a:b]  # [B,nkv,rep,c,d]
    scale = q5.shape[-1] ** -0.5
    s0 = (_fold(qc) @ keys[0][:, :, lo:b].transpose(-1, -2)).view(*qc.shape[:-1], b - lo)
    t = torch.arange(a, b, device=q5.device)[:, None]
    s = torch.arange(lo, b, device=q5.device)
    mask = (s <= t) & (doc_ids[:, a:b, None] == doc_ids[:, None, lo:b])  # [B,c,L]
    s0 = s0.mul_(scale).masked_fill_(~mask[:, None, None], float("-inf"))
    sd = torch.stack([(qc * k[:, :, None, a:b]).sum(-1) for k in keys[1:]], -1) if len(keys) > 1 else qc[..., :0]
    return s0, sd.mul(scale)


def _weighted(p0, pd, values, a, b, lo):
    """Unnormalised output of the query rows a..b-1: p0 [B,nkv,rep,c,L] over v_0[lo:b] plus pd[..., j-1] v_j[a:b]."""
    o = (_fold(p0) @ values[0][:, :, lo:b]).view(*p0.shape[:-1], -1)  # [B,nkv,rep,c,d]
    for j, v in enumerate(values[1:]):
        o += pd[..., j, None] * v[:, :, None, a:b]
    return o


# -- the flex_attention path (GPUs) ---------------------------------------------------------------------------------
FLEX_BLOCK = 128  # flex_attention's block size on a GPU (its default)


def chain_block_masks(doc_ids: torch.Tensor, steps: int, block: int = FLEX_BLOCK) -> list:
    """The block masks of TTT steps 0..steps-1 for flex_chain_attention: step i's queries [T] over the keys
    [k_0 | ... | k_i] ((i + 1) T), the step-0 keys causal within the document of doc_ids [B,T], then the diagonal.
    Built on doc_ids' device once per micro-batch and shared by every layer."""
    B, T = doc_ids.shape

    def mask_mod(b, h, q, kv):
        s = kv % T
        return torch.where(kv < T, (s <= q) & (doc_ids[b, q] == doc_ids[b, s]), s == q)

    fused = doc_ids.is_cuda and not torch.compiler.is_compiling()  # else the dense [B,T,(i+1)T] mask is built
    return [create_block_mask(mask_mod, B, None, T, (i + 1) * T, device=doc_ids.device, BLOCK_SIZE=block,
                              _compile=fused) for i in range(steps)]


def flex_chain_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], block_mask,
                         kernel=None) -> torch.Tensor:
    """chain_attention through flex_attention: q [B,nh,T,d], keys[j], values[j] [B,nkv,T,d] for j = 0..i, and
    block_mask = chain_block_masks(...)[i]. In q's dtype (bf16 under autocast: tensor cores); the softmax is the
    kernel's own (float32 accumulation). `kernel`: flex_attention compiled (flex_kernel), or the eager one."""
    k = torch.cat(keys, 2).to(q.dtype) if len(keys) > 1 else keys[0].to(q.dtype)
    v = torch.cat(values, 2).to(q.dtype) if len(values) > 1 else values[0].to(q.dtype)
    return (kernel or flex_attention)(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


_COMPILED = {}


def flex_kernel():
    """flex_attention compiled once per process (flex is fused only when compiled; inside a compiled training
    step the eager function is traced into the step's graph instead)."""
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)  # one entry per (T, step): see below
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # else unfused [T,kT]
    return _COMPILED["flex"]
