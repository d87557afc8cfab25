"""The trainer's data layer: sample sources, micro-batch tensors, a prefetch thread, online features.

A *source* is any object with the `eyas.store.reader.StoreReader` interface: `len`, `[i] -> sample` with `id`,
`input_ids [L]`, `loss_mask [L]`, `aux [L,3H]`, `final [L,H]`, plus `.lengths` (numpy token counts),
`.identity` and `.check_target(identity)`. A prepared dataset (`PreparedSource`, for `--online`) has no
features: the target computes them in the loop (`capture_features`).

Micro-batches come from `eyas.train.sharding` as tuples of units (sample indices packed into one row).
`load_micro_batch` turns them into a `Batch` (a store's samples are read straight into it by `read_batch`, other
sources' samples copied by `collate`): rows right-padded to the longest, `position_ids` restarting at 0 for every packed
sample and `doc_ids` numbering them (-1 on padding), which `eyas.draft.ttt.ttt_forward` turns into
document-aware attention. `Prefetcher` builds the next batches on a background thread, so the step never waits
on reading and copying (the time it does wait is measured).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from eyas.core.errors import EyasError
from eyas.data.prepared import open_prepared
from eyas.draft.cross_entropy import TargetRows
from eyas.draft.ttt import counted
from eyas.models.capture import Capture
from eyas.store.layout import features
from eyas.store.reader import StoreReader, check_tokens


@dataclasses.dataclass
class Sample:
    id: str
    input_ids: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L]
    aux: torch.Tensor | None = None  # [L,3H]
    final: torch.Tensor | None = None  # [L,H]


def open_store(path: str, skip_bad: bool = False):
    """The hidden-state store reader (eyas.store), with a clear error when the folder is not a store.
    `skip_bad`: the samples of missing or truncated shards are left out and counted (`reader.skipped`)."""
    if not Path(path).exists():
        raise EyasError(f"store {path} not found", fix="run `eyas extract --store DIR` first, or pass --store DIR")

    return StoreReader(path, skip_bad=skip_bad)


def check_store_data(reader, data: str) -> None:
    """Refuse a store that was not extracted from the prepared dataset `data` (`train --store S --data D`): equal
    fingerprints when both record one, else every sample's ids and token ids against its prepared row."""

    recorded = reader.manifest.get("dataset") or {}
    split = recorded.get("split") or "train"
    fingerprint = open_prepared(data, split).fingerprint
    fix = f"train on the store extracted from {data} (eyas extract --data {data}), or give the dataset it came from"
    if recorded.get("fingerprint") and fingerprint:
        if recorded["fingerprint"] != fingerprint:
            raise EyasError(f"store {reader.path} was extracted from another dataset than {data}: dataset "
                            f"fingerprint {str(recorded['fingerprint'])[:16]} in the store, {str(fingerprint)[:16]} "
                            f"in {data}", "its hidden states belong to other token sequences", fix)
        return
    problems = check_tokens(reader, data, split)
    if problems:
        raise EyasError(f"store {reader.path} does not hold the tokens of {data} [{split}]: {len(problems)} "
                        f"sample(s) differ, e.g. {problems[0]}", "its hidden states belong to other token sequences",
                        fix)


