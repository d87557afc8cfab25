"""The conversations `eyas regenerate` answers, turn by turn, and the append-only JSONL file they go to.

A reply is appended (and flushed) as each conversation completes; `read_done` reads back the ids already written,
so a restart skips them, and cuts a torn last line left by a crash.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from eyas.core.config import changed_settings
from eyas.core.errors import EyasError
from eyas.core.files import read_json, write_json
from eyas.data.formats import (
    Conversation,
    Issues,
    Message,
)


@dataclasses.dataclass(frozen=True)
class Reply:
    text: str
    tokens: int  # generated tokens (the server's usage count; 0 if it reports none)
    cut: bool  # stopped by --max-new-tokens rather than by the model


LEFT_OUT = "over-max-prompt-tokens"  # a Failed reason that is a choice (--max-prompt-tokens), not a failure
TOO_LONG = "prompt-too-long"  # exceeds the target's context: a rerun cannot fix it


class Failed(Exception):
    """A conversation that could not be completed: `reason` is counted, `detail` shown."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail

    def __reduce__(self):  # pickled as its two fields (a worker process sends failures to the parent)
        return Failed, (self.reason, self.detail)


class Dialogue:
    """One conversation being regenerated: its system and user messages replayed, each user turn answered."""

    def __init__(self, conv: Conversation):
        self.conv = conv
        self.script = [m for m in conv.messages if m.role != "assistant"]
        self.pos = 0
        self.messages: list[Message] = []
        self.tokens = self.cut = 0

    def next_prompt(self) -> list[dict] | None:
        """The messages up to the next user message (the target answers them), or None when all are answered."""
        while self.pos < len(self.script):
            m = self.script[self.pos]
            self.pos += 1
            self.messages.append(m)
            if m.role == "user":
                return [{"role": x.role, "content": x.content} for x in self.messages]
        return None

    def answer(self, reply: Reply) -> None:
        if not reply.text.strip():
            raise Failed("empty-reply", "the target answered with nothing")
        self.messages.append(Message("assistant", reply.text))
        self.tokens += reply.tokens
        self.cut += reply.cut

    def result(self) -> Conversation:
        return Conversation(id=self.conv.id, messages=list(self.messages), source=self.conv.source)


# ---------------------------------------------------------------- the output file


def read_done(out: Path, con=None) -> set[str]:
    """Ids already in `out`. A torn last line (no newline: a killed run) is removed by rewriting the file."""
    if not out.exists():
        return set()
    done: set[str] = set()
    good = 0  # bytes of complete lines
    with open(out, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                if not raw.startswith(b'{"id": '):  # eyas's records begin so: this fragment is not one torn
                    raise EyasError(f"{out}:{n} is not a line eyas wrote (no newline, and not an eyas record)",
                                    "eyas appends whole records, each starting with its id, so something else "
                                    "wrote the file", "choose another --out, or move that file away")
                break
            try:
                done.add(str(json.loads(raw)["id"]))
            except (ValueError, KeyError, TypeError):
                raise EyasError(f"{out}:{n} is not a regenerated conversation",
                                "eyas appends whole lines only, so something else changed the file",
                                "repair or delete that line, or choose another --out") from None
            good += len(raw)
    size = out.stat().st_size
    if size > good:
        _truncate_atomically(out, good)
        if con is not None:
            con.print(f"{out}: ignored a torn last line ({size - good} bytes) left by an interrupted run")
    return done


def _truncate_atomically(path: Path, size: int) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        remaining = size
        while remaining:
            chunk = src.read(min(remaining, 1 << 20))
            dst.write(chunk)
            remaining -= len(chunk)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)


