"""`eyas regenerate`: replace the assistant turns with the target's own answers.

EAGLE-3 drafts learn far better from what the target itself says (on-policy data) than from another model's
replies. For each conversation the system and user messages are replayed in order and a reply is generated after
every user message, turn by turn: the second user message follows the target's own first answer. The input's
assistant messages are dropped; prompt-only data (MT-Bench `turns`, plain prompts) works the same way.

Backends:
- local: the loaded target (eyas.data.local), eyas's continuous batching or `transformers` `generate`,
  `--batch-size` conversations at a time, greedy at `--temperature 0`, else sampled; replies end at EOS / the
  template's end-of-turn token. On a CPU, one worker process per core (eyas.data.workers).
- `--engine vllm`: a vLLM server eyas starts and stops (eyas.data.vllm_backend).
- `--server URL`: any OpenAI-compatible `/v1/chat/completions` (vLLM, SGLang, llama.cpp) with `--concurrency`
  conversations in flight on threads; each request has a `--timeout`, failures are retried with exponential
  backoff up to `--retries` times within `--retry-time` seconds (eyas/regenerate_server.py).

Output (docs/architecture.md, "Regenerated data"): a JSONL file, one `{"id", "messages", "source"}` per
conversation, appended (flush + fsync) as each completes. A rerun skips ids already present; a last line torn by
a killed run is ignored and removed (the file is rewritten without it, atomically). A lock file beside the output
keeps a second run from writing the same file at the same time. Failed conversations are not
written, so a rerun tries them again; the summary counts them by reason with their file and line.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from eyas.core.config import StageConfig, check, opt
from eyas.core.dist import on_gpu, pick_device
from eyas.core.errors import Incomplete
from eyas.core.lock import check_place, hold
from eyas.core.log import console, fmt_duration, fmt_int
from eyas.core.options import (
    Dtype,
    device_opt,
    dtype_opt,
    overwrite_opt,
    target_opt,
    trust_remote_code_opt,
    trusted_code_line,
)
from eyas.core.precision import choose_dtype
from eyas.data.formats import Conversation, Issues
from eyas.data.local import LocalBackend, answer_here
from eyas.data.replies import (
    LEFT_OUT,
    TOO_LONG,
    Sink,
    keep_settings,
    read_done,
    recorded_settings,
    start_anew,
)
from eyas.data.server import SERVER_CONCURRENCY, ServerBackend, run_server
from eyas.data.sources import data_opt, read_conversations, resolve_data
from eyas.data.vllm_backend import ENGINE_CONCURRENCY, EngineBackend, SharedEngine
from eyas.data.workers import Workers, plan_workers


@dataclasses.dataclass(frozen=True, kw_only=True)
class RegenerateConfig(StageConfig):
    target: str = target_opt(role="it answers")
    data: tuple[str, ...] = data_opt()
    out: str = opt("runs/demo/regenerated.jsonl", "output JSONL, appended; a rerun skips the ids it holds")
    max_samples: int = opt(0, "regenerate only the first N conversations of the input (0: all)")
    max_new_tokens: int = opt(256, "longest reply in tokens")
    temperature: float = opt(0.0, "0: greedy; above 0: sampled")
    top_p: float = opt(1.0, "nucleus sampling mass when sampling")
    seed: int = opt(0, "sampling seed")
    max_turns: int = opt(0, "answer only the first N user turns of a conversation, dropping the rest (0: all)")
    max_prompt_tokens: int = opt(0, "local backend: leave out prompts longer than N tokens, counted as left out "
                                 "(0: whatever fits the context with --max-new-tokens)")
    batch_size: int = opt(32, "local backend: conversations generated together (the lean decoder's slots)")
    generator: str = opt("auto", "local backend: lean (batched decoder for Llama-family targets, fast on CPUs), hf "
                         "(transformers generate, any model); auto = lean where it applies",
                         choices=("auto", "lean", "hf"))
    device: str = device_opt()  # the local backend's
    threads: int = opt(0, "local backend: CPU threads of each worker (0: its share of the cores other work leaves "
                          "free, re-checked as it runs; an explicit OMP_NUM_THREADS also wins)")
    workers: int = opt(0, "local backend: processes, each with a copy of the target (0: one per core on a CPU, "
                          "fewer for few conversations or little memory; 1 on a GPU)")
    dtype: Dtype = dtype_opt("the target (the local backend's and the engine's)")
    engine: str = opt("local", "local: the target loaded here answers (--generator); vllm: a vLLM server eyas starts "
                               "for the run and always stops (docs/regenerate.md)", choices=("local", "vllm"))
    engine_python: str = opt("", "vllm: the python of vLLM's own environment (empty: $EYAS_VLLM_PYTHON, else the one "
                                 "scripts/setup-vllm.sh makes)")
    engine_args: str = opt("", "vllm: more server arguments, passed through (e.g. '--tensor-parallel-size 8')")
    engine_port: int = opt(8300, "vllm: the port of the server eyas starts")
    engine_startup_s: float = opt(1800.0, "vllm: how long the server may take to start")
    server: str = opt("", "OpenAI-compatible server URL (e.g. http://127.0.0.1:8000); empty: generate locally")
    model: str = opt("", "model name sent to the server; empty: the first one its /v1/models lists")
    concurrency: int = opt(0, "server and engine backends: conversations in flight (0: "
                              f"{SERVER_CONCURRENCY} for --server, "
                              f"{ENGINE_CONCURRENCY} for --engine vllm, the best measured here)")
    timeout: float = opt(300.0, "server backend: seconds one request may take")
    retries: int = opt(4, "server backend: retries of a failed request (refused, timed out, 5xx, malformed)")
    retry_time: float = opt(600.0, "server backend: seconds one request may spend in retries, in total")
    api_key_file: str = opt("", "file holding the server's API key (else $EYAS_API_KEY; the key is never printed)")
    trust_remote_code: bool = trust_remote_code_opt()
    overwrite: bool = overwrite_opt("eyas regenerate")  # without it a rerun resumes, under the same settings only

    def validate(self):
        check(len(self.data) > 0, "no input data given", "pass --data FILE... (or a shorthand such as mt-bench)")
        check(self.max_samples >= 0, f"--max-samples {self.max_samples} is negative", "use 0 for all")
        check(self.max_turns >= 0, f"--max-turns {self.max_turns} is negative", "use 0 for all turns")
        check(self.max_prompt_tokens >= 0, f"--max-prompt-tokens {self.max_prompt_tokens} is negative",
              "use 0 for no limit beyond the context")
        check(self.max_new_tokens >= 1, f"--max-new-tokens {self.max_new_tokens} is below 1", "use e.g. 256")
        check(self.temperature >= 0, f"--temperature {self.temperature} is negative", "use 0 for greedy")
        check(0 < self.top_p <= 1, f"--top-p {self.top_p} is not in (0, 1]", "use e.g. 0.95, or 1")
        check(self.batch_size >= 1, f"--batch-size {self.batch_size} is below 1", "use e.g. 8")
        check(self.threads >= 0, f"--threads {self.threads} is negative", "use 0 for the free cores")
        check(self.workers >= 0, f"--workers {self.workers} is negative", "use 0 for one per core")
        check(self.workers <= 1 or not on_gpu(self.device),
              f"--workers {self.workers} on a GPU", "use --workers 1 and a larger --batch-size on a GPU")
        check(self.concurrency >= 0, f"--concurrency {self.concurrency} is negative", "use 0 for the default")
        check(not (self.server and self.engine == "vllm"), "--server and --engine vllm both given",
              "--server answers through a server already running, --engine vllm starts one: pass one of them")
        check(self.timeout > 0 and self.retry_time >= 0 and self.retries >= 0,
              "--timeout must be positive and --retries, --retry-time not negative", "use the defaults")
        check(bool(self.out), "--out is empty", "name the output JSONL file")


PERMANENT = {TOO_LONG, LEFT_OUT}


# ---------------------------------------------------------------- the stage


def pending(cfg: RegenerateConfig, done: set[str], issues: Issues) -> tuple[list[Conversation], int]:
    """(conversations still to regenerate, how many of the first --max-samples are already done)."""
    todo, seen, skipped = [], set(), 0
    for conv in read_conversations(cfg.data, issues):
        if conv.id in seen:
            issues.add("duplicate-id", conv.where, f"id {conv.id!r} was already used")
            continue
        if cfg.max_samples and len(seen) >= cfg.max_samples:
            break
        seen.add(conv.id)
        if conv.id in done:
            skipped += 1
        else:
            todo.append(first_turns(conv, cfg.max_turns) if cfg.max_turns else conv)
    return todo, skipped


def first_turns(conv: Conversation, n: int) -> Conversation:
    """The conversation up to (not including) its (n+1)-th user message: n user turns to answer."""
    users = [i for i, m in enumerate(conv.messages) if m.role == "user"]
    if len(users) <= n:
        return conv
    return dataclasses.replace(conv, messages=conv.messages[:users[n]])


def run(cfg: RegenerateConfig, shared: SharedEngine | None = None) -> dict:
    """The stage. `shared`: with --engine vllm, the server comes from it and is left running (`eyas run` keeps one
    for consecutive stages that would start the same one); else the stage starts and stops its own."""
    con = console(0, cfg.quiet, cfg.json)
    out = Path(cfg.out)
    check_place(out, "regenerate", "file")  # before any work (hold, below, checks it again as it takes the lock)
    for spec in cfg.data:  # a missing file fails now, before anything is loaded
        resolve_data(spec)
    if cfg.trust_remote_code:
        con.print(trusted_code_line(cfg.target))
    if not cfg.server:  # the dtype the answers are made in, recorded beside them: never "auto"
        dtype, why = choose_dtype(cfg.dtype, pick_device(cfg.device))
        cfg = dataclasses.replace(cfg, dtype=dtype)
        if why:
            con.print(why)
    lock = hold(out, "regenerate", kind="file")
    try:
        return _run(cfg, con, out, shared)
    finally:
        lock.close()


def generation_settings(cfg: RegenerateConfig, model: str) -> dict:
    """What the replies depend on, recorded beside the output (OUT.settings.json): a resume under other values
    would mix replies made two ways in one file. `model` is the model that answers (the server's name for it, or
    the local target); the server's address is not one of them (a server restarted elsewhere resumes)."""
    s = {"model": model, "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
         "max_turns": cfg.max_turns}
    if cfg.temperature > 0:
        s |= {"top_p": cfg.top_p, "seed": cfg.seed}
    if not cfg.server:
        s["dtype"] = cfg.dtype
    if cfg.engine != "local":  # an engine's replies differ from local ones at bf16 near-ties: never mixed
        s["engine"] = cfg.engine
    return s


