"""Corrupted inputs: damaged store shards and checkpoints, manifests pointing outside the store, a store paired with
another dataset. Each must be detected and named (an EyasError naming the file, with the fix), never a raw
traceback and never silently wrong data.

Bit flips and cuts are tried at many places of each file: a seeded sample of header and data bytes in the fast
subset; with --faults-full up to 3,000 header (or JSON) bytes and 1,000 data bytes per file, two bits each. Each
trial reads everything back through the loader the trainer uses and compares with the pristine file's content:
either the exact same content, or an EyasError naming the file.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from pathlib import Path

import pytest
import torch

from eyas.core.errors import EyasError
from eyas.draft.checkpoint import read_draft
from tests.test_extract import write_prepared
from tests.test_model import small_draft
from tests.test_store import IDENTITY, build_store
from tests.test_store import samples as store_samples

HEADER_SAMPLE, DATA_SAMPLE = 96, 32  # bytes flipped per file in the fast subset
FULL_HEADER_SAMPLE, FULL_DATA_SAMPLE = 3000, 1000  # with --faults-full (two bits each): every header byte of a
# safetensors file (they are smaller), 3,000 bytes of a JSON file


# ---------------------------------------------------------------- helpers

def same(a, b) -> bool:
    """Deep equality of loaded content: tensors bit for bit (dtype and shape too), containers recursively."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(_bits(a), _bits(b)))
    if isinstance(a, dict) and isinstance(b, dict):  # a: what was read, b: the reference
        # every key read back equal; an extra key can only be a renamed "checksum" key (a flip in its name: then
        # the content is unverified, but unchanged), which nothing reads
        return b.keys() <= a.keys() and all(same(a[k], b[k]) for k in b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8) if t.dtype.is_floating_point else t  # NaN == NaN, fp8


def header_end(path: Path) -> int:
    """Where a safetensors file's data starts (the whole file for anything else)."""
    data = path.read_bytes()
    if path.suffix != ".safetensors":
        return len(data)
    return 8 + struct.unpack("<Q", data[:8])[0]


def flip_positions(path: Path, full: bool) -> list[int]:
    """A seeded sample of the header (or JSON) bytes and of the data bytes, larger with --faults-full."""
    size, head = path.stat().st_size, header_end(path)
    header, data = list(range(head)), list(range(head, size))
    rng = random.Random(path.name)
    header = sorted(rng.sample(header, min(len(header), FULL_HEADER_SAMPLE if full else HEADER_SAMPLE)))
    return header + sorted(rng.sample(data, min(len(data), FULL_DATA_SAMPLE if full else DATA_SAMPLE)))


