"""A rank dying in a two-process training (gloo, CPU): the survivors stop within a bounded time with a clear
error, and `--resume` from the last checkpoint gives the losses and weights of an uninterrupted two-rank run.

Two launches: under torchrun (its agent sees the dead worker and stops the others), and two bare processes with the
torch.distributed environment set by hand (nothing stops the survivor: it must notice the dead peer in its next
collective by itself and exit with eyas's error, not hang). gloo sees a dead peer's closed connection at once; a
peer that hangs (SIGSTOP) is noticed by the collective timeout (dist.init's 600 s, shortened here to 10 s).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyas.draft.checkpoint import latest_checkpoint
from tests.faults.helpers_faults import (
    TRAIN,
    Forked,
    assert_same_training,
    env_one_thread,
    rank_pid,
    tail,
    wait_for,
)
from tests.ports import free_port
from tests.test_train import argv
from tests.train_fakes import write_store

SEED = 777
BOUND_S = 60  # a survivor must be gone this long after the death (the collective timeout is 600 s)


def torchrun(cfg: dict, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "eyas", "train", *argv(cfg)]
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, env=env_one_thread(), stdout=f, stderr=subprocess.STDOUT)


def bare_ranks(cfg: dict, logs: list[Path], **faults) -> list[Forked]:
    """Two `eyas train` processes that form a gloo group by themselves, as torchrun's workers would (the same
    environment variables) but without its agent watching them."""
    port = str(free_port())
    return [Forked(["train", *argv(cfg)], log, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(r),
                                                    "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"},
                   **faults) for r, log in enumerate(logs)]


def finish(proc, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def setup(tiny_target, tmp_path_factory):
    """The store and the uninterrupted two-rank run, started in the background (each test waits for it)."""
    root = tmp_path_factory.mktemp("rank-death")
    store = write_store(tiny_target, root / "store", n=32)
    cfg = {"store": store, **TRAIN, "epochs": 2, "quiet": True}
    ref = bare_ranks({**cfg, "out": root / "whole"}, [root / "whole-0.log", root / "whole-1.log"])
    yield cfg, root, ref
    for p in ref:
        p.kill()


def two_ranks_done(procs, logs) -> None:
    codes = [finish(p, 240) for p in procs]
    assert codes == [0, 0], "\n".join(tail(log) for log in logs)


def resume_and_compare(setup, out: Path, tmp_path: Path) -> None:
    """`--resume` with two ranks completes, with the uninterrupted two-rank run's losses and weights."""
    cfg, root, ref = setup
    logs = [tmp_path / "resume-0.log", tmp_path / "resume-1.log"]
    two_ranks_done(bare_ranks({**cfg, "out": out, "resume": True, "quiet": False}, logs), logs)
    assert f"resume: {out / 'checkpoints'}" in logs[0].read_text()
    two_ranks_done(ref, [root / "whole-0.log", root / "whole-1.log"])
    assert_same_training(root / "whole", out)


def wait_mid_training(out: Path, procs, log: Path, seed: int) -> None:
    """Until the first checkpoint exists, then a seeded random moment more (the next steps run meanwhile)."""
    wait_for(lambda: latest_checkpoint(out) is not None or any(p.poll() is not None for p in procs), 180,
             "a first checkpoint", log=log)
    assert all(p.poll() is None for p in procs), log.read_text()[-3000:]
    time.sleep(random.Random(seed).uniform(0.0, 1.0))


def test_rank_killed_under_torchrun_then_resume(setup, tmp_path, tally):
    cfg = setup[0]
    out, log = tmp_path / "run", tmp_path / "torchrun.log"
    agent = torchrun({**cfg, "out": out}, log)
    try:
        wait_mid_training(out, [agent], log, SEED)
        victim = rank_pid(agent.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        code = finish(agent, BOUND_S)
        took = time.monotonic() - t0
    finally:
        if agent.poll() is None:
            agent.kill()
    text = log.read_text(errors="replace")
    assert code != 0 and took < BOUND_S, text[-3000:]
    # torchrun's own report names the dead rank as the root cause
    assert re.search(r"Root Cause.*?rank\s*:\s*1 .*?exitcode\s*:\s*-9 .*?SIGKILL", text, re.DOTALL), text[-3000:]
    assert not (out / "final").exists()
    resume_and_compare(setup, out, tmp_path)
    tally("rank deaths survived: train", 1)


@pytest.mark.parametrize("victim", [1, 0])
def test_survivor_of_a_dead_peer_exits_by_itself(setup, tmp_path, victim, faults_full, tally):
    if victim == 0 and not faults_full:
        pytest.skip("full suite only (--faults-full)")
    cfg = setup[0]
    out = tmp_path / "run"
    logs = [tmp_path / f"rank{r}.log" for r in (0, 1)]
    procs = bare_ranks({**cfg, "out": out}, logs)
    try:
        wait_mid_training(out, procs, logs[0], SEED + victim)
        procs[victim].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        survivor = procs[1 - victim]
        code = finish(survivor, BOUND_S)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = logs[1 - victim].read_text()
    assert procs[victim].returncode == -signal.SIGKILL
    assert code == 2 and took < BOUND_S, f"exit {code} after {took:.1f} s:\n{text[-3000:]}"
    assert "Traceback" not in text, text[-3000:]
    err = text[text.index("eyas: error:"):]
    assert "rank" in err and "--resume" in err and "fix:" in err, err
    if faults_full:
        resume_and_compare(setup, out, tmp_path)
    tally("rank deaths survived: train", 1)


def test_survivor_of_a_hung_peer_exits_after_the_collective_timeout(setup, tmp_path, faults_full):
    """A rank that stops answering (SIGSTOP: alive, its sockets open) is noticed only by the collective timeout;
    the survivor must then stop with the same clear error. The trainer's timeout (600 s) is shortened to 10 s."""
    if not faults_full:
        pytest.skip("full suite only (--faults-full)")
    cfg, timeout = setup[0], 10.0
    out = tmp_path / "run"
    logs = [tmp_path / f"rank{r}.log" for r in (0, 1)]
    procs = bare_ranks({**cfg, "out": out}, logs, collective_timeout=timeout)
    try:
        wait_mid_training(out, procs, logs[0], SEED + 5)
        procs[1].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        code = finish(procs[0], timeout + BOUND_S)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    text = logs[0].read_text()
    assert code == 2 and timeout - 1 < took < timeout + BOUND_S, f"exit {code} after {took:.1f} s:\n{text[-3000:]}"
    err = text[text.index("eyas: error:"):]
    assert "lost contact" in err and "Timed out" in err and "--resume" in err, err
