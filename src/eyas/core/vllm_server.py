"""A vLLM server that eyas starts, waits for and always stops: regenerate's and extract's `--engine vllm`.

vLLM pins its own torch and transformers, so it lives in an environment of its own and eyas only talks to it over
HTTP: `--engine-python` names that environment's Python (else `$EYAS_VLLM_PYTHON`, else the environment
`scripts/setup-vllm.sh` makes under the cache). The server runs in a process group of its own, serves under a name
eyas gives it (so a server already on the port is never mistaken for it), and its log is kept. It is stopped on
every way out of eyas: `close()` in a `finally`, SIGKILL from the kernel when eyas itself dies (PR_SET_PDEATHSIG),
and a rerun kills the engine-core and worker processes a killed eyas left (they do not follow their server).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from eyas.core.errors import EyasError
from eyas.core.paths import cache_dir
from eyas.core.target import TINY, hub_id, resolve_source
from eyas.core.threads import Threads

PYTHON_ENV = "EYAS_VLLM_PYTHON"  # the python of vLLM's environment, when --engine-python is not given
SETUP = "scripts/setup-vllm.sh"  # makes that environment at cache_dir() / VENV
VENV = "vllm-venv"
EXTRACT_MIN = (0, 32)  # the first vLLM with extract_hidden_states and the hidden-states connector
LOG_TAIL = 30  # lines of the engine's log shown when it fails
GROUP_FILE = "engine.pgid"  # in the engine's folder: the process group eyas started it in
CPU_KV_CACHE_GIB = "4"  # VLLM_CPU_KVCACHE_SPACE when unset on a machine without CUDA (vLLM would take 92% of RAM)
FEW_CORES = 4  # at most this many cores: vLLM keeps none apart for its front end (VLLM_CPU_NUM_OF_RESERVED_CPU)
TCMALLOC = ("tcmalloc_minimal", "tcmalloc")  # the allocator vLLM's CPU guide preloads (apt: libtcmalloc-minimal4)
IOMP = "lib/libiomp5.so"  # Intel's OpenMP, which vLLM's CPU build installs (intel-openmp) under its environment


def vllm_python(given: str) -> str:
    """The python to start vLLM with: `given`, else $EYAS_VLLM_PYTHON, else the environment SETUP makes."""
    if given:
        return given
    if os.environ.get(PYTHON_ENV):
        return os.environ[PYTHON_ENV]
    default = cache_dir() / VENV / "bin" / "python"
    if default.exists():
        return str(default)
    raise EyasError("--engine vllm: no vLLM environment found",
                    f"none was given (--engine-python), ${PYTHON_ENV} is not set and {default} does not exist",
                    f"run `bash {SETUP}` (installs vLLM's CPU build into {default.parents[1]}), or pass "
                    "--engine-python VENV/bin/python of an environment vLLM is installed in")


def check_vllm(python: str, extraction: bool = False) -> str:
    """vLLM's version in that Python; refused when vLLM is missing, or (`extraction`) too old or without the
    extract_hidden_states method and the hidden-states connector."""
    probe = ("import importlib.util as u, vllm; "
             "print(vllm.__version__); "
             "print(bool(u.find_spec('vllm.v1.spec_decode.extract_hidden_states'))); "
             "print(bool(u.find_spec('vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector')))")
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    except (FileNotFoundError, PermissionError) as e:
        raise EyasError(f"--engine-python {python}: cannot run it ({e.strerror})",
                        fix="give the python of the environment vLLM is installed in (VENV/bin/python), or run "
                            f"`bash {SETUP}`") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        raise EyasError(f"--engine-python {python} cannot import vllm ({last})", "vLLM is not installed there",
                        f"install it in its own environment (`bash {SETUP}`, docs/integration.md) and pass that "
                        "environment's python")
    version, method, connector = out.stdout.split()[-3:]
    if not extraction:
        return version
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < EXTRACT_MIN:
        raise EyasError(f"vLLM {version} at {python} is too old for hidden-state extraction",
                        f"the extract_hidden_states method and its connector came with vLLM "
                        f"{'.'.join(map(str, EXTRACT_MIN))}", "install vLLM 0.32 or newer in that environment")
    if method != "True" or connector != "True":
        missing = "the extract_hidden_states method" if method != "True" else "the hidden-states connector"
        raise EyasError(f"vLLM {version} at {python} lacks {missing}", "a build without it cannot extract",
                        "install an official vLLM 0.32+ build")
    return version


def cpu_env(ranks_on_node: int = 1, python: str = "") -> tuple[dict, str]:
    """What vLLM's CPU build gets on a machine without CUDA, unless the user set it, and a line saying what its
    threads will be and why ('' on a GPU):
    - tcmalloc and Intel's OpenMP preloaded, as vLLM's CPU guide asks, where they are found (`preload`);
    - a KV cache of CPU_KV_CACHE_GIB: without one vLLM reserves 92% of the machine's memory and refuses to start
      when another process holds some;
    - no core kept apart on a machine of FEW_CORES or fewer: vLLM keeps one for its HTTP front end, which on two
      cores halves the cores that compute (SmolLM2-135M bf16, GSM8K, 128 in flight, AMD EPYC 2 cores: 438 tokens/s
      with the reserved core, 652 without; docs/regenerate.md);
    - its threads, from the cores other work leaves free (eyas.core.threads, as for eyas's own; this engine's
      share of them when `ranks_on_node` engines start on the node). vLLM binds one OpenMP thread to each core it
      is given and keeps them for the whole run, so beside a busy process the thread whose core is taken holds
      up the others (0.30x of its quiet throughput beside one, docs/regenerate.md). So vLLM keeps its binding only
      where the engine gets every core; where fewer are free, or several engines share the node, it gets its
      count of threads, unbound (VLLM_CPU_OMP_THREADS_BIND=nobind, OMP_NUM_THREADS), and the scheduler places
      them beside the other work. A VLLM_CPU_OMP_THREADS_BIND of the user's is kept;
    - torch.compile's ordinary cache rather than vLLM's ahead-of-time artifact (VLLM_USE_AOT_COMPILE=0): vLLM
      0.32.0's CPU build saves that artifact but cannot load it ("'function' object has no attribute
      'finalize_loading'") and compiles again at every start, where the ordinary cache is reused (SmolLM2-135M,
      AMD EPYC 2 cores: a second start in 40 s against 79-80 s, the same tokens/s; docs/regenerate.md)."""
    if torch.cuda.is_available():
        return {}, ""
    env = {} if "VLLM_CPU_KVCACHE_SPACE" in os.environ else {"VLLM_CPU_KVCACHE_SPACE": CPU_KV_CACHE_GIB}
    if "VLLM_USE_AOT_COMPILE" not in os.environ:
        env["VLLM_USE_AOT_COMPILE"] = "0"
    if "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ and len(os.sched_getaffinity(0)) <= FEW_CORES:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    env.update(preload(python))
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return env, f"engine threads: VLLM_CPU_OMP_THREADS_BIND={os.environ['VLLM_CPU_OMP_THREADS_BIND']} (yours)"
    threads = Threads(0, ranks_on_node)
    n, why = threads.choose()
    if n >= len(threads.cores):  # vLLM's binding takes every core this process may run on
        return env, f"engine threads: vLLM's own binding, one thread to each of its cores ({why})"
    env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(n))
    return env, (f"engine threads: {n}, unbound ({why}); fixed for the run: vLLM cannot change them once started, "
                 "so start it on a quiet machine for full speed")


def preload(python: str) -> dict:
    """LD_PRELOAD for vLLM's CPU build: tcmalloc (found by the system's loader) and Intel's OpenMP from the engine's
    own environment (`python`'s), those of the two that exist; {} when the user set LD_PRELOAD (an empty one turns
    this off) or neither is found. vLLM warns without them; measured on SmolLM2-135M bf16, GSM8K, 128 in flight,
    AMD EPYC 2 cores: 592-600 tokens/s with both against 568-579 without (docs/regenerate.md)."""
    if "LD_PRELOAD" in os.environ:
        return {}
    found = [name for name in (ctypes.util.find_library(n) for n in TCMALLOC) if name][:1]  # one allocator
    iomp = Path(python).parent.parent / IOMP  # the venv's lib, not the resolved interpreter's
    if python and iomp.exists():
        found.append(str(iomp))
    return {"LD_PRELOAD": ":".join(found)} if found else {}


def engine_model(spec: str) -> tuple[str, list[str]]:
    """(what vLLM's --model gets for a target, the --revision arguments): a Hub id as it is, else the target's
    folder (a built-in GGUF's converted copy), absolute. Code-built targets are refused: an engine cannot load them."""
    if spec in TINY:
        raise EyasError(f"--target {spec} is built in code: an engine cannot load it",
                        fix="save it as a model folder (model.save_pretrained) and pass that folder")
    hub = hub_id(spec)
    if hub:
        return hub[0], ["--revision", hub[1]] if hub[1] else []
    return str(resolve_source(spec)[1].resolve()), []


def server_argv(python: str, model: str, port: int, args: list[str]) -> list[str]:
    """The command line of vLLM's OpenAI-compatible server."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port), *args]


class Server:
    """One vLLM OpenAI-compatible server: started here (`start`) or attached to (`Server(url)`). `task` names what
    it is used for in errors ("extraction", "regeneration")."""

    def __init__(self, url: str, proc: subprocess.Popen | None = None, log: Path | None = None,
                 timeout: float = 600.0, name: str | None = None, task: str = "its work"):
        self.url, self.proc, self.log, self.timeout, self.task = url.rstrip("/"), proc, log, timeout, task
        self.model, self.max_model_len = self._served_model(name)

    @classmethod
    def start(cls, argv: list[str], home: Path, log: Path, port: int, startup_s: float = 1800.0,
              timeout: float = 600.0, env: dict | None = None, task: str = "its work",
              on_wait: Callable[[str], None] | None = None) -> Server:
        """Start `argv` (server_argv) in its own process group, its state in `home`, with `env` over this process's
        environment (cpu_env's, on a CPU); wait until it serves (or fails: its log's tail is shown), calling
        `on_wait(the log's last line)` every poll. A free port is checked first: a server already there is never
        used."""
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                raise EyasError(f"port {port} is already in use", "another server (another eyas run?) listens there",
                                "pass another --engine-port")
        home.mkdir(parents=True, exist_ok=True)
        log.parent.mkdir(parents=True, exist_ok=True)
        stop_leftovers(home / GROUP_FILE)
        name = f"eyas-{uuid.uuid4().hex[:12]}"
        with open(log, "ab") as out:
            proc = subprocess.Popen([*argv, "--served-model-name", name], stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, **(env or {})}, start_new_session=True,
                                    preexec_fn=_die_with_parent)
        record_group(home, proc.pid)
        try:
            return cls._wait(proc, f"http://127.0.0.1:{port}", log, startup_s, timeout, name, task, on_wait)
        except BaseException:
            stop(proc)
            raise

    @classmethod
    def _wait(cls, proc, url: str, log: Path, startup_s: float, timeout: float, name: str, task: str, on_wait):
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if on_wait is not None:
                on_wait(last_line(log))
            if proc.poll() is not None:
                raise EyasError(f"the vLLM engine exited with code {proc.returncode} while starting",
                                "it could not load the model or its settings (its log's last lines:)\n"
                                + tail(log), f"fix what the log says; the whole log is {log}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5):
                    return cls(url, proc, log, timeout, name, task)
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(2.0)
        raise EyasError(f"the vLLM engine did not serve within {startup_s:.0f} s", tail(log),
                        f"see {log}; a large model may need a longer --engine-startup-s")

    def _served_model(self, name: str | None) -> tuple[str, int | None]:
        """(the served model's name, its max_model_len): the one eyas named, when it started the server."""
        try:
            models = self.get("/v1/models")["data"]
            mine = [m for m in models if name is None or m["id"] == name]
            if not mine:
                raise EyasError(f"{self.url} serves {[m['id'] for m in models]}, not the engine eyas started",
                                "another server answers on that port", "stop it, or pass another --engine-port")
            return mine[0]["id"], mine[0].get("max_model_len")
        except (KeyError, IndexError, TypeError):
            raise EyasError(f"{self.url}/v1/models lists no model", fix="give the URL of a vLLM server") from None

    def get(self, path: str) -> dict:
        return self._exchange(urllib.request.Request(self.url + path))

    def post(self, path: str, body: dict) -> dict:
        return self._exchange(urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                                     headers={"Content-Type": "application/json"}, method="POST"))

    def _exchange(self, req) -> dict:
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            body = e.read().decode("utf-8", "replace")[:300]
            raise EyasError(f"the vLLM engine at {self.url} refused a request (HTTP {e.code}): {body}",
                            "the request or the engine's settings are wrong", self.fix()) from None
        except (urllib.error.URLError, ConnectionError, OSError, ValueError, http.client.HTTPException) as e:
            raise self.failure(e) from None  # HTTPException: a reply cut short (IncompleteRead), a dying server

    def died(self) -> bool:
        """Whether the server eyas started has exited (waiting a moment: a dying engine closes its sockets first)."""
        if self.proc is None:
            return False
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)
        return self.proc.poll() is not None

    def failure(self, e: BaseException) -> EyasError:
        if self.died():
            return EyasError(f"the vLLM engine died (exit code {self.proc.returncode}) during {self.task}",
                             "its log's last lines:\n" + tail(self.log),
                             f"fix what the log says and rerun the same command: finished work is kept ({self.log})")
        return EyasError(f"the vLLM engine at {self.url} did not answer ({getattr(e, 'reason', e)})",
                         "it is down, overloaded or unreachable", self.fix())

    def fix(self) -> str:
        return (f"see the engine's log ({self.log}); rerun the same command to resume" if self.log
                else "check the engine's log; rerun the same command to resume (finished work is kept)")

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


def record_group(home: Path, group: int) -> None:
    """Write the process group of an engine in use into `home`, where stop_leftovers finds it on a rerun after eyas
    was killed."""
    (home / GROUP_FILE).write_text(str(group))


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


def tail(log: Path | None, n: int = LOG_TAIL) -> str:
    """The log's first error line (a failing engine's root cause, often far above its last lines) and its end."""
    if log is None or not log.is_file():
        return "(no log)"
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    cause = next((x for x in lines if "WARNING" not in x and re.search(r"(^|\] |\s)[A-Z]\w*(Error|Exception): ", x)),
                 None)
    shown = ([cause.strip()[:500], "..."] if cause and cause not in lines[-n:] else []) + lines[-n:]
    return "\n".join("  " + line for line in shown)


# "(APIServer pid=1) INFO 12-02 12:23:38 [api_utils.py:347] ", the process part absent from the first lines
LOG_PREFIX = re.compile(r"^(\([^)]*pid=\d+\)\s+)?[A-Z]+\s+\d\d-\d\d [\d:.]+ \[[^\]]*\]\s*")


def last_line(log: Path) -> str:
    """The log's last non-empty line (what the engine is doing while it starts), without vLLM's prefix of process,
    level, time and source line."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = [x for x in f.read().decode("utf-8", "replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return LOG_PREFIX.sub("", lines[-1].strip()) if lines else ""


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
