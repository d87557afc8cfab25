"""The hidden-state store: checksummed safetensors shards plus a manifest, read as memory-mapped views or by pread.

    STORE/manifest.json                      what the store holds (see `write_manifest`)
    STORE/shards/shard-000000.safetensors    many samples each, concatenated along the token axis

A shard holds, for its T tokens (H = the target's hidden size):

    input_ids [T] int32    loss_mask [T] int8    aux [T, 3H]    final [T, H]
    bf16 store:    aux, final are bfloat16 (8H bytes per token of features)
    compact store: aux, final are float8_e4m3fn, plus aux_exp [T, 3] and final_exp [T, 1] int8: each row of
                   H values is q * 2**exp (per-row power-of-two scales, as in the MX formats): 4H + 4 bytes

Sample k of a shard is rows offset..offset+length. A shard's header metadata (`eyas`) repeats its own index
(rows, ids, offsets, lengths, checksums), so a shard describes itself: a restart trusts what it finds.
A checksum is xxh3-128 over the sample's bytes of every tensor, in `TENSORS` order, written "xxh3:<hex>" (a bare
hex digest, from stores written before 2026-11-30, is blake2b-128 and still checks).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import xxhash

from eyas.core.errors import EyasError

FORMAT, VERSION = "eyas-store", 1
SHARD_DIR, MANIFEST = "shards", "manifest.json"
TENSORS = ("input_ids", "loss_mask", "aux", "final", "aux_exp", "final_exp")  # checksum order
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Worst-case error of the compact store, elementwise: |x - x~| <= |x| / 16 + amax(row) / COMPACT_ABS_DIV
# (3 mantissa bits round to within 2**-4 relatively; below 2**-6 * scale, e4m3 subnormals step by 2**-9 * scale,
# and the power-of-two scale is < amax / 224).
COMPACT_REL, COMPACT_ABS_DIV = 1 / 16, 224 * 1024


def bytes_per_token(hidden: int, compact: bool) -> int:
    """Stored bytes per token: ids (4) + mask (1) + features (8H in bf16, 4H + 4 compact)."""
    return 5 + (4 * hidden + 4 if compact else 8 * hidden)


def row_specs(hidden: int, compact: bool) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """What one token of a shard holds: {tensor name: (dtype, shape of one row)}, in checksum order."""
    fdt = torch.float8_e4m3fn if compact else torch.bfloat16
    specs = {"input_ids": (torch.int32, ()), "loss_mask": (torch.int8, ()), "aux": (fdt, (3 * hidden,)),
             "final": (fdt, (hidden,))}
    if compact:
        specs |= {"aux_exp": (torch.int8, (3,)), "final_exp": (torch.int8, (1,))}
    return specs


def features(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored rows -> (aux [..., 3H], final [..., H]) in bf16: the compact store's fp8 rows are decoded, a bf16
    store's are returned as they are. `t` holds the stored tensors over any leading shape (a sample [L] or a
    batch [B, T])."""
    if "aux_exp" not in t:
        return t["aux"], t["final"]
    lead, H = t["final"].shape[:-1], t["final"].shape[-1]
    aux = dequantize_rows(t["aux"].view(*lead, 3, H), t["aux_exp"]).view(*lead, 3 * H)
    return aux, dequantize_rows(t["final"], t["final_exp"][..., 0])


def shard_name(k: int) -> str:
    return f"shard-{k:06d}.safetensors"


# ---------------------------------------------------------------- compact (fp8) codec

def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] float -> (q [N, H] float8_e4m3fn, exp [N] int8) with x ~= q * 2**exp."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp_min(2.0 ** -120)  # an all-zero row takes any scale
    exp = torch.ceil(torch.log2(amax / FP8_MAX)).clamp(-127, 127)
    y = (xf * torch.exp2(-exp).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)  # exact: scaling by a power of two
    return y.to(torch.float8_e4m3fn), exp.to(torch.int8)


def dequantize_rows(q: torch.Tensor, exp: torch.Tensor) -> torch.Tensor:
    """q [N, ..., H] float8, exp [N, ...] int8 -> bf16 (exact: 4 significant bits fit bf16's 8)."""
    return torch.ldexp(q.float(), exp.unsqueeze(-1).float()).to(torch.bfloat16)


# ---------------------------------------------------------------- checksums

def matches(parts: Sequence, stored) -> bool:
    """Whether `parts` hash to the manifest's `stored` checksum, with the algorithm it names (False when `stored`
    is not a checksum at all: a damaged manifest)."""
    if not isinstance(stored, str):
        return False
    algorithm = stored.split(":", 1)[0] if ":" in stored else ""
    if algorithm not in ("", "xxh3"):
        raise EyasError(f"a store checksum uses the algorithm {algorithm!r}, which this eyas does not know",
                        "the store was written by a newer eyas", "upgrade eyas to read it")
    return checksum(parts, algorithm) == stored


def checksum(parts: Sequence, algorithm: str = "xxh3") -> str:
    """The checksum of a sample's tensors, prefixed with its algorithm ("xxh3:..."; "" means blake2b, the first).

    xxh3-128 runs at memory speed (about 24 GiB/s over bytes just copied, docs/extract.md) where blake2b is an order
    of magnitude slower: the reader checks each sample on its first read, and with blake2b that check cost more
    than the read."""
    h = xxhash.xxh3_128() if algorithm == "xxh3" else hashlib.blake2b(digest_size=16)
    for t in parts:  # tensors, or buffers of their bytes (StoreReader.read_into)
        h.update(t.contiguous().view(torch.uint8).numpy().data if isinstance(t, torch.Tensor) else t)
    return f"{algorithm}:{h.hexdigest()}" if algorithm else h.hexdigest()


