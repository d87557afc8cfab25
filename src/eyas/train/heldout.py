"""Validation: the sums of training's validation pass (`validation_sums`), and any draft's loss and accuracy on a
hidden-state store computed the same way (`held_out_accuracy`).

Training validates on its `--val-store` at every epoch's end (eyas.train.trainer). `held_out_accuracy` gives the
same figures for a draft that was trained elsewhere or saved mid-run (an imported speculators or SpecForge draft,
an eyas checkpoint), so drafts can be compared on the same held-out samples with one definition: per TTT step i,
the share of counted positions (loss mask on, the next tokens inside the draft vocabulary) where the draft's
argmax equals the target's argmax over the draft vocabulary, and the soft cross-entropy against the target.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from eyas.core import dist
from eyas.core.dist import DistEnv
from eyas.core.errors import EyasError
from eyas.core.weights import load_target_shell, read_module
from eyas.draft.model import Eagle3Draft
from eyas.train.batches import load_micro_batch, open_store, valid_masks
from eyas.train.objective import TTTObjective, autocast, resolve_dtype, targets
from eyas.train.parallelize import reshard
from eyas.train.sharding import EpochShard, ShardSpec, shard_epoch


def masked_batches(source, shard: EpochShard, to_device):
    """The shard's micro-batches read from `source`, passed through `to_device`, with the loss mask of
    the rows that only pad the last step zeroed: run, not counted."""
    for s, step in enumerate(shard.steps):
        for m, micro in enumerate(step):
            b = to_device(load_micro_batch(source, micro))
            rows = [u for u in range(len(micro)) if (s, m, u) in shard.padded]
            if rows:
                mask = b.loss_mask.clone()
                mask[rows] = 0
                b = dataclasses.replace(b, loss_mask=mask)
            yield b


def store_feature_layers(src) -> list[int] | None:
    """The HF hidden-state indices a store (or a subset of one) holds, when it records them."""
    for holder in (src, getattr(src, "source", None)):
        ids = getattr(holder, "layer_ids", None) if holder is not None else None
        if ids:
            return [int(i) for i in ids]
    ident = getattr(src, "identity", None) or {}
    return [int(i) for i in ident["layer_ids"]] if ident.get("layer_ids") else None


def held_out_accuracy(draft: Eagle3Draft, store: str, target: str, ttt_steps: int, micro_batch: int = 1,
                      max_tokens: int = 0, dtype: str = "auto", device: str = "cpu") -> dict:
    """{"samples", "loss_i", "acc_i", "count_i"} of `draft` over every sample of `store` (extracted from `target`),
    for `ttt_steps` steps, batched as training's validation pass batches them (`micro_batch`, `max_tokens`), in
    training's compute dtype (`dtype` as --dtype: auto is bf16 where the device multiplies it in hardware)."""
    dtype = resolve_dtype(dtype, device)[0]
    src = open_store(store)
    layers = store_feature_layers(src)
    if layers is not None and sorted(layers) != sorted(draft.cfg.feature_layers):
        raise EyasError(f"store {store} holds layers {layers}, the draft reads {list(draft.cfg.feature_layers)}",
                        fix="score the draft on a store extracted with its feature layers")
    shell = load_target_shell(target)
    compute = torch.float32 if dtype == "fp32" else torch.bfloat16
    head = read_module(shell, shell.lm_head()).weight.detach()
    draft = draft.to(device).eval()
    head_rows = head[draft.target_ids().to(head.device)].to(device, compute)
    shard = shard_epoch(src.lengths, 0, 0, ShardSpec(world_size=1, micro_batch=micro_batch, shuffle=False,
                                                     max_tokens=max_tokens))
    batches = masked_batches(src, shard, lambda b: b.to(device, compute))
    red = validation_sums(TTTObjective(draft, ttt_steps), batches, head_rows, draft.t2d, ttt_steps,
                          DistEnv(device=device), dtype)
    return {"samples": len(src), **per_step(red, ttt_steps), "count_i": red[2 * ttt_steps:]}


def expected_acceptance_length(acc_i: list[float], chain: int | None = None) -> float:
    """The acceptance length tau a chain of `chain` draft tokens (default: every TTT step) is expected to reach,
    from the per-position acceptance rates acc_i: 1 + sum over k of acc_0 x ... x acc_(k-1). The 1 is the token the
    target adds at every verification; position k is reached only if positions 0..k-1 were accepted. acc_i is
    measured with the draft reading its own earlier outputs (training-time test), as in decoding; taking their
    product treats positions as independent, which `eyas evaluate`'s measured tau checks (the report sets the two
    side by side)."""
    steps = acc_i[:chain] if chain else acc_i
    tau, reach = 1.0, 1.0
    for a in steps:
        reach *= min(max(float(a), 0.0), 1.0)
        tau += reach
    return tau


def per_step(red: list[float], k: int) -> dict:
    """validation_sums' [loss sums..., correct..., counts...] as {"loss_i", "acc_i"}, means over counted positions."""
    n = [max(1.0, x) for x in red[2 * k:]]
    return {"loss_i": [red[i] / n[i] for i in range(k)], "acc_i": [red[k + i] / n[i] for i in range(k)]}


@torch.no_grad()
def validation_sums(model: nn.Module, batches, head_rows: torch.Tensor, t2d: torch.Tensor, ttt_steps: int, env,
                    dtype: str, path: str = "gathered") -> list[float]:
    """The validation pass of the (wrapped) TTT objective `model` over this rank's prepared micro-batches:
    [loss_sum_i..., correct_i..., count_i...] summed over ranks. Rows whose loss mask is zero are run, not counted."""
    sums = torch.zeros(3, ttt_steps, dtype=torch.float64)
    for b in batches:
        with autocast(env.device, dtype):
            valid = valid_masks(b.input_ids, b.loss_mask, b.doc_ids, t2d, ttt_steps)
            logp, index = targets(path, b.final, head_rows, valid)
            ls, c, n = model(b.input_ids, b.aux, logp, index, b.loss_mask, b.position_ids, b.doc_ids)
        sums += torch.stack([ls.double().cpu(), c.double().cpu(), n.double().cpu()])
    reshard(model)
    return dist.all_reduce_sum(sums.flatten().tolist(), env)