class PreparedSource:
    """A split of a prepared dataset (eyas.data.prepare) as a source without features (online training)."""

    def __init__(self, folder: str, split: str = "train"):
        self.folder, self.split = folder, split
        prepared = open_prepared(folder, split)
        self.ds = prepared.ds.with_format("numpy", columns=["input_ids", "loss_mask"])
        self.ids = prepared.ds["id"]
        self.lengths = np.asarray(prepared.ds["num_tokens"], dtype=np.int64)
        self.identity = prepared.identity

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Sample:
        row = self.ds[int(i)]
        return Sample(self.ids[int(i)], torch.from_numpy(row["input_ids"].astype(np.int64)),
                      torch.from_numpy(row["loss_mask"].astype(np.int64)))

    def token_ids(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        row = self.ds[int(i)]
        return row["input_ids"], row["loss_mask"]

    def check_target(self, identity: dict) -> None:
        """Features come from the target itself; the prepared tokens only need the target's vocabulary."""
        mine = self.identity.get("vocab_size")
        if mine is not None and mine != identity.get("vocab_size"):
            raise EyasError(f"{self.folder} was tokenized for a vocabulary of {mine:,} ids, the target has "
                            f"{identity.get('vocab_size'):,}", "the token ids would mean other tokens",
                            f"prepare the data with --target {identity.get('name')}")


class Subset:
    """Some samples of a source (a validation hold-out), with the source's interface."""

    def __init__(self, source, indices: np.ndarray, share_of: int | None = None):
        self.source, self.indices = source, np.asarray(indices, dtype=np.int64)
        self.share_of = share_of  # with --data-fraction: the training samples this is a share of
        self.lengths = np.asarray(source.lengths)[self.indices]
        self.identity = getattr(source, "identity", {})

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.source[int(self.indices[i])]

    @property
    def row_specs(self):  # only when the source is a store (an AttributeError otherwise)
        return self.source.row_specs

    def read_into(self, i: int, out: dict, at: int = 0) -> int:
        return self.source.read_into(int(self.indices[i]), out, at)

    def token_ids(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.source.token_ids(int(self.indices[i]))

    def check_target(self, identity: dict) -> None:
        self.source.check_target(identity)


def split_holdout(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) indices: a seeded `fraction` of 0..n-1 held out (at least 1 when fraction > 0)."""
    if fraction <= 0:
        return np.arange(n), np.arange(0)
    k = min(n - 1, max(1, round(n * fraction)))
    perm = np.random.default_rng([seed, 7919]).permutation(n)
    return np.sort(perm[k:]), np.sort(perm[:k])


def nested_share(n: int, fraction: float, seed: int) -> np.ndarray:
    """The sorted indices of a seeded `fraction` of 0..n-1 (at least 1): a prefix of one permutation, so a smaller
    share's samples are all within a larger one's (the points of a data-scaling curve differ only by data)."""
    if fraction >= 1:
        return np.arange(n)
    k = min(n, max(1, round(n * fraction)))
    return np.sort(np.random.default_rng([seed, 104729]).permutation(n)[:k])


# -- batches ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor  # [B,T] int64
    loss_mask: torch.Tensor  # [B,T] int64
    position_ids: torch.Tensor  # [B,T] restarting at 0 for every packed sample
    doc_ids: torch.Tensor  # [B,T] sample number within its row, -1 on padding
    aux: torch.Tensor | None  # [B,T,3H] (None until online features are computed)
    final: torch.Tensor | None  # [B,T,H]
    samples: int  # samples in the batch (repeats included)
    repeats: int  # of which padding repeats
    tokens: int  # real (non-padding) tokens
    docs: tuple[tuple[int, int, int], ...]  # (row, start, length) of every sample: online feature extraction
    # a compact store's stored rows (fp8 features and their exponents), still encoded: decoded where the batch goes
    # (Batch.to), so on a GPU the device decodes them and the host copies half the bytes (aux and final are None)
    encoded: dict[str, torch.Tensor] | None = None

    def to(self, device: str, dtype: torch.dtype | None = None) -> Batch:
        nb = str(device).startswith("cuda")

        def mv(t, float_=False):
            if t is None:
                return None
            t = t.to(device, non_blocking=nb)
            return t.to(dtype) if float_ and dtype is not None else t

        aux, final = self.aux, self.final
        if self.encoded is not None:
            aux, final = features({n: t.to(device, non_blocking=nb) for n, t in self.encoded.items()})
        return dataclasses.replace(self, input_ids=mv(self.input_ids), loss_mask=mv(self.loss_mask),
                                   position_ids=mv(self.position_ids), doc_ids=mv(self.doc_ids),
                                   aux=mv(aux, True), final=mv(final, True), encoded=None)

    def padded(self, smallest: int) -> Batch:
        """The batch with T rounded up to a power of two of at least `smallest` by padding positions (loss mask 0,
        doc -1, zero features), which no TTT step counts: a compiled step then sees a handful of shapes (each one
        a compilation), not one per length."""
        T = self.input_ids.shape[1]
        extra = max(smallest, 1 << (T - 1).bit_length()) - T
        if not extra:
            return self

        def pad(t, value=0):
            if t is None:
                return None
            return torch.nn.functional.pad(t, (0, 0, 0, extra) if t.dim() == 3 else (0, extra), value=value)

        return dataclasses.replace(self, input_ids=pad(self.input_ids), loss_mask=pad(self.loss_mask),
                                   position_ids=pad(self.position_ids), doc_ids=pad(self.doc_ids, -1),
                                   aux=pad(self.aux), final=pad(self.final))


def positions(row_lengths: list[list[int]], T: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Rows of packed sample lengths -> (position_ids [B,T] restarting at 0 for every sample, doc_ids [B,T]
    numbering the samples of a row, -1 on padding, docs: (row, start, length) of every sample)."""
    pos = np.zeros((len(row_lengths), T), dtype=np.int64)
    doc = np.full((len(row_lengths), T), -1, dtype=np.int64)
    docs = []
    for r, lengths in enumerate(row_lengths):
        at = 0
        for d, n in enumerate(lengths):
            pos[r, at:at + n], doc[r, at:at + n] = np.arange(n), d
            docs.append((r, at, n))
            at += n
    return torch.from_numpy(pos), torch.from_numpy(doc), tuple(docs)


def collate(rows: list[list[Sample]], repeats: int = 0, pin: bool = False) -> Batch:
    """Rows of samples (several = packed) -> one right-padded Batch."""
    row_lengths = [[len(s.input_ids) for s in row] for row in rows]
    lens = [sum(r) for r in row_lengths]
    B, T = len(rows), max(lens)
    first = rows[0][0]
    feats = first.aux is not None
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    aux = torch.zeros(B, T, first.aux.shape[-1], dtype=first.aux.dtype) if feats else None
    final = torch.zeros(B, T, first.final.shape[-1], dtype=first.final.dtype) if feats else None
    for r, row in enumerate(rows):
        at = 0
        for s in row:
            n = len(s.input_ids)
            ids[r, at:at + n], mask[r, at:at + n] = s.input_ids, s.loss_mask
            if feats:
                aux[r, at:at + n], final[r, at:at + n] = s.aux, s.final
            at += n
    if pin:
        aux, final = (t.pin_memory() if t is not None else None for t in (aux, final))
    pos, doc, docs = positions(row_lengths, T)
    return Batch(ids, mask, pos, doc, aux, final, sum(len(r) for r in rows), repeats, sum(lens), docs)


def read_batch(store, micro: tuple[tuple[int, ...], ...], repeats: int = 0, pin: bool = False) -> Batch:
    """A micro-batch read straight from a store (`StoreReader`, or a `Subset` of one) into the batch's own
    buffers: each sample's stored rows by `store.read_into` (the kernel's copy out of the page cache, no per-sample
    tensor work), then the ids widened and a compact store's features decoded once for the whole batch."""
    lengths = np.asarray(store.lengths)
    row_lengths = [[int(lengths[i]) for i in unit] for unit in micro]
    lens = [sum(r) for r in row_lengths]
    B, T = len(micro), max(lens)
    specs = store.row_specs
    compact = "aux_exp" in specs
    pinned = ("aux", "final", "aux_exp", "final_exp") if pin else ()  # a GPU's batch: its features copied async
    raw = {n: torch.empty(B, T, *shape, dtype=dt, pin_memory=n in pinned) for n, (dt, shape) in specs.items()}
    flat = [t.view(torch.uint8).numpy().reshape(B, -1) for t in raw.values()]  # byte views, made once a batch
    for r, unit in enumerate(micro):
        out = dict(zip(raw, (a[r] for a in flat)))
        at = 0
        for i in unit:
            at += store.read_into(int(i), out, at)
        for a in out.values():  # padding: zero ids and mask, and features that cannot be NaN
            a[at * (len(a) // T):] = 0
    pos, doc, docs = positions(row_lengths, T)
    if compact and pin:  # decoded on the device it goes to (Batch.to)
        encoded = {n: raw[n] for n in ("aux", "final", "aux_exp", "final_exp")}
        return Batch(raw["input_ids"].long(), raw["loss_mask"].long(), pos, doc, None, None,
                     sum(len(u) for u in micro), repeats, sum(lens), docs, encoded)
    aux, final = features(raw)
    return Batch(raw["input_ids"].long(), raw["loss_mask"].long(), pos, doc, aux, final,
                 sum(len(u) for u in micro), repeats, sum(lens), docs)


def load_micro_batch(source, micro: tuple[tuple[int, ...], ...], repeats: int = 0, pin: bool = False) -> Batch:
    if hasattr(source, "row_specs"):  # a store: read into the batch
        return read_batch(source, micro, repeats, pin)
    return collate([[source[i] for i in unit] for unit in micro], repeats, pin)


class Prefetcher:
    """Iterate batches built on a background thread, `depth` ahead. `wait_s` is the time the consumer spent
    blocked on data (the figure to keep near zero)."""

    _END = object()

    def __init__(self, make: Iterable, depth: int = 4):
        self.q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.wait_s = 0.0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(iter(make),), daemon=True, name="eyas-prefetch")
        self.thread.start()

    def _run(self, it: Iterator) -> None:
        try:
            for item in it:
                while not self._stop.is_set():
                    try:
                        self.q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as e:  # re-raised in the consumer, with its traceback
            self.error = e
        self.q.put(self._END)

    def __iter__(self):
        while True:
            t0 = time.perf_counter()
            item = self.q.get()
            self.wait_s += time.perf_counter() - t0
            if item is self._END:
                if self.error is not None:
                    raise self.error
                return
            yield item

    def close(self) -> None:
        self._stop.set()
        while self.thread.is_alive():
            try:
                self.q.get(timeout=0.05)
            except queue.Empty:
                pass


# -- what the loss counts ----------------------------------------------------------------------------------------
def valid_masks(input_ids: torch.Tensor, loss_mask: torch.Tensor, doc_ids: torch.Tensor, t2d: torch.Tensor,
                steps: int) -> torch.Tensor:
    """[k,B,T] bool: the positions TTT step i counts (the rule of eyas.draft.ttt.ttt_forward: x[t+2+i] loss-masked,
    in the draft vocabulary and in the same document). Cheap, so the global counts are known before backward."""
    return torch.stack([counted(input_ids, loss_mask, doc_ids, t2d, i) for i in range(steps)])


def needed_rows(valid: torch.Tensor) -> torch.Tensor:
    """[B,T] bool: positions u whose target distribution some step reads (u = t+1+i for valid_i(t))."""
    need = torch.zeros_like(valid[0])
    for i in range(valid.shape[0]):
        need[:, 1 + i:] |= valid[i, :, : valid.shape[2] - 1 - i]
    return need


def sparse_target_logp(final: torch.Tensor, head_rows: torch.Tensor, need: torch.Tensor):
    """final [B,T,H], head_rows [Vd,H], need [B,T] -> (TargetRows(final rows [M,H] of the M needed positions,
    head_rows), index [B,T] of each position's row, -1 elsewhere): ttt_forward's compact targets. Their log-probs
    over the draft vocabulary are formed a block of rows at a time inside the cross-entropy
    (eyas.draft.cross_entropy), so neither the [M,Vd] table nor the full-vocabulary logits are ever formed."""
    index = torch.cumsum(need.reshape(-1), 0).reshape(need.shape) - 1
    index = index.masked_fill(~need, -1)
    return TargetRows(final[need].to(head_rows.dtype), head_rows), index  # [M,H]


# -- online: features from the target in the loop ------------------------------------------------------------------
@torch.no_grad()
def capture_features(target, layer_ids: tuple[int, ...], batch: Batch) -> Batch:
    """Run the target on every sample of the batch (separately, so packed samples never attend to each other)
    and fill `aux` [B,T,3H] (HF hidden_states at `layer_ids`, low|mid|high) and `final` [B,T,H] (after the last
    norm), with the extraction's own forward hooks (eyas.models.capture.Capture); the output head is never run."""

    B, T = batch.input_ids.shape
    H, dev = target.hidden_size, target.device
    aux = torch.zeros(B, T, 3 * H, dtype=target.dtype, device=dev)
    final = torch.zeros(B, T, H, dtype=target.dtype, device=dev)
    with Capture(target, list(layer_ids)) as cap:
        for r, start, n in batch.docs:
            target.model.model(input_ids=batch.input_ids[r:r + 1, start:start + n].to(dev), use_cache=False)
            aux[r, start:start + n] = torch.cat(cap.out[:3], dim=-1)[0]  # [n,3H] low|mid|high
            final[r, start:start + n] = cap.out[3][0]
    return dataclasses.replace(batch, aux=aux, final=final)
