"""`eyas prepare`: chat data -> token ids and an assistant-only loss mask, as an on-disk Arrow dataset.

Output (docs/architecture.md, "Prepared dataset"): `OUT/train/` and `OUT/validation/` are
`datasets.Dataset.save_to_disk` folders with columns `id: string`, `input_ids: list<int32>`,
`loss_mask: list<int8>`, `num_tokens: int32`, and `OUT/summary.json` holds the counts, the target's identity
and the fingerprint. Samples stream through one pass: parsed, encoded, written to an Arrow file per split, so the
data is never all in memory. Read it back with `eyas.data.prepared.open_prepared(OUT, split)` (memory-mapped).

The split: a sample goes to validation when sha256(f"{seed}:{id}") read as a fraction of 2**64 is below
`validation`, so a sample keeps its split when data is added. The fingerprint of a split is the sha256 over its
samples in order of `id` (UTF-8) + b"\\0" + input_ids (int32 little-endian) + loss_mask (int8);
the dataset's `fingerprint` is sha256("train:" + train fingerprint + "validation:" + validation fingerprint).
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import time
from pathlib import Path
from typing import Literal

import numpy as np

from eyas.core.config import StageConfig, check, opt
from eyas.core.errors import EyasError
from eyas.core.files import check_replaceable, publish_output, staged_output, write_json
from eyas.core.lock import hold
from eyas.core.log import console, fmt_duration, fmt_int
from eyas.core.options import overwrite_opt, target_opt, trust_remote_code_opt, trusted_code_line
from eyas.core.target import load_tokenizer
from eyas.core.weights import load_target_shell
from eyas.data.chat import ChatRenderer
from eyas.data.formats import Conversation, FormatError, Issues
from eyas.data.prepared import SPLITS
from eyas.data.sources import data_opt, read_conversations, resolve_data

PROMPT_ONLY = "prompt-only"  # kept with an all-zero mask: regenerate them first


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrepareConfig(StageConfig):
    target: str = target_opt(role="its tokenizer and chat template are used")
    data: tuple[str, ...] = data_opt()
    out: str = opt("runs/demo/prepared", "output folder: train/, validation/ and summary.json")
    max_length: int = opt(2048, "longest sample in tokens")
    overlong: Literal["truncate", "drop"] = opt("truncate", "what happens to a longer sample (counted either way)")
    validation: float = opt(0.05, "fraction of samples in the validation split, chosen by a seeded hash of the id")
    seed: int = opt(0, "seed of the split hash")
    dedup: bool = opt(True, "drop conversations whose content (whitespace-normalised) was already seen")
    max_samples: int = opt(0, "stop after this many kept samples (0: all)")
    overwrite: bool = overwrite_opt("eyas prepare")
    trust_remote_code: bool = trust_remote_code_opt()

    def validate(self):
        check(len(self.data) > 0, "no input data given", "pass --data FILE... (or a shorthand such as mt-bench)")
        check(self.max_length >= 8, f"--max-length {self.max_length} is too small", "use at least 8 tokens")
        check(self.overlong in ("truncate", "drop"), f"--overlong {self.overlong!r} is unknown", "use truncate or drop")
        check(0.0 <= self.validation < 1.0, f"--validation {self.validation} is not a fraction in [0, 1)",
              "use e.g. 0.05 for 5 %")
        check(self.max_samples >= 0, f"--max-samples {self.max_samples} is negative", "use 0 for all samples")
        check(bool(self.out), "--out is empty", "name the output folder")


def split_of(sample_id: str, seed: int, fraction: float) -> str:
    """'validation' for a stable, seeded `fraction` of ids, else 'train'."""
    h = int.from_bytes(hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()[:8], "big")
    return "validation" if h / 2**64 < fraction else "train"


def _features():
    import datasets  # heavy (pyarrow): loaded only where a dataset is read or written

    return datasets.Features({"id": datasets.Value("string"), "input_ids": datasets.List(datasets.Value("int32")),
                              "loss_mask": datasets.List(datasets.Value("int8")),
                              "num_tokens": datasets.Value("int32")})


def hash_sample(h, sample_id: str, input_ids, loss_mask) -> None:
    """Feed one sample into a split fingerprint (see the module docstring)."""
    h.update(sample_id.encode() + b"\0")
    h.update(np.asarray(input_ids, dtype="<i4").tobytes())
    h.update(np.asarray(loss_mask, dtype="i1").tobytes())


def combine_fingerprints(train: str, validation: str) -> str:
    return hashlib.sha256(f"train:{train}validation:{validation}".encode()).hexdigest()


class _Writer:
    """Arrow files per split, written a batch at a time, with running counts and fingerprints."""

    def __init__(self, folder: Path):
        from datasets.arrow_writer import ArrowWriter  # heavy (pyarrow): loaded only where a dataset is read or written

        folder.mkdir(parents=True)
        self.folder = folder
        self.writers = {s: ArrowWriter(features=_features(), path=str(folder / f"{s}.arrow")) for s in SPLITS}
        self.hashes = {s: hashlib.sha256() for s in SPLITS}
        self.samples = dict.fromkeys(SPLITS, 0)
        self.tokens = dict.fromkeys(SPLITS, 0)
        self.masked = dict.fromkeys(SPLITS, 0)

    def write(self, split: str, sample_id: str, ids: list[int], mask: list[int]) -> None:
        self.writers[split].write({"id": sample_id, "input_ids": ids, "loss_mask": mask, "num_tokens": len(ids)})
        hash_sample(self.hashes[split], sample_id, ids, mask)
        self.samples[split] += 1
        self.tokens[split] += len(ids)
        self.masked[split] += sum(mask)

    def save(self, out: Path) -> None:
        """Finish the Arrow files and save each split with save_to_disk under `out`."""
        import datasets  # heavy (pyarrow): loaded only where a dataset is read or written

        datasets.disable_progress_bars()  # eyas prints its own progress
        for s in SPLITS:
            self.writers[s].finalize()
            self.writers[s].close()
            ds = datasets.Dataset.from_file(str(self.folder / f"{s}.arrow"))
            ds.save_to_disk(str(out / s), num_shards=1 if len(ds) == 0 else None)  # 0 shards would not load back
            del ds
        shutil.rmtree(self.folder)


def longest_token(tokenizer) -> int:
    """The most characters one token of `tokenizer` covers (its longest vocabulary entry): a text of more than
    N times this many characters needs more than N tokens."""
    return max(1, max(len(t) for t in tokenizer.get_vocab()))


def bounded(conv: Conversation, limit: int) -> Conversation:
    """`conv` with its message texts cut once `limit` characters are reached (later messages dropped): what lies
    past them cannot reach the first tokens that `limit` was computed for, and never gets tokenized."""
    kept, left = [], limit
    for m in conv.messages:
        if left <= 0:
            break
        kept.append(m if len(m.content) <= left else dataclasses.replace(m, content=m.content[:left]))
        left -= len(m.content)
    return dataclasses.replace(conv, messages=kept)


def _encode(conv: Conversation, renderer, cfg: PrepareConfig, notes: Issues, per_token: int
            ) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one conversation; FormatError when it must be dropped. The work is bounded before
    tokenizing: a conversation of more than --max-length x `per_token` characters cannot fit (dropped untokenized
    with --overlong drop), and with truncate only its first 2 x that many characters are tokenized (the margin keeps
    the cut's word, whose tokens the cut may change, beyond the tokens kept)."""
    chars = sum(len(m.content) for m in conv.messages)
    if chars > cfg.max_length * per_token and cfg.overlong == "drop":
        raise FormatError("too-long", f"{chars:,} characters cannot fit in --max-length {cfg.max_length} tokens "
                                      f"(a token covers at most {per_token})")
    cut = chars > 2 * cfg.max_length * per_token
    if cut:
        conv = bounded(conv, 2 * cfg.max_length * per_token)
    enc = renderer.encode(conv.messages)
    ids, mask = enc.input_ids, enc.loss_mask
    if len(ids) > cfg.max_length:
        if cfg.overlong == "drop":
            raise FormatError("too-long", f"{len(ids)} tokens > --max-length {cfg.max_length}")
        ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
        if conv.has_assistant and not any(mask):
            raise FormatError("too-long", f"no reply token within the first {cfg.max_length} tokens")
        notes.add("truncated", conv.where, f"{len(enc.input_ids)}{'+' if cut else ''} -> {cfg.max_length} tokens")
    if not conv.has_assistant:
        notes.add(PROMPT_ONLY, conv.where, "no assistant reply: regenerate it first")
    return ids, mask