class Sink:
    """Appends finished conversations (flush + fsync each) and keeps the counts and the progress bar."""

    def __init__(self, out: Path, bar):
        out.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(out, "ab")
        self.bar = bar
        self.failures = Issues()
        self.left_out = Issues()  # deliberately not answered (--max-prompt-tokens): not failures, never retried
        self.done = self.tokens = self.cut = self.failed_in_a_row = 0
        self.live = 0  # tokens generated so far, finished conversations or not (local backend)
        self.t0 = time.perf_counter()

    def finished(self, d: Dialogue) -> None:
        line = json.dumps(d.result().to_record(), ensure_ascii=False) + "\n"
        self.file.write(line.encode("utf-8"))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.done += 1
        self.tokens += d.tokens
        self.cut += d.cut
        self.failed_in_a_row = 0
        self._tick()

    def failed(self, conv: Conversation, e: Failed) -> None:
        if e.reason == LEFT_OUT:
            self.left_out.add(e.reason, conv.where, e.detail)
        else:
            self.failures.add(e.reason, conv.where, e.detail)
            self.failed_in_a_row += 1
        self._tick()

    def step(self, tokens: int) -> None:
        """Tokens generated by one local batch step: keeps tok/s moving between finished conversations."""
        self.live += tokens
        self._rate(refresh=True)

    def _tick(self) -> None:
        self.bar.update(1)
        self._rate(refresh=False)

    def _rate(self, refresh: bool) -> None:
        rate = max(self.live, self.tokens) / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=refresh)

    def close(self) -> None:
        self.file.close()


def prompt_limit(context: int | None, cfg) -> int:
    """The longest prompt a backend answers: what `context` leaves for --max-new-tokens (None: no known limit),
    and at most --max-prompt-tokens when given."""
    limit = (context or 1 << 30) - cfg.max_new_tokens
    return min(limit, cfg.max_prompt_tokens) if cfg.max_prompt_tokens else limit


def too_long(n: int, cfg, context: str) -> Failed:
    """The Failed of a prompt of `n` tokens over the limit: left out by --max-prompt-tokens, or too long for
    `context` (the target's, or an engine's max_model_len) with --max-new-tokens."""
    if cfg.max_prompt_tokens and n > cfg.max_prompt_tokens:
        return Failed(LEFT_OUT, f"{n} tokens exceed --max-prompt-tokens {cfg.max_prompt_tokens}")
    return Failed(TOO_LONG, f"{n} tokens + --max-new-tokens {cfg.max_new_tokens} exceed {context}")


def settings_file(out: Path) -> Path:
    return out.with_name(out.name + ".settings.json")


def start_anew(out: Path, own=None) -> None:
    """--overwrite: remove the output and its settings, once `own(out)` has read it as the command's own output
    (it raises otherwise: --overwrite replaces nothing else). `own` defaults to read_done, regenerate's reader."""
    if out.is_file():
        (own or read_done)(out)
        out.unlink()
    settings_file(out).unlink(missing_ok=True)


def recorded_settings(out: Path) -> dict | None:
    """The settings `out` was written under (OUT.settings.json), or None when none are recorded."""
    side = settings_file(out)
    return read_json(side, f"remove {side} and {out} to start anew, or choose another --out") if side.is_file() \
        else None


def keep_settings(out: Path, mine: dict, con, what: str) -> None:
    """Refuse to add `what` (replies, prompts) to `out` under other settings than those it was written with
    (OUT.settings.json; --overwrite starts it anew); record the settings of a new output."""
    side = settings_file(out)
    has_lines = out.is_file() and out.stat().st_size > 0
    if side.is_file() and has_lines:
        before = read_json(side, f"remove {side} and {out} to start anew, or choose another --out")
        diff = changed_settings(before, mine)
        if diff:
            raise EyasError(f"{out} holds {what} made under other settings: "
                            + ", ".join(f"{k} {before.get(k)!r} then, {mine.get(k)!r} now" for k in diff),
                            f"resuming would mix {what} generated two ways in one file",
                            f"rerun with the settings recorded in {side}, choose another --out, or pass --overwrite "
                            f"to generate every one again")
    elif has_lines:
        con.print(f"{out}: written by an older eyas that did not record its settings; resuming under these "
                  f"({side} now records them)", force=True)
    write_json(side, mine)
