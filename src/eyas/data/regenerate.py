"""`eyas regenerate`: replace the assistant turns with the target's own answers.

EAGLE-3 drafts learn far better from what the target itself says (on-policy data) than from another model's
replies. For each conversation the system and user messages are replayed in order and a reply is generated after
every user message, turn by turn: the second user message follows the target's own first answer. The input's
assistant messages are dropped; prompt-only data (MT-Bench `turns`, plain prompts) works the same way.

Backends:
- local: the loaded target through `transformers` `generate`, `--batch-size` conversations a step (left-padded),
  greedy at `--temperature 0`, else sampled; replies end at EOS / the template's end-of-turn token.
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

import torch

from eyas.core.config import StageConfig, changed_settings, check, opt
from eyas.core.dist import pick_device
from eyas.core.errors import EyasError, Incomplete
from eyas.core.files import read_json, write_json
from eyas.core.generate import BatchGenerator, SlotGenerator, supports
from eyas.core.log import console, fmt_duration, fmt_int
from eyas.core.memory import tune_allocator
from eyas.core.target import DEFAULT_TARGET, load_target
from eyas.core.threads import Threads
from eyas.data.chat import ChatRenderer
from eyas.data.engine import ENGINE_CONCURRENCY, EngineBackend
from eyas.data.formats import (
    Conversation,
    Issues,
    read_conversations,
    resolve_data,
)
from eyas.data.replies import LEFT_OUT, TOO_LONG, Dialogue, Failed, Reply, Sink, prompt_limit, read_done, too_long
from eyas.data.server import SERVER_CONCURRENCY, ServerBackend, run_server


@dataclasses.dataclass(frozen=True, kw_only=True)
class RegenerateConfig(StageConfig):
    target: str = opt(DEFAULT_TARGET, "target that answers (local backend); a name, HF folder or .gguf")
    data: tuple[str, ...] = opt((), "input files, folders or shorthands: mt-bench, gsm8k-train, gsm8k-test, "
                                    "chitchat, writingbench")
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
    device: str = opt("auto", "local backend: auto, cpu, cuda, cuda:1, ...")
    threads: int = opt(0, "local backend: CPU threads (0: the cores other work leaves free, re-checked as it runs; "
                          "an explicit OMP_NUM_THREADS also wins)")
    dtype: str = opt("float32", "local backend: float32, bfloat16 or float16",
                     choices=("float32", "bfloat16", "float16"))
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
    trust_remote_code: bool = opt(False, "let transformers run code shipped with a target folder")
    overwrite: bool = opt(False, "start --out anew (its replies and their settings are replaced), e.g. after changing "
                                 "a generation setting; without it a rerun resumes, under the same settings only")

    def __post_init__(self):
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
        check(self.concurrency >= 0, f"--concurrency {self.concurrency} is negative", "use 0 for the default")
        check(not (self.server and self.engine == "vllm"), "--server and --engine vllm both given",
              "--server answers through a server already running, --engine vllm starts one: pass one of them")
        check(self.timeout > 0 and self.retry_time >= 0 and self.retries >= 0,
              "--timeout must be positive and --retries, --retry-time not negative", "use the defaults")
        check(bool(self.out), "--out is empty", "name the output JSONL file")


PERMANENT = {TOO_LONG, LEFT_OUT}


class LocalBackend:
    """The target itself, answering `batch_size` conversations per `generate` call."""

    def __init__(self, cfg: RegenerateConfig, con):
        self.cfg, self.con = cfg, con
        device = pick_device(cfg.device)
        tune_allocator()  # eyas.core.memory: freed buffers stay in the process (no page faults per step)
        self.cpu = Threads(cfg.threads, 1, device)
        con.print("threads: %d (%s)" % self.cpu.apply())
        self.target = load_target(cfg.target, dtype=cfg.dtype, device=device, trust_remote_code=cfg.trust_remote_code)
        con.print(self.target.info())
        self.renderer = ChatRenderer(self.target.tokenizer)
        self.stops = self.renderer.stop_token_ids()
        pad = self.target.tokenizer.pad_token_id
        self.pad = pad if pad is not None else self.stops[0]
        self.max_prompt = prompt_limit(getattr(self.target.text_config, "max_position_embeddings", None), cfg)
        torch.manual_seed(cfg.seed)
        self.rng = torch.Generator(device=self.target.device).manual_seed(cfg.seed)
        self.lean = self._lean(cfg.generator)

    def _lean(self, choice: str):
        """The batched lean decoder when it applies (Llama family, stops by token only), else None (generate)."""

        fits = supports(self.target) and not self.renderer.stop_strings
        if choice == "lean" and not fits:
            raise EyasError(f"--generator lean does not apply to {self.target.name}",
                            f"it decodes Llama-family targets that stop on a token (this is "
                            f"{getattr(self.target.text_config, 'model_type', '?')}"
                            f"{', with stop strings' if self.renderer.stop_strings else ''})",
                            "use --generator hf (or auto)")
        return BatchGenerator(self.target) if fits and choice != "hf" else None

    @property
    def name(self) -> str:
        return self.target.name

    def prompt_ids(self, prompt: list[dict]) -> list[int] | Failed:
        """The rendered prompt's token ids, or a Failed if it is too long for the target's context."""
        ids = self.renderer.prompt_ids(prompt)
        return ids if len(ids) <= self.max_prompt else too_long(len(ids), self.cfg, "the target's context")

    def slots(self) -> SlotGenerator:
        """The continuous-batching engine over `--batch-size` slots (the lean decoder only)."""
        cfg = self.cfg
        return SlotGenerator(self.target, cfg.batch_size, cfg.max_new_tokens, set(self.stops), cfg.temperature,
                             cfg.top_p, self.rng)

    def recheck_threads(self) -> None:
        if changed := self.cpu.recheck():
            self.con.print(changed)

    def generate(self, prompts: list[list[dict]]) -> list[Reply | Failed]:
        """One reply per prompt (a Failed for a prompt too long for the target's context)."""

        self.recheck_threads()
        ids = [self.prompt_ids(p) for p in prompts]
        ok = [i for i, x in enumerate(ids) if not isinstance(x, Failed)]
        out: list[Reply | Failed] = [x if isinstance(x, Failed) else None for x in ids]
        if not ok:
            return out
        if self.lean is not None:
            cfg = self.cfg
            rows = self.lean.generate([ids[i] for i in ok], cfg.max_new_tokens, set(self.stops), cfg.temperature,
                                      cfg.top_p, self.rng)
            for row, i in zip(rows, ok):
                out[i] = self.reply(row)
            return out
        width = max(len(ids[i]) for i in ok)
        batch = torch.tensor([[self.pad] * (width - len(ids[i])) + ids[i] for i in ok])  # [B, T] left-padded
        attn = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in ok])  # [B, T]
        dev = self.target.device
        with torch.no_grad():
            gen = self.target.model.generate(input_ids=batch.to(dev), attention_mask=attn.to(dev), **self._sampling())
        for row, i in zip(gen[:, width:].tolist(), ok):  # [B, new] generated tokens
            out[i] = self.reply(row)
        return out

    def _sampling(self) -> dict:
        cfg, greedy = self.cfg, self.cfg.temperature == 0
        kw = dict(max_new_tokens=cfg.max_new_tokens, do_sample=not greedy, eos_token_id=self.stops,
                  pad_token_id=self.pad, temperature=None if greedy else cfg.temperature,
                  top_p=None if greedy else cfg.top_p, top_k=None)
        if self.renderer.stop_strings:
            kw.update(stop_strings=self.renderer.stop_strings, tokenizer=self.target.tokenizer)
        return kw

    def reply(self, row: list[int]) -> Reply:
        text, tokens, stopped = self.renderer.reply(row, self.stops)
        return Reply(text, tokens, cut=not stopped)


