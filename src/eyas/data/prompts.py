"""`eyas prompts`: user prompts written by the target itself, for `eyas regenerate` to answer (Magpie).

A draft learns what it is shown, and the prompts that install here (GSM8K, chitchat, WritingBench) cover few of
the kinds of request a chat model is asked (MT-Bench: coding, extraction, STEM, humanities, roleplay, ...). An
instruction-tuned target has seen many more: given its chat template opened for a user turn and nothing else, it
writes a user's request the way its own training data did (Magpie, Xu et al. 2024). Sampled at temperature 1,
these prompts are as varied as that data, cost a few dozen tokens each, and need no data set.

The open user turn is the template's own text up to a user message's content (found by rendering a placeholder
message, so any template works), after `--system` when one is given (a system prompt steers the kind of request:
"You are a coding assistant." asks for code). Each batch of `--batch-size` rows is sampled with its own seed
(`--seed`, batch index), so a resumed run writes what an uninterrupted one would (it samples the last batch
written again and goes on after its last row). A prompt is kept when the
target ended the turn itself (not cut at `--max-new-tokens`), has at least `--min-chars` characters and was not
written before (exact duplicates are dropped and counted).

Output: a JSONL file of `{"id", "messages": [{"role": "user", ...}], "source"}` records (`--system` adds the
system message, and `batch`, `row`: where it was sampled), appended and fsynced batch by batch; `eyas regenerate
--data OUT` answers them. A rerun resumes under the same settings only (OUT.settings.json); a second run on the
same output at once is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch

from eyas.core.config import StageConfig, check, opt
from eyas.core.dist import pick_device
from eyas.core.errors import EyasError
from eyas.core.lock import hold
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
from eyas.core.target import load_target
from eyas.core.threads import Threads
from eyas.data.chat import ChatRenderer
from eyas.data.replies import keep_settings, read_done, start_anew
from eyas.models.generation import BatchGenerator
from eyas.models.llama import supports

PLACEHOLDER = "\u2063EYAS-USER-TURN\u2063"  # a user message's content, to find where the template puts it


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptsConfig(StageConfig):
    target: str = target_opt(role="it writes the prompts")
    out: str = opt("runs/demo/prompts.jsonl", "output JSONL, appended; a rerun resumes where it stopped")
    num_prompts: int = opt(1000, "prompts to write")
    system: str = opt("", "a system message before the user turn, to steer the kind of request (empty: the "
                          "template's default)")
    max_new_tokens: int = opt(160, "longest prompt in tokens; a prompt the target did not end by then is dropped")
    min_chars: int = opt(16, "shortest prompt kept, in characters")
    temperature: float = opt(1.0, "sampling temperature (Magpie samples at 1)")
    top_p: float = opt(1.0, "nucleus sampling mass")
    seed: int = opt(0, "sampling seed; each batch's own seed follows from it and the batch's index")
    batch_size: int = opt(64, "rows sampled together")
    dtype: Dtype = dtype_opt("the target")
    device: str = device_opt()
    threads: int = opt(0, "CPU threads (0: the cores other work leaves free; an explicit OMP_NUM_THREADS wins)")
    trust_remote_code: bool = trust_remote_code_opt()
    overwrite: bool = overwrite_opt("eyas prompts")  # without it a rerun resumes

    def validate(self):
        check(self.num_prompts >= 1, f"--num-prompts {self.num_prompts} is below 1", "use e.g. 1000")
        check(self.max_new_tokens >= 1, f"--max-new-tokens {self.max_new_tokens} is below 1", "use e.g. 160")
        check(self.temperature > 0, f"--temperature {self.temperature} is not above 0",
              "prompts are sampled: use e.g. 1.0 (greedy would write one prompt over and over)")
        check(0 < self.top_p <= 1, f"--top-p {self.top_p} is not in (0, 1]", "use e.g. 0.95, or 1")
        check(self.batch_size >= 1, f"--batch-size {self.batch_size} is below 1", "use e.g. 64")
        check(self.min_chars >= 0, f"--min-chars {self.min_chars} is negative", "use 0 to keep every length")
        check(bool(self.out), "--out is empty", "name the output JSONL file")


def open_user_turn(renderer: ChatRenderer, system: str) -> str:
    """The template's text up to a user message's content: what the target continues to write a prompt."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": PLACEHOLDER}]
    text = renderer.render(msgs)
    if PLACEHOLDER not in text:
        raise EyasError("the chat template does not show a user message's content", "prompts continue the "
                        "template's text up to it", "use a target with a chat template that renders user turns")
    return text.split(PLACEHOLDER, 1)[0]


