"""The plan of an extraction (pure functions but for the disk's free space): samples sorted by length and cut into
shards of about `--shard-mb` (small data into about `--min-shards` of them), shard k to global rank k mod world,
each shard's samples in length-sorted batches of at most `--batch-tokens` padded tokens; and the plan as printed.
The plan depends only on the data and the settings, never on the number of ranks, so a store's content is the
same however it was run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from eyas.core.log import fmt_bytes, fmt_int

HEADER_BYTES = 64 * 1024  # allowance per shard for its safetensors header (its own index)


def shard_indices(n: int, rank: int, world: int) -> list[int]:
    """The shards (of n) that global rank `rank` of `world` writes: k = rank, rank + world, ...

    Round-robin, because shards are in length order: neighbours cost about the same, so ranks stay balanced.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    return list(range(rank, n, world))


MIN_SHARD_BYTES = 4 * 2**20


def plan_shards(lengths: list[int], token_bytes: int, shard_bytes: int, min_shards: int = 1) -> list[list[int]]:
    """Rows sorted by (length, row), cut into consecutive shards of at most shard_bytes, and of at most 1/min_shards
    of the data (but not below MIN_SHARD_BYTES, where a file's own cost would show), so that data smaller than
    min_shards shards is still cut into about min_shards of them (ranks take shards round-robin: a store of two
    shards would leave one rank most of the work). >= 1 sample each."""
    total = sum(lengths) * token_bytes
    shard_bytes = min(shard_bytes, max(MIN_SHARD_BYTES, -(-total // max(1, min_shards))))
    order = sorted(range(len(lengths)), key=lambda r: (lengths[r], r))
    shards, cur, size = [], [], 0
    for r in order:
        b = lengths[r] * token_bytes
        if cur and size + b > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(r)
        size += b
    return shards + ([cur] if cur else [])


def plan_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Positions 0..n-1 (in length order) grouped so that batch size x longest <= batch_tokens (>= 1 each)."""
    batches, cur, longest = [], [], 0
    for p, n in enumerate(lengths):
        if cur and (len(cur) + 1) * max(longest, n) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(p)
        longest = max(longest, n)
    return batches + ([cur] if cur else [])


ENGINE_GROUP_BYTES = 4 << 30  # the engine's states a group holds in host memory at most ([T, 4, H] per sample)


def plan_engine_batches(lengths: list[int], concurrency: int, bytes_per_token: int) -> list[list[int]]:
    """Positions 0..n-1 grouped for an engine (--engine vllm), whose samples are separate requests: up to
    4 x `concurrency` samples per group, so `concurrency` requests stay in flight through most of each group
    whatever --batch-tokens says, and the group's states (`bytes_per_token` each) within ENGINE_GROUP_BYTES
    (>= 1 sample each)."""
    budget = max(1, ENGINE_GROUP_BYTES // max(1, bytes_per_token))
    batches, cur, tokens = [], [], 0
    for p, n in enumerate(lengths):
        if cur and (len(cur) >= 4 * concurrency or tokens + n > budget):
            batches.append(cur)
            cur, tokens = [], 0
        cur.append(p)
        tokens += n
    return batches + ([cur] if cur else [])


def free_bytes(path: Path) -> int:
    """Free bytes on the disk that holds `path` (its nearest existing parent)."""
    p = path.resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def plan_text(p: dict) -> str:
    """The plan block printed before any work starts."""
    return "\n".join([
        "extract plan",
        (f"  target   {p['target']} ({p['num_layers']} layers, hidden {p['hidden']}), features {p['layers']} "
         f"+ final norm, forward {p['dtype']} on {p['device']}"),
        f"  data     {p['data']} [{p['split']}], fingerprint {str(p['fingerprint'])[:16]}",
        (f"  samples  {fmt_int(p['samples'])} ({fmt_int(p['tokens'])} tokens) in {p['shards']} shards; already "
         f"stored: {fmt_int(p['done_samples'])} samples in {p['done_shards']} shards"),
        (f"  storage  {p['storage']}, {fmt_int(p['bpt'])} B/token (8H reference {fmt_int(8 * p['hidden'])}) -> "
         f"{fmt_bytes(p['bytes'])}, {fmt_bytes(p['todo_bytes'])} still to write"),
        f"  ranks    {p['world']} (shard k -> rank k mod {p['world']})",
        f"  disk     {fmt_bytes(p['free'])} free at {p['store']}",
    ])
