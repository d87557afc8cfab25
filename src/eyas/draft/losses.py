"""The draft head's losses against the target's distribution, row by row: each gives a row's loss and its gradient
with respect to the row's logits, which the fused output-head passes (eyas.draft.cross_entropy for the gathered
TTT path, eyas.draft.static_loss for the static one) turn into the hidden state's and the head's gradients.

With q = softmax(z) the draft's distribution and p the target's (both over the draft vocabulary), and the
acceptance rate of one drafted token alpha = sum_v min(p_v, q_v) (speculative sampling accepts it with that
probability):

    ce         soft cross-entropy  -sum p log q = lse(z) - p.z          dz = q - p      (EAGLE-3; KL(p||q) + H(p))
    tv         total variation     1 - alpha = 1/2 sum |p - q|          dz = -dalpha
    nla        -log alpha          (alpha floored at 1e-5)              dz = -dalpha / alpha
    lk-hybrid  lambda KL(p||q) + (1 - lambda)(1 - alpha), lambda = exp(-eta alpha) held constant, eta = 3

where dalpha/dz = q (1[q <= p] - s), s = the sum of q over {q <= p}. The last three target acceptance directly
(Samarin et al., "LK losses", arXiv 2602.23881, as speculators 0.9 implements them under the same names); the
hybrid starts as KL where alpha is small and moves to TV as it grows.
"""

from __future__ import annotations

import torch

LOSSES = ("ce", "tv", "nla", "lk-hybrid")
LK_ETA = 3.0  # the hybrid's eta: the paper's best setting, speculators' default
NLA_FLOOR = 1e-5


def row_losses(kind: str, z: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss [c] float32, dz [c,Vd] float32, the draft's top-1 [c]) of logits z [c,Vd] (float32, overwritten: the
    caller's scratch) against target probabilities p [c,Vd] (float32, rows summing to 1)."""
    m, top = z.max(-1, keepdim=True)
    z.sub_(m)  # shift-invariant: every loss below is a function of softmax(z), and ce's p.z of sum p = 1
    e = z.exp()
    total = e.sum(-1, keepdim=True)
    ce = total.squeeze(-1).log() - (p * z).sum(-1)  # lse(z) - p.z
    q = e.mul_(total.reciprocal())
    top = top.squeeze(-1)
    if kind == "ce":
        return ce, q.sub_(p), top
    below = q <= p
    alpha = torch.minimum(p, q).sum(-1)
    dalpha = q * (below.float() - (q * below).sum(-1, keepdim=True))  # d alpha / dz
    if kind == "tv":
        return 1.0 - alpha, dalpha.neg_(), top
    if kind == "nla":
        floor = alpha.clamp_min(NLA_FLOOR)
        return -floor.log(), dalpha.div_(floor[:, None]).neg_(), top
    if kind == "lk-hybrid":
        lam = torch.exp(-LK_ETA * alpha)[:, None]  # held constant (a stop-gradient)
        kl = ce + torch.xlogy(p, p).sum(-1)  # KL(p||q) = CE - H(p)
        loss = lam[:, 0] * kl + (1.0 - lam[:, 0]) * (1.0 - alpha)
        return loss, (q - p).mul_(lam).sub_(dalpha.mul_(1.0 - lam)), top
    raise ValueError(f"unknown draft loss {kind!r}: one of {', '.join(LOSSES)}")


def reference_loss(kind: str, z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The same losses written plainly, for autograd to differentiate (tests): [c]."""
    logq = torch.log_softmax(z.float(), -1)
    q = logq.exp()
    ce = -(p * logq).sum(-1)
    alpha = torch.minimum(p, q).sum(-1)
    if kind == "ce":
        return ce
    if kind == "tv":
        return 0.5 * (p - q).abs().sum(-1)
    if kind == "nla":
        return -alpha.clamp_min(NLA_FLOOR).log()
    lam = torch.exp(-LK_ETA * alpha).detach()
    return lam * (ce + torch.xlogy(p, p).sum(-1)) + (1 - lam) * (1 - alpha)
