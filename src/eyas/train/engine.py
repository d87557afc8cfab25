"""The draft as the trainer drives it: the TTT objective, its parallel wrapper, optimizer and LR schedule.

The model file (eyas.draft.model) knows nothing of ranks. Here the draft is wrapped from outside in `TTTObjective`
(one `forward` = one TTT unroll, so DDP and FSDP2 see a normal module call), then in
`DistributedDataParallel` (default) or FSDP2's `fully_shard` (`parallel="fsdp"`; one parameter group for the
whole draft, since TTT calls the layers' pieces rather than their `forward`).

Loss normalisation: each TTT step's summed cross-entropy is divided by the GLOBAL count of counted positions
of that step in the optimizer step (all ranks, all micro-batches; counts are all-reduced before backward), and
multiplied by the world size because DDP and FSDP average gradients over ranks. So W ranks with micro-batch b
compute exactly the gradient of one process with the same global batch.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from eyas.core import dist
from eyas.core.precision import SHORT, choose_dtype
from eyas.draft.model import Eagle3Draft
from eyas.draft.ttt import ttt_forward
from eyas.train.data import needed_rows, sparse_target_logp, valid_masks


class TTTObjective(nn.Module):
    """forward(batch tensors) = ttt_forward(draft, ...) as a tuple (loss_sum [k], correct [k], count [k]);
    target_logp (TargetRows [M,...]) with target_index [B,T] are the compact targets of
    eyas.train.data.sparse_target_logp; step_scale [k], the weights the loss sums will get (optional: the output
    head's weight gradient is then made in the forward pass alone)."""

    def __init__(self, draft: Eagle3Draft, steps: int):
        super().__init__()
        self.draft, self.steps = draft, steps

    def forward(self, input_ids, aux, target_logp, target_index, loss_mask, position_ids, doc_ids, step_scale=None):
        r = ttt_forward(self.draft, input_ids, aux, target_logp, loss_mask, self.steps, position_ids, doc_ids,
                        target_index, step_scale)
        return r.loss_sum, r.correct, r.count


def wrap(objective: TTTObjective, parallel: str, env) -> nn.Module:
    """Apply data parallelism from outside: DDP, or FSDP2 fully_shard; the plain module on one process."""
    if not env.distributed:
        return objective
    if parallel == "fsdp":  # on the chosen device's mesh: left to itself FSDP takes CUDA whenever a GPU exists
        fully_shard(objective, mesh=init_device_mesh(torch.device(env.device).type, (env.world_size,)))
        return objective

    ids = [torch.device(env.device).index] if env.device.startswith("cuda") else None
    # buffers (d2t, t2d) never change: no broadcast at every forward (the flag was renamed in torch 2.13)
    newer = "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    sync = {"forward_sync_buffers": False} if newer else {"broadcast_buffers": False}
    return DDP(objective, device_ids=ids, gradient_as_bucket_view=True, **sync)


def no_sync(model: nn.Module, last: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of an optimizer step."""
    if last:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2

        @contextlib.contextmanager
        def off():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return off()
    return contextlib.nullcontext()


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


@torch.no_grad()
def validation_sums(model: nn.Module, batches, head_rows: torch.Tensor, t2d: torch.Tensor, ttt_steps: int, env,
                    dtype: str) -> list[float]:
    """The validation pass of the (wrapped) TTT objective `model` over this rank's prepared micro-batches:
    [loss_sum_i..., correct_i..., count_i...] summed over ranks. Rows whose loss mask is zero are run, not counted."""
    sums = torch.zeros(3, ttt_steps, dtype=torch.float64)
    for b in batches:
        with autocast(env.device, dtype):
            valid = valid_masks(b.input_ids, b.loss_mask, b.doc_ids, t2d, ttt_steps)
            logp, index = sparse_target_logp(b.final, head_rows, needed_rows(valid))
            ls, c, n = model(b.input_ids, b.aux, logp, index, b.loss_mask, b.position_ids, b.doc_ids)
        sums += torch.stack([ls.double().cpu(), c.double().cpu(), n.double().cpu()])
    reshard(model)
    return dist.all_reduce_sum(sums.flatten().tolist(), env)


def reshard(model: nn.Module) -> None:
    """Give FSDP2 back its sharded parameters after forwards without a backward (validation): it leaves the root
    module's parameters unsharded after its forward, expecting the backward to reshard them, and the optimizer
    (and its checkpoint) holds the sharded ones. Nothing to do for DDP or one process."""
    if isinstance(model, FSDPModule):
        model.reshard()


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


# -- full (unsharded) state for checkpoints -------------------------------------------------------------------------
def _options(**kw):
    return StateDictOptions(full_state_dict=True, **kw)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The draft's full state dict on CPU, keyed like Eagle3Draft.state_dict() (a collective under FSDP)."""

    sd = get_model_state_dict(model, options=_options(cpu_offload=True))  # full on rank 0 only
    for name, buf in _objective(model).named_buffers():  # d2t, t2d: never sharded
        sd.setdefault(name, buf)
    return {k.removeprefix("draft."): v.detach().cpu() for k, v in sd.items()}


def full_optimizer_state(model: nn.Module, optimizer) -> dict:
    return get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))


def load_optimizer_state(model: nn.Module, optimizer, state: dict) -> None:
    set_optimizer_state_dict(model, optimizer, state, options=_options())


def _objective(model: nn.Module) -> TTTObjective:
    return model.module if hasattr(model, "module") else model


def draft_of(model: nn.Module) -> Eagle3Draft:
    return _objective(model).draft
