"""A conversation through the target's chat template: `input_ids` and the assistant-only loss mask.

The loss mask is 1 exactly on the tokens the target generates as the assistant: each reply's text and the
end-of-turn token that closes it, 0 on system, user and template tokens. For SmolLM2's ChatML

    <|im_start|>assistant\\n  Hello there<|im_end|>  \\n
    0            0     0      1     1     1           0

How, robustly for any template: the whole conversation is rendered to text once, and each reply's characters
are located in it, then mapped to tokens through the tokenizer's character offsets on that text, so the ids are
exactly those of tokenising the rendering once (what `apply_chat_template(tokenize=True)` gives). Masked: every
token overlapping a reply, whitespace between the generation prompt and the reply (the model generates it, e.g.
the space after the fallback's `Assistant:`), and after the reply, whitespace tokens up to the special token that
ends the turn (`<|im_end|>`, `<|eot_id|>`, `</s>`), that token included.

Locating replies: the fast path renders the conversation a second time with each reply replaced by a placeholder;
the template's text around the placeholders must then equal the real rendering around the replies (trimmed or
not), which proves where every reply sits with two renders per conversation. A template that rewrites replies
fails that proof and takes the exact path: for assistant message i, the rendering of messages[:i] with the
generation prompt (what the model is given before it answers) must be a prefix of the whole text, and the reply
is looked for right after it (quadratic in the turns, so it is only the fallback).

Targets without a chat template (gemma3-270m is a base model) use `FALLBACK_TEMPLATE`, a plain-text format:

    <bos>SYSTEM PROMPT\\n\\nUser: question\\nAssistant: reply<eos>\\nUser: ...

where the generation prompt is `Assistant:` (the reply's leading space is the model's to generate) and the EOS
token ends each reply, so it is the end-of-turn token and generation stops at it (or at a new "\\nUser:").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jinja2

from eyas.core.errors import EyasError
from eyas.data.formats import FormatError, Message

FALLBACK_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
FALLBACK_STOP = "\nUser:"  # a base model writing the next user turn has finished its reply
_PLACEHOLDER = "\x00eyas-reply-{}\x00"  # NUL is neither whitespace (so trims keep it) nor text a template adds


@dataclasses.dataclass(frozen=True)
class Encoded:
    input_ids: list[int]  # [L]
    loss_mask: list[int]  # [L], 1 on assistant reply tokens and their end-of-turn token

    @property
    def num_masked(self) -> int:
        return sum(self.loss_mask)


class ChatRenderer:
    """Renders conversations for one tokenizer: training samples (`encode`) and generation prompts."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.fallback = not getattr(tokenizer, "chat_template", None)
        self.template = FALLBACK_TEMPLATE if self.fallback else None  # None: the tokenizer's own
        if self.fallback and tokenizer.eos_token is None:
            raise EyasError("the tokenizer has neither a chat template nor an EOS token",
                            "without one of them eyas cannot tell where an assistant reply ends",
                            "use a target whose tokenizer defines eos_token or a chat_template")
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special_ids = {i for i, t in added.items() if getattr(t, "special", False)}
        self.special_ids |= set(tokenizer.all_special_ids)
        self.stop_strings = [FALLBACK_STOP] if self.fallback else []
        self.generation_prompt = self._generation_prompt()

    def _generation_prompt(self) -> str:
        """The text the template appends for the model to answer (ChatML: "<|im_start|>assistant\\n")."""
        probe = [{"role": "user", "content": "Hi"}]
        try:
            plain, asking = self.render(probe), self.render(probe, add_generation_prompt=True)
        except FormatError:
            return ""
        return asking[len(plain):] if asking.startswith(plain) else ""

    def render(self, messages: Sequence[Message | dict], add_generation_prompt: bool = False) -> str:
        """The template's text for `messages`; a template that refuses them raises FormatError."""
        try:
            return self.tokenizer.apply_chat_template(_dicts(messages), chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise FormatError("template-error", str(e)) from None

    def encode(self, messages: Sequence[Message | dict]) -> Encoded:
        """input_ids and loss mask of a whole conversation (no generation prompt at its end)."""
        msgs = _dicts(messages)
        full = self.render(msgs)
        spans = self._spans_by_placeholder(msgs, full)
        if spans is None:  # the template rewrites replies: ask it turn by turn
            spans = [self._reply_span(msgs, i, full) for i, m in enumerate(msgs) if m["role"] == "assistant"]
        try:
            enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:
            raise EyasError("the tokenizer cannot report character offsets", "eyas maps replies to tokens by them",
                            "use a fast (tokenizers-backed) tokenizer for this target") from None
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
        return Encoded(ids, self._mask(full, ids, offsets, spans))

    def _spans_by_placeholder(self, msgs: list[dict], full: str) -> list[tuple[int, int]] | None:
        """Reply spans [start, end) in `full`, or None when the template does not render replies verbatim."""
        replies = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if not replies:
            return []
        marked = [dict(m, content=_PLACEHOLDER.format(i)) if i in replies else m for i, m in enumerate(msgs)]
        try:
            text = self.render(marked)
        except FormatError:
            return None
        spans, pos, cursor = [], 0, 0  # pos walks `text`, cursor walks `full`
        for i in replies:
            mark = _PLACEHOLDER.format(i)
            at = text.find(mark, pos)
            if at < 0 or not full.startswith(text[pos:at], cursor):
                return None
            cursor += at - pos
            content = msgs[i]["content"]
            reply = next((c for c in (content, content.strip()) if full.startswith(c, cursor)), None)
            if reply is None:
                return None
            spans.append((self._prompt_end(full, cursor), cursor + len(reply.rstrip())))
            pos, cursor = at + len(mark), cursor + len(reply)
        return spans if full[cursor:] == text[pos:] else None

    def _prompt_end(self, full: str, start: int) -> int:
        """Where the generation prompt before a reply starting at `start` ends (whitespace between is the model's)."""
        q = start
        while not full.endswith(self.generation_prompt, 0, q):
            if q == 0 or not full[q - 1].isspace():
                return start
            q -= 1
        return q

    def _reply_span(self, msgs: list[dict], i: int, full: str) -> tuple[int, int]:
        """Exact path: span [start, end) of assistant message i's reply, found after the prompt that precedes it."""
        prefix = self.render(msgs[:i], add_generation_prompt=True)
        reply = msgs[i]["content"].strip()  # templates that trim replies render the stripped text
        if not full.startswith(prefix):
            raise FormatError("template-not-prefix-stable",
                              f"the prompt before assistant message {i} is not how the whole conversation begins")
        start = full.find(reply, len(prefix))
        if start >= 0 and not full[len(prefix):start].strip():
            return len(prefix), start + len(reply)  # whitespace after the prompt is the model's to generate too
        # the template put text between the generation prompt and the reply: accept the reply only inside this
        # turn's own rendering, so that a match in a later message is never taken for it
        upto = self.render(msgs[: i + 1])
        start = upto.find(reply, len(prefix)) if full.startswith(upto) else -1
        if start < 0:
            raise FormatError("template-altered-reply", f"assistant message {i} is not in its rendering")
        return start, start + len(reply)

    def _mask(self, full: str, ids: list[int], offsets: list, spans: list[tuple[int, int]]) -> list[int]:
        mask = [0] * len(ids)
        j = 0
        for s, e in spans:  # spans are in increasing order, so one pass over the tokens
            while j < len(ids) and offsets[j][1] <= s:
                j += 1
            while j < len(ids) and offsets[j][0] < e:  # every token overlapping the reply
                mask[j] = 1
                j += 1
            k = j  # then whitespace tokens up to the special token that ends the turn, if there is one
            while k < len(ids) and ids[k] not in self.special_ids and not full[offsets[k][0]:offsets[k][1]].strip():
                k += 1
            if k < len(ids) and ids[k] in self.special_ids:
                mask[j:k + 1] = [1] * (k + 1 - j)
                j = k + 1
        return mask

    def prompt_ids(self, messages: Sequence[Message | dict]) -> list[int]:
        """Token ids of `messages` followed by the generation prompt: what the target answers."""
        text = self.render(messages, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def stop_token_ids(self) -> list[int]:
        """EOS and the template's end-of-turn token (found by encoding a probe conversation)."""
        probe = self.encode([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
        masked = [t for t, m in zip(probe.input_ids, probe.loss_mask) if m]
        stops = [masked[-1]] if masked and masked[-1] in self.special_ids else []
        eos = self.tokenizer.eos_token_id
        return stops + [eos] if eos is not None and eos not in stops else stops

    def reply(self, row: list[int], stops: Sequence[int]) -> tuple[str, int, bool]:
        """A generated row as (the reply's text, tokens generated counting the stop token, whether the target
        ended it itself): cut at the first of `stops`, decoded without special tokens, cleaned (clean_reply)."""
        end = next((k for k, t in enumerate(row) if t in stops), None)
        toks = row if end is None else row[:end]
        text = self.tokenizer.decode(toks, skip_special_tokens=True)
        stopped = end is not None or any(s in text for s in self.stop_strings)
        return self.clean_reply(text), len(toks) + (end is not None), stopped

    def clean_reply(self, text: str) -> str:
        """A generated reply without a trailing start of the next turn (fallback format only)."""
        for stop in self.stop_strings:
            text = text.split(stop, 1)[0]
        return text.strip() if self.fallback else text


def _dicts(messages: Sequence[Message | dict]) -> list[dict]:
    return [{"role": m.role, "content": m.content} if isinstance(m, Message) else dict(m) for m in messages]
