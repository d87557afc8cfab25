"""The optimizer and its schedule: AdamW over the draft's trainable parameters, linear warmup then cosine decay.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def make_optimizer(model: nn.Module, lr: float, weight_decay: float, device: str) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (the frozen embeddings and buffers are not optimised)."""
    params = [p for p in model.parameters() if p.requires_grad]
    sharded = any(type(p).__name__ == "DTensor" for p in params)
    # fused AdamW is one pass over the state; it does not take FSDP's DTensors everywhere, foreach does
    kw = {"foreach": True} if sharded else {"fused": True}
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, **kw)


def lr_at(step: int, total: int, warmup: int, peak: float, min_ratio: float) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup over `warmup` steps to `peak`, then cosine
    down to `min_ratio * peak` at `total` (the real optimizer-step count of the run)."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
