"""`eyas extract --engine vllm` with the real vLLM (0.32 CPU build here): SmolLM2-135M's store through the engine
against local extraction, a SIGKILLed and resumed run against an uninterrupted one, and the store trained on.

    python -m pytest -m integration tests/integration/test_vllm_extract.py -s

The features are compared with local fp32 extraction, per layer (max abs, relative Frobenius error, printed):
the engine's bf16 forward must be as close to it as local extraction's own bf16 forward is (within 1.5x, the
kernels differ), token ids and loss masks identical.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eyas.store.reader import StoreReader

pytestmark = [pytest.mark.integration]
ENGINE_ARGS = "--max-model-len 2048 --enforce-eager --max-num-seqs 8"
NAMES = ["layer 2", "layer 15", "layer 27", "final"]


# vLLM's CPU build otherwise reserves 92% of the machine's memory for its cache
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}


def eyas(*args: str, timeout: float = 1800, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eyas", *args], capture_output=True, text=True, timeout=timeout,
                          env=ENV, **kw)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prep")
    r = eyas("prepare", "--data", "gsm8k-train", "--max-samples", "48", "--out", str(out / "p"), "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    return out / "p"


def extract(prepared: Path, store: Path, *extra: str, engine: str | None = None, **kw):
    args = ["extract", "--data", str(prepared), "--store", str(store), "--shard-mb", "1", "--quiet", *extra]
    if engine:
        args += ["--engine", "vllm", "--engine-python", engine, "--engine-args", ENGINE_ARGS]
    return eyas(*args, **kw)


def errors(ref: Path, other: Path) -> dict[str, tuple[float, float]]:
    """{feature: (max abs error, relative Frobenius error)} of `other` against `ref`; ids and masks must match."""
    a, b = StoreReader(ref), StoreReader(other)
    assert len(a) == len(b)
    out = {n: [0.0, 0.0] for n in NAMES}
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.id == y.id and torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        H = x.final.shape[-1]
        for j, n in enumerate(NAMES):
            u = (x.aux[:, j * H:(j + 1) * H] if j < 3 else x.final).float()
            v = (y.aux[:, j * H:(j + 1) * H] if j < 3 else y.final).float()
            d = (u - v).abs()
            out[n] = [max(out[n][0], d.max().item()), max(out[n][1], (d.norm() / u.norm()).item())]
    return {n: tuple(v) for n, v in out.items()}


def test_the_engines_store_matches_local_extraction_and_trains(vllm_python, prepared, tmp_path):
    for name, extra in (("fp32", ("--dtype", "fp32")), ("bf16", ())):
        r = extract(prepared, tmp_path / name, *extra)
        assert r.returncode == 0, r.stderr[-3000:]
    t0 = time.perf_counter()
    r = extract(prepared, tmp_path / "engine", engine=vllm_python)
    assert r.returncode == 0, r.stderr[-3000:]
    print(f"\n[vllm extract] {time.perf_counter() - t0:.0f} s with the engine's start")
    local, engine = errors(tmp_path / "fp32", tmp_path / "bf16"), errors(tmp_path / "fp32", tmp_path / "engine")
    for n in NAMES:
        print(f"[vllm extract] {n}: local bf16 max abs {local[n][0]:.3g} rel {local[n][1]:.4f}; "
              f"vLLM bf16 max abs {engine[n][0]:.3g} rel {engine[n][1]:.4f}")
        assert engine[n][1] <= max(1.5 * local[n][1], 0.01), n
    assert not list((tmp_path / "engine" / ".engine").rglob("*.safetensors*"))  # every engine file consumed
    v = eyas("store", "verify", str(tmp_path / "engine"))
    assert v.returncode == 0 and "all checksums match" in v.stderr + v.stdout
    t = eyas("train", "--store", str(tmp_path / "engine"), "--out", str(tmp_path / "run"), "--max-steps", "3",
             "--draft-vocab", "512", "--max-tokens", "512", "--quiet")
    assert t.returncode == 0, t.stderr[-3000:]
    assert (tmp_path / "run" / "final").is_dir()


def test_a_sigkilled_run_resumes_to_the_uninterrupted_store(vllm_python, prepared, tmp_path):
    whole = extract(prepared, tmp_path / "whole", engine=vllm_python)
    assert whole.returncode == 0, whole.stderr[-3000:]
    store = tmp_path / "store"
    args = ["extract", "--data", str(prepared), "--store", str(store), "--shard-mb", "1", "--quiet",
            "--engine", "vllm", "--engine-python", vllm_python, "--engine-args", ENGINE_ARGS]
    log = tmp_path / "killed.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "eyas", *args], stdout=out, stderr=subprocess.STDOUT, env=ENV)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and len(list((store / "shards").glob("shard-*.safetensors"))) < 2:
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = len(list((store / "shards").glob("shard-*.safetensors")))
    assert finished >= 2
    time.sleep(5)  # the engine follows its parent (PR_SET_PDEATHSIG), its port is free again
    again = extract(prepared, store, engine=vllm_python)
    assert again.returncode == 0, again.stderr[-3000:]
    a, b = StoreReader(tmp_path / "whole"), StoreReader(store)
    assert all(a[i].id == b[i].id and torch.equal(a[i].aux, b[i].aux) and torch.equal(a[i].final, b[i].final)
               for i in range(len(a)))
    assert not list((store / ".engine").rglob("*.safetensors*"))
    left = [p for p in Path("/proc").glob("[0-9]*") if _cmdline(p).startswith(b"VLLM::")]
    assert not left, "the killed run's engine-core and workers were left running"


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""
