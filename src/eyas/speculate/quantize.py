"""Weight rewrites of a draft for decoding on a CPU: weight-only int8 linears (`quantize_int8`, `--draft-quant int8`)
and linears computed as the target's runner computes its projections (`projected_draft`: the same weights, by
few_rows_linear or oneDNN's packed product where those measured faster). Each returns a copy; the trained draft is
never changed.
"""

from __future__ import annotations

import copy

import torch


class Int8Linear(torch.nn.Module):
    """Weight-only int8 linear for CPU drafting: w = int8 [N,K] * per-row scale [N], x in bf16. A one-token draft step
    reads every weight once, so halving the bytes of the head (Vd x H, most of a draft step) halves its time. Only
    the proposals can change (slightly); verification by the target is untouched, so outputs stay exact."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [N]
        self.register_buffer("w8", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [M,K]
        return torch._weight_int8pack_mm(flat, self.w8, self.scale).reshape(*x.shape[:-1], self.out_features)


class ProjectedLinear(torch.nn.Module):
    """A linear layer computed by the target runner's Projections (eyas.speculate.target_forward): the same weights
    and product, by the kind that measured fastest for its number of rows."""

    def __init__(self, linear: torch.nn.Linear, projections):
        super().__init__()
        self.weight, self.bias, self.projections = linear.weight, linear.bias, projections
        projections.pack([self.weight])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projections(x, self.weight, self.bias)


def _with_linears(draft, make):
    """A copy of the draft whose linear layers (fc, attention, MLP, head) are `make(linear)`."""
    q = copy.deepcopy(draft)
    for module in list(q.modules()):
        for child, sub in list(module.named_children()):
            if isinstance(sub, torch.nn.Linear):
                setattr(module, child, make(sub))
    return q


def quantize_int8(draft):
    """A copy of the draft whose linear layers (fc, attention, MLP, head) are weight-only int8 (CPU, bf16)."""
    return _with_linears(draft, Int8Linear)


def projected_draft(draft, projections):
    """A copy of the draft whose linear layers compute as `projections` does (the same weights, to the last bit)."""
    return _with_linears(draft, lambda linear: ProjectedLinear(linear, projections))
