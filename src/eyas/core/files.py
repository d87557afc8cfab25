"""Reading and writing the small files every stage keeps beside its output: JSON and TOML.

Writes are atomic (a temp file, fsync, rename): a crash leaves the old file or the new one, never half of one.
Reads are guarded: a missing, unreadable, cut-short or wrong-shaped file is an EyasError naming the file, what is
wrong with it (with the line for a syntax error) and the fix the caller gives, never a raw traceback.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

from eyas.core.errors import EyasError


def write_json(path, obj) -> None:
    """Write JSON atomically (temp file + rename), so a crash never leaves half a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)


def read_text(path: str | Path, fix: str) -> str:
    """A UTF-8 text file's content; EyasError when it is missing, unreadable or not text."""
    p = Path(path)
    if not p.is_file():
        raise EyasError(f"{p} not found", fix=fix)
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise EyasError(f"{p} is not UTF-8 text (byte {e.start})", "it is damaged, or not the file meant",
                        fix) from None
    except OSError as e:
        raise EyasError(f"{p} cannot be read: {e.strerror or e}", "the file system refused it", fix) from None


def read_json(path: str | Path, fix: str, expect: type | None = dict) -> Any:
    """A JSON file's content, of type `expect` (None: any); EyasError naming the file and the line otherwise."""
    text = read_text(path, fix)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise EyasError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}",
                        "it was cut short or edited by hand", fix) from None
    except RecursionError:
        raise EyasError(f"{path}: its JSON is nested too deeply to read", "it is damaged", fix) from None
    if expect is not None and not isinstance(obj, expect):
        raise EyasError(f"{path} holds a JSON {type(obj).__name__}, not a {expect.__name__}",
                        "it is not the file meant, or it is damaged", fix)
    return obj


def read_toml(path: str | Path, fix: str) -> dict:
    """A TOML file's tables; EyasError naming the file and the line otherwise."""
    text = read_text(path, fix)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise EyasError(f"{path}: invalid TOML: {e}", fix="fix the syntax at the line named") from None
