"""Training-time test (TTT): the draft unrolled for k steps on its own hidden states, as in EAGLE-3.

Alignment (x = tokens, f = target features, h = target final hidden states, m = loss mask):
    p_u = softmax(target_lm_head(h_u)) restricted to the draft vocabulary: the target's distribution of x[u+1].
    Step 0 at position t reads (fc(f_t), embed(x[t+1])) and predicts x[t+2]: its target is p_{t+1}.
    Step i at position t reads (its own step i-1 output at t, embed(x[t+1+i])) and predicts x[t+2+i]
    against p_{t+1+i}; it counts where m[t+2+i] = 1, x[t+2+i] is in the draft vocabulary and t+2+i is
    still in the same document.

Attention at step i (what inference sees when drafting the i-th token after position t): the query at t
attends to the step-0 keys at positions s <= t of its document (those came from real target features), and
to its own chain, the step-j keys at position t for j = 1..i. Its rotary position is pos(t) + i. Computed in
query chunks (eyas.draft.attention): memory linear in T.

Two paths compute the same thing (`path`): "gathered", the CPU's, keeps only the counted rows of each step and
scores them once per distinct target row (eyas.draft.cross_entropy), with the chunked attention; "static", the
GPU's, keeps every position of every step with weight 0 where the step does not count it (eyas.draft.static_loss)
and attends through flex_attention, so every shape is known from k, B and T and a compiled step never waits for the
device. tests/test_ttt_paths.py holds them equal.

Loss at step i: cross-entropy of the draft distribution against p (forward KL up to a constant), summed
over counted positions; the trainer divides by the global count and weights step i by decay**i. The target's
distribution and the draft's logits are formed a block of rows at a time (eyas.draft.cross_entropy): memory flat
in vocabulary x length.
acc_i: share of counted positions where the draft's top-1 equals the target's top-1 (both in the draft
vocabulary), the estimate of acceptance at depth i.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from eyas.draft.attention import (
    CHUNK,
    chain_attention,
    chain_block_masks,
    flex_chain_attention,
    flex_kernel,
    query_chunks,
    static_chunks,
)
from eyas.draft.cross_entropy import TargetRows, soft_cross_entropy
from eyas.draft.model import Eagle3Draft
from eyas.draft.static_loss import static_cross_entropy

PATHS = ("gathered", "static")


@dataclasses.dataclass
class TTTResult:
    loss_sum: torch.Tensor  # [k] summed cross-entropy per step (differentiable)
    correct: torch.Tensor  # [k] positions where draft top-1 == target top-1
    count: torch.Tensor  # [k] positions counted per step


def target_log_probs(final: torch.Tensor, head_rows: torch.Tensor) -> torch.Tensor:
    """final [B,T,H] target hidden states after the last norm, head_rows [Vd,H] the target's output-head rows
    of the draft vocabulary -> log p restricted to the draft vocabulary [B,T,Vd] (float32)."""
    return torch.log_softmax((final.to(head_rows.dtype) @ head_rows.T).float(), dim=-1)


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t] <- x[:, t+n], padded with `fill` at the end. Works for [B,T] and [B,T,...]."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat((x[:, n:], pad), dim=1)


def ttt_forward(model: Eagle3Draft, input_ids: torch.Tensor, aux: torch.Tensor, target_logp, loss_mask: torch.Tensor,
                steps: int, position_ids: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                target_index: torch.Tensor | None = None, step_scale: torch.Tensor | None = None,
                path: str | None = None, attention: str | None = None, loss: str = "ce") -> TTTResult:
    """Unroll the draft for `steps` steps. input_ids/loss_mask [B,T], aux [B,T,3Ht]; position_ids and doc_ids
    [B,T] for packed sequences (default: one document per row, positions 0..T-1).

    target_logp: the target's distribution over the draft vocabulary at every position, as log-probs [B,T,Vd]
    or as TargetRows (final [B,T,H] and the head rows, computed block by block in the cross-entropy). Compact
    targets: [M,Vd] log-probs or TargetRows(final [M,H], ...) hold only the positions some step reads, and
    target_index [B,T] gives each position's row there (-1 elsewhere), as eyas.train.batches.sparse_target_logp
    builds them. step_scale [k]: the weights the caller will give the steps' loss sums (the trainer's scale), so
    the output head's weight gradient made in the forward is the one backward needs (any other weighting is still
    exact, at the cost of a second pass over the output head).

    path: "gathered" or "static" (see the module docstring; default: static on CUDA, gathered elsewhere); the static
    path takes the full targets (no target_index). attention, for the static path: "flex" (default on CUDA) or
    "chunked" (its query chunks fixed by T: nothing read back). loss: the head's loss (eyas.draft.losses)."""
    B, T = input_ids.shape
    dev = input_ids.device
    if position_ids is None:
        position_ids = torch.arange(T, device=dev).expand(B, T)
    if doc_ids is None:
        doc_ids = torch.zeros(B, T, dtype=torch.long, device=dev)
    path = path or ("static" if dev.type == "cuda" else "gathered")
    if path == "static":
        if target_index is not None:
            raise ValueError("the static TTT path takes the full targets [B,T,...], not compact ones with an index")
        return _static(model, input_ids, aux, target_logp, loss_mask, steps, position_ids, doc_ids, step_scale,
                       attention or ("flex" if dev.type == "cuda" else "chunked"), loss)
    if path != "gathered":
        raise ValueError(f"unknown TTT path {path!r}: one of {', '.join(PATHS)}")
    chunks = query_chunks(doc_ids, CHUNK.get(dev.type, CHUNK["cuda"]))  # once for every layer and step
    attend = functools.partial(chain_attention, doc_ids=doc_ids, chunks=chunks)
    rows, target_rows, count = [], [], []
    for i, hidden in enumerate(_unroll(model, input_ids, aux, position_ids, [attend] * steps)):
        valid = counted(input_ids, loss_mask, doc_ids, model.t2d, i)
        rows.append(hidden[valid])  # [N_i,H], only counted positions
        b, t = valid.nonzero(as_tuple=True)
        target_rows.append(b * T + t + 1 + i)  # rows of the target viewed [B*T,...]: p_{t+1+i}
        count.append(valid.sum())
    # One output-head pass over every step's counted positions: one weight cast and one weight gradient instead
    # of one per step, the [N,Vd] work a block at a time (see eyas.draft.cross_entropy).
    count = torch.stack(count)
    step = torch.repeat_interleave(torch.arange(steps, device=dev), count)  # [N] the TTT step of each row
    where = torch.cat(target_rows)  # [N] rows of the target viewed [B*T,...]
    if target_index is not None:
        where = target_index.reshape(-1)[where]  # [N] rows of the compact target [M,...]
    elif isinstance(target_logp, TargetRows):
        target_logp = TargetRows(target_logp.final.reshape(B * T, -1), target_logp.head_rows)
    else:
        target_logp = target_logp.reshape(B * T, -1)
    weight = None if step_scale is None else step_scale.float().to(dev)[step]
    loss_row, hit = soft_cross_entropy(model.norm(torch.cat(rows)), model.lm_head.weight, target_logp, where, weight,
                                       loss)
    loss_sum = torch.zeros(steps, dtype=loss_row.dtype, device=dev).index_add(0, step, loss_row)
    correct = torch.zeros(steps, dtype=torch.long, device=dev).index_add(0, step, hit.long())
    return TTTResult(loss_sum, correct, count)


