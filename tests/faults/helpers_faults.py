"""Shared helpers of the process faults (test_kills, test_disk_full, test_rank_death): `eyas <stage>` processes on
the tiny target, killed, starved of disk or left without a peer, then rerun.

`Forked` starts a stage as its own process, forked from a server that imported torch and transformers once, so a
chain of ten reruns costs the stage's work rather than ten times five seconds of imports; torchrun's workers are
started by torchrun itself (test_rank_death).

`kill_chain` is the kill loop: start the stage, wait until this run made progress (its output grew), SIGKILL it at a
seeded random moment of its next unit of work, rerun, ... until the wanted number of kills really happened; then one
last run must complete. Only kills that landed count (returncode -9): a run that finished first is not a kill.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


# A small, exactly resumable training of the tiny target's draft (fp32, one thread, a checkpoint every 2 steps)
TRAIN = {"target": "tiny", "threads": 1, "draft_vocab": 512, "ttt_steps": 3, "micro_batch": 1, "checkpoint_every": 2,
         "keep_checkpoints": 2, "dtype": "fp32", "lr": 1e-2}
# Extract in many small units of work (~1 sample per forward batch and per shard), so faults land inside them
EXTRACT = {"target": "tiny", "dtype": "bf16", "shard_mb": 0.02, "batch_tokens": 48}  # as the references load it


@contextlib.contextmanager
def torch_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def one_thread():
    """In-process reference runs use the forked runs' single thread: the same sums, bit for bit."""
    with torch_threads(1):
        yield


def manifest(store: Path) -> dict:
    """A store's manifest without where its prepared data lives (not content)."""
    m = json.loads((Path(store) / "manifest.json").read_text())
    m["dataset"].pop("path")
    return m


