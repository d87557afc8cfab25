"""The draft head's cross-entropy over every position of every TTT step: static shapes, for the GPU's training step.

eyas.draft.cross_entropy gathers the counted rows of all steps ([N,H], N known only on the host) and sorts them by
target row so each target row is computed once; both need the host to wait for the device. Here nothing is
gathered: the draft's hidden states of the k steps stay [k,B,T,H], a row's weight is 0 where its step does not
count it, and the shapes depend on k, B and T alone, so a compiled training step runs without one host
synchronisation. The target's distribution is still formed once per position: for the positions a..b-1 of a row,
step i reads the target rows a+1+i..b+i, so one block computes the rows a+1..b+k-1 and every step slices it.

The same algebra as eyas.draft.cross_entropy (loss = lse(z) - p.z, dz = softmax(z) - p, dh = dz W): dh and the
output head's weight gradient dW = sum_n w_n dz_n^T h_n are made in the forward a block at a time, nothing [.., Vd]
is kept, and the backward scales: grad_h = g dh, grad_W = c dW with c = (g.w) / (w.w), which is exact when the
upstream gradient g is proportional to the announced weights w (the trainer's case: w = the step's scale where the
step counts the position, g = the same times 1 / its global count). An asynchronous device assert checks that
proportionality without waiting for it. Without weights, dW is computed in backward with g (one more pass).
"""

from __future__ import annotations

import torch

from eyas.draft.cross_entropy import TargetRows, _autocast_dtype
from eyas.draft.losses import row_losses

BLOCK = {"cpu": 256, "cuda": 2048}  # positions of one row per block


class StaticCrossEntropy(torch.autograd.Function):
    """forward(h [k,B,T,H] after the final norm, W [Vd,H], weight [k,B,T] float32 or None, block, *target) ->
    (loss [k,B,T] float32, hit [k,B,T] bool: draft top-1 == target top-1). target: (log-probs [B,T,Vd],) or
    (final [B,T,H], head_rows [Vd,H]); step i at position t is scored against the target's row t+1+i (rows past
    the end are zeros, and must have weight 0). Under autocast the matmuls run in its dtype."""

    @staticmethod
    def forward(ctx, h, W, weight, block, kind, *target):
        dt = _autocast_dtype(h.device.type)
        want_dW = ctx.needs_input_grad[1] and weight is not None
        with torch.autocast(h.device.type, enabled=False):
            loss, hit, dh, dW = _blocks(h, W, weight, target, dt, block, ctx.needs_input_grad[0], want_dW, kind)
        ctx.mark_non_differentiable(hit)
        ctx.save_for_backward(h, W, weight, dh, dW, *target)
        ctx.dt, ctx.block, ctx.kind = dt, block, kind
        return loss, hit

    @staticmethod
    def backward(ctx, grad_loss, _grad_hit):
        h, W, weight, dh, dW, *target = ctx.saved_tensors
        g = grad_loss.float()
        grad_h = (dh * g[..., None]).to(h.dtype) if dh is not None else None
        grad_W = None
        if ctx.needs_input_grad[1]:
            if dW is not None:
                c = (g * weight).sum() / (weight * weight).sum().clamp_min(1e-30)
                torch._assert_async(((g - c * weight).abs() <= 1e-5 * g.abs().amax() + 1e-30).all(),
                                    "the loss's gradient is not proportional to the weights announced")
                grad_W = (dW * c).to(W.dtype)
            else:
                with torch.autocast(h.device.type, enabled=False):
                    grad_W = _blocks(h, W, g, target, ctx.dt, ctx.block, False, True, ctx.kind)[3].to(W.dtype)
        return grad_h, grad_W, None, None, None, *(None for _ in target)


def static_cross_entropy(h: torch.Tensor, W: torch.Tensor, target, weight: torch.Tensor | None = None,
                         kind: str = "ce"):
    """See StaticCrossEntropy. target: log-probs [B,T,Vd] or TargetRows(final [B,T,H], head_rows); `kind`: the loss
    (eyas.draft.losses)."""
    weight = None if weight is None else weight.float()
    block = BLOCK.get(h.device.type, BLOCK["cuda"])
    target = tuple(target) if isinstance(target, TargetRows) else (target,)
    if not (torch.is_grad_enabled() and (h.requires_grad or W.requires_grad)):
        dt = _autocast_dtype(h.device.type)
        with torch.autocast(h.device.type, enabled=False):
            return _blocks(h, W, weight, target, dt, block, False, False, kind)[:2]
    return StaticCrossEntropy.apply(h, W, weight, block, kind, *target)


def _blocks(h, W, weight, target, dt, block: int, want_dh: bool, want_dW: bool, kind: str = "ce"):
    """-> loss [k,B,T] float32, hit [k,B,T] bool, dh [k,B,T,H] or None, dW [Vd,H] float32 or None (with `weight`)."""
    k, B, T, _ = h.shape
    hc, Wc = h.to(dt or h.dtype), W.to(dt or h.dtype)
    table = target[0] if len(target) == 1 else target[0].to(dt or target[0].dtype)
    head = None if len(target) == 1 else target[1].to(dt or target[1].dtype)
    table = torch.nn.functional.pad(table, (0, 0, 0, k))  # [B,T+k,.]: the rows past the end, never counted
    loss = torch.empty(k, B, T, dtype=torch.float32, device=h.device)
    hit = torch.empty(k, B, T, dtype=torch.bool, device=h.device)
    dh = torch.empty_like(h) if want_dh else None
    dW = torch.zeros(W.shape, dtype=torch.float32, device=W.device) if want_dW else None
    for r in range(B):
        for a in range(0, T, block):
            b = min(a + block, T)
            n = b - a
            t = table[r, a + 1:b + k]  # [n+k-1, .] the target rows steps 0..k-1 read here
            t = (t @ head.T).float() if head is not None else t.float()
            top = t.argmax(-1)
            p = (t - t.logsumexp(-1, keepdim=True)).exp_()  # [n+k-1, Vd] float32 (t may be the table itself)
            for i in range(k):
                z = (hc[i, r, a:b] @ Wc.T).float()  # [n, Vd]
                loss[i, r, a:b], dz, draft_top = row_losses(kind, z, p[i:i + n])  # ce: lse(z) - p.z, q - p
                hit[i, r, a:b] = draft_top == top[i:i + n]
                dz = dz.to(Wc.dtype)
                if want_dh:
                    dh[i, r, a:b] = (dz @ Wc).to(h.dtype)
                if want_dW:
                    hw = (h[i, r, a:b].float() * weight[i, r, a:b, None]).to(dz.dtype)
                    dW += (dz.T @ hw).float()
    return loss, hit, dh, dW
