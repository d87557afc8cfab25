"""eyas.core.threads: torch's CPU threads from the cores other processes leave free; the user's count wins."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from eyas.core import threads as th


@pytest.fixture(autouse=True)
def keep_torch_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield
    torch.set_num_threads(before)


class FakeStat:
    """/proc/stat as a test drives it: `others` cores' worth of foreign work per second of wall time."""

    def __init__(self, monkeypatch, cores=2):
        self.others, self.busy, self.t = 0.0, 0, 1000.0
        monkeypatch.setattr(th, "cores", lambda: list(range(cores)))
        monkeypatch.setattr(th, "_busy_ticks", lambda _: (self.busy, self.busy + 10**6))
        monkeypatch.setattr(th, "_own_seconds", lambda: 0.0)
        monkeypatch.setattr(th.time, "monotonic", lambda: self.t)
        monkeypatch.setattr(th.time, "sleep", lambda s: self.advance(s))
        monkeypatch.setattr(th.os, "sysconf", lambda _: 100)

    def advance(self, seconds: float) -> None:
        self.busy += round(self.others * seconds * 100)
        self.t += seconds


@pytest.mark.parametrize("others,expect", [(0.0, 2), (0.3, 2), (1.0, 1), (2.0, 1)])
def test_free_cores_set_the_count(monkeypatch, others, expect):
    fake = FakeStat(monkeypatch)
    fake.others = others
    n, why = th.Threads().apply()
    assert n == expect == torch.get_num_threads()
    assert why.startswith("2 cores")
    assert ("busy with other work" in why) == (others >= 0.5)


def test_user_counts_win(monkeypatch):
    fake = FakeStat(monkeypatch)
    fake.others = 2.0
    assert th.Threads(2).apply() == (2, "--threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    cpu = th.Threads()
    assert cpu.apply() == (2, "OMP_NUM_THREADS=2")
    fake.advance(60)
    assert cpu.recheck() == "" and torch.get_num_threads() == 2  # never changed
    assert th.Threads(0, 1, "cuda:0").why == "torch's default (the GPU computes)"


def test_ranks_share_the_cores_and_do_not_count_as_other_work(monkeypatch):
    fake = FakeStat(monkeypatch, cores=4)
    assert th.Threads(0, 2).apply()[0] == 2  # 4 cores, 2 ranks on the node
    cpu = th.Threads(0, 2)
    cpu.apply()
    fake.others = 2.0  # the sibling rank computing on its 2 threads
    fake.advance(th.RECHECK_S + 1)
    assert cpu.recheck() == "" and cpu.n == 2
    fake.others = 4.0  # the sibling, and 2 cores' worth of someone else's work
    fake.advance(th.RECHECK_S + 1)
    assert cpu.recheck().startswith("threads: 2 -> 1") and torch.get_num_threads() == 1


def test_recheck_follows_the_load(monkeypatch):
    fake = FakeStat(monkeypatch)
    cpu = th.Threads()
    assert cpu.apply()[0] == 2
    fake.others = 2.0
    fake.advance(5)
    assert cpu.recheck() == ""  # not yet RECHECK_S since the last look
    fake.advance(th.RECHECK_S)
    line = cpu.recheck()
    assert line.startswith("threads: 2 -> 1") and "busy with other work" in line and torch.get_num_threads() == 1
    fake.others = 0.0
    fake.advance(th.RECHECK_S + 1)
    assert cpu.recheck().startswith("threads: 1 -> 2") and torch.get_num_threads() == 2


def test_real_hogs_are_seen(tmp_path):
    """Busy processes pinned to this process's cores: /proc/stat shows them, and the count drops to 1."""
    if not os.path.exists("/proc/stat") or not hasattr(os, "sched_getaffinity"):
        pytest.skip("needs Linux /proc/stat")
    cores = sorted(os.sched_getaffinity(0))
    hogs = [subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{c}}})\nwhile True: pass"])
            for c in cores]
    try:
        time.sleep(0.5)
        n, why = th.Threads().apply()
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert n == 1 and "busy with other work" in why, why


