"""`eyas extract --engine vllm` against a stand-in engine (tests/fake_vllm.py), which computes its states with
transformers and writes files the way vLLM's hidden-states connector does: the store equals local extraction's,
resumes after the engine dies, leaves none of the engine's files behind, and every way the engine can fail is a
clear error. The real vLLM: tests/integration/test_vllm_extract.py."""

import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch

from eyas.core.errors import EyasError
from eyas.core.target import load_target
from eyas.core.vllm_server import check_vllm
from eyas.store.extract import ExtractConfig, run
from eyas.store.reader import StoreReader
from eyas.store.vllm_states import ENGINE_DIR, engine_command, vllm_layer_ids
from tests.ports import free_port
from tests.test_extract import manifest, write_prepared

pytestmark = pytest.mark.usefixtures("one_thread")
FAKE = Path(__file__).with_name("fake_vllm.py")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny target as a model folder: what an engine loads."""
    out = tmp_path_factory.mktemp("target") / "tiny-hf"
    t = load_target("tiny")
    t.model.save_pretrained(out)
    t.tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return write_prepared(tmp_path_factory.mktemp("prepared"), n=12)


def engine_python(root: Path, die_after: int = -1, version: str = "0.32.0", probe_fails: bool = False) -> str:
    """An executable standing in for vLLM's environment's python: it answers eyas's version probe and runs the fake
    server for `-m vllm.entrypoints.openai.api_server`."""
    root.mkdir(parents=True, exist_ok=True)
    script = root / "python"
    probe = "echo 'ModuleNotFoundError: No module named vllm' >&2; exit 1" if probe_fails else \
        f"echo {version}; echo True; echo True; exit 0"
    script.write_text(f"""#!/bin/sh
if [ "$1" = "-c" ]; then {probe}; fi
shift 2
FAKE_VLLM_DIE_AFTER={die_after} OMP_NUM_THREADS=1 exec {sys.executable} {FAKE} "$@"
""")
    script.chmod(0o755)
    return str(script)


def cfg(prepared, store, folder, **kw) -> ExtractConfig:
    return ExtractConfig(data=str(prepared), store=str(store), target=str(folder), dtype="fp32", quiet=True,
                         batch_tokens=200, shard_mb=0.05, **kw)


def test_the_engines_store_equals_local_extraction(prepared, folder, tmp_path):
    local = run(cfg(prepared, tmp_path / "local", folder, attn="eager"))
    py = engine_python(tmp_path / "env")
    via = run(cfg(prepared, tmp_path / "engine", folder, engine="vllm", engine_python=py, engine_port=free_port(),
                  concurrency=3))
    assert via["samples"] == local["samples"] and via["shards"] == local["shards"] > 2
    a, b = StoreReader(tmp_path / "local"), StoreReader(tmp_path / "engine")
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.id == y.id and torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        # both bf16 in the store; fp32 forwards, per sample (engine) and in padded batches (local)
        torch.testing.assert_close(y.aux.float(), x.aux.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(y.final.float(), x.final.float(), rtol=1e-2, atol=1e-2)
    assert manifest(tmp_path / "engine")["layer_ids"] == manifest(tmp_path / "local")["layer_ids"] == [2, 4, 5]
    assert not list((tmp_path / "engine" / ENGINE_DIR).rglob("*.safetensors*"))  # every engine file consumed
    assert "fake vllm: serving" in (tmp_path / "engine" / "logs" / "engine-rank-00000.log").read_text()


def test_an_engine_dying_mid_run_is_named_and_a_rerun_resumes_to_the_same_store(prepared, folder, tmp_path):
    whole = tmp_path / "whole"
    run(cfg(prepared, whole, folder, engine="vllm", engine_python=engine_python(tmp_path / "ok"),
            engine_port=free_port()))
    store = tmp_path / "store"
    with pytest.raises(EyasError, match="engine died") as e:
        run(cfg(prepared, store, folder, engine="vllm", engine_python=engine_python(tmp_path / "dies", die_after=7),
                engine_port=free_port()))
    assert "dying as asked" in e.value.why  # the log's tail
    partial = len(list((store / "shards").glob("*.safetensors")))
    assert partial >= 1
    again = run(cfg(prepared, store, folder, engine="vllm", engine_python=engine_python(tmp_path / "ok"),
                    engine_port=free_port()))
    assert again["resumed_shards"] == partial
    a, b = StoreReader(whole), StoreReader(store)
    assert [a[i].id for i in range(len(a))] == [b[i].id for i in range(len(b))]
    assert all(torch.equal(a[i].aux, b[i].aux) and torch.equal(a[i].final, b[i].final) for i in range(len(a)))


def test_an_engine_that_dies_before_writing_an_answered_samples_file_is_named_as_dead(tmp_path):
    """An engine that answered a request and died before writing its file (its lock left, the file never made):
    the error says the engine died and shows its log, not only that a file is missing; a live engine's missing file
    stays the file's error."""
    import subprocess

    from eyas.core.vllm_server import Server
    from eyas.store.vllm_states import VllmEngine

    log = tmp_path / "engine.log"
    log.write_text("fake vllm: dying as asked\n")
    path = tmp_path / "cmpl-000007-0.safetensors"

    class Answered(Server):  # an engine that answers the sample with a file path and nothing more
        def _served_model(self, name):
            return "m", None

        def post(self, route, body):
            return {"choices": [{"prompt_token_ids": [1, 2]}], "kv_transfer_params": {"hidden_states_path": str(path)}}

    def engine(proc) -> VllmEngine:
        Path(str(path) + ".lock").write_text("")
        return VllmEngine(Answered("http://127.0.0.1:1", proc, log, task="extraction"))

    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    with pytest.raises(EyasError, match="engine died") as e:
        engine(dead).states([1, 2])
    assert "dying as asked" in str(e.value) and not Path(str(path) + ".lock").exists()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(EyasError, match="unreadable"):
            engine(alive).states([1, 2])
    finally:
        alive.kill()
        alive.wait()


