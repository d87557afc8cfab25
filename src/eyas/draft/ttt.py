"""Training-time test (TTT): the draft unrolled for k steps on its own hidden states, as in EAGLE-3.

Alignment (x = tokens, f = target features, h = target final hidden states, m = loss mask):
    p_u = softmax(target_lm_head(h_u)) restricted to the draft vocabulary: the target's distribution of x[u+1].
    Step 0 at position t reads (fc(f_t), embed(x[t+1])) and predicts x[t+2]: its target is p_{t+1}.
    Step i at position t reads (its own step i-1 output at t, embed(x[t+1+i])) and predicts x[t+2+i]
    against p_{t+1+i}; it counts where m[t+2+i] = 1, x[t+2+i] is in the draft vocabulary and t+2+i is
    still in the same document.

Attention at step i (what inference sees when drafting the i-th token after position t): the query at t
attends to the step-0 keys at positions s <= t of its document (those came from real target features), and
to its own chain, the step-j keys at position t for j = 1..i. Its rotary position is pos(t) + i.

Loss at step i: cross-entropy of the draft distribution against p (forward KL up to a constant), summed
over counted positions; the trainer divides by the global count and weights step i by decay**i.
acc_i: share of counted positions where the draft's top-1 equals the target's top-1 (both in the draft
vocabulary), the estimate of acceptance at depth i.
"""

from __future__ import annotations

import dataclasses

import torch

from eyas.draft.model import Eagle3Draft, attend


@dataclasses.dataclass
class TTTResult:
    loss_sum: torch.Tensor  # [k] summed cross-entropy per step (differentiable)
    correct: torch.Tensor  # [k] positions where draft top-1 == target top-1
    count: torch.Tensor  # [k] positions counted per step


def target_log_probs(final: torch.Tensor, head_rows: torch.Tensor) -> torch.Tensor:
    """final [B,T,H] target hidden states after the last norm, head_rows [Vd,H] the target's output-head rows
    of the draft vocabulary -> log p restricted to the draft vocabulary [B,T,Vd] (float32)."""
    return torch.log_softmax((final.to(head_rows.dtype) @ head_rows.T).float(), dim=-1)


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t] <- x[:, t+n], padded with `fill` at the end. Works for [B,T] and [B,T,...]."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat((x[:, n:], pad), dim=1)


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


def ttt_forward(model: Eagle3Draft, input_ids: torch.Tensor, aux: torch.Tensor, target_logp: torch.Tensor,
                loss_mask: torch.Tensor, steps: int, position_ids: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, target_index: torch.Tensor | None = None) -> TTTResult:
    """Unroll the draft for `steps` steps. input_ids/loss_mask [B,T], aux [B,T,3Ht], target_logp [B,T,Vd];
    position_ids and doc_ids [B,T] for packed sequences (default: one document per row, positions 0..T-1).
    Compact targets: target_logp [M,Vd] holds only the positions some step reads and target_index [B,T] gives
    each position's row there (-1 elsewhere), so the trainer never materialises [B,T,Vd]."""
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
    # One output-head pass over every step's counted positions: one weight cast and one weight gradient instead
    # of one per step, and the [N,Vd] work fused (see SoftCrossEntropy).
    count = torch.stack(count)
    if target_index is None:
        table, where = target_logp.reshape(B * T, -1), torch.cat(target_rows)  # [B*T,Vd], [N]
    else:
        table, where = target_logp, target_index.reshape(-1)[torch.cat(target_rows)]  # [M,Vd], [N]
    loss_row, hit = soft_cross_entropy(model.norm(torch.cat(rows)), model.lm_head.weight, table, where)
    step = torch.repeat_interleave(torch.arange(steps, device=dev), count)  # [N] the TTT step of each row
    loss_sum = torch.zeros(steps, dtype=loss_row.dtype, device=dev).index_add(0, step, loss_row)
    correct = torch.zeros(steps, dtype=torch.long, device=dev).index_add(0, step, hit.long())
    return TTTResult(loss_sum, correct, count)


class SoftCrossEntropy(torch.autograd.Function):
    """Cross-entropy of the draft against a soft target, fused: rows h [N,H] (after the final norm), head
    W [Vd,H], target log-probs table[where] ([M,Vd] indexed by [N]) -> (loss per row [N] float32, draft top-1 ==
    target top-1 [N] bool). The target rows are gathered a chunk at a time, never as a whole [N,Vd] copy.

        loss = -sum_v p_v log q_v = lse(z) - p.z     (z = h W^T, sum_v p_v = 1)
        dloss/dz = softmax(z) - p

    The logits come from one matmul (bf16 under autocast); the rest runs over row chunks small enough to stay in
    cache, and the gradient dz overwrites the logits, so the backward pass is just the two matmuls. Same values
    as log_softmax + multiply + sum, with a few passes over [N,Vd] instead of about fifteen.
    """

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


def soft_cross_entropy(h: torch.Tensor, W: torch.Tensor, table: torch.Tensor, where: torch.Tensor | None = None):
    """See SoftCrossEntropy; `where` defaults to every row of `table` in order. Row chunks of 16 on CPU (the
    [16,Vd] float32 work stays in L2), larger on GPUs."""
    if where is None:
        where = torch.arange(table.shape[0], device=table.device)
    return SoftCrossEntropy.apply(h, W, table, where, 16 if h.device.type == "cpu" else 4096)


def step_weights(steps: int, decay: float, device=None) -> torch.Tensor:
    """[k] weights decay**i of the steps' losses (EAGLE-3 uses 0.8)."""
    return decay ** torch.arange(steps, dtype=torch.float32, device=device)