@pytest.mark.parametrize("others,bind,omp", [(0.0, None, None), (1.0, "nobind", "1"), (2.0, "nobind", "1")])
def test_an_engine_gets_the_free_cores(monkeypatch, others, bind, omp):
    """vLLM binds a thread to each core it is given and keeps it: on a loaded machine it gets as many threads as
    cores are free, unbound; on a quiet one its own binding. torch's own count is left alone."""
    from eyas.core.vllm_server import cpu_env

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    fake = FakeStat(monkeypatch)
    fake.others = others
    torch.set_num_threads(2)
    env, line = cpu_env()
    assert env.get("VLLM_CPU_OMP_THREADS_BIND") == bind and env.get("OMP_NUM_THREADS") == omp
    assert ("unbound" in line) == (bind == "nobind") and "2 cores" in line
    assert torch.get_num_threads() == 2


def test_an_engine_keeps_the_users_binding_and_count(monkeypatch):
    from eyas.core.vllm_server import cpu_env

    fake = FakeStat(monkeypatch)
    fake.others = 2.0
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env, line = cpu_env()
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env and "OMP_NUM_THREADS" not in env and "yours" in line
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's count: the engine gets it, vLLM binds it
    env, line = cpu_env()
    assert "OMP_NUM_THREADS" not in env and "vLLM's own binding" in line
    monkeypatch.delenv("OMP_NUM_THREADS")
    fake.others = 0.0
    env, _ = cpu_env(ranks_on_node=2)  # two engines on 2 free cores: one thread each, unbound (vLLM would bind
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["OMP_NUM_THREADS"] == "1"  # both to every core)


def test_an_engine_on_a_cpu_reuses_its_compile_cache_unless_the_user_chose(monkeypatch):
    """vLLM 0.32.0's CPU build cannot load its own ahead-of-time artifact and compiles again at every start: eyas
    turns that path off (torch.compile's ordinary cache is reused) unless VLLM_USE_AOT_COMPILE is the user's."""
    from eyas.core.vllm_server import cpu_env

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    assert cpu_env()[0]["VLLM_USE_AOT_COMPILE"] == "0"
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert "VLLM_USE_AOT_COMPILE" not in cpu_env()[0]


def test_an_engine_on_a_cpu_gets_the_allocator_and_openmp_vllm_asks_for(monkeypatch, tmp_path):
    """vLLM's CPU build wants tcmalloc and Intel's OpenMP in LD_PRELOAD: eyas preloads those it finds (tcmalloc by
    the loader's name, libiomp5 from the engine's own environment), and nothing when LD_PRELOAD is the user's."""
    import ctypes.util

    from eyas.core import vllm_server as engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    python = str(venv / "bin" / "python")
    names = {"tcmalloc_minimal": None, "tcmalloc": "libtcmalloc.so.4"}
    monkeypatch.setattr(ctypes.util, "find_library", lambda n: names.get(n))
    assert engine.preload(python) == {"LD_PRELOAD": "libtcmalloc.so.4"}  # no libiomp5 in that environment
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    names["tcmalloc_minimal"] = "libtcmalloc_minimal.so.4"  # the minimal one first, one allocator only
    assert engine.cpu_env(python=python)[0]["LD_PRELOAD"] == f"libtcmalloc_minimal.so.4:{venv}/lib/libiomp5.so"
    names.update(tcmalloc_minimal=None, tcmalloc=None)
    assert engine.preload(python) == {"LD_PRELOAD": f"{venv}/lib/libiomp5.so"}
    assert engine.preload("") == {}  # no environment named, no allocator found
    monkeypatch.setenv("LD_PRELOAD", "")  # the user's, even empty: kept as it is
    assert "LD_PRELOAD" not in engine.cpu_env(python=python)[0]


def test_one_rank_per_core_stays_on_its_core(monkeypatch):
    """As many ranks on the node as cores, one thread each: rank `slot` is pinned to the slot-th core; with more
    cores than ranks, on a GPU, or alone, nothing is pinned."""
    pinned = []
    monkeypatch.setattr(th.os, "sched_setaffinity", lambda pid, cpus: pinned.append((pid, set(cpus))))
    FakeStat(monkeypatch, cores=2)
    n, why = th.Threads(0, 2, "cpu", slot=1).apply()
    assert n == 1 and pinned == [(0, {1})] and why.endswith("on core 1 (one rank per core)")
    pinned.clear()
    for cpu in (th.Threads(0, 2, "cuda:1", slot=1), th.Threads(0, 1, "cpu", slot=0), th.Threads(0, 2, "cpu")):
        cpu.apply()
    FakeStat(monkeypatch, cores=4)
    assert th.Threads(0, 2, "cpu", slot=1).apply()[0] == 2  # two threads a rank: not pinned
    assert pinned == []