def test_each_way_an_engine_is_missing_is_a_clear_error(prepared, folder, tmp_path, monkeypatch):
    with pytest.raises(EyasError, match="cannot run it"):
        check_vllm(str(tmp_path / "nowhere" / "python"))
    with pytest.raises(EyasError, match="cannot import vllm"):
        check_vllm(engine_python(tmp_path / "a", probe_fails=True), extraction=True)
    with pytest.raises(EyasError, match="too old"):
        check_vllm(engine_python(tmp_path / "b", version="0.11.2"), extraction=True)
    monkeypatch.delenv("EYAS_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(EyasError, match="no vLLM environment found") as e:
        run(cfg(prepared, tmp_path / "s", folder, engine="vllm"))
    assert "setup-vllm.sh" in e.value.fix
    monkeypatch.setenv("EYAS_VLLM_PYTHON", str(tmp_path / "elsewhere" / "python"))
    with pytest.raises(EyasError, match="elsewhere/python: cannot run it"):
        run(cfg(prepared, tmp_path / "s1", folder, engine="vllm"))
    with pytest.raises(EyasError, match="did not answer"):
        run(cfg(prepared, tmp_path / "s2", folder, engine="vllm", engine_url=f"http://127.0.0.1:{free_port()}"))
    with pytest.raises(EyasError, match=r"feature layer\(s\) \[9\]"):
        run(cfg(prepared, tmp_path / "s3", folder, engine="vllm", engine_python=engine_python(tmp_path / "c"),
                layers=(2, 4, 9)))


def test_an_engine_that_fails_to_start_shows_its_log(prepared, folder, tmp_path):
    """As vLLM exits when it cannot load a model: the error carries its log's last lines; nothing is extracted."""
    py = engine_python(tmp_path / "env")
    Path(py).write_text(Path(py).read_text().replace("exec ", "FAKE_VLLM_FAIL_LOAD=1 exec "))
    with pytest.raises(EyasError, match="exited with code") as e:
        run(cfg(prepared, tmp_path / "s", folder, engine="vllm", engine_python=py, engine_port=free_port()))
    assert "cannot load this model" in e.value.why
    assert not list((tmp_path / "s" / "shards").glob("*.safetensors"))


def test_the_layer_ids_and_command_are_vllms(tmp_path):
    assert vllm_layer_ids([2, 15, 27], 30) == [2, 15, 27, 30]  # HF indices are vLLM's ids; L = the final state
    cmd = engine_command("/v/bin/python", "/m", [2, 15, 27, 30], tmp_path, 8011, "--tensor-parallel-size 8")
    assert '"method": "extract_hidden_states"' in cmd and '"eagle_aux_hidden_state_layer_ids": [2, 15, 27, 30]' in cmd
    assert "EyasHiddenStatesConnector" in cmd and "--tensor-parallel-size 8" in cmd and "PYTHONPATH=" in cmd


def test_two_ranks_with_an_engine_each_write_the_same_store_as_one(prepared, folder, tmp_path):
    """Under torchrun every rank starts its own engine (port + LOCAL_RANK) and writes shards k = rank mod world;
    the merge's coverage check proves every sample is in the store once."""
    import json
    import subprocess

    from tests.test_extract import env_one_thread

    py = engine_python(tmp_path / "env")
    run(cfg(prepared, tmp_path / "one", folder, engine="vllm", engine_python=py, engine_port=free_port()))
    port = free_port()
    args = ["extract", "--data", str(prepared), "--store", str(tmp_path / "two"), "--target", str(folder),
            "--dtype", "fp32", "--batch-tokens", "200", "--shard-mb", "0.05", "--engine", "vllm",
            "--engine-python", py, "--engine-port", str(port), "--quiet"]
    out = subprocess.run(["torchrun", "--standalone", "--nproc-per-node", "2", "--module", "eyas", *args],
                         env=env_one_thread(), capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert manifest(tmp_path / "two") == manifest(tmp_path / "one")
    logs = sorted(p.name for p in (tmp_path / "two" / "logs").glob("engine-rank-*.log"))
    assert logs == ["engine-rank-00000.log", "engine-rank-00001.log"]  # one engine per rank
    by_rank = [json.loads((tmp_path / "two" / "index" / f"rank-{r:05d}-of-00002.json").read_text()) for r in (0, 1)]
    names = [{s["name"] for s in part} for part in by_rank]
    assert names[0] and names[1] and not names[0] & names[1]
    a, b = StoreReader(tmp_path / "one"), StoreReader(tmp_path / "two")
    assert all(torch.equal(a[i].aux, b[i].aux) and torch.equal(a[i].final, b[i].final) for i in range(len(a)))


def test_a_killed_runs_engine_leftovers_are_stopped_and_nothing_else(tmp_path):
    """vLLM's engine-core and workers outlive a SIGKILLed eyas (only the server follows it): the next start kills
    the recorded group's vLLM processes, never another process of that group."""
    import subprocess
    import time

    from eyas.core.vllm_server import GROUP_FILE, stop_leftovers

    sleep = f"{sys.executable} -c 'import time; time.sleep(600)'"
    leader = subprocess.Popen(["sh", "-c", f"{sleep} unrelated & exec {sleep} VLLM::EngineCore"],
                              start_new_session=True)  # the group: a vLLM-named process and another one
    others = []
    try:
        time.sleep(1.0)
        members = [int(p) for p in os.listdir("/proc") if p.isdigit() and _group(int(p)) == leader.pid]
        others = [p for p in members if p != leader.pid]
        (tmp_path / GROUP_FILE).write_text(str(leader.pid))
        assert others and stop_leftovers(tmp_path / GROUP_FILE) == [leader.pid]
        leader.wait(timeout=10)
        assert all(_group(p) == leader.pid for p in others)  # not vLLM processes: kept
        assert not (tmp_path / GROUP_FILE).exists() and stop_leftovers(tmp_path / GROUP_FILE) == []
    finally:
        for p in others:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, 9)
        leader.kill()


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None
