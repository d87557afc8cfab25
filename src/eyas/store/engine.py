"""Hidden states through a serving engine: vLLM runs the target, eyas writes the store.

A target of a trillion parameters runs only tensor-parallel inside a serving engine, never as one transformers
model. vLLM's `extract_hidden_states` speculative method makes the engine keep, for every prompt token, the
residual stream at the layer ids it is given (id i < L: the input of decoder layer i, which is HF
`hidden_states[i]`; id L: the last layer's output before the final norm), and its hidden-states connector writes
them with the prompt's token ids, [T, layers, H] and [T], to one safetensors file per request once the request has
finished, under an exclusive lock on `FILE.lock` until the write is complete.

So each sample is one completion request: its whole token ids as the prompt, `max_tokens` 1. The answer echoes the
prompt's ids (checked against the sample's) and names the file (`kv_transfer_params.hidden_states_path`); eyas
waits on the file's lock, reads it, checks its ids again, deletes it, applies the target's own final norm to the
last state (HF's `hidden_states[L]`, which local extraction stores, is after the norm), and hands the four [T, H]
tensors to the shard writer local extraction uses. At most `concurrency` files exist at any time: nothing is kept
in the engine's layout beyond the requests in flight.

eyas starts the engine itself (`--engine-python`: the Python of vLLM's own environment; `--engine-args` passed
through: tensor-parallel size, GPU memory, ...) or attaches to one already serving (`--engine-url`, started with
the command `engine_command` prints).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from eyas.core.errors import EyasError

PLUGINS = Path(__file__).resolve().parent / "engine_plugins"  # put on the engine's PYTHONPATH
CONNECTOR = "EyasHiddenStatesConnector"  # engine_plugins/eyas_vllm_connector.py: vLLM's, with a CPU write path
MIN_VERSION = (0, 32)  # the first vLLM with extract_hidden_states and the hidden-states connector
LOG_TAIL = 30  # lines of the engine's log shown when it fails
GROUP_FILE = "engine.pgid"  # in the engine's folder: the process group eyas started it in


def vllm_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """The ids vLLM captures for eyas's three feature layers (HF hidden_states indices: the same numbers) and the
    final state (id L, before the norm)."""
    return [*layer_ids, num_layers]


def engine_args(model: str, layer_ids: list[int], tmp: Path, port: int, extra: str = "") -> list[str]:
    """The vLLM server's command-line arguments for hidden-state extraction into `tmp`."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
    transfer = {"kv_connector": CONNECTOR, "kv_connector_module_path": "eyas_vllm_connector",
                "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(tmp)}}
    return ["-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
            "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(transfer),
            *shlex.split(extra)]


def engine_command(python: str, model: str, layer_ids: list[int], tmp: Path, port: int, extra: str = "") -> str:
    """The shell command that starts the engine by hand (to attach to it with --engine-url)."""
    argv = [python, *engine_args(model, layer_ids, tmp, port, extra)]
    return f"PYTHONPATH={shlex.quote(str(PLUGINS))} " + " ".join(shlex.quote(a) for a in argv)


def check_engine_python(python: str) -> str:
    """vLLM's version in that Python, refused when vLLM, the method or the connector is missing or too old."""
    probe = ("import importlib.util as u, vllm; "
             "print(vllm.__version__); "
             "print(bool(u.find_spec('vllm.v1.spec_decode.extract_hidden_states'))); "
             "print(bool(u.find_spec('vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector')))")
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    except (FileNotFoundError, PermissionError) as e:
        raise EyasError(f"--engine-python {python}: cannot run it ({e.strerror})",
                        fix="give the python of the environment vLLM is installed in (VENV/bin/python)") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        raise EyasError(f"--engine-python {python} cannot import vllm ({last})", "vLLM is not installed there",
                        "install it in its own environment (docs/integration.md) and pass that environment's python")
    version, method, connector = out.stdout.split()[-3:]
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < MIN_VERSION:
        raise EyasError(f"vLLM {version} at {python} is too old for hidden-state extraction",
                        f"the extract_hidden_states method and its connector came with vLLM "
                        f"{'.'.join(map(str, MIN_VERSION))}", "install vLLM 0.32 or newer in that environment")
    if method != "True" or connector != "True":
        missing = "the extract_hidden_states method" if method != "True" else "the hidden-states connector"
        raise EyasError(f"vLLM {version} at {python} lacks {missing}", "a build without it cannot extract",
                        "install an official vLLM 0.32+ build")
    return version


class VllmEngine:
    """One vLLM server extracting hidden states: started here (`start`) or attached to (`url`)."""

    def __init__(self, url: str, tmp: Path | None, proc: subprocess.Popen | None = None, log: Path | None = None,
                 timeout: float = 600.0, name: str | None = None):
        self.url, self.tmp, self.proc, self.log, self.timeout = url.rstrip("/"), tmp, proc, log, timeout
        self.model, self.max_model_len = self._served_model(name)

    @classmethod
    def start(cls, python: str, model: str, layer_ids: list[int], tmp: Path, log: Path, port: int,
              extra: str = "", startup_s: float = 1800.0, timeout: float = 600.0,
              env: dict | None = None) -> VllmEngine:
        """Start the server in its own process group, wait until it serves (or fails: its log's tail is shown).
        It serves under a name of its own, so a server that already held the port is never mistaken for it."""
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                raise EyasError(f"port {port} is already in use", "another server (another extract?) listens there",
                                "pass another --engine-port, or attach to that server with --engine-url")
        tmp.mkdir(parents=True, exist_ok=True)
        log.parent.mkdir(parents=True, exist_ok=True)
        stop_leftovers(tmp / GROUP_FILE)
        name = f"eyas-{uuid.uuid4().hex[:12]}"
        env = {**os.environ, **(env or {}),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")]))}
        with open(log, "ab") as out:
            proc = subprocess.Popen([python, *engine_args(model, layer_ids, tmp, port, extra),
                                     "--served-model-name", name], stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        (tmp / GROUP_FILE).write_text(str(proc.pid))  # its process group, for a rerun after eyas was killed
        try:
            return cls._wait(proc, f"http://127.0.0.1:{port}", tmp, log, startup_s, timeout, name)
        except BaseException:
            stop(proc)
            raise

    @classmethod
    def _wait(cls, proc, url: str, tmp: Path, log: Path, startup_s: float, timeout: float, name: str):
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise EyasError(f"the vLLM engine exited with code {proc.returncode} while starting",
                                "it could not load the model or its settings (its log's last lines:)\n"
                                + tail(log), f"fix what the log says; the whole log is {log}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5):
                    return cls(url, tmp, proc, log, timeout, name)
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(2.0)
        raise EyasError(f"the vLLM engine did not serve within {startup_s:.0f} s", tail(log),
                        f"see {log}; a large model may need a longer --engine-startup-s")

    def _served_model(self, name: str | None) -> tuple[str, int | None]:
        """(the served model's name, its max_model_len): the one eyas named, when it started the server."""
        try:
            models = self._get("/v1/models")["data"]
            mine = [m for m in models if name is None or m["id"] == name]
            if not mine:
                raise EyasError(f"{self.url} serves {[m['id'] for m in models]}, not the engine eyas started",
                                "another server answers on that port", "stop it, or pass another --engine-port")
            return mine[0]["id"], mine[0].get("max_model_len")
        except (KeyError, IndexError, TypeError):
            raise EyasError(f"{self.url}/v1/models lists no model", fix="give the URL of a vLLM server") from None

    def _get(self, path: str) -> dict:
        return self._exchange(urllib.request.Request(self.url + path))

    def _exchange(self, req) -> dict:
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            body = e.read().decode("utf-8", "replace")[:300]
            raise EyasError(f"the vLLM engine at {self.url} refused a request (HTTP {e.code}): {body}",
                            "the request or the engine's settings are wrong", self._fix()) from None
        except (urllib.error.URLError, ConnectionError, OSError, ValueError) as e:
            raise self._failure(e) from None

    def _failure(self, e: BaseException) -> EyasError:
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):  # a dying engine closes its sockets first
                self.proc.wait(timeout=5.0)
        if self.proc is not None and self.proc.poll() is not None:
            return EyasError(f"the vLLM engine died (exit code {self.proc.returncode}) during extraction",
                             "its log's last lines:\n" + tail(self.log),
                             f"fix what the log says and rerun the same command: finished shards are kept ({self.log})")
        return EyasError(f"the vLLM engine at {self.url} did not answer ({getattr(e, 'reason', e)})",
                         "it is down, overloaded or unreachable", self._fix())

    def _fix(self) -> str:
        return (f"see the engine's log ({self.log}); rerun the same command to resume" if self.log
                else "check the engine's log; rerun the same command to resume (finished shards are kept)")

    def states(self, ids: list[int]) -> torch.Tensor:
        """[T, layers, H] hidden states of one sample's token ids (the file the engine wrote, read and removed)."""
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "return_token_ids": True}
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        answer = self._exchange(req)
        try:
            echoed = answer["choices"][0].get("prompt_token_ids")
            path = Path(answer["kv_transfer_params"]["hidden_states_path"])
        except (KeyError, IndexError, TypeError, AttributeError):
            raise EyasError(f"the engine at {self.url} answered without a hidden-states file",
                            "it does not run the extract_hidden_states method with a hidden-states connector",
                            "start it with the command eyas prints (--engine-url) or let eyas start it") from None
        try:
            if echoed is not None and list(echoed) != ids:
                raise EyasError(f"the engine tokenised a sample otherwise ({len(echoed)} ids for {len(ids)})",
                                "its states would belong to other tokens", "serve the same model eyas names")
            data = read_states(path)
        finally:
            remove_states(path)
        if data["token_ids"].tolist() != ids:
            raise EyasError(f"{path} holds the states of other token ids", "the engine's files are mixed up",
                            "give each eyas run its own engine and temporary folder")
        return data["hidden_states"]

    def many(self, samples: list[list[int]], concurrency: int) -> list[torch.Tensor]:
        """states() of several samples, `concurrency` in flight, in order; on an error the queued ones are dropped
        (not sent to an engine that failed)."""
        pool = ThreadPoolExecutor(max_workers=max(1, concurrency))
        try:
            out = list(pool.map(self.states, samples))
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        return out

    def close(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the engine's process before exec: on Linux it gets SIGKILL when eyas dies, even by SIGKILL, so a rerun
    never finds the port held by an orphan (its own engine-core and worker processes do not follow it: a rerun
    kills them, `stop_leftovers`). prctl was looked up at import: nothing is loaded in the forked child."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def stop_leftovers(record: Path) -> list[int]:
    """Kill what is left of an engine eyas started before and could not stop (eyas was SIGKILLed: the server
    follows it, PR_SET_PDEATHSIG, but vLLM's engine-core and worker processes stay, holding memory and GPUs).
    Only processes of the recorded process group whose command line names vLLM are killed; returns their pids."""
    if not record.is_file():
        return []
    try:
        group = int(record.read_text().strip())
    except ValueError:
        return []
    killed = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if os.getpgid(int(proc.name)) != group:
                continue
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
        except (OSError, ValueError):
            continue
        if "vllm" in cmd.lower():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)
                killed.append(int(proc.name))
    record.unlink(missing_ok=True)
    return killed


def read_states(path: Path) -> dict[str, torch.Tensor]:
    """A connector's file, once its writer released the lock (a shared lock waits for the exclusive one)."""
    lock = Path(str(path) + ".lock")
    if not lock.exists() and not path.exists():
        raise EyasError(f"the engine's file {path} is not on this machine",
                        "the engine writes its files where eyas cannot see them (another host, another folder)",
                        "run the engine on this machine with its storage path visible here, or let eyas start it")
    if lock.exists():
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)
    try:
        return load_file(str(path))
    except (OSError, ValueError, SafetensorError) as e:
        raise EyasError(f"the engine's file {path} is unreadable ({e})", "the engine failed while writing it",
                        "rerun the same command: the sample is extracted again") from None


def remove_states(path: Path) -> None:
    for p in (path, Path(str(path) + ".lock")):
        p.unlink(missing_ok=True)


def tail(log: Path | None, n: int = LOG_TAIL) -> str:
    """The log's first error line (a failing engine's root cause, often far above its last lines) and its end."""
    if log is None or not log.is_file():
        return "(no log)"
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    cause = next((x for x in lines if "WARNING" not in x and re.search(r"(^|\] |\s)[A-Z]\w*(Error|Exception): ", x)),
                 None)
    shown = ([cause.strip()[:500], "..."] if cause and cause not in lines[-n:] else []) + lines[-n:]
    return "\n".join("  " + line for line in shown)


def stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """Stop the engine and its workers (its whole process group)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
    except ProcessLookupError:
        pass
