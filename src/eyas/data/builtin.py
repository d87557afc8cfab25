"""The data sets eyas ships (src/eyas/data/files/, with their sources and licenses): MT-Bench's 80 questions and
GSM8K train and test, so the built-in names resolve on a machine that has only eyas installed.

`EYAS_SHARED_DATA`, when set, is read first (a folder laid out as files/ is). A gzip-compressed file is unpacked
once into `$EYAS_CACHE/data/` under its original name, so its records get the ids they have in the original file.
"""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path

from eyas.core.errors import EyasError
from eyas.core.paths import cache_dir, shared_data_dir

FILES = Path(__file__).resolve().parent / "files"
# built-in name -> file under files/ (or under $EYAS_SHARED_DATA)
BUILTIN = {"mt-bench": "mt_bench/question.jsonl", "mt_bench": "mt_bench/question.jsonl",
           "gsm8k-train": "gsm8k/train.jsonl", "gsm8k-test": "gsm8k/test.jsonl", "gsm8k": "gsm8k/test.jsonl"}


def builtin_file(name: str) -> Path:
    """The readable file of a built-in data set name (see BUILTIN)."""
    rel = BUILTIN[name]
    shared = shared_data_dir()
    if shared is not None and (shared / rel).is_file():
        return shared / rel
    if (FILES / rel).is_file():
        return FILES / rel
    packed = FILES / f"{rel}.gz"
    if not packed.is_file():
        raise EyasError(f"the built-in data set {name!r} is missing from this installation ({packed})",
                        "eyas's package data was left out when it was installed",
                        "reinstall eyas (pip install -e . from its checkout), or set EYAS_SHARED_DATA to a folder "
                        f"holding {rel}")
    out = cache_dir() / "data" / rel
    if not out.is_file() or out.stat().st_mtime < packed.stat().st_mtime:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        try:
            with gzip.open(packed, "rb") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(tmp, out)  # whole or not at all: a killed unpack leaves only its temp file
        finally:
            tmp.unlink(missing_ok=True)
    return out