def _unroll(model: Eagle3Draft, input_ids, aux, position_ids, attends: list):
    """The draft unrolled for len(attends) TTT steps: yields its hidden state [B,T,H] after each. attends[i] is step
    i's attention, attend(q, keys, values) over the step's keys and values and every earlier step's."""
    hidden = model.fuse(aux)  # [B,T,H]
    layers = model.all_layers()
    keys = [[] for _ in layers]
    values = [[] for _ in layers]
    for i, attend in enumerate(attends):
        embeds = model.embed_tokens(shift_left(input_ids, 1 + i)).to(hidden.dtype)  # x[t+1+i]
        cos, sin = model.rope(position_ids + i, hidden.dtype)
        for li, layer in enumerate(layers):
            hidden = layer(hidden, embeds, cos, sin, _keeping(keys[li], values[li], attend))
        yield hidden
        hidden = model.carry(hidden)  # what the next step reads (post-norm with norm_output)


def _keeping(keys: list, values: list, attend):
    """The layer's attention at one TTT step: keep the step's k and v beside the earlier steps', then attend over
    them all (attend(q, keys, values))."""
    def attention(q, k, v):
        keys.append(k)
        values.append(v)
        return attend(q, keys, values)
    return attention


def counted(input_ids, loss_mask, doc_ids, t2d: torch.Tensor, i: int) -> torch.Tensor:
    """[B,T] bool: the positions TTT step i counts: x[t+2+i] loss-masked, in the draft vocabulary (t2d [V]) and in
    the same document (eyas.train.batches.valid_masks takes the same rule on the host copy of a batch)."""
    predicted = shift_left(input_ids, 2 + i)  # x[t+2+i]
    return (shift_left(loss_mask, 2 + i) > 0) & t2d[predicted] & (shift_left(doc_ids, 2 + i, -1) == doc_ids)


def _static(model, input_ids, aux, target, loss_mask, steps, position_ids, doc_ids, step_scale,
            attention: str, kind: str = "ce") -> TTTResult:
    """ttt_forward's static path: every shape from (steps, B, T), nothing read back to the host."""
    B, T = input_ids.shape
    if attention == "flex":
        masks = chain_block_masks(doc_ids, steps)
        kernel = flex_kernel() if input_ids.device.type == "cuda" and not torch.compiler.is_compiling() else None
        attends = [functools.partial(flex_chain_attention, block_mask=m, kernel=kernel) for m in masks]
    elif attention == "chunked":
        chunks = static_chunks(T, CHUNK.get(input_ids.device.type, CHUNK["cuda"]))
        attends = [functools.partial(chain_attention, doc_ids=doc_ids, chunks=chunks)] * steps
    else:
        raise ValueError(f"unknown TTT attention {attention!r}: flex or chunked")
    states = list(_unroll(model, input_ids, aux, position_ids, attends))
    valid = torch.stack([counted(input_ids, loss_mask, doc_ids, model.t2d, i) for i in range(steps)])  # [k,B,T]
    weight = None if step_scale is None else valid.float() * step_scale.float().to(valid.device)[:, None, None]
    if (target.final if isinstance(target, TargetRows) else target).dim() != 3:
        raise ValueError("the static TTT path takes targets over every position: [B,T,Vd] or TargetRows [B,T,H]")
    loss, hit = static_cross_entropy(model.norm(torch.stack(states)), model.lm_head.weight, target, weight, kind)
    zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
    return TTTResult(torch.where(valid, loss, zero).sum((1, 2)), (hit & valid).sum((1, 2)), valid.sum((1, 2)))


def step_weights(steps: int, decay: float, device=None) -> torch.Tensor:
    """[k] weights decay**i of the steps' losses (EAGLE-3 uses 0.8)."""
    return decay ** torch.arange(steps, dtype=torch.float32, device=device)