def settings(cfg: PromptsConfig, dtype: str) -> dict:
    """What the prompts depend on (a resume under other values would mix prompts made two ways)."""
    return {"model": cfg.target, "system": cfg.system, "max_new_tokens": cfg.max_new_tokens,
            "min_chars": cfg.min_chars, "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed,
            "batch_size": cfg.batch_size, "dtype": dtype}


class Sampler:
    """Batches of sampled user turns from the target: the lean decoder for Llama-family targets, else
    transformers' generate."""

    def __init__(self, cfg: PromptsConfig, dtype: str, con):
        device = pick_device(cfg.device)
        con.print("threads: %d (%s)" % Threads(cfg.threads, 1, device).apply())
        if cfg.trust_remote_code:
            con.print(trusted_code_line(cfg.target))
        self.target = load_target(cfg.target, dtype=dtype, device=device, trust_remote_code=cfg.trust_remote_code)
        con.print(self.target.info())
        self.cfg, self.renderer = cfg, ChatRenderer(self.target.tokenizer)
        self.stops = set(self.renderer.stop_token_ids())
        text = open_user_turn(self.renderer, cfg.system)
        self.prefix = list(self.target.tokenizer(text, add_special_tokens=False)["input_ids"])
        self.lean = BatchGenerator(self.target) if supports(self.target) else None

    def batch(self, index: int) -> list[tuple[str, int, bool]]:
        """Batch `index`: (prompt text, tokens generated, whether the target ended the turn itself) per row."""
        cfg, dev = self.cfg, self.target.device
        gen = torch.Generator(device=dev).manual_seed(cfg.seed * 1_000_003 + index)
        rows = [self.prefix] * cfg.batch_size
        if self.lean is not None:
            out = self.lean.generate(rows, cfg.max_new_tokens, self.stops, cfg.temperature, cfg.top_p, gen)
        else:
            torch.manual_seed(cfg.seed * 1_000_003 + index)  # generate samples from the global generator
            ids = torch.tensor(rows, device=dev)
            pad = self.target.tokenizer.pad_token_id
            new = self.target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                             temperature=cfg.temperature, top_p=cfg.top_p, top_k=None,
                                             max_new_tokens=cfg.max_new_tokens, eos_token_id=sorted(self.stops),
                                             pad_token_id=pad if pad is not None else min(self.stops))
            out = [r[len(self.prefix):] for r in new.tolist()]
        texts = []
        for row in out:
            text, n, stopped = self.renderer.reply(row, sorted(self.stops))
            texts.append((text.strip(), n, stopped))
        return texts


def written(out: Path) -> tuple[int, tuple[int, int], set[str]]:
    """(prompts in `out`, (batch, row) of the last one, their texts) from the output itself; a file that is not
    eyas prompts' own output is refused, never changed."""
    if not out.is_file():
        return 0, (-1, -1), set()
    n, last, texts = 0, (-1, -1), set()
    with open(out, "rb") as f:
        for n_line, raw in enumerate(f, start=1):
            try:
                rec = json.loads(raw)
                ok = str(rec["id"]).startswith("magpie:") and isinstance(rec["messages"], list)
                place = (int(rec["batch"]), int(rec["row"]))
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                if not raw.endswith(b"\n") and raw.startswith(b'{"id": "magpie:'):
                    break  # a torn last record of an interrupted run: read_done below drops it
                raise EyasError(f"{out}:{n_line} is not a prompt `eyas prompts` wrote",
                                "its records carry a magpie: id, the messages, and the batch and row sampled",
                                "choose another --out (this file is left as it is)")
            n += 1
            last = max(last, place)
            texts.add(rec["messages"][-1]["content"])
    read_done(out)  # drops a torn last line
    return n, last, texts


