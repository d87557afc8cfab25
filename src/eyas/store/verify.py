"""`eyas store info DIR` (a store's figures) and `eyas store verify DIR` (every checksum recomputed)."""

from __future__ import annotations

import dataclasses

import numpy as np

from eyas.core.config import StageConfig, check, opt
from eyas.core.errors import EyasError
from eyas.core.log import console, fmt_bytes, fmt_int
from eyas.store.reader import StoreReader, check_tokens


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreInfoConfig(StageConfig):
    store: str = opt("", "the store folder", positional=True)

    def validate(self):
        check(bool(self.store), "no store given", "run eyas store info DIR")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreVerifyConfig(StageConfig):
    store: str = opt("", "the store folder", positional=True)
    data: str = opt("", "also check every sample's token ids against this prepared dataset (eyas prepare --out)")
    split: str = opt("train", "split of --data")
    max_problems: int = opt(20, "how many problems to list in the error message")

    def validate(self):
        check(bool(self.store), "no store given", "run eyas store verify DIR")
        check(self.max_problems >= 1, f"--max-problems {self.max_problems} must be >= 1", "use e.g. 20")


def info(reader: StoreReader) -> dict:
    """A store's figures, from its manifest (no shard is read)."""
    m = reader.manifest
    H = reader.hidden_size
    lengths = reader.lengths
    totals = m["totals"]
    return {"store": str(reader.path), "source": m.get("source"), "target": m["target"],
            "layer_ids": m["layer_ids"], "dtype": m["dtype"], "compact": bool(m.get("compact")),
            "forward_dtype": m.get("forward_dtype"), "dataset": m.get("dataset"), **totals,
            "reference_bytes_per_token": 8 * H,
            "ratio_to_reference": round(totals["bytes_per_token"] / (8 * H), 4),
            "length_min": int(lengths.min()) if len(lengths) else 0,
            "length_median": float(np.median(lengths)) if len(lengths) else 0.0,
            "length_max": int(lengths.max()) if len(lengths) else 0}


def run_info(cfg: StoreInfoConfig) -> dict:
    con = console(0, cfg.quiet, cfg.json)
    d = info(StoreReader(cfg.store))
    t, ds = d["target"], d["dataset"] or {}
    con.print("\n".join([
        f"store     {d['store']} (from {d['source']})",
        (f"target    {t['name']} ({t['architecture']}, {t['num_layers']} layers, hidden {t['hidden_size']}, "
         f"vocab {fmt_int(t['vocab_size'])}, config {t['config_hash']})"),
        f"features  hidden_states {d['layer_ids']} + final norm; stored as {d['dtype']}"
        + (" with per-row scales (compact)" if d["compact"] else "") + f", forward {d['forward_dtype'] or 'unknown'}",
        (f"dataset   {ds.get('path')} [{ds.get('split')}], fingerprint {ds.get('fingerprint')}" if ds.get("path")
         else "dataset   none recorded (imported without --data)"),
        (f"samples   {fmt_int(d['samples'])}, tokens {fmt_int(d['tokens'])} "
         f"(length {d['length_min']} / {d['length_median']:.0f} / {d['length_max']} min / median / max)"),
        (f"size      {fmt_bytes(d['bytes'])} in {d['shards']} shards, {d['bytes_per_token']} B/token "
         f"= {d['ratio_to_reference']:.3f} x the 8H reference ({d['reference_bytes_per_token']} B)"),
    ]))
    con.summary(f"store info: {fmt_int(d['samples'])} samples, {fmt_int(d['tokens'])} tokens, {fmt_bytes(d['bytes'])}")
    return d


def run_verify(cfg: StoreVerifyConfig) -> dict:
    con = console(0, cfg.quiet, cfg.json)
    # missing/truncated shards become problems, not a refusal; verify() checks every checksum, reads need not
    reader = StoreReader(cfg.store, skip_bad=True, check_reads=False)
    total = reader.manifest["totals"]["bytes"]
    bar = con.progress(total=total, desc="verify", unit="B", unit_scale=True, unit_divisor=1024)
    problems = reader.verify(progress=bar.update)
    bar.close()
    if cfg.data:
        problems += check_tokens(reader, cfg.data, cfg.split)
    summary = {"store": cfg.store, "samples": len(reader.manifest["samples"]), "shards": len(reader.manifest["shards"]),
               "bytes": total, "problems": problems}
    if problems:
        shown = "\n    ".join(problems[: cfg.max_problems])
        more = f"\n    ... and {len(problems) - cfg.max_problems} more" if len(problems) > cfg.max_problems else ""
        raise EyasError(f"store {cfg.store}: {len(problems)} problem(s):\n    {shown}{more}",
                        "a shard was damaged, cut short or removed after it was written",
                        "delete the named shards and rerun the extract command that wrote the store (it rewrites "
                        "only what is missing); for an imported store, import again")
    con.summary(f"store verify: {fmt_int(summary['samples'])} samples in {summary['shards']} shards, "
                f"{fmt_bytes(total)}: all checksums match")
    return summary