def check_settings(cfg: RegenerateConfig, out: Path, model: str, con) -> None:
    """Refuse to add replies to `out` under other generation settings than those it holds (--overwrite starts it
    anew); record the settings of a new output."""
    keep_settings(out, generation_settings(cfg, model), con, "replies")


def _run(cfg: RegenerateConfig, con, out: Path, shared: SharedEngine | None) -> dict:
    if cfg.overwrite:
        start_anew(out)
    done = read_done(out, con)
    issues = Issues()
    todo, skipped = pending(cfg, done, issues)
    t0 = time.perf_counter()
    backend = None
    if not todo:  # nothing to add, and yet a file made under other settings is not "done" under these
        check_settings(cfg, out, (recorded_settings(out) or {}).get("model", "") if cfg.server else cfg.target, con)
    elif cfg.server:  # the model's name comes from the server
        backend = ServerBackend(cfg, con)
        check_settings(cfg, out, backend.name, con)
    else:  # checked before minutes go into loading the target or starting an engine
        check_settings(cfg, out, cfg.target, con)
        backend = EngineBackend(cfg, con, shared) if cfg.engine == "vllm" else local_backend(cfg, con, len(todo))
    con.print(f"regenerate: {fmt_int(len(todo))} conversations to do, {fmt_int(skipped)} already in {out}")
    bar = con.progress(total=len(todo), desc="regenerate", unit="conv")
    sink = Sink(out, bar)
    stopped = ""
    try:
        if isinstance(backend, ServerBackend):
            stopped = run_server(backend, todo, sink)
        elif todo:
            run_local(backend, todo, sink)
    finally:
        sink.close()
        bar.close()
        if isinstance(backend, (EngineBackend, Workers)):
            backend.close()
    summary = _summary(cfg, backend, sink, issues, len(todo), skipped, stopped, time.perf_counter() - t0)
    _report(con, summary, sink.failures, issues, sink.left_out)
    retry = summary["not_started"] + sum(n for reason, n in sink.failures.counts.items() if reason not in PERMANENT)
    if retry:
        raise Incomplete(f"regenerate stopped with {fmt_int(retry)} of {fmt_int(len(todo))} conversations left to do"
                         + (f" ({summary['stopped_early']})" if summary["stopped_early"] else ""),
                         f"{fmt_int(sink.done)} were written to {out} and are kept",
                         "rerun the same command to do the rest (it skips what is written)"
                         + ("; check the server first" if cfg.server else ""), summary)
    return summary