def run_local(backend: LocalBackend, todo: list[Conversation], sink: Sink) -> None:
    """Keep `batch_size` conversations active: the lean decoder refills a finished row's slot at once
    (`run_slots`); transformers' `generate` answers the next user turn of all of them together (`run_batches`)."""
    return (run_slots if backend.lean is not None else run_batches)(backend, todo, sink)


def run_batches(backend: LocalBackend, todo: list[Conversation], sink: Sink) -> None:
    """Batch by batch: each step answers the next user turn of all `batch_size` active conversations, and waits
    for the longest reply among them."""
    queue = iter(todo)
    active: list[tuple[Dialogue, list[dict]]] = []
    while True:
        while len(active) < backend.cfg.batch_size and (conv := next(queue, None)) is not None:
            d = Dialogue(conv)
            active.append((d, d.next_prompt()))
        if not active:
            return
        replies = backend.generate([p for _, p in active])
        sink.step(sum(r.tokens for r in replies if isinstance(r, Reply)))
        still = []
        for (d, _), r in zip(active, replies):
            try:
                if isinstance(r, Failed):
                    raise r
                d.answer(r)
            except Failed as e:
                sink.failed(d.conv, e)
                continue
            prompt = d.next_prompt()
            if prompt is None:
                sink.finished(d)
            else:
                still.append((d, prompt))
        active = still


