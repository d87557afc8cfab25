"""The training-time test as it was before eyas.draft.attention and eyas.draft.cross_entropy (commit 2ae6a09): the
[B,1,T,T] mask, the [B,nh,T,T] attention scores and the [N,Vd] fused cross-entropy, copied unchanged. The tests
check the new code against it, and bench/bench_ttt_memory.py measures it beside the new."""

from __future__ import annotations

import torch

from eyas.draft.model import Eagle3Draft, attend
from eyas.draft.ttt import TTTResult, shift_left


def base_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Causal, document-aware mask [B,1,T,T] (True = may attend)."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (causal[None] & same)[:, None]


def chain_attention(q, keys, values, mask0) -> torch.Tensor:
    """Attention of step i: q [B,nh,T,d] over step-0 keys (masked by mask0 [B,1,T,T]) and the diagonal of
    steps 1..i (`keys[j]`, `values[j]` [B,nkv,T,d]). Returns [B,nh,T,d]."""
    if len(keys) == 1:
        return attend(q, keys[0], values[0], mask0)
    rep = q.shape[1] // keys[0].shape[1]
    scale = q.shape[-1] ** -0.5
    k0, v0 = keys[0].repeat_interleave(rep, 1), values[0].repeat_interleave(rep, 1)
    scores0 = (q @ k0.transpose(-1, -2) * scale).masked_fill(~mask0, float("-inf"))  # [B,nh,T,T]
    diag = torch.stack([(q * k.repeat_interleave(rep, 1)).sum(-1) * scale for k in keys[1:]], dim=-1)  # [B,nh,T,i]
    probs = torch.cat((scores0, diag), dim=-1).float().softmax(-1).to(q.dtype)
    T = q.shape[2]
    out = probs[..., :T] @ v0
    for j, v in enumerate(values[1:]):
        out = out + probs[..., T + j, None] * v.repeat_interleave(rep, 1)
    return out


def sparse_target_logp(final: torch.Tensor, head_rows: torch.Tensor, need: torch.Tensor):
    """final [B,T,H], head_rows [Vd,H], need [B,T] -> (log p [M,Vd] float32 of the M needed positions, index [B,T])."""
    index = torch.cumsum(need.reshape(-1), 0).reshape(need.shape) - 1
    index = index.masked_fill(~need, -1)
    rows = final[need].to(head_rows.dtype)  # [M,H]
    return torch.log_softmax((rows @ head_rows.T).float(), dim=-1), index


def ttt_forward(model: Eagle3Draft, input_ids: torch.Tensor, aux: torch.Tensor, target_logp: torch.Tensor,
                loss_mask: torch.Tensor, steps: int, position_ids: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, target_index: torch.Tensor | None = None) -> TTTResult:
    """The old eyas.draft.ttt.ttt_forward: target_logp [B,T,Vd], or [M,Vd] with target_index [B,T]."""
    B, T = input_ids.shape
    dev = input_ids.device
    if position_ids is None:
        position_ids = torch.arange(T, device=dev).expand(B, T)
    if doc_ids is None:
        doc_ids = torch.zeros(B, T, dtype=torch.long, device=dev)
    mask0 = base_mask(doc_ids)
    hidden = model.fuse(aux)  # [B,T,H]
    layers = model.all_layers()
    keys = [[] for _ in layers]
    values = [[] for _ in layers]
    rows, target_rows, count = [], [], []
    for i in range(steps):
        tokens = shift_left(input_ids, 1 + i)  # x[t+1+i]
        embeds = model.embed_tokens(tokens).to(hidden.dtype)
        cos, sin = model.rope(position_ids + i, hidden.dtype)
        for li, layer in enumerate(layers):
            q, k, v, residual = layer.qkv(hidden, embeds, cos, sin)
            keys[li].append(k)
            values[li].append(v)
            hidden = layer.finish(chain_attention(q, keys[li], values[li], mask0), residual)
        predicted = shift_left(input_ids, 2 + i)  # x[t+2+i]
        valid = (shift_left(loss_mask, 2 + i) > 0) & model.t2d[predicted] & (shift_left(doc_ids, 2 + i, -1) == doc_ids)
        rows.append(hidden[valid])  # [N_i,H], only counted positions
        b, t = valid.nonzero(as_tuple=True)
        target_rows.append(b * T + t + 1 + i)  # rows of target_logp viewed [B*T,Vd]: p_{t+1+i}
        count.append(valid.sum())
    count = torch.stack(count)
    if target_index is None:
        table, where = target_logp.reshape(B * T, -1), torch.cat(target_rows)  # [B*T,Vd], [N]
    else:
        table, where = target_logp, target_index.reshape(-1)[torch.cat(target_rows)]  # [M,Vd], [N]
    loss_row, hit = SoftCrossEntropy.apply(model.norm(torch.cat(rows)), model.lm_head.weight, table, where,
                                           16 if input_ids.device.type == "cpu" else 4096)
    step = torch.repeat_interleave(torch.arange(steps, device=dev), count)  # [N] the TTT step of each row
    loss_sum = torch.zeros(steps, dtype=loss_row.dtype, device=dev).index_add(0, step, loss_row)
    correct = torch.zeros(steps, dtype=torch.long, device=dev).index_add(0, step, hit.long())
    return TTTResult(loss_sum, correct, count)


class SoftCrossEntropy(torch.autograd.Function):
    """The old fused cross-entropy: the [N,Vd] logits from one matmul, kept (as dz) for backward."""

    @staticmethod
    def forward(ctx, h, W, table, where, chunk: int):
        kind = h.device.type
        dt = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else h.dtype
        hc, Wc = h.to(dt), W.to(dt)
        z = hc @ Wc.T  # [N,Vd] logits, then dz in place
        N = z.shape[0]
        loss = torch.empty(N, dtype=torch.float32, device=h.device)
        hit = torch.empty(N, dtype=torch.bool, device=h.device)
        for s in range(0, N, chunk):
            zf = z[s:s + chunk].float()  # [c,Vd]
            m, top = zf.max(-1)
            e = zf.sub_(m[:, None]).exp()  # exp(z - m)
            total = e.sum(-1)
            tl = table[where[s:s + chunk]].float()
            p = tl.exp()
            loss[s:s + chunk] = total.log() - (p * zf).sum(-1)  # lse(z) - p.z; shift-invariant as sum p = 1
            hit[s:s + chunk] = top == tl.max(-1).indices
            z[s:s + chunk] = e.mul_(total.reciprocal()[:, None]).sub_(p)  # softmax(z) - p
        ctx.save_for_backward(hc, Wc, z)
        ctx.dtypes = (h.dtype, W.dtype)
        return loss, hit

    @staticmethod
    def backward(ctx, grad_loss, _grad_hit):
        hc, Wc, dz = ctx.saved_tensors
        dz = dz.mul_(grad_loss.to(dz.dtype)[:, None])  # [N,Vd], in place: the graph is not run twice
        grad_h = (dz @ Wc).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        grad_W = (dz.T @ hc).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return grad_h, grad_W, None, None, None
