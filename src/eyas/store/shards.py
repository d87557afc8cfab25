"""A store's shard files: safetensors written atomically and aligned for zero-copy views, headers read and checked.

A shard's header metadata (`eyas`) repeats its own index (rows, ids, offsets, lengths, checksums), so a shard
describes itself: a restart trusts what it finds.
"""

from __future__ import annotations

import io
import json
import os
import re
import struct
from pathlib import Path

import torch

from eyas.core.errors import EyasError

ST_DTYPES = {torch.int32: "I32", torch.int8: "I8", torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3",
              torch.int64: "I64", torch.float32: "F32", torch.float16: "F16"}
TORCH_DTYPES = {v: k for k, v in ST_DTYPES.items()}
# A shard is named by a plain file name in STORE/shards: a manifest cannot point a reader at any other file.
SHARD_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}\.safetensors")


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
        header[n] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
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