def run(cfg: PromptsConfig) -> dict:
    out = Path(cfg.out)
    lock = hold(out, "prompts", kind="file")
    try:
        return _run(cfg, out)
    finally:
        lock.close()


def _run(cfg: PromptsConfig, out: Path) -> dict:
    con = console(0, cfg.quiet, cfg.json)
    if cfg.overwrite:
        start_anew(out, written)  # only a file of eyas prompts' own records
    dtype, why = choose_dtype(cfg.dtype, pick_device(cfg.device))
    if why:
        con.print(why)
    have, (batch, after), texts = written(out)  # resume within the last batch written, after its last row
    batch = max(batch, 0)
    todo = max(0, cfg.num_prompts - have)
    con.print(f"prompts: {fmt_int(todo)} to write, {fmt_int(have)} already in {out}")
    dropped = {"cut at --max-new-tokens": 0, "shorter than --min-chars": 0, "duplicate": 0}
    t0, tokens, kept = time.perf_counter(), 0, 0
    keep_settings(out, settings(cfg, dtype), con, "prompts")  # a finished file too: "done" under these settings only
    if todo:
        sampler = Sampler(cfg, dtype, con)
        bar = con.progress(total=todo, desc="prompts", unit="prompt")
        out.parent.mkdir(parents=True, exist_ok=True)
        first = batch
        with open(out, "ab") as f:
            while kept < todo:
                lines = []
                for row, (text, n, stopped) in enumerate(sampler.batch(batch)):
                    if row <= after:  # written before the run stopped
                        continue
                    tokens += n
                    why_not = ("cut at --max-new-tokens" if not stopped else "shorter than --min-chars"
                               if len(text) < cfg.min_chars else "duplicate" if text in texts else "")
                    if why_not:
                        dropped[why_not] += 1
                        continue
                    texts.add(text)
                    msgs = ([{"role": "system", "content": cfg.system}] if cfg.system else []) + [
                        {"role": "user", "content": text}]
                    lines.append(json.dumps({"id": f"magpie:{cfg.seed}:{batch}:{row}", "messages": msgs,
                                             "source": f"magpie:{cfg.target}", "batch": batch, "row": row},
                                            ensure_ascii=False))
                    if kept + len(lines) == todo:
                        break
                if lines:  # a whole batch at a time: a resume starts at the batch after the last one written
                    f.write(("\n".join(lines) + "\n").encode("utf-8"))
                    f.flush()
                    os.fsync(f.fileno())
                kept += len(lines)
                bar.update(len(lines))
                batch, after = batch + 1, -1
                seen = (batch - first) * cfg.batch_size
                if kept < todo and seen >= max(8 * cfg.batch_size, 256) and kept < 0.01 * seen:
                    bar.close()
                    raise EyasError(f"prompts: {fmt_int(kept)} of {fmt_int(seen)} samples kept ("
                                    + ", ".join(f"{fmt_int(n)} {k}" for k, n in dropped.items()) + ")",
                                    f"{cfg.target} rarely writes a user turn that ends and is new",
                                    "raise --max-new-tokens if most were cut; otherwise use an instruction-tuned "
                                    f"target with a chat template ({fmt_int(kept)} kept prompts are in {out})")
        bar.close()
    elapsed = time.perf_counter() - t0
    summary = {"out": str(out), "prompts": have + kept, "written": kept, "already_there": have,
               "dropped": dropped, "batches": batch, "tokens": tokens, "elapsed_s": round(elapsed, 3),
               "tokens_per_s": round(tokens / max(elapsed, 1e-9), 2), "dtype": dtype}
    con.summary(f"prompts: {fmt_int(kept)} written ({fmt_int(have + kept)} in all), dropped "
                + ", ".join(f"{fmt_int(n)} {k}" for k, n in dropped.items())
                + f"; {fmt_duration(elapsed)} -> {out}")
    return summary
