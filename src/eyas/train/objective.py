"""The training objective: `TTTObjective` wraps the draft so that one `forward` is one TTT unroll (DDP and FSDP2
then see a normal module call; eyas.train.parallelize wraps it) and its compute dtype (`autocast`,
`resolve_dtype`); the validation pass's sums are eyas.train.heldout.validation_sums.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from eyas.core.precision import SHORT, choose_dtype
from eyas.draft.cross_entropy import TargetRows
from eyas.draft.model import Eagle3Draft
from eyas.draft.ttt import ttt_forward
from eyas.train.batches import needed_rows, sparse_target_logp

STATIC_MIN_LENGTH = 256  # the static path's micro-batches are padded to a power of two of at least this many positions
RECOMPILE_LIMIT = 64  # compilations of the step a run may need: padded lengths x batch sizes x train/validation
COMPILE_BACKEND = "inductor"  # torch.compile's; the tests trace with aot_eager (the same graph, no code generated)


class TTTObjective(nn.Module):
    """forward(batch tensors) = ttt_forward(draft, ...) as a tuple (loss_sum [k], correct [k], count [k]);
    target_logp and target_index come from `targets`; step_scale [k], the weights the loss sums will get
    (optional: the output head's weight gradient is then made in the forward pass alone).

    path: ttt_forward's ("gathered", the CPU's; "static", the GPU's); compiled: ttt_forward under
    torch.compile(fullgraph=True), the static path only (the gathered one reads counts back to the host); loss: the
    output head's loss (eyas.draft.losses)."""

    def __init__(self, draft: Eagle3Draft, steps: int, path: str = "gathered", compiled: bool = False,
                 loss: str = "ce"):
        super().__init__()
        self.draft, self.steps, self.path, self.loss = draft, steps, path, loss
        if compiled:  # fullgraph fails hard past the limit (default 8), where a run's shapes can take it
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.ttt = torch.compile(ttt_forward, fullgraph=True, backend=COMPILE_BACKEND) if compiled else ttt_forward

    def forward(self, input_ids, aux, target_logp, target_index, loss_mask, position_ids, doc_ids, step_scale=None):
        r = self.ttt(self.draft, input_ids, aux, target_logp, loss_mask, self.steps, position_ids, doc_ids,
                     target_index, step_scale, path=self.path, loss=self.loss)
        return r.loss_sum, r.correct, r.count


def targets(path: str, final: torch.Tensor, head_rows: torch.Tensor, valid: torch.Tensor):
    """The target's distribution as `path` takes it -> (target, index): the static path every position's
    (TargetRows [B,T,H], None: nothing read back), the gathered path only the rows some step counts (compact
    TargetRows [M,H] and their index [B,T]; valid [k,B,T] from eyas.train.batches.valid_masks)."""
    if path == "static":
        return TargetRows(final, head_rows), None
    return sparse_target_logp(final, head_rows, needed_rows(valid))


def choose_path(device: str, compile_opt: str, sharded: bool = False) -> tuple[str, bool, str]:
    """--compile (auto, on, off) on `device` -> (TTT path, compiled, the line that says so). auto: compiled with CUDA
    (the static path, fused by inductor, no host synchronisation); on a CPU the gathered path eagerly, which
    computes only the counted rows and measured faster there (docs/train.md). sharded (FSDP2): not compiled as one
    graph, since FSDP2's per-layer hooks are never compiled and would break it (the static path stays, eager)."""
    cuda = device.startswith("cuda")
    compiled = compile_opt == "on" or (compile_opt == "auto" and cuda)
    why = ""
    if compiled and sharded:
        compiled, why = False, " (not compiled under FSDP2: its per-layer hooks break a whole-step graph)"
    path = "static" if compiled or cuda or compile_opt == "on" else "gathered"
    how = "compiled (torch.compile, fullgraph)" if compiled else "eager"
    return path, compiled, f"TTT step: {path} path, {how}{why}"


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


