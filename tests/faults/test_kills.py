"""SIGKILL at seeded random moments of regenerate, extract and train, rerun until done: the result equals an
uninterrupted run (the regenerated file byte for byte, the store's manifest with every checksum, every step's
losses and the final weights), with nothing duplicated and nothing missing.

Each stage runs as `eyas <stage> ...` on the tiny target in its own process (helpers_faults.Forked). A chain kills
it `kills` times (10 with --faults-full, 2 in the fast subset), each time at a random moment after the run made
progress of its own: after 2 or 3 units of work (conversations written, shards written, checkpoints written), at a
random point of the next one, so every kill lands in real work and every rerun resumes further on, however fast
the machine is.
"""

from __future__ import annotations

import json
from pathlib import Path

from eyas.draft.checkpoint import list_checkpoints
from eyas.store.reader import StoreReader
from tests.faults.helpers_faults import (  # noqa: F401 (one_thread: an autouse fixture)
    EXTRACT,
    TRAIN,
    Forked,
    assert_same_training,
    kill_chain,
    lines,
    manifest,
    one_thread,
    tail,
)
from tests.test_extract import write_prepared
from tests.test_train import argv
from tests.train_fakes import write_store

SEED = 20240611


def kills_wanted(full: bool) -> int:
    return 10 if full else 2


def check_chain(chain, full: bool, tally, kind: str) -> None:
    assert chain.kills >= kills_wanted(full), f"the stage finished before the kills landed: {chain}"
    tally(kind, chain.kills)


# ---------------------------------------------------------------- regenerate

def write_chats(path: Path, n: int) -> Path:
    """n two-turn conversations (OpenAI messages with an old answer, which regenerate replaces)."""
    recs = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Tell me about the number {i}."},
                                         {"role": "assistant", "content": "an old answer"},
                                         {"role": "user", "content": f"And about {i * 7 % 13}?"}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return path


def test_regenerate_survives_kills(tmp_path, faults_full, tally):
    from eyas.data.regenerate import RegenerateConfig, run

    n = 48 if faults_full else 12  # a run uses up to 4 units: 10 kills need < 40
    data = write_chats(tmp_path / "chats.jsonl", n)
    # batch size 1: a conversation's greedy text must not depend on which others share its batch (padding);
    # at temperature 0 a rerun then writes exactly what the uninterrupted run wrote. One process: worker processes
    # write replies in the order they finish, which varies between runs (as a server's do); their kills and
    # replies are tested in tests/test_regenerate_workers.py
    cfg = {"target": "tiny", "batch_size": 1, "max_new_tokens": 8, "temperature": 0.0, "workers": 1}
    run(RegenerateConfig(data=(str(data),), out=str(tmp_path / "ref.jsonl"), quiet=True, **cfg))
    out, log = tmp_path / "out.jsonl", tmp_path / "regenerate.log"
    chain = kill_chain(lambda: Forked(["regenerate", *argv({**cfg, "data": data, "out": out, "quiet": True})], log),
                       lambda: lines(out), kills=kills_wanted(faults_full), seed=SEED, log=log)
    ids = [json.loads(x)["id"] for x in out.read_text(encoding="utf-8").splitlines()]
    assert len(ids) == len(set(ids)) == n  # nothing twice, nothing missing
    assert out.read_bytes() == (tmp_path / "ref.jsonl").read_bytes()  # the same texts, in the same order
    check_chain(chain, faults_full, tally, "kills survived: regenerate")


# ---------------------------------------------------------------- extract

def test_extract_survives_kills(tmp_path, faults_full, tally):
    from eyas.core.target import load_target
    from eyas.store.extract import ExtractConfig, run

    prepared = write_prepared(tmp_path / "prepared", n=150 if faults_full else 50, lo=5, hi=40)
    target = load_target("tiny", dtype="bf16")  # the CLI's default forward dtype
    ref = tmp_path / "ref"
    run(ExtractConfig(quiet=True, data=str(prepared), store=str(ref), **EXTRACT), target=target)
    store, log = tmp_path / "store", tmp_path / "extract.log"

    def shards():
        return len(list((store / "shards").glob("shard-*.safetensors")))

    args = ["extract", *argv({"data": prepared, "store": store, **EXTRACT, "quiet": True})]
    chain = kill_chain(lambda: Forked(args, log), shards, kills=kills_wanted(faults_full), seed=SEED + 1, log=log)
    assert manifest(store) == manifest(ref)  # every sample once, in the same shards, with the same checksums
    assert json.loads((store / "summary.json").read_text())["resumed_shards"] > 0  # the last run did resume
    assert StoreReader(store).verify() == []
    assert not list((store / "shards").glob(".*tmp*"))  # no killed run's partial shard is left
    check_chain(chain, faults_full, tally, "kills survived: extract")


def test_extract_killed_while_it_starts_then_rerun_completes(tmp_path, tally):
    """The kill lands as extract records its settings (extract.json), before any shard: the store folder holds only
    what that moment leaves, and the same command must still be accepted as the run to resume."""
    from eyas.store.extract import ExtractConfig, run

    prepared = write_prepared(tmp_path / "prepared", n=6, lo=5, hi=40)
    store, log = tmp_path / "store", tmp_path / "extract.log"
    proc = Forked(["extract", *argv({"data": prepared, "store": store, **EXTRACT, "quiet": True})], log,
                  die_at="extract.json")
    assert proc.wait(120) == -9, tail(log)
    assert not (store / "extract.json").exists()
    run(ExtractConfig(quiet=True, data=str(prepared), store=str(store), **EXTRACT))
    assert StoreReader(store).verify() == [] and len(StoreReader(store)) == 6
    tally("kills survived: extract", 1)


# ---------------------------------------------------------------- train

def newest_checkpoint(run_dir: Path) -> int:
    found = list_checkpoints(run_dir)
    return found[-1][0] if found else 0


def test_train_survives_kills(tiny_target, tmp_path, faults_full, tally):
    from eyas.train.settings import TrainConfig
    from eyas.train.trainer import run

    n = 48 if faults_full else 16  # 2 epochs of n steps: n checkpoints
    store = write_store(tiny_target, tmp_path / "store", n=n)
    cfg = {"store": str(store), **TRAIN, "epochs": 2}
    run(TrainConfig(quiet=True, out=str(tmp_path / "whole"), **cfg))
    out, log = tmp_path / "killed", tmp_path / "train.log"
    # every run is the same command with --resume (the first finds no checkpoint and starts at step 0)
    args = ["train", *argv({**cfg, "out": out, "resume": True, "quiet": True})]
    chain = kill_chain(lambda: Forked(args, log), lambda: newest_checkpoint(out) // TRAIN["checkpoint_every"],
                       kills=kills_wanted(faults_full), seed=SEED + 2, log=log)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 2 * n + 1))  # every step once
    assert_same_training(tmp_path / "whole", out)
    check_chain(chain, faults_full, tally, "kills survived: train")