def train_metrics(run_dir: Path) -> list[list]:
    """Every step's figures in metrics.jsonl, without the timings."""
    keys = ("step", "epoch", "lr", "loss", "loss_i", "acc_i", "samples_seen_global", "grad_norm")
    return [[json.loads(x)[k] for k in keys] for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_same_training(whole: Path, other: Path) -> None:
    """The same steps with the same losses, and bit-identical final draft weights."""
    from safetensors.torch import load_file

    assert train_metrics(other) == train_metrics(whole)
    a, b = load_file(whole / "final" / "model.safetensors"), load_file(other / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def env_one_thread(**extra: str) -> dict:
    """One intra-op thread (OpenMP barriers on a shared 2-core machine are slow), eyas from this checkout."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src"), **extra}


# ---------------------------------------------------------------- forked stage runs

# What a stage imports before it does any work (~5 s of CPU per process): imported once, in the forkserver
PRELOAD = ["torch", "numpy", "datasets", "safetensors.torch", "transformers",
           "transformers.models.llama.modeling_llama", "transformers.models.auto.tokenization_auto",
           "transformers.generation.utils", "eyas.cli", "eyas.store.extract", "eyas.data.regenerate",
           "eyas.train.trainer", "eyas.train.setup", "eyas.train.batches", "eyas.train.objective",
           "eyas.train.parallelize", "eyas.draft.model", "eyas.core.target", "eyas.data.formats", "eyas.data.chat"]


class Forked:
    """`eyas ARGS` in a process forked from a server that imported torch, transformers and eyas once
    (multiprocessing's forkserver): the same code path as `python -m eyas ARGS` from the command line's parsing on,
    without paying the imports at every rerun of a kill chain. Popen's interface (pid, poll, wait, kill)."""

    _ctx = None

    def __init__(self, args: list[str], log: Path, fsize: int = 0, env: dict | None = None, die_at: str = "",
                 collective_timeout: float = 0.0):
        if Forked._ctx is None:
            Forked._ctx = multiprocessing.get_context("forkserver")
            Forked._ctx.set_forkserver_preload(PRELOAD)
        faults = {"fsize": fsize, "env": env or {}, "die_at": die_at, "collective_timeout": collective_timeout}
        self.proc = Forked._ctx.Process(target=_eyas_main, args=(list(args), str(log), faults))
        self.proc.start()
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"eyas (pid {self.pid})", timeout)
        return self.proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self.proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode


def _eyas_main(args: list[str], log: str, faults: dict) -> None:
    """The forked process: output to `log`, one thread (as OMP_NUM_THREADS=1), and the faults of `Forked`."""
    import resource
    import threading

    from tqdm import tqdm

    from eyas import cli

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update({"OMP_NUM_THREADS": "1", **faults["env"]})  # env: a distributed rank's variables
    torch.set_num_threads(1)
    tqdm.set_lock(threading.RLock())  # not tqdm's default multiprocessing lock: a SIGKILL would leak its semaphore
    if faults["fsize"]:  # RLIMIT_FSIZE, as a preexec_fn would set it
        resource.setrlimit(resource.RLIMIT_FSIZE, (faults["fsize"], faults["fsize"]))
    if faults["die_at"]:  # SIGKILL itself as it is about to rename a file into that name: the last step of an
        _die_before_replacing(faults["die_at"])  # atomic write (all before it is on disk, the file itself is not)
    if faults["collective_timeout"]:  # the trainer's collective timeout (600 s) shortened to what a test can wait
        _shorten_collective_timeout(faults["collective_timeout"])
    sys.argv = ["eyas", *args]
    raise SystemExit(cli.main(args))


def _die_before_replacing(name: str) -> None:
    replace = os.replace

    def dying_replace(src, dst, **kw):
        if Path(dst).name == name:
            os.kill(os.getpid(), signal.SIGKILL)
        return replace(src, dst, **kw)

    os.replace = dying_replace


def _shorten_collective_timeout(seconds: float) -> None:
    from eyas.core import dist

    init = dist.init
    dist.init = lambda device="auto", timeout_s=seconds: init(device, timeout_s=min(timeout_s, seconds))


def tail(log: Path, n: int = 3000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no log)"


def wait_for(cond: Callable[[], bool], timeout: float, what: str, proc=None, log: Path | None = None) -> None:
    """Poll `cond` every 10 ms; fail the test (with the log's tail) after `timeout` s or if `proc` died."""
    end = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {what}:\n{tail(log) if log else ''}")
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}:\n{tail(log) if log else ''}")
        time.sleep(0.01)


def lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@dataclasses.dataclass
class ChainResult:
    kills: int  # runs that really died of the SIGKILL (returncode -9)
    runs: int  # runs started, the completing one included
    seconds: float


def kill_chain(start: Callable[[], Forked], progress: Callable[[], int], *, kills: int, seed: int, log: Path,
               timeout: float = 120.0) -> ChainResult:
    """Start the stage (`start()`) and let it finish k = 2 or 3 units of work of its own (`progress()`, e.g. files
    written, counted from its value at this start); SIGKILL it at a uniformly random moment of the next unit (a
    fraction of the k-th unit's duration: wherever it stands, inside a computation or a write), then start it again,
    until `kills` kills landed; then wait for a run to complete (returncode 0). Seeded: the same k and fractions
    every time. Any other exit fails the test with the log's tail."""
    rng, t0 = random.Random(seed), time.monotonic()
    killed = runs = 0
    while True:
        before, k, frac = progress(), rng.randint(2, 3), rng.random()
        proc, runs = start(), runs + 1
        try:
            if killed < kills:
                marks = []  # when the run's (k-1)-th and k-th units were done
                for want in (before + k - 1, before + k):
                    wait_for(lambda w=want, p=proc: progress() >= w or p.poll() is not None, timeout, "progress",
                             log=log)
                    marks.append(time.monotonic())
                end = marks[1] + frac * (marks[1] - marks[0])
                while proc.poll() is None and time.monotonic() < end:
                    time.sleep(0.002)
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
            code = proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if code == -signal.SIGKILL:
            killed += 1
            continue
        assert code == 0, f"run {runs} exited with {code}:\n{tail(log)}"
        return ChainResult(killed, runs, time.monotonic() - t0)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def rank_pid(root_pid: int, rank: int) -> int | None:
    """The pid of the eyas process with RANK=rank below `root_pid` (a torchrun agent), or None."""
    for p in descendants(root_pid):
        try:
            env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return p
    return None
