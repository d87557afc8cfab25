"""The draft head's cross-entropy against the target's distribution, in memory flat in vocabulary x length.

For a row n (a counted position of some TTT step) with draft hidden h_n [H] and target row u = where[n]:

    z = h_n W^T                          the draft's logits over the draft vocabulary [Vd]
    p = softmax(f_u Wt^T)                the target's distribution there (f_u its final hidden row, Wt its head rows)
    loss_n = -sum_v p_v log q_v = lse(z) - p.z        (sum_v p_v = 1)
    dloss_n/dz = softmax(z) - p = dz_n,  dh_n = dz_n W,  dW = sum_n g_n dz_n^T h_n   (g_n: upstream gradient)

Liger-style: the forward goes over blocks of rows sorted by their target row, so a block computes each of its
target rows once (the target work is about M rows, not N); in a block it forms the draft logits, the loss, the
top-1 hit and dz (over small row chunks, in float32), then dh for the block's rows and its share of dW. Nothing
[N, Vd] is kept: the backward only scales. dh_n is exact for any g (grad_h = g dh); dW is accumulated with the row
weights w the caller announces, and grad_W = c dW when g = c w, the trainer's case (g_n is the weight of row n's
TTT step). Without weights, or for any other g, dW is computed in backward, block by block with g: one more pass
over the output head.

Memory: one block's logits [R, Vd] (compute dtype) and target probabilities [<= R, Vd] float32, plus dh [N, H]
and dW [Vd, H] float32; the old path kept [N, Vd] logits and an [M, Vd] float32 table.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from eyas.draft.losses import row_losses

# (rows per block, rows per float32 chunk inside a block). CPU: the [16, Vd] float32 work stays in L2, and a block
# of 1024 rows amortises the [Vd, H] update of dW (bench/bench_ttt_memory.py); GPUs take a block at once.
SIZES = {"cpu": (1024, 16), "cuda": (2048, 2048)}


class TargetRows(NamedTuple):
    """The target's distribution at M positions, not yet computed: final [M,H] its hidden rows after the last norm,
    head_rows [Vd,H] its output-head rows of the draft vocabulary. p = softmax(final @ head_rows^T) is formed a
    block of rows at a time by SoftCrossEntropy."""

    final: torch.Tensor
    head_rows: torch.Tensor


class SoftCrossEntropy(torch.autograd.Function):
    """forward(h [N,H] (after the final norm), W [Vd,H], where [N] (each row's target row), weight [N] float32 or
    None (see the module docstring), sizes, *target: (log-prob table [M,Vd],) or (final [M,H], head_rows [Vd,H])) ->
    (loss per row [N] float32, draft top-1 == target top-1 [N] bool). Under autocast the matmuls run in its dtype."""

    @staticmethod
    def forward(ctx, h, W, where, weight, sizes, kind, *target):
        dt = _autocast_dtype(h.device.type)
        want_dW = ctx.needs_input_grad[1] and weight is not None  # no weights announced: dW in backward, with g
        with torch.autocast(h.device.type, enabled=False):
            loss, hit, dh, dW = _blocks(h, W, where, weight, target, dt, sizes, ctx.needs_input_grad[0], want_dW,
                                        kind)
        ctx.mark_non_differentiable(hit)
        ctx.save_for_backward(h, W, where, weight, dh, dW, *target)
        ctx.dt, ctx.sizes, ctx.kind = dt, sizes, kind
        return loss, hit

    @staticmethod
    def backward(ctx, grad_loss, _grad_hit):
        h, W, where, weight, dh, dW, *target = ctx.saved_tensors
        g = grad_loss.float()  # [N]
        grad_h = (dh * g[:, None]).to(h.dtype) if dh is not None else None
        grad_W = None
        if ctx.needs_input_grad[1]:
            c = _ratio(g, weight) if dW is not None else None
            if c is not None:
                grad_W = (dW * c).to(W.dtype)
            else:  # no weights announced, or an upstream gradient not proportional to them: dW now, with g
                with torch.autocast(h.device.type, enabled=False):
                    grad_W = _blocks(h, W, where, g, target, ctx.dt, ctx.sizes, False, True, ctx.kind)[3].to(W.dtype)
        return grad_h, grad_W, None, None, None, None, *(None for _ in target)


def _autocast_dtype(kind: str) -> torch.dtype | None:
    """The matmuls' dtype under autocast, None outside (the inputs' own)."""
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _ratio(g: torch.Tensor, w: torch.Tensor) -> float | None:
    """c with g = c w to float rounding (relative 1e-6), else None."""
    g64, w64 = g.double(), w.double()
    c = float((g64 @ w64) / (w64 @ w64).clamp_min(1e-300))
    return c if torch.allclose(g64, c * w64, rtol=1e-6, atol=0) else None


def soft_cross_entropy(h: torch.Tensor, W: torch.Tensor, target, where: torch.Tensor | None = None,
                       weight: torch.Tensor | None = None, kind: str = "ce"):
    """See SoftCrossEntropy. target: log-probs [M,Vd] or TargetRows; `where` [N] defaults to every target row in
    order; `weight` [N]: the gradient each row's loss will get, up to a common factor (None: unknown, so the head's
    weight gradient waits for backward, one more pass over the output head); `kind`: the loss (eyas.draft.losses,
    the soft cross-entropy by default)."""
    if where is None:
        where = torch.arange(h.shape[0], device=h.device)
    weight = None if weight is None else weight.float()
    sizes = SIZES.get(h.device.type, SIZES["cuda"])
    target = target if isinstance(target, tuple) else (target,)
    if not (torch.is_grad_enabled() and (h.requires_grad or W.requires_grad)):  # validation: no gradients made
        dt = _autocast_dtype(h.device.type)
        with torch.autocast(h.device.type, enabled=False):
            return _blocks(h, W, where, weight, target, dt, sizes, False, False, kind)[:2]
    return SoftCrossEntropy.apply(h, W, where, weight, sizes, kind, *target)


def _blocks(h, W, where, weight, target, dt, sizes, want_dh: bool, want_dW: bool, kind: str = "ce"):
    """The block loop of SoftCrossEntropy -> (loss [N] float32, hit [N] bool, dh [N,H] or None, dW [Vd,H] float32
    or None, accumulated with `weight`). dt: the matmuls' dtype (None: the inputs' own)."""
    block, chunk = sizes
    N = h.shape[0]
    hc, Wc = h.to(dt or h.dtype), W.to(dt or h.dtype)
    if len(target) == 2:
        target = (target[0], target[1].to(dt or target[1].dtype))
    order = torch.argsort(where, stable=True)
    ranked = where[order]  # [N] target rows, ascending
    loss = torch.empty(N, dtype=torch.float32, device=h.device)
    hit = torch.empty(N, dtype=torch.bool, device=h.device)
    dh = torch.empty_like(h) if want_dh else None
    dW = torch.zeros(W.shape, dtype=torch.float32, device=W.device) if want_dW else None
    for s in range(0, N, block):
        rows = order[s:s + block]  # [R]
        u, local = torch.unique_consecutive(ranked[s:s + block], return_inverse=True)
        p, top = _target(target, u)  # [U,Vd] float32, [U]
        z = hc[rows] @ Wc.T  # [R,Vd] logits, then dz in place
        loss[rows], hit[rows] = _soft_rows(z, p, top, local, chunk, kind)
        if want_dh:
            dh[rows] = (z @ Wc).to(h.dtype)
        if want_dW:
            hw = (h[rows] * weight[rows][:, None]).to(z.dtype)  # the row weights on the [R,H] side, in float32
            if z.dtype == torch.float32:
                dW.addmm_(z.T, hw)
            else:
                dW += z.T @ hw
    return loss, hit, dh, dW


def _target(target, u):
    """The target's probabilities [U,Vd] float32 and top-1 [U] at target rows u."""
    if len(target) == 1:  # a table of log-probs
        logp = target[0][u].float()
        return logp.exp_(), logp.max(-1).indices
    final, head = target
    t = (final[u].to(head.dtype) @ head.T).float()  # [U,Vd]
    top = t.max(-1).indices
    return t.sub_(t.logsumexp(-1, keepdim=True)).exp_(), top


def _soft_rows(z, p, top, local, chunk: int, kind: str = "ce"):
    """Loss [R] and hit [R] of a block's logits z [R,Vd], whose row r has the target row local[r] of p [U,Vd];
    z becomes dz in place (eyas.draft.losses: softmax(z) - p for the soft cross-entropy). Float32 over row chunks
    small enough to stay in cache."""
    R = z.shape[0]
    loss = torch.empty(R, dtype=torch.float32, device=z.device)
    hit = torch.empty(R, dtype=torch.bool, device=z.device)
    for s in range(0, R, chunk):
        zf = z[s:s + chunk].float()  # [c,Vd] (z itself when float32: it is overwritten below anyway)
        at = local[s:s + chunk]
        loss[s:s + chunk], z[s:s + chunk], draft_top = row_losses(kind, zf, p[at])
        hit[s:s + chunk] = draft_top == top[at]
    return loss, hit
