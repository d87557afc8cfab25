"""Writing a store: shards built sample by sample, committed atomically, and the manifest that lists them."""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from eyas.store.layout import (
    FORMAT,
    MANIFEST,
    TENSORS,
    VERSION,
    checksum,
    quantize_rows,
    row_specs,
)
from eyas.store.shards import write_safetensors


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


class BackgroundWriter:
    """A thread that runs the copy/checksum/write jobs in order, so they overlap the next forward pass."""

    def __init__(self, depth: int = 4):
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.bytes = 0
        self.thread = threading.Thread(target=self._loop, name="eyas-writer", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (job := self.q.get()) is not None:
            if self.error is None:
                try:
                    job()
                except BaseException as e:  # noqa: BLE001 - handed to the main thread, re-raised by put/close
                    self.error = e

    def put(self, job: Callable[[], None]) -> None:
        if self.error is not None:
            raise self.error
        self.q.put(job)

    def close(self) -> None:
        self.q.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