def local_backend(cfg: RegenerateConfig, con, conversations: int) -> LocalBackend | Workers:
    """The target loaded in this process, or in worker processes (eyas.data.workers.plan_workers)."""
    n, why = plan_workers(cfg, conversations)
    return Workers(cfg, con, n, why) if n > 1 else LocalBackend(cfg, con)


def run_local(backend: LocalBackend | Workers, todo: list[Conversation], sink: Sink) -> None:
    """Answer `todo` locally, in this process or on the workers."""
    if isinstance(backend, Workers):
        backend.run(todo, sink)
    else:
        answer_here(backend, todo, sink)


def _summary(cfg, backend, sink: Sink, issues: Issues, todo: int, skipped: int, stopped: str, elapsed: float) -> dict:
    return {
        "out": cfg.out, "data": list(cfg.data),
        "backend": "server" if cfg.server else "engine" if cfg.engine != "local" else "local",
        "workers": backend.n if isinstance(backend, Workers) else 1,
        "conversations_by_worker": backend.finished if isinstance(backend, Workers) else None,
        "model": getattr(backend, "name", cfg.target), "to_do": todo, "done": sink.done, "skipped": skipped,
        "failed": sink.failures.total(), "failures": sink.failures.to_dict(), "input_issues": issues.to_dict(),
        "left_out": sink.left_out.total(), "left_out_reasons": sink.left_out.to_dict(),
        "not_started": todo - sink.done - sink.failures.total() - sink.left_out.total(), "stopped_early": stopped,
        "tokens": sink.tokens, "tokens_per_s": round(sink.tokens / max(elapsed, 1e-9), 2),
        "replies_cut_at_max_new_tokens": sink.cut, "elapsed_s": round(elapsed, 3),
    }