def cut_points(path: Path) -> list[int]:
    size, head = path.stat().st_size, header_end(path)
    return sorted({0, 1, 7, 8, 9, head // 2, head - 1, head, head + 1, (head + size) // 2, size - 1} & set(range(size)))


class Damage:
    """Flip one bit, or cut the file; `restore` puts the pristine bytes back. Each version is a new file (rename):
    safetensors maps files into memory, and the tensors read before must keep their bytes."""

    def __init__(self, path: Path):
        self.path, self.pristine = path, path.read_bytes()

    def flip(self, pos: int, bit: int) -> None:
        b = bytearray(self.pristine)
        b[pos] ^= 1 << bit
        self._write(bytes(b))

    def cut(self, size: int) -> None:
        self._write(self.pristine[:size])

    def restore(self) -> None:
        self._write(self.pristine)

    def _write(self, data: bytes) -> None:
        tmp = self.path.with_name(self.path.name + ".damaged")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)


def trial(load, reference, names: tuple[str, ...], what: str) -> str:
    """'same' (read back unchanged) or 'detected' (an EyasError naming one of `names`); anything else fails."""
    try:
        got = load()
    except EyasError as e:
        assert any(n in str(e) for n in names), f"{what}: the error does not name the file: {e}"
        assert e.fix, f"{what}: the error gives no fix: {e}"
        return "detected"
    except Exception as e:  # noqa: BLE001 - exactly what must not happen
        pytest.fail(f"{what}: raw {type(e).__name__}: {e}")
    assert same(got, reference), f"{what}: silently different content"
    return "same"


def run_trials(path: Path, load, reference, names, full: bool, tally) -> dict:
    counts = {"same": 0, "detected": 0}
    dmg = Damage(path)
    try:
        for pos in flip_positions(path, full):
            for bit in ((pos % 8, (pos + 3) % 8) if full else (pos % 8,)):
                dmg.flip(pos, bit)
                counts[trial(load, reference, names, f"{path.name}: bit {bit} of byte {pos} flipped")] += 1
        for size in cut_points(path):
            dmg.cut(size)
            assert trial(load, reference, names, f"{path.name} cut to {size} bytes") == "detected"
            counts["detected"] += 1
    finally:
        dmg.restore()
    tally("corrupted inputs detected", counts["detected"])
    tally("corrupted inputs read back unchanged (harmless bytes)", counts["same"])
    assert counts["detected"] > 0
    return counts


# ---------------------------------------------------------------- store shards

def read_store(path: Path, via: str = "views") -> list:
    """Every sample, through the reader the trainer opens (eyas.train.batches.open_store): as the memory-mapped
    views `reader[i]` returns, or read into a micro-batch of its own as the trainer reads (read_batch)."""
    from eyas.train.batches import open_store, read_batch

    reader = open_store(str(path))
    if via == "views":
        out = [(s.id, s.input_ids.clone(), s.loss_mask.clone(), s.aux.clone(), s.final.clone())
               for s in (reader[i] for i in range(len(reader)))]
    else:
        out = [(reader.ids[i], b.input_ids, b.loss_mask, b.aux, b.final)
               for i, b in ((i, read_batch(reader, ((i,),))) for i in range(len(reader)))]
    del reader
    return out


@pytest.mark.parametrize("via", ["views", "batches"])
@pytest.mark.parametrize("compact", [False, True], ids=["bf16", "compact"])
def test_damaged_store_shards_are_named_never_read_wrong(tmp_path, compact, via, faults_full, tally):
    store = build_store(tmp_path / "s", store_samples(7), compact=compact, per_shard=4)
    reference = read_store(store, via)
    for shard in sorted((store / "shards").iterdir()):
        counts = run_trials(shard, lambda: read_store(store, via), reference, (shard.name,), faults_full, tally)
        assert counts["detected"] >= 0.5 * sum(counts.values())  # most bytes of a shard matter


# ---------------------------------------------------------------- manifests pointing outside the store

def _rewrite_manifest(store: Path, edit) -> None:
    m = json.loads((store / "manifest.json").read_text())
    edit(m)
    (store / "manifest.json").write_text(json.dumps(m))


ESCAPES = ["../../etc/passwd", "/etc/passwd", "../../other/shards/shard-000000.safetensors", "shards/../../x",
           "..", "", "sub/shard-000000.safetensors"]


@pytest.mark.parametrize("where", ["shard list", "sample"])
@pytest.mark.parametrize("name", ESCAPES)
def test_manifest_paths_cannot_leave_the_store(tmp_path, name, where, tally):
    data = store_samples(4)
    store = build_store(tmp_path / "s", data, per_shard=4)
    build_store(tmp_path / "other", store_samples(4, seed=1), per_shard=4)  # same sizes, other content
    size = (store / "shards" / "shard-000000.safetensors").stat().st_size

    def edit(m):
        if where == "shard list":
            m["shards"][0].update(name=name, bytes=size)
        for s in m["samples"]:
            s["shard"] = name

    _rewrite_manifest(store, edit)
    with pytest.raises(EyasError) as e:
        read_store(store)
    assert "manifest.json" in str(e.value) and repr(name) in str(e.value) and e.value.fix
    tally("corrupted inputs detected")


# ---------------------------------------------------------------- a store paired with another dataset

def _store_from_prepared(prepared: Path, out: Path, identity: dict, fingerprint) -> Path:
    """A store of the prepared rows (random features: what matters here is which tokens it holds)."""
    from datasets import load_from_disk

    from eyas.store.layout import SHARD_DIR, shard_name
    from eyas.store.writer import ShardBuilder, write_manifest

    rows = list(load_from_disk(str(prepared / "train")))
    H = identity["hidden_size"]
    (out / SHARD_DIR).mkdir(parents=True)
    b = ShardBuilder(shard_name(0), sum(len(r["input_ids"]) for r in rows), H, compact=False)
    for k, r in enumerate(rows):
        L = len(r["input_ids"])
        b.add(k, r["id"], r["input_ids"], r["loss_mask"], [torch.randn(L, H) for _ in range(3)], torch.randn(L, H))
    dataset = {"path": str(prepared), "split": "train", "fingerprint": fingerprint, "samples": len(rows)}
    write_manifest(out, {"target": identity, "layer_ids": [2, 4, 5], "hidden_size": H, "dtype": "bfloat16",
                         "compact": False, "dataset": dataset}, [b.commit(out / SHARD_DIR)])
    return out


@pytest.fixture(scope="module")
def paired(tmp_path_factory):
    """A prepared dataset and its store (recording its fingerprint, or none as an import without --data), another
    dataset (other tokens and fingerprint), and the first with one token changed and no fingerprint."""
    from datasets import Dataset, load_from_disk

    root = tmp_path_factory.mktemp("paired")
    prepared = write_prepared(root / "prepared", n=6, seed=0, lo=8, hi=24)
    other = write_prepared(root / "other", n=6, seed=1, lo=8, hi=24)
    fp = json.loads((prepared / "summary.json").read_text())["fingerprint"]
    edited = root / "edited"
    edited.mkdir()
    ds = load_from_disk(str(prepared / "train"))
    rows = ds.to_dict()
    rows["input_ids"][3][5] += 1
    Dataset.from_dict(rows, features=ds.features).save_to_disk(str(edited / "train"))
    (edited / "summary.json").write_text("{}")
    return {"prepared": prepared, "other": other, "edited": edited,
            "store": _store_from_prepared(prepared, root / "store", IDENTITY, fp),
            "bare": _store_from_prepared(prepared, root / "bare", IDENTITY, None)}


def train_cfg(store: Path, data: Path, out: Path):
    from eyas.train.settings import TrainConfig

    return TrainConfig(store=str(store), data=str(data), out=str(out), target="tiny", threads=1, draft_vocab=64,
                       ttt_steps=1, micro_batch=2, max_steps=1, quiet=True)


def test_trainer_refuses_a_store_made_from_another_dataset(paired, tmp_path, tally):
    from eyas.train.trainer import run

    with pytest.raises(EyasError) as e:  # both record fingerprints, and they differ
        run(train_cfg(paired["store"], paired["other"], tmp_path / "run1"))
    msg = str(e.value)
    assert str(paired["store"]) in msg and str(paired["other"]) in msg and "fingerprint" in msg and e.value.fix
    assert not (tmp_path / "run1" / "metrics.jsonl").exists()
    tally("corrupted inputs detected")
    with pytest.raises(EyasError) as e:  # no fingerprint in the store: the token ids are compared
        run(train_cfg(paired["bare"], paired["edited"], tmp_path / "run2"))
    assert "sample-3" in str(e.value) and "shard-000000" in str(e.value) and e.value.fix
    tally("corrupted inputs detected")


def test_a_store_with_its_own_dataset_passes_the_check(paired, tmp_path):
    from eyas.train.setup import sources

    for store in (paired["store"], paired["bare"]):  # by fingerprint, and by token ids
        train, _ = sources(train_cfg(store, paired["prepared"], tmp_path / "run"))
        assert len(train) == 6


# ---------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A training checkpoint (eyas.draft.checkpoint) of a small draft after two optimizer steps."""
    from eyas.draft.checkpoint import rng_state, save_checkpoint
    from eyas.train.parallelize import full_optimizer_state
    from eyas.train.settings import TrainConfig

    draft = small_draft()
    opt = torch.optim.AdamW(draft.trainable_parameters(), lr=1e-2)
    for _ in range(2):
        sum(p.square().sum() for p in draft.trainable_parameters()).backward()
        opt.step()
        opt.zero_grad()
    state = {"step": 2, "epoch": 0, "step_in_epoch": 2, "world_size": 1, "rng": [rng_state()],
             "config": json.loads(json.dumps(TrainConfig(store="s", out="o").to_dict())),
             "vocab": {"size": 20, "coverage": 0.9}, "training": {"loss": 1.5}}
    root = tmp_path_factory.mktemp("ckpt")
    return save_checkpoint(root, 2, draft, full_optimizer_state(draft, opt), state, keep=1)


def _copy(folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / folder.name
    shutil.copytree(folder, dst)
    return dst


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "trainer_state.json"])
def test_damaged_checkpoint_is_named_never_resumed_wrong(checkpoint, tmp_path, name, faults_full, tally):
    """What a resume reads (config.json is the draft folder's: next test)."""
    from eyas.draft.checkpoint import load_checkpoint

    folder = _copy(checkpoint, tmp_path)
    reference = load_checkpoint(folder)
    run_trials(folder / name, lambda: load_checkpoint(folder), reference, (name,), faults_full, tally)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_damaged_draft_folder_is_named_never_loaded_wrong(checkpoint, tmp_path, name, faults_full, tally):

    folder = _copy(checkpoint, tmp_path)

    def load():
        m = read_draft(folder)
        return m.cfg, m.state_dict()

    reference = load()
    run_trials(folder / name, load, reference, (name,), faults_full, tally)
