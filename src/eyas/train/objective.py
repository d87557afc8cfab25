"""The training objective: `TTTObjective` wraps the draft so that one `forward` is one TTT unroll (DDP and FSDP2
then see a normal module call; eyas.train.parallelize wraps it) and its compute dtype (`autocast`,
`resolve_dtype`); the validation pass's sums are eyas.train.heldout.validation_sums.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from eyas.core.precision import SHORT, choose_dtype
from eyas.draft.model import Eagle3Draft
from eyas.draft.ttt import ttt_forward


class TTTObjective(nn.Module):
    """forward(batch tensors) = ttt_forward(draft, ...) as a tuple (loss_sum [k], correct [k], count [k]);
    target_logp (TargetRows [M,...]) with target_index [B,T] are the compact targets of
    eyas.train.batches.sparse_target_logp; step_scale [k], the weights the loss sums will get (optional: the output
    head's weight gradient is then made in the forward pass alone)."""

    def __init__(self, draft: Eagle3Draft, steps: int):
        super().__init__()
        self.draft, self.steps = draft, steps

    def forward(self, input_ids, aux, target_logp, target_index, loss_mask, position_ids, doc_ids, step_scale=None):
        r = ttt_forward(self.draft, input_ids, aux, target_logp, loss_mask, self.steps, position_ids, doc_ids,
                        target_index, step_scale)
        return r.loss_sum, r.correct, r.count


def autocast(device: str, dtype: str):
    """bf16 autocast (CUDA or CPU) or nothing (fp32)."""
    if dtype != "bf16":
        return contextlib.nullcontext()
    return torch.autocast("cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16)


def resolve_dtype(dtype: str, device: str) -> tuple[str, str | None]:
    """--dtype (auto, bf16, fp32) on `device` -> (the short name training computes in, the line that says what auto
    chose or why an explicit bf16 will be slow here), as every stage decides it (eyas.core.precision)."""
    name, why = choose_dtype(dtype, device)
    return SHORT[name], why