def _report(con, s: dict, failures: Issues, issues: Issues, left_out: Issues) -> None:
    if issues.counts:
        con.print("\n".join(["input records skipped:", *issues.lines()]))
    if left_out.counts:
        con.print("\n".join(["left out by --max-prompt-tokens (not written; a rerun checks their length again):",
                             *left_out.lines()]))
    if failures.counts:
        con.print("\n".join(["failed (not written; a rerun retries them):", *failures.lines()]), force=True)
    if s["stopped_early"]:
        con.print(f"stopped early: {s['stopped_early']}; completed work is kept, rerun to resume", force=True)
    if s["replies_cut_at_max_new_tokens"]:
        con.print(f"{fmt_int(s['replies_cut_at_max_new_tokens'])} replies stopped at --max-new-tokens")
    con.summary(f"regenerate: {fmt_int(s['done'])} done, {fmt_int(s['skipped'])} skipped (already done), "
                f"{fmt_int(s['failed'])} failed, "
                + (f"{fmt_int(s['left_out'])} left out (--max-prompt-tokens), " if s["left_out"] else "")
                + f"{fmt_int(s['tokens'])} tokens at {s['tokens_per_s']:.1f} tok/s, "
                + (f"on {s['workers']} workers ({' + '.join(map(fmt_int, s['conversations_by_worker']))} "
                   "conversations), " if s["workers"] > 1 else "")
                + f"{fmt_duration(s['elapsed_s'])} -> {s['out']}")
