"""eyas.core.dist: the device choice, as a GPU machine would see it (CUDA faked: this suite runs on CPUs), and the
process group's tear-down."""

import pytest
import torch

from eyas.core import dist
from eyas.core.errors import EyasError
from tests.ports import free_port


@pytest.fixture
def gpus(monkeypatch):
    def visible(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return visible


def test_each_rank_takes_its_own_gpu_and_cuda_means_this_ranks(gpus):
    gpus(2)
    assert [dist.pick_device("auto", r) for r in (0, 1)] == ["cuda:0", "cuda:1"]
    assert [dist.pick_device("cuda", r) for r in (0, 1)] == ["cuda:0", "cuda:1"]  # set_device needs an index
    assert dist.pick_device("cuda:1", 0) == "cuda:1" and dist.pick_device("cpu", 5) == "cpu"  # as given
    gpus(0)
    assert dist.pick_device("auto", 3) == "cpu"


def test_a_rank_without_a_gpu_is_told_what_to_change(gpus, monkeypatch):
    gpus(1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(EyasError, match=r"local rank 1 has no GPU of its own") as e:
        dist.pick_device("auto", 1)
    assert "1 GPU(s)" in str(e.value) and "--nproc_per_node 1" in str(e.value)
    assert dist.read_env().device == "cpu"  # reading the environment decides nothing and never raises


def test_the_demo_runs_at_most_one_rank_per_gpu(gpus):
    from eyas.pipeline.demo import gpu_ranks

    gpus(1)
    assert gpu_ranks(2) == 1
    gpus(8)
    assert gpu_ranks(2) == 2
    gpus(0)
    assert gpu_ranks(2) == 2  # a CPU: one rank per core, as asked


def test_cuda_asked_of_a_machine_without_a_gpu_says_so(gpus):
    gpus(0)
    with pytest.raises(EyasError, match="--device cuda, but no CUDA GPU is visible") as e:
        dist.pick_device("cuda", 0)
    assert "--device cpu" in str(e.value)
    assert not dist.on_gpu("auto") and dist.on_gpu("cuda") and dist.on_gpu("cuda:1") and not dist.on_gpu("cpu")
    gpus(1)
    assert dist.on_gpu("auto")


def test_a_gpu_number_past_the_count_is_told_which_exist(gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    gpus(2)
    assert dist.pick_device("cuda:1", 0) == "cuda:1"
    for bad in ("cuda:2", "cuda:x"):
        with pytest.raises(EyasError, match=f"--device {bad}: no such GPU") as e:
            dist.pick_device(bad, 0)
        assert "cuda:0 to cuda:1" in str(e.value) and "CUDA_VISIBLE_DEVICES=4,5" in str(e.value)
    gpus(0)
    with pytest.raises(EyasError, match="--device cuda:0, but no CUDA GPU is visible"):
        dist.pick_device("cuda:0", 0)


def test_a_target_loads_straight_onto_its_gpu(monkeypatch):
    """Not through host memory first (each rank would hold a whole copy there): from_pretrained is given the
    device. Stopped at that call: no GPU here."""
    from transformers import AutoModelForCausalLM

    from eyas.core.target import load_target, resolve_source

    resolve_source("smollm2-135m")  # the GGUF converted to a folder first (a fresh cache loads it with from_pretrained)
    asked = []

    def fake(folder, **kw):
        asked.append(kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake)
    for device in ("cuda:1", "cpu"):
        with pytest.raises(RuntimeError, match="stop here"):
            load_target("smollm2-135m", device=device)
    assert asked[0].get("device_map") == "cuda:1" and "device_map" not in asked[1]


def _shutdown_rank(rank: int, port: int, finished: bool, out) -> None:
    import os
    import time

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    dist.init("cpu", timeout_s=60)
    if rank == 1:
        time.sleep(1.5)  # the slower rank still finishing its work
    t0 = time.perf_counter()
    dist.shutdown(finished)
    out.put((rank, time.perf_counter() - t0))


@pytest.mark.parametrize("finished", [True, False])
def test_a_finished_rank_waits_for_the_others_before_tearing_down(finished):
    """After success every rank is expected, so the fast one waits for the slow one before closing its connections;
    after a failure nobody waits (the others may never come)."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_shutdown_rank, args=(r, port, finished, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    assert [p.exitcode for p in procs] == [0, 0]
    waited = dict(out.get(timeout=5) for _ in procs)
    if finished:
        assert waited[0] > 1.0  # rank 0 waited out rank 1's 1.5 s
    else:
        assert waited[0] < 1.0
