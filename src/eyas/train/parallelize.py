"""Data parallelism applied to the TTT objective from outside (the model file knows nothing of ranks): DDP, or
FSDP2's `fully_shard` (`parallel="fsdp"`) as torchtitan applies it, and the full (unsharded) state that checkpoints
hold.

FSDP2: each decoder layer is its own group (TTT calls it k times a micro-batch; it is gathered at its first call
and kept until its backward, reshard_after_forward=False, the next layer's gather prefetched), then the root (fc,
the norm, the output head). The frozen embeddings are left out (`ignored_params`): nothing of theirs is trained,
so each rank keeps its own copy and nothing is gathered for them. With bf16 the policy is torchtitan's,
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): parameters gathered in bf16, gradients reduced in fp32,
the fp32 master weights and optimizer state sharded.

Loss normalisation makes the two agree with one process: each TTT step's summed cross-entropy is divided by the
GLOBAL count of counted positions of that step in the optimizer step (all ranks, all micro-batches; counts are
all-reduced before backward), and multiplied by the world size because DDP and FSDP average gradients over ranks.
So W ranks with micro-batch b compute exactly the gradient of one process with the same global batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from eyas.draft.model import Eagle3Draft
from eyas.train.objective import TTTObjective


def wrap(objective: TTTObjective, parallel: str, env, dtype: str = "fp32") -> nn.Module:
    """Apply data parallelism from outside: DDP, or FSDP2 fully_shard (see the module docstring); the plain module
    on one process. dtype: training's compute dtype (bf16 or fp32)."""
    if not env.distributed:
        return objective
    if parallel == "fsdp":  # on the chosen device's mesh: left to itself FSDP takes CUDA whenever a GPU exists
        mesh = init_device_mesh(torch.device(env.device).type, (env.world_size,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bf16" \
            else MixedPrecisionPolicy()
        draft = objective.draft
        layers = draft.all_layers()
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        for layer, after in zip(layers, layers[1:]):
            layer.set_modules_to_forward_prefetch([after])
        # the root's inputs keep their dtypes: the step weights (float32) must reach the loss as the trainer has them
        root = dataclasses.replace(policy, cast_forward_inputs=False)
        fully_shard(objective, mesh=mesh, mp_policy=root, ignored_params={draft.embed_tokens.weight})
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


def reshard(model: nn.Module) -> None:
    """Give FSDP2 back its sharded parameters after forwards without a backward (validation): it leaves the root
    module's parameters unsharded after its forward, expecting the backward to reshard them, and the optimizer
    (and its checkpoint) holds the sharded ones. Nothing to do for DDP or one process."""
    for module in model.modules():  # the root and each layer
        if isinstance(module, FSDPModule):
            module.reshard()


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
