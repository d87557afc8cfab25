"""The prepared dataset that `eyas prepare` writes, read back: the one reader every later stage uses.

    DIR/train/, DIR/validation/   datasets.Dataset.save_to_disk folders: id, input_ids, loss_mask, num_tokens
    DIR/summary.json              counts, the target's identity, and the fingerprint of the tokens
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from eyas.core.errors import EyasError
from eyas.core.files import read_json

SPLITS = ("train", "validation")
SUMMARY = "summary.json"
COLUMNS = ("id", "input_ids", "loss_mask", "num_tokens")


@dataclasses.dataclass(frozen=True)
class PreparedSplit:
    """One split of a prepared dataset, memory-mapped."""

    folder: Path  # the dataset folder (DIR)
    split: str
    ds: Any  # datasets.Dataset with the COLUMNS
    summary: dict  # DIR/summary.json ({} for a folder without one)

    @property
    def fingerprint(self) -> str | None:
        """sha256 over ids, input ids and masks, in order (None when no summary records it)."""
        return self.summary.get("fingerprint")

    @property
    def identity(self) -> dict:
        """The target identity the tokens were made with ({} when not recorded)."""
        return self.summary.get("target") or {}


def read_summary(folder: str | Path) -> dict:
    """DIR/summary.json of a prepared dataset (counts, target identity, fingerprint)."""
    return read_json(Path(folder) / SUMMARY, "give the folder written by eyas prepare, or run eyas prepare again")


def open_prepared(folder: str | Path, split: str = "train") -> PreparedSplit:
    """A split of a prepared dataset, checked: the split exists and has the contract's columns."""
    import datasets  # heavy (pyarrow): loaded only where a dataset is read or written

    if split not in SPLITS:
        raise EyasError(f"unknown split {split!r} of a prepared dataset", fix=f"use one of {', '.join(SPLITS)}")
    root = Path(folder)
    if not (root / split / "state.json").is_file():
        raise EyasError(f"{root / split} is not a prepared dataset split",
                        fix=f"run `eyas prepare --data ... --out {folder}` first, or give the folder it wrote")
    ds = datasets.load_from_disk(str(root / split))
    missing = set(COLUMNS) - set(ds.column_names)
    if missing:
        raise EyasError(f"{root / split} lacks the column(s) {sorted(missing)}", fix="re-run eyas prepare")
    summary = read_summary(root) if (root / SUMMARY).is_file() else {}
    return PreparedSplit(root, split, ds, summary)
