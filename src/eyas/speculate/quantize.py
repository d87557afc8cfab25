"""Weight rewrites of a draft for decoding on a CPU: weight-only int8 linears (`quantize_int8`, `--draft-quant int8`)
and few-rows linears (`few_rows_draft`, the same weights computed by another BLAS call). Each returns a copy; the
trained draft is never changed.
"""

from __future__ import annotations

import copy

import torch

from eyas.models.llama import few_rows_linear


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


class FewRowsLinear(torch.nn.Module):
    """A linear layer computed by eyas.models.llama.few_rows_linear: the same weights and product, another BLAS
    call, faster for a draft step's one row where the target's runner measured it faster (LeanRunner.choose_linear)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return few_rows_linear(x, self.weight, self.bias)


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


def few_rows_draft(draft):
    """A copy of the draft whose linear layers run as few_rows_linear (the same weights, to the last bit)."""
    return _with_linears(draft, FewRowsLinear)
