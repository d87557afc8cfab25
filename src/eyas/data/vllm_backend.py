"""`eyas regenerate --engine vllm`: the target answers through a vLLM server eyas starts for the run and stops
after it (eyas.core.vllm_server: its own environment, its start-up shown, its log kept beside the output).

On this two-core CPU vLLM's CPU build makes more tokens per second than eyas's own decoder (docs/regenerate.md,
measured side by side), and on GPUs it is what a user would run anyway. Each prompt is rendered here with the
target's chat template exactly as the local backend renders it, and its token ids are sent to `/v1/completions`
with the template's stop tokens; the reply's token ids come back (`return_token_ids`) and are cut and decoded the
local way (ChatRenderer.reply). So both backends see the same prompts and the same stops, and only the engine's
arithmetic differs. `--max-prompt-tokens` and the context check (the engine's max_model_len) apply as locally.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from eyas.core.target import load_tokenizer
from eyas.core.vllm_server import (
    Server,
    check_vllm,
    cpu_env,
    engine_model,
    record_group,
    server_argv,
    vllm_python,
)
from eyas.data.chat import ChatRenderer
from eyas.data.replies import Reply, prompt_limit, too_long
from eyas.data.server import Retryable, ServerBackend, ServerSettings

ENGINE_CONCURRENCY = 128  # conversations in flight by default: the best of 64, 128, 256 measured here
ENGINE_FLOOR_TPS = 20.0  # tokens/s the engine makes in all, at the least (vLLM's CPU build made 68-77 on an
# AVX2-only EPYC in float32 with WritingBench's long prompts, 2026-12-03): what a request's time limit allows for


def engine_timeout(timeout: float, max_new: int, concurrency: int) -> float:
    """Seconds one request to an engine eyas started may take: --timeout, or longer where the engine may need it.
    A request waits its turn among `concurrency` in flight, so at an aggregate ENGINE_FLOOR_TPS a reply of
    `max_new` tokens takes max_new x concurrency / ENGINE_FLOOR_TPS seconds (320 tokens x 128 in flight: 34 min).
    A server that died is noticed by its refused connections at once; this bounds only a hung one."""
    return max(timeout, max_new * concurrency / ENGINE_FLOOR_TPS)


class EngineSettings(ServerSettings, Protocol):
    """What the engine backend reads of the stage's settings besides the server's (eyas.data.regenerate)."""

    out: str
    target: str
    dtype: str
    max_prompt_tokens: int
    trust_remote_code: bool
    engine_python: str
    engine_args: str
    engine_port: int
    engine_startup_s: float


def engine_paths(out: Path) -> tuple[Path, Path]:
    """(the engine's folder: its process-group record, its log) beside the output."""
    return out.with_name(f".{out.name}.engine"), out.with_name(out.name + ".engine.log")


def engine_key(cfg: EngineSettings) -> tuple:
    """What the server a stage starts depends on: stages of one run with the same key can share one."""
    return (cfg.target, cfg.dtype, cfg.seed, cfg.trust_remote_code, vllm_python(cfg.engine_python), cfg.engine_args,
            cfg.engine_port, cfg.engine_startup_s, cfg.timeout)


def start_engine(cfg: EngineSettings, con) -> Server:
    """Start the stage's vLLM server (its log and process-group record beside --out) and wait until it serves."""
    model, revision = engine_model(cfg.target)
    python = vllm_python(cfg.engine_python)
    version = check_vllm(python)
    args = ["--dtype", cfg.dtype, "--seed", str(cfg.seed), "--generation-config", "vllm", *revision,
            *(["--trust-remote-code"] if cfg.trust_remote_code else []), *cfg.engine_args.split()]
    home, log = engine_paths(Path(cfg.out))
    argv = server_argv(python, model, cfg.engine_port, args)
    env, threads = cpu_env(python=python)
    con.print(f"engine: starting vLLM {version} on port {cfg.engine_port} (log {log})"
              + (f", {' '.join(f'{k}={v}' for k, v in env.items())} (CPU defaults; set them to change)"
                 if env else "") + "; by hand: " + " ".join(argv))
    if threads:
        con.print(threads)
    bar = con.progress(desc="vLLM start", unit="poll", bar_format="{desc}: {elapsed}{postfix}")

    def waiting(line: str) -> None:  # the engine log's last line beside the clock, one refresh per poll
        bar.set_postfix_str(line[:70], refresh=False)
        bar.update()

    try:
        return Server.start(argv, home, log, cfg.engine_port, cfg.engine_startup_s, cfg.timeout, env,
                            task="regeneration", on_wait=waiting)
    finally:
        bar.close()


class SharedEngine:
    """One engine kept for consecutive stages of a run (`eyas run`) that would each start the same one: the second
    and later ones skip a start-up (40-115 s for SmolLM2-135M on a two-core CPU, docs/regenerate.md). `serve(cfg)`
    gives the running server when its key matches, else stops it and starts the stage's own; `close()` (also on
    leaving a `with`) stops it, so it never outlives the stages that use it."""

    def __init__(self):
        self.key: tuple | None = None
        self.server: Server | None = None
        self.started_by = ""  # the output of the stage that started it (its log is beside it)

    def serve(self, cfg: EngineSettings, con) -> Server:
        key = engine_key(cfg)
        if self.server is not None and key == self.key and self.server.proc.poll() is None:
            con.print(f"engine: the vLLM server started for {self.started_by} answers this stage too "
                      f"(no start-up; log {self.server.log})")
            home = engine_paths(Path(cfg.out))[0]  # recorded here too: a rerun that starts at this stage after
            home.mkdir(parents=True, exist_ok=True)  # eyas was killed stops what is left of it
            record_group(home, self.server.proc.pid)
            return self.server
        self.close()
        self.server, self.key, self.started_by = start_engine(cfg, con), key, cfg.out
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.server = self.key = None

    def __enter__(self) -> SharedEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EngineBackend(ServerBackend):
    """The target served by a vLLM server of this run's own; answers a conversation's turns by token ids. With
    `shared`, the server comes from it and is left running for the run's next stage; else it is started here and
    stopped by `close()`."""

    def __init__(self, cfg: EngineSettings, con, shared: SharedEngine | None = None):
        self.renderer = ChatRenderer(load_tokenizer(cfg.target, cfg.trust_remote_code))
        self.stops = self.renderer.stop_token_ids()
        self.own = shared is None
        self.server = start_engine(cfg, con) if self.own else shared.serve(cfg, con)
        self.max_prompt = prompt_limit(self.server.max_model_len, cfg)
        super().__init__(cfg, con, url=self.server.url + "/v1/completions", model=self.server.model,
                         concurrency=cfg.concurrency or ENGINE_CONCURRENCY)
        self.timeout = engine_timeout(cfg.timeout, cfg.max_new_tokens, self.concurrency)
        if self.timeout > cfg.timeout:
            con.print(f"engine: a request may take {self.timeout:.0f} s (--timeout {cfg.timeout:g}): "
                      f"{cfg.max_new_tokens} new tokens each, {self.concurrency} in flight, at {ENGINE_FLOOR_TPS:g} "
                      "tokens/s in all at the least")

    def ask(self, messages: list[dict]) -> Reply:
        ids = self.renderer.prompt_ids(messages)
        if len(ids) > self.max_prompt:
            raise too_long(len(ids), self.cfg, f"the engine's max_model_len {self.server.max_model_len}")
        cfg = self.cfg
        body = {"model": self.name, "prompt": ids, "max_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
                "stop_token_ids": self.stops, "skip_special_tokens": False, "return_token_ids": True}
        if self.renderer.stop_strings:
            body["stop"] = self.renderer.stop_strings
        if cfg.temperature > 0:
            body.update(top_p=cfg.top_p, seed=cfg.seed)
        return self._with_retries(self.url, body, self._reply)

    def _reply(self, obj: dict) -> Reply:
        """The reply of a completion whose output token ids came back, cut and decoded as locally."""
        try:
            choice = obj["choices"][0]
            row = [int(t) for t in choice["token_ids"]]
        except (KeyError, IndexError, TypeError, ValueError):
            raise Retryable("malformed-response", "no choices[0].token_ids in the completion") from None
        text, tokens, stopped = self.renderer.reply(row, self.stops)
        usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
        counted = usage.get("completion_tokens")  # with the stop token, where token_ids leave it out
        tokens = max(tokens, counted) if type(counted) is int else tokens
        return Reply(text, tokens, cut=not (stopped or choice.get("finish_reason") == "stop"))

    def close(self) -> None:
        if self.own:
            self.server.close()
