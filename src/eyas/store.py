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

import dataclasses
import errno
import hashlib
import io
import json
import math
import mmap
import os
import re
import struct
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self

import numpy as np
import torch
import xxhash

from eyas.errors import EyasError

FORMAT, VERSION = "eyas-store", 1
SHARD_DIR, MANIFEST = "shards", "manifest.json"
TENSORS = ("input_ids", "loss_mask", "aux", "final", "aux_exp", "final_exp")  # checksum order
OPEN_FILES = 128  # shards a reader keeps open (file and memory map)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Worst-case error of the compact store, elementwise: |x - x~| <= |x| / 16 + amax(row) / COMPACT_ABS_DIV
# (3 mantissa bits round to within 2**-4 relatively; below 2**-6 * scale, e4m3 subnormals step by 2**-9 * scale,
# and the power-of-two scale is < amax / 224).
COMPACT_REL, COMPACT_ABS_DIV = 1 / 16, 224 * 1024

_ST_DTYPES = {torch.int32: "I32", torch.int8: "I8", torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3",
              torch.int64: "I64", torch.float32: "F32", torch.float16: "F16"}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
# A shard is named by a plain file name in STORE/shards: a manifest cannot point a reader at any other file.
SHARD_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}\.safetensors")


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


# ---------------------------------------------------------------- safetensors files

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

    xxh3-128 runs at memory speed (about 50 GiB/s over data in cache, on one core) where blake2b runs at 1 GiB/s:
    the reader checks each sample on its first read, and with blake2b that check cost more than the read."""
    h = xxhash.xxh3_128() if algorithm == "xxh3" else hashlib.blake2b(digest_size=16)
    for t in parts:  # tensors, or buffers of their bytes (StoreReader.read_into)
        h.update(t.contiguous().view(torch.uint8).numpy().data if isinstance(t, torch.Tensor) else t)
    return f"{algorithm}:{h.hexdigest()}" if algorithm else h.hexdigest()


_DISK_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
              errno.EFBIG: "the file size limit is reached (ulimit -f, or the file system's largest file)"}


def disk_full(e: BaseException) -> str | None:
    """Why a write failed when it is for want of room (ENOSPC, EDQUOT, EFBIG, also inside a safetensors error), else
    None: the errors a user fixes by freeing space rather than by changing anything in eyas."""
    code = getattr(e, "errno", None)
    if code is None:  # safetensors' Rust writer: "... I/O error: No space left on device (os error 28)"
        m = re.search(r"\(os error (\d+)\)", str(e))
        code = int(m.group(1)) if m else None
    return _DISK_FULL.get(code)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Write a safetensors file atomically (temp name, fsync, rename); returns its size in bytes.

    Tensors go in order of decreasing item size, so every tensor's data is aligned for zero-copy views.
    """
    names = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict = {"__metadata__": metadata}
    pos = 0
    for n in names:
        t = tensors[n]
        header[n] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(len(blob) + 8) % 8)  # data starts 8-byte aligned
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for n in names:
                f.write(tensors[n].contiguous().view(torch.uint8).numpy().data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # half a file is of no use, and on a full disk it holds the space
        raise
    _fsync_dir(path.parent)
    return 8 + len(blob) + pos


def read_header(path: Path, f: io.FileIO | None = None) -> tuple[dict, int]:
    """(header, offset of the data section); an EyasError naming the file when it is not a whole shard.
    `f`: the shard already open (its size and header are then read from it, not from the path again)."""
    try:
        if f is None:
            with open_shard(path) as g:
                return read_header(path, g)
        size = os.fstat(f.fileno()).st_size
        f.seek(0)
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise ValueError(f"header of {n} bytes in a {size}-byte file")
        header = json.loads(f.read(n))
    except (ValueError, struct.error, UnicodeDecodeError, RecursionError) as e:
        raise EyasError(f"shard {path} is corrupted: unreadable header ({str(e)[:120]})",
                        fix="delete the shard and re-run the command that wrote the store") from None
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        raise EyasError(f"shard {path} is corrupted: its header does not describe tensors",
                        fix="delete the shard and re-run the command that wrote the store") from None
    if 8 + n + end != size:
        raise EyasError(f"shard {path} is truncated: {size:,} bytes, its header describes {8 + n + end:,}",
                        fix="delete the shard and re-run the command that wrote the store (finished shards are kept)")
    return header, 8 + n


def open_shard(path: Path) -> io.FileIO:
    """The shard file, opened for reading; an EyasError saying why it cannot be."""
    try:
        return open(path, "rb", buffering=0)  # the caller closes it
    except FileNotFoundError:
        raise EyasError(f"shard {path} is missing", fix="re-run the command that wrote the store") from None
    except OSError as e:
        raise EyasError(f"shard {path} cannot be read: {e.strerror}",
                        fix="check the file's permissions and the disk it is on") from None


def shard_index(path: Path) -> dict:
    """A complete shard's own index (its `eyas` metadata) plus its size."""
    header, _ = read_header(path)
    meta = json.loads(header.get("__metadata__", {}).get("eyas", "null") or "null")
    if not isinstance(meta, dict) or "rows" not in meta:
        raise EyasError(f"{path} is not an eyas shard (no `eyas` index in its metadata)",
                        fix="remove foreign files from the store's shards folder")
    return {**meta, "name": path.name, "bytes": path.stat().st_size}


# ---------------------------------------------------------------- writing

class ShardBuilder:
    """One shard's samples in preallocated storage buffers; `commit` writes it atomically."""

    def __init__(self, name: str, tokens: int, hidden: int, compact: bool):
        self.name, self.hidden, self.compact, self.fill = name, hidden, compact, 0
        self.t = {n: torch.empty(tokens, *shape, dtype=dt) for n, (dt, shape) in row_specs(hidden, compact).items()}
        self.entries: dict[str, list] = {"rows": [], "ids": [], "offsets": [], "lengths": [], "checksums": []}

    def add(self, row: int, sample_id: str, input_ids, loss_mask, aux: Sequence[torch.Tensor], final) -> None:
        """aux: the three feature layers, each [L, H]; final [L, H]; any float dtype (cast to storage)."""
        o, L, H = self.fill, len(input_ids), self.hidden
        if o + L > len(self.t["input_ids"]):
            raise ValueError(f"{self.name}: sample {sample_id} overflows the shard's planned tokens")
        sl = slice(o, o + L)
        self.t["input_ids"][sl] = torch.as_tensor(input_ids).to(torch.int32)
        self.t["loss_mask"][sl] = torch.as_tensor(loss_mask).to(torch.int8)
        aux_out = self.t["aux"][sl].view(L, 3, H)  # [L, 3, H] view of [L, 3H]: low | mid | high
        if self.compact:
            q, e = quantize_rows(torch.stack([a[:L] for a in aux], dim=1).reshape(3 * L, H))
            aux_out.copy_(q.view(L, 3, H))
            self.t["aux_exp"][sl] = e.view(L, 3)
            qf, ef = quantize_rows(final[:L])
            self.t["final"][sl], self.t["final_exp"][sl] = qf, ef.view(L, 1)
        else:
            for j, a in enumerate(aux):
                aux_out[:, j].copy_(a[:L])
            self.t["final"][sl].copy_(final[:L])
        self.fill += L
        for k, v in zip(self.entries, (row, sample_id, o, L, checksum([t[sl] for t in self._ordered()]))):
            self.entries[k].append(v)

    def _ordered(self) -> list[torch.Tensor]:
        return [self.t[n] for n in TENSORS if n in self.t]

    def commit(self, folder: Path) -> dict:
        """Write the shard (only now does it become visible); returns its index."""
        if self.fill != len(self.t["input_ids"]):
            raise ValueError(f"{self.name}: {self.fill} of {len(self.t['input_ids'])} planned tokens filled")
        meta = {"format": FORMAT + "-shard", "version": VERSION, **self.entries}
        size = write_safetensors(folder / self.name, self.t, {"eyas": json.dumps(meta, separators=(",", ":"))})
        return {**meta, "name": self.name, "bytes": size}


def check_coverage(shards: list[dict], expected_rows: int | None) -> list[str]:
    """Problems with 'every sample in the store exactly once' (rows 0..expected_rows-1 when given)."""
    seen: dict[int, str] = {}
    problems = []
    for s in shards:
        for r, sid in zip(s["rows"], s["ids"]):
            if r in seen:
                problems.append(f"sample {sid} (row {r}) is in both {seen[r]} and {s['name']}")
            seen[r] = s["name"]
    if expected_rows is not None:
        missing = [r for r in range(expected_rows) if r not in seen]
        if missing:
            problems.append(f"{len(missing)} of {expected_rows} samples are missing (rows {missing[:10]}...)")
    return problems


def write_manifest(store: Path, header: dict, shards: list[dict]) -> dict:
    """Merge shard indexes into STORE/manifest.json (atomic); samples in row order, one per line."""
    samples = sorted((r, sid, s["name"], o, n, c) for s in shards
                     for r, sid, o, n, c in zip(s["rows"], s["ids"], s["offsets"], s["lengths"], s["checksums"]))
    tokens = sum(x[4] for x in samples)
    size = sum(s["bytes"] for s in shards)
    totals = {"samples": len(samples), "tokens": tokens, "shards": len(shards), "bytes": size,
              "bytes_per_token": round(size / max(tokens, 1), 1)}
    shard_list = [{"name": s["name"], "bytes": s["bytes"], "samples": len(s["rows"]), "tokens": sum(s["lengths"])}
                  for s in sorted(shards, key=lambda s: s["name"])]
    head = {"format": FORMAT, "version": VERSION, **header, "totals": totals, "shards": shard_list}
    text = json.dumps(head, indent=1)[:-2] + ',\n "samples": [\n'
    text += ",\n".join(json.dumps({"row": r, "id": sid, "shard": sh, "offset": o, "length": n, "checksum": c})
                       for r, sid, sh, o, n, c in samples)
    text += "\n ]\n}\n"
    tmp = store / f".{MANIFEST}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, store / MANIFEST)
    return totals


# ---------------------------------------------------------------- reading

@dataclasses.dataclass
class StoreSample:
    id: str
    input_ids: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] int8, 1 on trained tokens
    aux: torch.Tensor  # [L, 3H] bf16: the three feature layers, low | mid | high
    final: torch.Tensor  # [L, H] bf16: last hidden state after the final norm


