"""`eyas regenerate`'s local backend: the target loaded in this process answers, `--batch-size` conversations at
a time, through eyas's lean batched decoder (continuous batching: `run_slots`) or transformers' `generate`
(batch by batch: `run_batches`). Several of these run side by side as worker processes (eyas.data.workers)."""

from __future__ import annotations

from typing import Iterable, Protocol

import torch

from eyas.core.dist import pick_device
from eyas.core.errors import EyasError
from eyas.core.memory import tune_allocator
from eyas.core.target import load_target
from eyas.core.threads import Threads
from eyas.data.chat import ChatRenderer
from eyas.data.formats import Conversation
from eyas.data.replies import Dialogue, Failed, Reply, Sink, prompt_limit, too_long
from eyas.models.generation import BatchGenerator, SlotGenerator
from eyas.models.llama import supports


class LocalSettings(Protocol):
    """What the local backend reads of the stage's settings (eyas.data.regenerate.RegenerateConfig)."""

    target: str
    device: str
    dtype: str
    threads: int
    trust_remote_code: bool
    generator: str
    batch_size: int
    max_new_tokens: int
    max_prompt_tokens: int
    temperature: float
    top_p: float
    seed: int


class LocalBackend:
    """The target itself, answering `batch_size` conversations per `generate` call. `workers` processes like this
    one share the node (eyas.data.workers): this is number `index`, its threads from its share of the cores and
    its sampling seed --seed + index (the workers draw different streams)."""

    def __init__(self, cfg: LocalSettings, con, workers: int = 1, index: int = 0):
        self.cfg, self.con = cfg, con
        device = pick_device(cfg.device)
        tune_allocator()  # eyas.core.memory: freed buffers stay in the process (no page faults per step)
        self.cpu = Threads(cfg.threads, workers, device)
        con.print("threads: %d (%s)" % self.cpu.apply())
        self.target = load_target(cfg.target, dtype=cfg.dtype, device=device, trust_remote_code=cfg.trust_remote_code)
        con.print(self.target.info())
        self.renderer = ChatRenderer(self.target.tokenizer)
        self.stops = self.renderer.stop_token_ids()
        pad = self.target.tokenizer.pad_token_id
        self.pad = pad if pad is not None else self.stops[0]
        self.max_prompt = prompt_limit(getattr(self.target.text_config, "max_position_embeddings", None), cfg)
        torch.manual_seed(cfg.seed + index)
        self.rng = torch.Generator(device=self.target.device).manual_seed(cfg.seed + index)
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


def answer_here(backend: LocalBackend, todo: Iterable[Conversation], sink: Sink) -> None:
    """Keep `batch_size` conversations active: the lean decoder refills a finished row's slot at once
    (`run_slots`); transformers' `generate` answers the next user turn of all of them together (`run_batches`)."""
    return (run_slots if backend.lean is not None else run_batches)(backend, todo, sink)


def run_batches(backend: LocalBackend, todo: Iterable[Conversation], sink: Sink) -> None:
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


def run_slots(backend: LocalBackend, todo: Iterable[Conversation], sink: Sink) -> None:
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
