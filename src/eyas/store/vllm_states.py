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

import fcntl
import json
import os
import shlex
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from eyas.core.errors import EyasError
from eyas.core.precision import FULL
from eyas.core.vllm_server import Server, check_vllm, cpu_env, engine_model, server_argv, vllm_python

PLUGINS = Path(__file__).resolve().parent / "engine_plugins"  # put on the engine's PYTHONPATH
ENGINE_DIR = ".engine"  # STORE/.engine/rank-R/: the files of the engine eyas started, while they are read
CONNECTOR = "EyasHiddenStatesConnector"  # engine_plugins/eyas_vllm_connector.py: vLLM's, with a CPU write path


def vllm_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """The ids vLLM captures for eyas's three feature layers (HF hidden_states indices: the same numbers) and the
    final state (id L, before the norm)."""
    return [*layer_ids, num_layers]


def engine_args(layer_ids: list[int], tmp: Path, extra: str = "") -> list[str]:
    """The vLLM server's arguments (after the model and port) for hidden-state extraction into `tmp`."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
    transfer = {"kv_connector": CONNECTOR, "kv_connector_module_path": "eyas_vllm_connector",
                "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(tmp)}}
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(transfer),
            *shlex.split(extra)]


def engine_command(python: str, model: str, layer_ids: list[int], tmp: Path, port: int, extra: str = "") -> str:
    """The shell command that starts the engine by hand (to attach to it with --engine-url)."""
    argv = server_argv(python, model, port, engine_args(layer_ids, tmp, extra))
    return f"PYTHONPATH={shlex.quote(str(PLUGINS))} " + " ".join(shlex.quote(a) for a in argv)


class VllmEngine:
    """One vLLM server extracting hidden states: started here (`start`) or attached to (`VllmEngine.attach`)."""

    def __init__(self, server: Server):
        self.server = server
        self.url, self.model, self.max_model_len = server.url, server.model, server.max_model_len

    @classmethod
    def attach(cls, url: str) -> VllmEngine:
        return cls(Server(url, task="extraction"))

    @classmethod
    def start(cls, python: str, model: str, layer_ids: list[int], tmp: Path, log: Path, port: int,
              extra: str = "", startup_s: float = 1800.0, timeout: float = 600.0,
              env: dict | None = None) -> VllmEngine:
        """Start the server (eyas.core.vllm_server.Server.start) with the connector's plugin on its PYTHONPATH."""
        env = {**(env or {}),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")]))}
        return cls(Server.start(server_argv(python, model, port, engine_args(layer_ids, tmp, extra)), tmp, log, port,
                                startup_s, timeout, env, task="extraction"))

    def states(self, ids: list[int]) -> torch.Tensor:
        """[T, layers, H] hidden states of one sample's token ids (the file the engine wrote, read and removed)."""
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "return_token_ids": True}
        answer = self.server.post("/v1/completions", body)
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
            try:
                data = read_states(path)
            except EyasError as e:  # an engine that died after answering never wrote the file: say it died
                if self.server.died():
                    raise self.server.failure(e) from None
                raise
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
        self.server.close()


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


def engine_dtype(cfg) -> torch.dtype:
    """The dtype the engine runs in, and writes its states in."""
    return getattr(torch, FULL[cfg.dtype])


def open_engine(cfg, env, con, target, layer_ids: list[int], longest: int) -> VllmEngine:
    """Attach to this rank's server (--engine-url), or start one whose files go to STORE/.engine/rank-R/."""
    ids = vllm_layer_ids(layer_ids, target.num_layers)
    if cfg.engine_url:
        urls = [u.strip() for u in cfg.engine_url.split(",") if u.strip()]
        con.print(f"engine: attached to {urls[env.rank % len(urls)]} (rank {env.rank})")
        return VllmEngine.attach(urls[env.rank % len(urls)])
    model, revision = engine_model(cfg.target)
    python = vllm_python(cfg.engine_python)
    version = check_vllm(python, extraction=True)
    tmp = Path(cfg.store) / ENGINE_DIR / f"rank-{env.rank:05d}"
    for leftover in (*tmp.glob("*.safetensors"), *tmp.glob("*.safetensors.lock")):  # a killed run's, never read
        leftover.unlink(missing_ok=True)
    log = Path(cfg.store) / "logs" / f"engine-rank-{env.rank:05d}.log"
    extra = " ".join([f"--dtype {FULL[cfg.dtype]}", *revision,
                      *(["--trust-remote-code"] if cfg.trust_remote_code else [])])
    if "--max-model-len" not in cfg.engine_args:
        extra += f" --max-model-len {longest + 1}"  # the longest prompt, and the one token a completion asks for
    extra += f" {cfg.engine_args}"
    port = cfg.engine_port + env.local_rank
    cpu, threads = cpu_env(env.local_world_size, python)
    con.print(f"engine: starting vLLM {version} on port {port} (log {log}); by hand: "
              f"{engine_command(python, model, ids, tmp, port, extra)}" + (f"\n{threads}" if threads else ""))
    return VllmEngine.start(python, model, ids, tmp, log, port, extra, cfg.engine_startup_s,
                            env={**cpu, **gpu_share(env)})


def gpu_share(env) -> dict:
    """CUDA_VISIBLE_DEVICES for this rank's engine: its slice of the node's GPUs (8 GPUs, 8 ranks: one each; 1
    rank: all of them), unless the user chose them."""
    if "CUDA_VISIBLE_DEVICES" in os.environ or not torch.cuda.is_available():
        return {}
    n, ranks = torch.cuda.device_count(), max(1, env.local_world_size)
    per = max(1, n // ranks)
    first = (env.local_rank * per) % n
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(first + i) for i in range(min(per, n - first)))}


def engine_features(engine: VllmEngine, norm, toks: list[torch.Tensor], concurrency: int,
                    hidden: int) -> list[list[torch.Tensor]]:
    """The engine's [T, 4, H] states of each sample as [aux0, aux1, aux2, final] lists; the final state through
    the target's own norm (the engine's is before it, the store's after it, as HF's hidden_states[L])."""
    states = engine.many([t.tolist() for t in toks], concurrency)
    out: list[list[torch.Tensor]] = [[], [], [], []]
    with torch.inference_mode():
        for s, t in zip(states, toks):
            if tuple(s.shape) != (len(t), 4, hidden):
                raise EyasError(f"the engine at {engine.url} sent states of shape {list(s.shape)} for a sample of "
                                f"{len(t)} tokens; the target's would be [{len(t)}, 4, {hidden}]",
                                "it runs another model, or other layer ids than eyas's",
                                "serve the target eyas names with the ids it prints (or let eyas start it)")
            for j in range(3):
                out[j].append(s[:, j])
            out[3].append(norm(s[:, 3].to(norm.weight.dtype)))
    return out
