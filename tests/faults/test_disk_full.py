"""Disk full while extract writes its shards and while train writes a checkpoint.

Simulated with RLIMIT_FSIZE on the stage's own process (Python ignores SIGXFSZ, so a write past the limit raises
OSError EFBIG where a full disk raises ENOSPC): set before it starts (as a preexec_fn would), or lowered with
prlimit at a seeded random moment after it made progress: the disk filling up under a running stage. The stage must
stop with an EyasError that names the file and says what to do (not a traceback), keep every shard / checkpoint it
finished valid, leave no partial file on the full disk, and a rerun without the limit must give the uninterrupted
result.
"""

from __future__ import annotations

import filecmp
import random
import resource
import time
from pathlib import Path

import pytest

from eyas.draft.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, read_draft
from eyas.store.reader import StoreReader
from eyas.store.shards import shard_index
from tests.faults.helpers_faults import (  # noqa: F401 (one_thread: an autouse fixture)
    EXTRACT,
    TRAIN,
    Forked,
    assert_same_training,
    manifest,
    one_thread,
    tail,
    torch_threads,
    train_metrics,
    wait_for,
)
from tests.test_extract import write_prepared
from tests.test_train import argv
from tests.train_fakes import write_store

SEED = 4242


def until_disk_full(args: list[str], log: Path, limit: int, when: str, started, delay: bool = True) -> Forked:
    """`eyas ARGS` whose files may not grow past `limit` bytes: from the start, or ("mid-run") once `started()`
    holds, after a seeded random delay when `delay` (its file size limit lowered while it runs: the disk fills up
    under it)."""
    if when == "from-start":
        return Forked(args, log, fsize=limit)
    proc = Forked(args, log)
    wait_for(started, 120, "progress", proc, log)
    if delay:
        time.sleep(random.Random(SEED).uniform(0.0, 0.5))
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (limit, limit))
    return proc


def fails_clearly(proc, log: Path, *names: str) -> str:
    """The run stopped by itself with eyas's error format (exit 2, what/why/fix, no traceback) naming `names`."""
    try:
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    text = tail(log, 6000)
    assert code == 2, f"exit {code}, expected eyas's error exit 2:\n{text}"
    assert "Traceback" not in text, text
    err = text[text.index("eyas: error:"):]
    assert "fix:" in err and "free" in err and all(n in err for n in names), err
    return err


# ---------------------------------------------------------------- extract

def extract_cfg(prepared: Path, store: Path) -> dict:
    return {"data": str(prepared), "store": str(store), **EXTRACT}


@pytest.fixture(scope="module")
def extract_ref(tmp_path_factory):
    from eyas.core.target import load_target
    from eyas.store.extract import ExtractConfig, run

    root = tmp_path_factory.mktemp("extract")
    prepared = write_prepared(root / "prepared", n=120, lo=5, hi=40)
    with torch_threads(1):  # as the forked runs: the same sums
        run(ExtractConfig(quiet=True, **extract_cfg(prepared, root / "ref")), target=load_target("tiny", dtype="bf16"))
    return prepared, root / "ref"


@pytest.fixture(params=["mid-run", "from-start"])
def when(request, faults_full) -> str:
    """When the disk is full: from a random moment of the run on, or from its start (full suite only)."""
    if request.param == "from-start" and not faults_full:
        pytest.skip("full suite only (--faults-full)")
    return request.param


def test_extract_disk_full(extract_ref, tmp_path, when, tally):
    from eyas.store.extract import ExtractConfig, run

    prepared, ref = extract_ref
    store, log = tmp_path / "store", tmp_path / "extract.log"
    args = ["extract", *argv({**extract_cfg(prepared, store), "quiet": True})]

    def shards():
        return sorted((store / "shards").glob("shard-*.safetensors"))

    # 4 KiB: room for the settings file (1 KiB), not for a shard (~20 KiB). The disk fills after a seeded random
    # number of shards within the first half, never a delay: a fixed 0.43 s let a fast run finish first (flaky)
    total = len(list((ref / "shards").glob("shard-*.safetensors")))
    at = random.Random(SEED).randint(2, max(2, total // 2))
    proc = until_disk_full(args, log, 4096, when, lambda: len(shards()) >= at, delay=False)
    err = fails_clearly(proc, log, "shard-")
    kept = shards()
    assert (len(kept) >= 2) == (when == "mid-run"), err
    for p in kept:  # every finished shard is whole and is the uninterrupted run's shard, byte for byte
        shard_index(p)
        assert filecmp.cmp(p, ref / "shards" / p.name, shallow=False), p.name
    assert not list((store / "shards").glob(".*tmp*")), "the partial shard is left on the full disk"
    assert not (store / "manifest.json").exists()
    again = run(ExtractConfig(quiet=True, **extract_cfg(prepared, store)))  # the limit lifted: rerun completes
    assert again["resumed_shards"] == len(kept)
    assert manifest(store) == manifest(ref) and StoreReader(store).verify() == []
    tally("disk-full faults survived: extract", 1)


# ---------------------------------------------------------------- checkpoint

CKPT_TRAIN = {**TRAIN, "epochs": 1}


@pytest.fixture(scope="module")
def train_ref(tiny_target, tmp_path_factory):
    from eyas.train.settings import TrainConfig
    from eyas.train.trainer import run

    root = tmp_path_factory.mktemp("train")
    store = write_store(tiny_target, root / "store", n=24)
    run(TrainConfig(quiet=True, store=str(store), out=str(root / "whole"), **CKPT_TRAIN))
    return store, root / "whole"


def test_checkpoint_disk_full(train_ref, tmp_path, when, tally):
    from eyas.train.settings import TrainConfig
    from eyas.train.trainer import run

    store, whole = train_ref
    out, log = tmp_path / "run", tmp_path / "train.log"
    args = ["train", *argv({"store": store, "out": out, **CKPT_TRAIN, "quiet": True})]
    # 1 MiB: metrics.jsonl stays far below, a checkpoint's model.safetensors (~13 MB) does not
    proc = until_disk_full(args, log, 1 << 20, when, lambda: latest_checkpoint(out) is not None)
    err = fails_clearly(proc, log, "checkpoint", "--resume")
    found = list_checkpoints(out)
    assert bool(found) == (when == "mid-run"), err
    for _, folder in found:  # the checkpoints written before the disk filled are whole
        load_checkpoint(folder)
        read_draft(folder)
    assert not [p.name for p in (out / "checkpoints").iterdir() if ".tmp" in p.name], "partial checkpoint left"
    summary = run(TrainConfig(quiet=True, store=str(store), out=str(out), resume=True, **CKPT_TRAIN))
    assert summary["steps"] == len(train_metrics(whole))
    assert_same_training(whole, out)
    tally("disk-full faults survived: checkpoint", 1)
