"""Chat formats: every input format parses into one normalised `Conversation` (docs/architecture.md).

A record's format is detected from its keys, so one file may mix formats:

| format   | keys                                          | becomes                                                  |
|----------|-----------------------------------------------|----------------------------------------------------------|
| sharegpt | `conversations: [{from, value}]`              | human/user -> user, gpt/assistant/model -> assistant    |
| chitchat | `messages: [[{text, sender}, ...], ...]`      | first sender -> user, the other -> assistant (a group's  |
|          |                                               | texts joined by newlines)                                |
| openai   | `messages: [{role, content}]`                 | as is (content parts of type text are concatenated)     |
| mt-bench | `turns: [str]`                                | one user message per turn, no replies (prompt-only)     |
| gsm8k    | `question` (+ `answer`)                       | user question (+ assistant answer)                      |
| alpaca   | `instruction` (+ `input`, `output`, `system`) | user = instruction, a blank line, input (+ assistant     |
|          |                                               | output)                                                  |
| prompt   | `prompt` (+ `response`/`completion`/`output`) | user prompt (+ assistant reply)                         |
| query    | `query` (WritingBench)                        | user prompt (prompt-only)                               |

Where records come from (files, folders, shorthands, Hub datasets) is `eyas.data.sources`.

Ids are stable: the record's own `id` (or `question_id`, `prompt_id`, `conversation_id`, the mapping key), else
`<file stem>:<line>` (`<dataset>:<row>` for a Hub dataset). Bad records never stop a run: each is counted in an
`Issues` with its file and line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter, defaultdict
from collections.abc import Iterable

ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system"}
ID_KEYS = ("id", "question_id", "prompt_id", "conversation_id", "conv_id", "uuid")
REPLY_KEYS = ("response", "completion", "output")
TOO_DEEP = "JSON nested deeper than Python can read (a RecursionError)"


@dataclasses.dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant
    content: str


@dataclasses.dataclass(frozen=True)
class Conversation:
    id: str
    messages: list[Message]
    source: str  # the record's own `source`, else "<format>:<file name>"
    where: str = dataclasses.field(default="", compare=False)  # "file:line", for reporting only

    @property
    def has_assistant(self) -> bool:
        return any(m.role == "assistant" for m in self.messages)

    def to_record(self) -> dict:
        """The regenerated-data JSONL object: OpenAI messages with an id."""
        return {"id": self.id, "messages": [{"role": m.role, "content": m.content} for m in self.messages],
                "source": self.source}

    def content_key(self) -> bytes:
        """Digest of the content with whitespace runs collapsed: equal for duplicates that differ only in spacing."""
        norm = [[m.role, " ".join(m.content.split())] for m in self.messages]
        return hashlib.sha256(json.dumps(norm, ensure_ascii=False).encode()).digest()[:16]


class FormatError(Exception):
    """A record that cannot be used: `reason` is the short key counted in `Issues`."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


class Issues:
    """Records skipped (or kept with a warning) by reason, with the first `keep` places of each."""

    def __init__(self, keep: int = 20):
        self.keep = keep
        self.counts: Counter[str] = Counter()
        self.places: dict[str, list[dict]] = defaultdict(list)

    def add(self, reason: str, where: str, detail: str = "") -> None:
        self.counts[reason] += 1
        if len(self.places[reason]) < self.keep:
            self.places[reason].append({"where": where, "detail": detail[:200]})

    def total(self, exclude: Iterable[str] = ()) -> int:
        return sum(n for r, n in self.counts.items() if r not in set(exclude))

    def to_dict(self) -> dict:
        return {r: {"count": n, "examples": self.places[r]} for r, n in sorted(self.counts.items())}

    def lines(self) -> list[str]:
        """One line per reason: count, reason, first place."""
        out = []
        for r, n in sorted(self.counts.items(), key=lambda kv: -kv[1]):
            first = self.places[r][0]
            detail = f" ({first['detail']})" if first["detail"] else ""
            out.append(f"  {n:>8,}  {r}: first at {first['where']}{detail}")
        return out


# ---------------------------------------------------------------- records -> conversations


def parse_record(rec: object, *, stem: str, name: str, where: str, key: str | None = None) -> Conversation:
    """One record -> a Conversation; raises FormatError(reason, detail) for anything unusable. `stem` opens the
    default id (`stem:N`, N from `where`), `name` the default source (`format:name`)."""
    fmt = detect(rec)
    if fmt is None:
        keys = ", ".join(list(rec)[:6]) if isinstance(rec, dict) else type(rec).__name__
        raise FormatError("unknown-format", f"keys: {keys}")
    messages = _PARSERS[fmt](rec)
    if not messages:
        raise FormatError("empty-conversation")
    for m in messages:
        if not m.content.strip():
            raise FormatError("empty-message", f"an empty {m.role} message")
    if not any(m.role == "user" for m in messages):
        raise FormatError("no-user-message")
    line = where.rsplit(":", 1)[-1].split(" ", 1)[0] if key is None else key  # "12", or "1.3" (see _json_array)
    rid = _text(key if key is not None else _own_id(rec) or f"{stem}:{line}", "the id")  # written as UTF-8
    source = _text(rec["source"], "source") if isinstance(rec.get("source"), str) else f"{fmt}:{name}"
    return Conversation(id=rid, messages=messages, source=source, where=where)


