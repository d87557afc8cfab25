"""Reading a store: memory-mapped views of its samples, or their rows copied by pread into buffers the caller owns."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import mmap
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Self

import numpy as np
import torch
import xxhash

from eyas.core.errors import EyasError
from eyas.data.prepared import open_prepared
from eyas.store.layout import (
    FORMAT,
    MANIFEST,
    SHARD_DIR,
    VERSION,
    features,
    matches,
    row_specs,
)
from eyas.store.shards import SHARD_FILE, TORCH_DTYPES, open_shard, read_header

OPEN_FILES = 128  # shards a reader keeps open (file and memory map)



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
                dt, shape, (a, b) = TORCH_DTYPES[spec["dtype"]], list(spec["shape"]), spec["data_offsets"]
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
            raise EyasError(f"store {self.path}: sample {s['id']} lies at rows "
                            f"{s['offset']}..{s['offset'] + s['length']} of shard {s['shard']}, which has "
                            f"{sh.tokens}", "the manifest and the shard disagree", self._fix)
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

    def token_ids(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample i's input_ids [L] int32 and loss_mask [L] int8 alone, as views of the mapped shard: the hidden
        states are not read. Not checked: a sample's checksum covers all its rows, and training checks it when it
        reads them (this serves statistics over token ids, such as the draft vocabulary)."""
        with self._lock:
            s, sh = self._locate(i)
            t = sh.tensors()
        sl = slice(s["offset"], s["offset"] + s["length"])
        return t["input_ids"][sl].numpy(), t["loss_mask"][sl].numpy()

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


def check_tokens(reader: StoreReader, data: str, split: str) -> list[str]:
    """Samples whose stored token ids differ from their prepared row (named by shard and id)."""

    ds = open_prepared(data, split).ds.select_columns(["id", "input_ids"])
    problems = []
    for i, s in enumerate(reader.samples):
        if s["row"] >= len(ds):
            problems.append(f"shard {s['shard']}: sample {s['id']} is row {s['row']}, {data} has {len(ds)} rows")
            continue
        row = ds[s["row"]]
        if row["id"] != s["id"] or row["input_ids"] != reader[i].input_ids.tolist():
            problems.append(f"shard {s['shard']}: sample {s['id']} (row {s['row']}) has other token ids than "
                            f"{data} [{split}] row {s['row']} (id {row['id']})")
    return problems
