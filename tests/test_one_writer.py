"""One writer per output (issue 45): every stage that writes a folder holds a lock beside it, a second run is
refused naming the first, the ranks of a killed torchrun stop with it, and SIGTERM stops a stage as Ctrl-C does."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyas.core.errors import EyasError
from eyas.core.lock import hold
from tests.ports import free_port
from tests.test_regenerate_workers import alive, children
from tests.train_fakes import write_store

ENTRY = str(Path(__file__).parent / "train_entry.py")
# a run these tests stop or kill: long enough (minutes) that it cannot finish first on a fast machine, where
# 50 epochs ended in 8 s, before a second launch reached the lock
LONG = ["--epochs", "5000"]
SMALL = ["--target", "tiny", "--threads", "1", "--draft-vocab", "512", "--ttt-steps", "2", "--quiet"]


@pytest.fixture(scope="module")
def store(tiny_target, tmp_path_factory):
    return write_store(tiny_target, tmp_path_factory.mktemp("store") / "s", n=64)


def test_a_held_output_names_its_holder(tmp_path):
    held = hold(tmp_path / "out", "train")
    with pytest.raises(EyasError, match=rf"another eyas run is writing {tmp_path / 'out'} \(pid {os.getpid()} on "):
        hold(tmp_path / "out", "train")
    held.close()
    hold(tmp_path / "out", "train").close()  # released: taken again


def test_every_stage_that_writes_a_folder_is_refused_while_another_run_holds_it(tiny_target, store, tmp_path,
                                                                                 monkeypatch):
    from eyas.data.prepare import PrepareConfig
    from eyas.data.prepare import run as prepare
    from eyas.draft.export import ExportConfig
    from eyas.draft.export import run as export
    from eyas.store.extract import ExtractConfig
    from eyas.store.extract import run as extract
    from eyas.train.settings import TrainConfig
    from eyas.train.trainer import run as train

    monkeypatch.setattr("eyas.data.prepare.load_target_shell", lambda spec, **kw: tiny_target)
    chats = tmp_path / "c.jsonl"
    chats.write_text(json.dumps({"question": "2+2?", "answer": "4"}) + "\n")
    stages = {
        "prepare": (tmp_path / "prep", lambda out: prepare(PrepareConfig(target="tiny", data=(str(chats),),
                                                                          out=str(out), quiet=True))),
        "extract": (tmp_path / "store2", lambda out: extract(ExtractConfig(target="tiny", data=str(tmp_path / "prep"),
                                                                            store=str(out), quiet=True))),
        "train": (tmp_path / "run", lambda out: train(TrainConfig(store=str(store), out=str(out), max_steps=1,
                                                                  target="tiny", draft_vocab=512, ttt_steps=2,
                                                                  quiet=True))),
        "export": (tmp_path / "exported", lambda out: export(ExportConfig(checkpoint=str(tmp_path / "run" / "final"),
                                                                          out=str(out), quiet=True))),
    }
    for name, (out, stage) in stages.items():
        held = hold(out, "another")
        with pytest.raises(EyasError, match="another eyas run is writing"):
            stage(out)
        assert not out.exists(), name  # refused before anything was written
        held.close()
        stage(out)  # once the lock is free, the same command runs
        assert out.exists(), name


def wait_for_training(proc, out: Path, timeout: float = 120) -> None:
    """Until the run `proc` writes into `out` has logged its first step (it must not exit first)."""
    deadline = time.time() + timeout
    while not (out / "metrics.jsonl").is_file() and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    assert (out / "metrics.jsonl").is_file(), "the run never started training"


def torchrun(args, port=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port or free_port()), ENTRY, *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads child processes from /proc (Linux)")
def test_a_second_torchrun_is_refused_on_every_rank_and_a_killed_launchers_ranks_stop(store, tmp_path):
    out = tmp_path / "run"
    first = torchrun(["--store", str(store), "--out", str(out), *LONG, *SMALL])
    try:
        wait_for_training(first, out)
        # a second launch on the same run folder, and a --resume beside it: both refused on both ranks, no hang
        for extra in ([], ["--resume"]):
            # a short run: were it not refused, it ends in seconds and the assert below says so (no hang)
            second = torchrun(["--store", str(store), "--out", str(out), "--epochs", "50", *SMALL, *extra])
            try:
                _, err = second.communicate(timeout=120)
            finally:
                if second.poll() is None:
                    os.killpg(second.pid, signal.SIGKILL)
                    second.communicate()
            assert second.returncode != 0
            assert err.count("another eyas run is writing") == 2, err[-3000:]  # rank 0's refusal, on each rank
            assert "pid " in err and "train_entry.py" in err
        ranks = children(first.pid)
        assert len(ranks) == 2 and all(alive(r) for r in ranks)
        os.kill(first.pid, signal.SIGKILL)  # the launcher only: it cannot stop its ranks
        deadline = time.time() + 60
        while any(alive(r) for r in ranks) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(alive(r) for r in ranks), "the ranks of a killed torchrun went on"
        lock = hold(out, "train")  # and with them the lock: a resume may start
        lock.close()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.communicate()


def test_sigterm_stops_a_stage_with_its_resume_hint(store, tmp_path):
    """SIGTERM (a scheduler's stop, `kill`) ends a one-process run as Ctrl-C does: exit 143 with the command that
    resumes it, not a silent death."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "eyas", "train", "--store", str(store), "--out", str(out),
                             *LONG, "--checkpoint-every", "2", *SMALL],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        wait_for_training(proc, out)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # a run that ignored SIGTERM must not go on for its 5,000 epochs
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err[-3000:]
    assert "eyas: stopped (SIGTERM); completed work is kept. To resume: eyas train" in err and "--resume" in err
    assert "Traceback" not in err


def test_a_stopped_eyas_torchrun_ends_in_one_line_with_the_resume_hint(store, tmp_path):
    """SIGTERM to the launcher (what a scheduler sends): torchrun's agent stops the ranks, each says how to resume,
    and eyas-torchrun ends with one line and exit 143, not torch's SignalException traceback (issue 45, item 5)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "eyas.torchrun", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "eyas", "train", "--store", str(store), "--out", str(out),
           *LONG, "--checkpoint-every", "2", *SMALL]
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_training(proc, out)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "eyas-torchrun: stopped (SIGTERM)" in err
    assert "To resume: eyas-torchrun --nproc_per_node 2 -m eyas train" in err and "--resume" in err, err[-3000:]