def _process(cfg: PrepareConfig, renderer, writer: _Writer, dropped: Issues, notes: Issues, con) -> int:
    """Stream every conversation into `writer`; returns the number of samples read."""
    seen_ids: set[str] = set()
    seen_content: set[bytes] = set()
    read = late = 0  # conversations parsed; of them dropped here (the rest of `dropped` never parsed)
    per_token = longest_token(renderer.tokenizer)
    bar = con.progress(desc="prepare", unit="conv")
    for conv in read_conversations(cfg.data, dropped):
        read += 1
        bar.update(1)
        try:
            if conv.id in seen_ids:
                raise FormatError("duplicate-id", f"id {conv.id!r} was already used")
            if cfg.dedup:
                key = conv.content_key()
                if key in seen_content:
                    raise FormatError("duplicate-content", f"id {conv.id!r} repeats an earlier conversation")
                seen_content.add(key)
            seen_ids.add(conv.id)
            ids, mask = _encode(conv, renderer, cfg, notes, per_token)
        except FormatError as e:
            dropped.add(e.reason, conv.where, e.detail)
            late += 1
            continue
        writer.write(split_of(conv.id, cfg.seed, cfg.validation), conv.id, ids, mask)
        if cfg.max_samples and sum(writer.samples.values()) >= cfg.max_samples:
            break
    bar.close()
    return read + dropped.total() - late


