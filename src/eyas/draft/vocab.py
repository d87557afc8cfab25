"""The draft vocabulary: the K target tokens most frequent among the loss-masked tokens of the training data.

`d2t[d]` is the offset from draft index d to its target id (target = d + d2t[d]); `t2d[t]` says whether target
token t is in the draft vocabulary. Draft indices follow ascending target ids. When the data shows fewer than K
distinct tokens, the rest are the lowest unused target ids, so the map is always K entries long.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
class DraftVocab:
    d2t: torch.Tensor  # [K] int64
    t2d: torch.Tensor  # [V] bool
    coverage: float  # share of loss-masked training tokens whose id is in the vocabulary
    distinct_seen: int  # distinct loss-masked token ids in the data

    @property
    def size(self) -> int:
        return int(self.d2t.numel())

    def target_ids(self) -> torch.Tensor:
        return torch.arange(self.size) + self.d2t


def count_tokens(samples: Iterable[tuple[np.ndarray, np.ndarray]], vocab_size: int,
                 batch: int = 1 << 20) -> np.ndarray:
    """Frequency [V] of token ids at loss-masked positions over (input_ids, loss_mask) pairs. Ids are counted
    about `batch` at a time: one bincount per sample would cost a pass over [V] each (163,840 for Kimi-K2)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    pending, held = [], 0

    def flush():
        if pending:
            counts[:] += np.bincount(np.concatenate(pending), minlength=vocab_size)[:vocab_size]
            pending.clear()

    for ids, mask in samples:
        kept = np.asarray(ids)[np.asarray(mask) > 0]
        pending.append(kept.astype(np.int64, copy=False))
        held += len(kept)
        if held >= batch:
            flush()
            held = 0
    flush()
    return counts


def build_draft_vocab(counts: np.ndarray, size: int) -> DraftVocab:
    """Top-`size` ids by frequency (ties: lower id first), then the lowest unused ids; sorted ascending."""
    V = counts.shape[0]
    size = min(size, V)
    order = np.lexsort((np.arange(V), -counts))  # by count descending, then id ascending
    seen = int((counts > 0).sum())
    chosen = order[: min(size, seen)]
    if len(chosen) < size:
        unused = np.setdiff1d(np.arange(V), chosen, assume_unique=True)
        chosen = np.concatenate([chosen, unused[: size - len(chosen)]])
    ids = np.sort(chosen)
    total = counts.sum()
    coverage = float(counts[ids].sum() / total) if total else 0.0
    d2t = torch.from_numpy(ids - np.arange(size)).long()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.from_numpy(ids)] = True
    return DraftVocab(d2t=d2t, t2d=t2d, coverage=coverage, distinct_seen=seen)
