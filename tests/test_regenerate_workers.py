"""`eyas regenerate` on worker processes (eyas.data.workers): the same replies as one process, every reply written
once by the parent, nothing left running after Ctrl-C or a kill, and the plan of how many workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyas.core.errors import EyasError
from eyas.data.regenerate import RegenerateConfig, run
from eyas.data.workers import plan_workers
from tests.test_regenerate import make_data, read_out

REPO = Path(__file__).resolve().parents[1]


def test_two_workers_write_the_replies_one_process_writes(tmp_path):
    """Greedy in float32: each conversation's replies are the same whichever worker answered it, in whatever
    company of other rows; the parent writes each conversation once."""
    data = make_data(tmp_path, 10)  # MT-Bench pairs of turns, a system prompt with two turns, GSM8K questions
    got = {}
    for workers in (1, 2):
        out = tmp_path / f"out{workers}.jsonl"
        summary = run(RegenerateConfig(data=(str(data),), out=str(out), target="tiny", max_new_tokens=6,
                                       batch_size=2, workers=workers, quiet=True))
        assert summary["workers"] == workers and summary["done"] + summary["failed"] == 10
        recs = read_out(out)
        assert len({r["id"] for r in recs}) == len(recs) == summary["done"]
        got[workers] = {r["id"]: r["messages"] for r in recs}
    assert sum(summary["conversations_by_worker"]) == summary["done"] and len(summary["conversations_by_worker"]) == 2
    assert got[2] == got[1] and len(got[1]) >= 8


def children(pid: int) -> set[int]:
    """The process's child processes (Linux /proc)."""
    kids = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids |= {int(x) for x in (task / "children").read_text().split()}
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has stopped


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads child processes from /proc (Linux)")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_a_stopped_run_leaves_no_worker_running_and_a_rerun_finishes(tmp_path, sig):
    """Ctrl-C: the parent stops its workers; a kill of the parent: each worker sees it is orphaned and exits.
    Either way what was written stays, and a rerun writes the rest, each conversation once."""
    data, out = make_data(tmp_path, 120), tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "eyas", "regenerate", "--data", str(data), "--out", str(out), "--target", "tiny",
           "--max-new-tokens", "64", "--batch-size", "2", "--workers", "2", "--quiet"]
    # SIGINT's default restored in the child: a suite started in the background of a shell ignores SIGINT
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(REPO / "src")}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not out.exists() or out.read_text().count("\n") < 2):
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.02)
    kids = children(proc.pid)
    assert len(kids) >= 2  # the two workers (and multiprocessing's resource tracker)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    proc.stderr.close()
    deadline = time.monotonic() + 30  # a worker checks for its parent every POLL_S
    while time.monotonic() < deadline and any(alive(k) for k in kids):
        time.sleep(0.1)
    assert not [k for k in kids if alive(k)]
    before = out.read_text().count("\n")
    assert 2 <= before < 120
    summary = run(RegenerateConfig(data=(str(data),), out=str(out), target="tiny", max_new_tokens=64, batch_size=2,
                                   workers=2, quiet=True))
    ids = [r["id"] for r in read_out(out)]
    assert len(ids) == len(set(ids)) == summary["skipped"] + summary["done"] and summary["skipped"] >= before - 1
    assert summary["done"] + summary["failed"] + summary["skipped"] == 120


def test_a_worker_that_fails_to_start_is_a_clear_error(tmp_path):
    """A model folder without weights passes the parent's checks; the workers' loading fails, and the parent
    raises that failure, naming the worker, with nothing written."""
    data, out, model = make_data(tmp_path, 4), tmp_path / "out.jsonl", tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(EyasError) as e:
        run(RegenerateConfig(data=(str(data),), out=str(out), target=str(model), workers=2, quiet=True))
    assert e.value.what.startswith("regenerate worker ") and e.value.why and e.value.fix
    assert not out.exists() or not read_out(out)


def test_workers_are_one_per_core_unless_the_run_is_small_or_the_user_chose(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr("eyas.data.workers._copies_that_fit", lambda cfg: 1 << 10)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def plan(conversations=1000, **kw):
        return plan_workers(RegenerateConfig(data=("x",), device="cpu", **kw), conversations)[0]

    assert plan() == 4  # one per core, one thread each
    assert plan(threads=2) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert plan() == 1  # the user's threads fill the cores
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert plan(conversations=70, batch_size=32) == 2  # each worker gets at least --batch-size conversations
    assert plan(conversations=5, batch_size=32) == 1
    assert plan(workers=3, conversations=5) == 3  # the user's choice
    monkeypatch.setattr("eyas.data.workers._copies_that_fit", lambda cfg: 1)
    assert plan() == 1  # one copy of the target fits in memory
    monkeypatch.setattr("eyas.data.workers.pick_device", lambda d: "cuda:0")
    assert plan() == 1


def test_workers_on_a_gpu_are_refused():
    with pytest.raises(EyasError, match="--workers 2 on a GPU"):
        RegenerateConfig(data=("x",), device="cuda", workers=2)