class _Shard:
    """A shard: where each stored tensor lies, read once from its header (`rows[name] = (byte offset, bytes per
    token)`, in checksum order; `tokens` rows each), and, opened on demand, the file (for
    `StoreReader.read_into`) and a private memory map of it with one tensor view per stored tensor (`tensors()`,
    no copy). `close` gives both back; reopening checks that the file is still the one whose header was read."""

    def __init__(self, path: Path, expected: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
        with open_shard(path) as f:  # the header and the identity of one and the same file
            header, start = read_header(path, f)
            self.path, self.spec, self.start = path, {}, start
            self.identity, self.head = self._identity(f), self._head(f)
        self._file = self._t = None
        try:
            for name, spec in header.items():
                if name == "__metadata__":
                    continue
                dt, shape, (a, b) = _TORCH_DTYPES[spec["dtype"]], list(spec["shape"]), spec["data_offsets"]
                if not all(type(x) is int and x >= 0 for x in [*shape, a, b]) or not shape \
                        or math.prod(shape) * dt.itemsize != b - a:
                    raise ValueError(f"{name}: shape {shape} of {spec['dtype']} in bytes {a}..{b}")
                self.spec[name] = (dt, shape, start + a)
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # a damaged header: dtype, shape, offsets
            raise self._corrupted(f"its header does not describe readable tensors ({type(e).__name__}: "
                                  f"{str(e)[:80]})") from None
        wrong = [n + (f" (a {self.spec[n][0]} {self.spec[n][1]})" if n in self.spec else " (missing)")
                 for n, (dt, row) in expected.items()
                 if n not in self.spec or self.spec[n][0] != dt or tuple(self.spec[n][1][1:]) != row]
        if wrong:
            raise self._corrupted("it does not hold the store's tensors: " + ", ".join(wrong))
        self.tokens = self.spec["input_ids"][1][0]
        if any(shape[0] != self.tokens for _, shape, _ in self.spec.values()):
            raise self._corrupted("its tensors have different numbers of rows")
        self.rows = {n: (self.spec[n][2], math.prod(self.spec[n][1][1:]) * self.spec[n][0].itemsize)
                     for n in expected}

    def _corrupted(self, why: str) -> EyasError:
        return EyasError(f"shard {self.path} is corrupted: {why}",
                         fix="delete the shard and re-run the command that wrote the store")

    @staticmethod
    def _identity(f) -> tuple[int, int, int]:
        st = os.fstat(f.fileno())
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _head(self, f) -> bytes:
        """A digest of the header's bytes, which hold every sample's place and checksum."""
        f.seek(0)
        return xxhash.xxh3_128(f.read(self.start)).digest()

    def _open(self):
        """The shard file, opened again, after checking it is still the one whose header was read: the same
        inode, size and modification time, or else (a copy, a file system without stable inodes) the same size
        and header bytes."""
        if not self.path.is_file():
            raise EyasError(f"shard {self.path} was removed while its store was being read",
                            fix="open the store again (rerun the command) once it is complete")
        f = open_shard(self.path)
        identity = self._identity(f)
        if identity != self.identity:
            if identity[1] != self.identity[1] or self._head(f) != self.head:
                f.close()
                raise EyasError(f"shard {self.path} was replaced or changed while its store was being read",
                                "its samples may no longer be where the reader found them",
                                "open the store again (rerun the command) once it is complete")
            self.identity = identity
        return f

    def file(self) -> io.FileIO:
        if self._file is None:
            self._file = self._open()
        return self._file

    def tensors(self) -> dict[str, torch.Tensor]:
        if self._t is None:
            with self._open() as f:  # a private mapping: writes to a view never reach the file
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            with warnings.catch_warnings():  # frombuffer warns that the buffer is not writable: it is (a copy)
                warnings.simplefilter("ignore", UserWarning)
                self._t = {n: torch.frombuffer(mm, dtype=dt, count=math.prod(shape), offset=off).view(shape)
                           if math.prod(shape) else torch.empty(shape, dtype=dt)
                           for n, (dt, shape, off) in self.spec.items()}
        return self._t

    def close(self) -> None:
        """Close the file and drop the map (views handed out keep it alive until they go)."""
        if self._file is not None:
            self._file.close()
        self._file = self._t = None


def _read_fully(f: io.FileIO, dst: np.ndarray, pos: int) -> int:
    """Read len(dst) bytes at `pos` into dst (pread; one call reads at most about 2 GiB); the bytes read."""
    done = 0
    while done < len(dst):
        if _PREADV:
            k = os.preadv(f.fileno(), [dst[done:]], pos + done)
        else:  # no pread (Windows; macOS before 11): seek and read, under the reader's lock
            f.seek(pos + done)
            k = f.readinto(dst[done:])
        if not k:
            break
        done += k
    return done


_PREADV = hasattr(os, "preadv")


_SAMPLE_FIELDS = {"id": str, "shard": str, "row": int, "offset": int, "length": int}


def manifest_problem(m) -> str | None:
    """What makes `m` unreadable as a manifest (the types the reader relies on), or None."""
    if not isinstance(m, dict):
        return "it is not a JSON object"
    for key, kind in (("target", dict), ("shards", list), ("samples", list)):
        if not isinstance(m.get(key), kind):
            return f"its {key!r} is missing or not a {'list' if kind is list else 'mapping'}"
    if type(m["target"].get("hidden_size")) is not int:
        return "its target has no hidden_size"
    for k, sh in enumerate(m["shards"]):
        if not isinstance(sh, dict) or not isinstance(sh.get("name"), str) or type(sh.get("bytes")) is not int:
            return f"shard entry {k} lacks a name or a size in bytes"
    for k, s in enumerate(m["samples"]):
        if not isinstance(s, dict) or any(type(s.get(f)) is not t for f, t in _SAMPLE_FIELDS.items()) \
                or s["offset"] < 0 or s["length"] < 0:
            return f"sample entry {k} lacks an id, shard, row, offset or length, or one has the wrong type"
    return None


class StoreReader:
    """Random access to a store's samples: `reader[i]` returns zero-copy views into the memory-mapped shards,
    `reader.read_into(i, buffers)` copies the sample's stored rows into the caller's buffers (the trainer's way).

    `skip_bad=True` leaves out (and counts in `.skipped`) the samples of shards that are missing or truncated,
    instead of refusing to open the store. `check_reads=True` checks each sample's checksum the first time it is
    read, so damaged bytes are an error naming the shard and sample, never data.
    """

    def __init__(self, path: str | Path, *, skip_bad: bool = False, check_reads: bool = True):
        self.path = Path(path)
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            raise EyasError(f"{self.path} is not a hidden-state store (no {MANIFEST})",
                            fix="give the folder written by `eyas extract` or `eyas store import`; "
                                "an interrupted extract writes it when rerun to completion")
        try:
            self.manifest = json.loads(mpath.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise EyasError(f"{mpath} is corrupted: {str(e)[:120]}",
                            fix="re-run the command that wrote the store") from None
        if (why := manifest_problem(self.manifest)) is not None:
            raise EyasError(f"{mpath} is damaged: {why}", fix="re-run the command that wrote the store "
                            "(never edit a manifest by hand)")
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != VERSION:
            raise EyasError(f"{mpath} is not an eyas store of version {VERSION}", fix="re-extract with this eyas")
        self._check_names(mpath)
        self.bad_shards = self._check_files()
        if self.bad_shards and not skip_bad:
            name, why = next(iter(self.bad_shards.items()))
            raise EyasError(f"store {self.path}: shard {name} {why}" + (
                f" (and {len(self.bad_shards) - 1} more)" if len(self.bad_shards) > 1 else ""),
                fix="re-run the extract/import command (it rewrites missing shards), or leave their samples out: "
                    "`eyas train --skip-bad-shards`, StoreReader(..., skip_bad=True)")
        all_samples = self.manifest["samples"]
        self.samples = [s for s in all_samples if s["shard"] not in self.bad_shards]
        self.skipped = len(all_samples) - len(self.samples)
        self.lengths = np.fromiter((s["length"] for s in self.samples), dtype=np.int64, count=len(self.samples))
        self.ids = [s["id"] for s in self.samples]
        self._shards: dict[str, _Shard] = {}  # every shard read so far (its layout: a few numbers)
        self._open: dict[str, _Shard] = {}  # of which those with open files or maps, least recently used first
        self._lock = threading.RLock()
        self._unchecked = np.ones(len(self.samples), dtype=bool) if check_reads else None

    def _check_names(self, mpath: Path) -> None:
        """Every shard the manifest names is a plain file name in STORE/shards, never a path."""
        names = {s["name"] for s in self.manifest["shards"]} | {s["shard"] for s in self.manifest["samples"]}
        bad = [n for n in names if not SHARD_FILE.fullmatch(n)]  # strings: manifest_problem checked the types
        if bad:
            raise EyasError(f"{mpath} names the shard {bad[0]!r}, which is not a file name in {self.path / SHARD_DIR}",
                            "a store reads only its own shards/ folder; a path there could read any file",
                            "re-run the command that wrote the store (never edit a manifest by hand)")

    def _check_files(self) -> dict[str, str]:
        """Shards that are missing or whose size differs from the manifest (a cheap stat per shard)."""
        bad = {}
        for s in self.manifest["shards"]:
            p = self.path / SHARD_DIR / s["name"]
            if not p.is_file():
                bad[s["name"]] = f"is missing ({p})"
            elif p.stat().st_size != s["bytes"]:
                bad[s["name"]] = f"has {p.stat().st_size:,} bytes, the manifest says {s['bytes']:,} (truncated?)"
        return bad

    # --- what the store is
    @property
    def identity(self) -> dict:
        return dict(self.manifest["target"])

    @property
    def layer_ids(self) -> list[int]:
        return list(self.manifest["layer_ids"])

    @property
    def compact(self) -> bool:
        return bool(self.manifest.get("compact"))

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["target"]["hidden_size"])

    def check_target(self, identity: dict) -> None:
        """Refuse a target other than the one the store was extracted from."""
        mine = self.identity
        diff = sorted(k for k in set(mine) | set(identity) if mine.get(k) != identity.get(k))
        if diff:
            detail = "; ".join(f"{k}: store {mine.get(k)!r}, target {identity.get(k)!r}" for k in diff)
            raise EyasError(f"store {self.path} was extracted from another target ({detail})",
                            "hidden states only teach a draft about the model that produced them",
                            f"use --target {mine.get('name')} or extract a store from this target")

    # --- samples
    def __len__(self) -> int:
        return len(self.samples)

    def shard(self, name: str) -> _Shard:
        """Shard `name`, counted as in use: at most OPEN_FILES shards keep a file or a map open (a terabyte store
        has thousands of shards, more than a process may open), the least recently used is closed first."""
        with self._lock:
            sh = self._shards.get(name)
            if sh is None:
                sh = self._shards[name] = _Shard(self.path / SHARD_DIR / name, self.row_specs)
            self._open[name] = self._open.pop(name, sh)
            if len(self._open) > OPEN_FILES:
                self._open.pop(next(iter(self._open))).close()
            return sh

    def close(self) -> None:
        """Close every open shard file and drop the maps (the reader stays usable: shards reopen on demand)."""
        with self._lock:
            for sh in self._open.values():
                sh.close()
            self._open.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _locate(self, i: int) -> tuple[dict, _Shard]:
        """Sample i's manifest entry and its shard, checking that the sample lies inside the shard."""
        s = self.samples[i]
        sh = self.shard(s["shard"])
        if not 0 <= s["offset"] <= s["offset"] + s["length"] <= sh.tokens:
            raise EyasError(f"store {self.path}: sample {s['id']} lies at rows {s['offset']}..{s['offset'] + s['length']}"
                            f" of shard {s['shard']}, which has {sh.tokens}", "the manifest and the shard disagree",
                            self._fix)
        return s, sh

    @property
    def _fix(self) -> str:
        return (f"`eyas store verify {self.path}` lists every damaged sample; delete the shards it names and rerun "
                "the extract (it rewrites only those), or import again")

    def __getitem__(self, i: int) -> StoreSample:
        """Sample i as views into the memory-mapped shard (a compact store's features decoded to bf16)."""
        with self._lock:
            s, sh = self._locate(i)
            t = sh.tensors()
        sl = slice(s["offset"], s["offset"] + s["length"])
        rows = {n: t[n][sl] for n in sh.rows}
        if self._unchecked is not None and self._unchecked[i]:
            self._check(i, list(rows.values()))
        aux, final = features(rows)
        return StoreSample(s["id"], rows["input_ids"].long(), rows["loss_mask"], aux, final)

    @property
    def row_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """{stored tensor: (dtype, shape of one token's row)}: the buffers `read_into` fills."""
        return row_specs(self.hidden_size, self.compact)

    def read_into(self, i: int, out: dict[str, np.ndarray], at: int = 0) -> int:
        """Copy sample i's stored rows into caller-owned buffers from token `at` on; returns its length.

        `out[name]` is a flat uint8 view of a buffer of the stored dtype and row shape (`row_specs`), for every
        stored tensor. The kernel copies the bytes out of the page cache (pread), which runs at the speed of
        reading the files in order, where copying out of the memory map ran 0.6x that (bench/bench_extract.py).
        Nothing here touches torch: per sample, a few system calls. A sample's first read checks its checksum
        on the bytes just copied. Safe to call from several threads (they take turns).
        """
        with self._lock:  # another thread's shard() could otherwise close this shard's file mid-read
            s, sh = self._locate(i)
            o, n = s["offset"], s["length"]
            parts = []
            for name, (start, width) in sh.rows.items():
                dst = out[name][at * width:(at + n) * width]
                if len(dst) != n * width:
                    raise ValueError(f"read_into: the {name} buffer holds {len(out[name]) // width} rows, sample "
                                     f"{s['id']} needs {at + n} (from row {at})")
                try:
                    got = _read_fully(sh.file(), dst, start + o * width)
                except OSError as e:
                    raise EyasError(f"store {self.path}: shard {s['shard']}: reading sample {s['id']} failed: "
                                    f"{e.strerror}", "the disk or file system reported an error",
                                    f"check the disk (dmesg), then `eyas store verify {self.path}`") from None
                if got != n * width:
                    raise EyasError(f"store {self.path}: shard {s['shard']} ends inside sample {s['id']} (row "
                                    f"{s['row']})", "the shard was cut short after it was opened", self._fix)
                parts.append(dst)
            if self._unchecked is not None and self._unchecked[i]:
                self._check(i, parts)
        return n

    def _check(self, i: int, parts: list) -> None:
        s = self.samples[i]
        if not matches(parts, s["checksum"]):
            raise EyasError(f"store {self.path}: shard {s['shard']}: sample {s['id']} (row {s['row']}) is "
                            "corrupted (its checksum differs)", "the shard was damaged after it was written",
                            self._fix)
        self._unchecked[i] = False

    # --- checking
    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        """Recompute every checksum; the problems found, each naming the shard and sample (empty: all good).

        `progress(n_bytes)` is called after each shard.
        """
        problems = [f"shard {n} {why}" for n, why in self.bad_shards.items()]
        by_shard: dict[str, list[dict]] = {}
        for s in self.manifest["samples"]:
            by_shard.setdefault(s["shard"], []).append(s)
        for info in self.manifest["shards"]:
            name = info["name"]
            if name not in self.bad_shards:
                problems += self._verify_shard(name, by_shard.get(name, []))
            if progress:
                progress(info["bytes"])
        return problems

    def _verify_shard(self, name: str, samples: list[dict]) -> list[str]:
        try:
            sh = self.shard(name)
            t = sh.tensors()
        except EyasError as e:
            return [str(e).split("\n")[0]]  # unreadable, or lacking tensors
        problems = []
        for s in samples:
            sl = slice(s["offset"], s["offset"] + s["length"])
            if sl.stop > sh.tokens:
                problems.append(f"shard {name}: sample {s['id']} ends at row {sl.stop}, the shard has {sh.tokens}")
            elif not matches([t[n][sl] for n in sh.rows], s["checksum"]):
                problems.append(f"shard {name}: sample {s['id']} (row {s['row']}) is corrupted (checksum differs)")
        return problems