def _legacy_dataset(out: Path) -> bool:
    """A prepared dataset written before output markers: its summary and train split."""
    return (out / "summary.json").is_file() and (out / "train").is_dir()


def run(cfg: PrepareConfig) -> dict:
    """The stage, holding its output's lock (eyas.core.lock) throughout."""
    with hold(Path(cfg.out), "prepare"):
        return _run(cfg)


def _run(cfg: PrepareConfig) -> dict:
    con = console(0, cfg.quiet, cfg.json)
    out = Path(cfg.out)
    check_replaceable(out, "prepare", cfg.overwrite, _legacy_dataset)
    for spec in cfg.data:  # a missing file fails now, before the target is loaded
        resolve_data(spec)
    t0 = time.perf_counter()
    # the tokenizer and the target's identity only: no weight is read (a 1T target prepares like a small one)
    if cfg.trust_remote_code:
        con.print(trusted_code_line(cfg.target))
    target = load_target_shell(cfg.target, trust_remote_code=cfg.trust_remote_code)
    if target.tokenizer is None:
        target = dataclasses.replace(target, tokenizer=load_tokenizer(cfg.target, cfg.trust_remote_code))
    con.print(target.info())
    renderer = ChatRenderer(target.tokenizer)
    if renderer.fallback:
        con.print(f"{target.name} has no chat template: using eyas's plain-text fallback (docs/prepare.md)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = staged_output(out, "prepare", cfg.overwrite, _legacy_dataset)
    dropped, notes = Issues(), Issues(keep=5)
    try:
        writer = _Writer(tmp / "_arrow")
        samples_in = _process(cfg, renderer, writer, dropped, notes, con)
        if not sum(writer.samples.values()):
            files = ", ".join(str(f) for s in cfg.data for f in resolve_data(s))
            raise EyasError(f"prepare: no usable conversation in {files}",
                            (f"{samples_in} records read, all dropped: " + "; ".join(dropped.lines()))
                            if samples_in else "the input holds no records at all (an empty file?)",
                            "give files holding chat records (docs/prepare.md lists the formats)")
        writer.save(tmp)
        summary = _summary(cfg, target, writer, samples_in, dropped, notes, renderer.fallback, time.perf_counter() - t0)
        write_json(tmp / "summary.json", summary)
        publish_output(tmp, out, "prepare")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    _report(con, summary, dropped, notes)
    return summary


def _summary(cfg, target, writer: _Writer, samples_in: int, dropped: Issues, notes: Issues, fallback: bool,
             elapsed: float) -> dict:
    fps = {s: writer.hashes[s].hexdigest() for s in SPLITS}
    kept = sum(writer.samples.values())
    return {
        "out": str(cfg.out), "data": list(cfg.data), "target": target.identity(),
        "chat_template": "fallback" if fallback else "target",
        "samples_in": samples_in, "kept": kept, "samples": dict(writer.samples),
        "dropped": dropped.total(), "dropped_by_reason": dropped.to_dict(),
        "prompt_only": notes.counts[PROMPT_ONLY], "truncated": notes.counts["truncated"], "notes": notes.to_dict(),
        "tokens": sum(writer.tokens.values()), "loss_tokens": sum(writer.masked.values()),
        "tokens_by_split": dict(writer.tokens), "loss_tokens_by_split": dict(writer.masked),
        "max_length": cfg.max_length, "overlong": cfg.overlong, "validation_fraction": cfg.validation,
        "seed": cfg.seed, "dedup": cfg.dedup,
        "fingerprint": combine_fingerprints(fps["train"], fps["validation"]), "fingerprints": fps,
        "elapsed_s": round(elapsed, 3),
    }


def _report(con, s: dict, dropped: Issues, notes: Issues) -> None:
    con.print(f"samples in {fmt_int(s['samples_in'])}: kept {fmt_int(s['kept'])} "
              f"(train {fmt_int(s['samples']['train'])}, validation {fmt_int(s['samples']['validation'])}), "
              f"dropped {fmt_int(s['dropped'])}")
    con.print(f"tokens {fmt_int(s['tokens'])}, loss-masked tokens {fmt_int(s['loss_tokens'])}")
    if s["prompt_only"]:
        con.print(f"prompt-only: {fmt_int(s['prompt_only'])} samples have no assistant reply and an all-zero mask: "
                  f"regenerate them first (eyas regenerate --data ...), then prepare the regenerated file")
    if s["truncated"]:
        con.print(f"truncated to {s['max_length']} tokens: {fmt_int(s['truncated'])}")
    if dropped.counts:
        con.print("\n".join(["dropped by reason (first places in summary.json):", *dropped.lines()]))
    con.summary(f"prepare: {fmt_int(s['kept'])} samples, {fmt_int(s['tokens'])} tokens "
                f"({fmt_int(s['loss_tokens'])} loss-masked), {fmt_int(s['dropped'])} dropped, "
                f"{fmt_duration(s['elapsed_s'])} -> {s['out']}")