def detect(rec: object) -> str | None:
    if not isinstance(rec, dict):
        return None
    if "conversations" in rec:
        return "sharegpt"
    if "messages" in rec:
        msgs = rec["messages"]
        return "chitchat" if isinstance(msgs, list) and msgs and isinstance(msgs[0], list) else "openai"
    for fmt, k in (("mt-bench", "turns"), ("gsm8k", "question"), ("alpaca", "instruction"), ("prompt", "prompt"),
                   ("query", "query")):
        if k in rec:
            return fmt
    return None


def _own_id(rec: dict) -> str | None:
    for k in ID_KEYS:
        v = rec.get(k)
        if isinstance(v, (str, int)) and not isinstance(v, bool) and str(v):
            return str(v)
    return None


def _text(value: object, what: str) -> str:
    """A message text: a string (or OpenAI content parts) that encodes as UTF-8."""
    if isinstance(value, list):  # OpenAI content parts
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in value):
            raise FormatError("non-text-content", f"{what} has a non-text content part")
        value = "".join(str(p.get("text", "")) for p in value)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise FormatError("bad-record", f"{what} is a {type(value).__name__}, not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise FormatError("invalid-utf8", f"{what} holds bytes that are not UTF-8") from None
    return value


def _role(value: object) -> str:
    role = ROLE_ALIASES.get(str(value).strip().lower())
    if role is None:
        raise FormatError("unknown-role", f"role {value!r}; eyas knows {', '.join(sorted(ROLE_ALIASES))}")
    return role


def _list(rec: dict, key: str) -> list:
    value = rec[key]
    if not isinstance(value, list):
        raise FormatError("bad-record", f"`{key}` is a {type(value).__name__}, not a list")
    return value


def _sharegpt(rec: dict) -> list[Message]:
    out = []
    for i, m in enumerate(_list(rec, "conversations")):
        if not isinstance(m, dict):
            raise FormatError("bad-record", f"conversations[{i}] is not an object")
        role = m.get("from", m.get("role"))
        out.append(Message(_role(role), _text(m.get("value", m.get("content")), f"conversations[{i}]")))
    return out


def _openai(rec: dict) -> list[Message]:
    out = []
    for i, m in enumerate(_list(rec, "messages")):
        if not isinstance(m, dict):
            raise FormatError("bad-record", f"messages[{i}] is not an object")
        out.append(Message(_role(m.get("role")), _text(m.get("content"), f"messages[{i}]")))
    return out


def _chitchat(rec: dict) -> list[Message]:
    """Groups of consecutive texts by one sender; the first sender is the user, the second the assistant."""
    senders: list[str] = []
    out: list[Message] = []
    for i, group in enumerate(_list(rec, "messages")):
        if not isinstance(group, list) or not group or not all(isinstance(u, dict) for u in group):
            raise FormatError("bad-record", f"messages[{i}] is not a list of {{text, sender}} objects")
        sender = str(group[0].get("sender"))
        if sender not in senders:
            senders.append(sender)
        if len(senders) > 2:
            raise FormatError("bad-record", "a chitchat dialogue with more than two senders")
        role = "user" if sender == senders[0] else "assistant"
        text = "\n".join(_text(u.get("text"), f"messages[{i}]").strip() for u in group)
        if out and out[-1].role == role:  # the same sender again: still one turn
            out[-1] = Message(role, out[-1].content + "\n" + text)
        else:
            out.append(Message(role, text))
    return out


def _mt_bench(rec: dict) -> list[Message]:
    return [Message("user", _text(t, f"turns[{i}]")) for i, t in enumerate(_list(rec, "turns"))]


def _with_reply(rec: dict, prompt: str, reply_keys: tuple[str, ...]) -> list[Message]:
    out = [Message("system", _text(rec["system"], "system"))] if rec.get("system") else []
    out.append(Message("user", prompt))
    for k in reply_keys:
        if rec.get(k) is not None:
            out.append(Message("assistant", _text(rec[k], k)))
            break
    return out


def _gsm8k(rec: dict) -> list[Message]:
    return _with_reply(rec, _text(rec["question"], "question"), ("answer",))


def _alpaca(rec: dict) -> list[Message]:
    prompt, extra = _text(rec["instruction"], "instruction"), _text(rec.get("input"), "input")
    return _with_reply(rec, f"{prompt}\n\n{extra}" if extra.strip() else prompt, ("output",))


def _prompt(rec: dict) -> list[Message]:
    return _with_reply(rec, _text(rec["prompt"], "prompt"), REPLY_KEYS)


def _query(rec: dict) -> list[Message]:
    return [Message("user", _text(rec["query"], "query"))]


_PARSERS = {"sharegpt": _sharegpt, "chitchat": _chitchat, "openai": _openai, "mt-bench": _mt_bench,
            "gsm8k": _gsm8k, "alpaca": _alpaca, "prompt": _prompt, "query": _query}
