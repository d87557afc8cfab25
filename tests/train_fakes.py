"""Test helpers for the trainer: small hidden-state stores of the tiny target's own features.

`write_store` writes a real eyas store (eyas.store's ShardBuilder + write_manifest, the format `eyas extract`
writes) from random token sequences run through the target: aux = HF hidden_states at the feature layers,
final = the last hidden state (after the final norm).
"""

from __future__ import annotations

from pathlib import Path

import torch


@torch.no_grad()
def tiny_samples(target, n: int = 24, seed: int = 0, lengths=(12, 40), vocab_ids: int = 300):
    """[(id, input_ids [L], loss_mask [L], aux [(L,H)]*3, final [L,H])]: random tokens from `vocab_ids` ids (a
    small draft vocabulary covers them), the loss mask on the last two thirds."""
    g = torch.Generator().manual_seed(seed)
    layers = target.default_feature_layers()
    pool = torch.randperm(target.vocab_size, generator=g)[:vocab_ids]
    out = []
    for i in range(n):
        L = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        ids = pool[torch.randint(0, vocab_ids, (L,), generator=g)]
        mask = torch.zeros(L, dtype=torch.long)
        mask[L // 3:] = 1
        hs = target.model(ids[None], output_hidden_states=True).hidden_states
        out.append((f"s{i}", ids, mask, [hs[j][0] for j in layers], hs[-1][0]))
    return out


def write_store(target, path: Path, n: int = 24, seed: int = 0, per_shard: int = 0, **kw) -> Path:
    """A store of `n` samples, in shards of `per_shard` samples (0: one shard)."""
    from eyas.store.layout import SHARD_DIR, shard_name
    from eyas.store.writer import ShardBuilder, write_manifest

    samples = tiny_samples(target, n, seed, **kw)
    shards_dir = Path(path) / SHARD_DIR
    shards_dir.mkdir(parents=True, exist_ok=True)
    per_shard = per_shard or n
    indexes = []
    for k in range(0, n, per_shard):
        part = list(enumerate(samples))[k:k + per_shard]
        b = ShardBuilder(shard_name(k // per_shard), sum(len(s[1]) for _, s in part), target.hidden_size, compact=False)
        for row, (sid, ids, mask, aux, final) in part:
            b.add(row, sid, ids, mask, aux, final)
        indexes.append(b.commit(shards_dir))
    header = {"target": target.identity(), "layer_ids": target.default_feature_layers(), "compact": False,
              "dtype": "bfloat16"}
    write_manifest(Path(path), header, indexes)
    return Path(path)