def run_slots(backend: LocalBackend, todo: list[Conversation], sink: Sink) -> None:
    """Continuous batching: `batch_size` slots decode together; when a reply ends, its conversation's next turn
    (or the next conversation) takes the slot at once, so no slot waits for the longest reply of a batch."""
    engine, queue, steps, made = backend.slots(), iter(todo), 0, 0

    def offer(d: Dialogue, prompt: list[dict] | None) -> None:
        if prompt is None:
            sink.finished(d)
            return
        ids = backend.prompt_ids(prompt)
        if isinstance(ids, Failed):
            sink.failed(d.conv, ids)
        else:
            engine.submit(d, ids)

    while True:
        while engine.busy() + len(engine.queue) < engine.S and (conv := next(queue, None)) is not None:
            d = Dialogue(conv)
            offer(d, d.next_prompt())
        if engine.idle():
            break
        made += engine.busy() + len(engine.queue)
        for d, row in engine.step():
            try:
                d.answer(backend.reply(row))
            except Failed as e:
                sink.failed(d.conv, e)
                continue
            offer(d, d.next_prompt())
        steps += 1
        if steps % 16 == 0:
            sink.step(made)
            made = 0
            backend.recheck_threads()
    sink.step(made)


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


def run(cfg: RegenerateConfig) -> dict:
    con = console(0, cfg.quiet, cfg.json)
    out = Path(cfg.out)
    if out.is_dir():
        raise EyasError(f"--out {out} is a folder", fix="name a .jsonl file to write")
    for spec in cfg.data:  # a missing file fails now, before anything is loaded
        resolve_data(spec)
    lock = lock_output(out)
    try:
        return _run(cfg, con, out)
    finally:
        lock.close()


def lock_output(out: Path):
    """An exclusive lock beside `out` for the run (the kernel drops it when the process dies, even by SIGKILL)."""
    import fcntl  # POSIX only

    out.parent.mkdir(parents=True, exist_ok=True)
    f = open(out.with_name(f".{out.name}.lock"), "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise EyasError(f"another eyas regenerate is writing {out}", "two writers would duplicate conversations",
                        "wait for it to finish, or choose another --out") from None
    return f


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


def settings_file(out: Path) -> Path:
    return out.with_name(out.name + ".settings.json")


def start_anew(out: Path) -> None:
    """--overwrite: remove the output and its settings, once `out` is known to be regenerate's own output."""
    if out.is_file():
        read_done(out)  # refuses a file that is not regenerate's output: --overwrite replaces nothing else
        out.unlink()
    settings_file(out).unlink(missing_ok=True)


def check_settings(cfg: RegenerateConfig, out: Path, model: str, con) -> None:
    """Refuse to add replies to `out` under other generation settings than those it holds (--overwrite starts it
    anew); record the settings of a new output."""
    mine, side = generation_settings(cfg, model), settings_file(out)
    has_replies = out.is_file() and out.stat().st_size > 0
    if side.is_file() and has_replies:
        before = read_json(side, f"remove {side} and {out} to start anew, or choose another --out")
        diff = changed_settings(before, mine)
        if diff:
            raise EyasError(f"{out} holds replies made under other settings: "
                            + ", ".join(f"{k} {before.get(k)!r} then, {mine.get(k)!r} now" for k in diff),
                            "resuming would mix replies generated two ways in one file",
                            f"rerun with the settings recorded in {side}, choose another --out, or pass --overwrite "
                            "to generate every reply again")
    elif has_replies:
        con.print(f"{out}: written by an older eyas that did not record its generation settings; resuming under "
                  f"these ({side} now records them)", force=True)
    write_json(side, mine)


def _run(cfg: RegenerateConfig, con, out: Path) -> dict:
    if cfg.overwrite:
        start_anew(out)
    done = read_done(out, con)
    issues = Issues()
    todo, skipped = pending(cfg, done, issues)
    t0 = time.perf_counter()
    backend = None
    if todo:  # nothing to add: nothing can be mixed
        if cfg.server:  # the model's name comes from the server
            backend = ServerBackend(cfg, con)
            check_settings(cfg, out, backend.name, con)
        else:  # checked before minutes go into loading the target or starting an engine
            check_settings(cfg, out, cfg.target, con)
            backend = EngineBackend(cfg, con) if cfg.engine == "vllm" else LocalBackend(cfg, con)
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
        if isinstance(backend, EngineBackend):
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


def _summary(cfg, backend, sink: Sink, issues: Issues, todo: int, skipped: int, stopped: str, elapsed: float) -> dict:
    return {
        "out": cfg.out, "data": list(cfg.data),
        "backend": "server" if cfg.server else "engine" if cfg.engine != "local" else "local",
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
                f"{fmt_duration(s['elapsed_s'])} -> {s['out']}")
