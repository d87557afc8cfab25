"""Reading and writing the small files every stage keeps beside its output (JSON and TOML), and the output folders
a command writes whole (replaced only when they are its own, never anything else).

Writes are atomic (a temp file, fsync, rename): a crash leaves the old file or the new one, never half of one.
Reads are guarded: a missing, unreadable, cut-short or wrong-shaped file is an EyasError naming the file, what is
wrong with it (with the line for a syntax error) and the fix the caller gives, never a raw traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

from eyas.core.errors import EyasError, unwritable


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


# ---------------------------------------------------------------- output folders a command owns

OUTPUT_MARKER = ".eyas-output.json"  # in a folder a command wrote whole: {"command": ..., "written": ...}


def staged_output(out: Path, command: str, overwrite: bool, legacy=None) -> Path:
    """A fresh temp folder beside `out`, for a command that writes `out` whole; `publish_output` moves it in.

    An existing `out` is refused unless --overwrite is given and it is this command's own output: its marker names
    the command (`legacy(out)` may recognise folders written before markers were). Anything else, such as a
    training run, a checkpoint or another command's output, is never replaced."""
    check_replaceable(out, command, overwrite, legacy)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)  # our own temp folder, left by this pid's earlier crash
    tmp.mkdir(parents=True)
    return tmp


@contextlib.contextmanager
def staged(out: Path, command: str, overwrite: bool, legacy=None):
    """`with staged(out, ...) as tmp:` write the output into `tmp`; at the end of the block it is published onto
    `out` (`publish_output`). On any failure, a full disk included, `tmp` is removed and `out` is as it was."""
    tmp = staged_output(out, command, overwrite, legacy)
    try:
        yield tmp
        publish_output(tmp, out, command)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def check_replaceable(out: Path, command: str, overwrite: bool, legacy=None) -> None:
    if not out.exists():
        return
    if not overwrite:
        raise EyasError(f"{out} already exists", "eyas never overwrites a folder unasked",
                        "choose another --out, or pass --overwrite")
    if out.is_dir() and output_command(out) == command:
        foreign = foreign_files(out)
        if foreign:
            raise EyasError(f"--overwrite refuses to replace {out}: it holds {len(foreign)} file(s) `eyas {command}` "
                            f"did not write, such as {foreign[0]}",
                            "--overwrite replaces exactly what the command wrote there (the listing in "
                            f"{OUTPUT_MARKER}), and nothing added or changed since",
                            f"move {', '.join(map(str, foreign[:3]))}{' ...' if len(foreign) > 3 else ''} out of "
                            f"{out} first, or choose another --out")
        return
    if out.is_dir() and (not any(out.iterdir()) or (legacy and legacy(out))):
        return
    raise EyasError(f"--overwrite refuses to replace {out}",
                    f"it is not a folder `eyas {command}` wrote (no {OUTPUT_MARKER} naming it): --overwrite replaces "
                    "only a command's own output, never a training run, a checkpoint or another command's folder",
                    "choose another --out, or move that folder away yourself if it is no longer needed")


def output_command(folder: Path) -> str | None:
    """The command whose marker `folder` holds, or None."""
    marker = folder / OUTPUT_MARKER
    if not marker.is_file():
        return None
    try:
        return json.loads(marker.read_text(encoding="utf-8")).get("command")
    except (OSError, ValueError, AttributeError):
        return None


def _listing(folder: Path) -> dict[str, int]:
    """relative path -> size of every file under `folder` but the marker (a link counts as a file)."""
    return {p.relative_to(folder).as_posix(): (p.lstat().st_size if p.is_symlink() else p.stat().st_size)
            for p in sorted(folder.rglob("*")) if (p.is_file() or p.is_symlink()) and p.name != OUTPUT_MARKER}


def foreign_files(folder: Path) -> list[Path]:
    """Files of a command's output folder that its marker's listing does not hold as they are now (added, or
    changed in size, since). A marker written before listings (an older eyas) vouches for the whole folder."""
    try:
        files = json.loads((folder / OUTPUT_MARKER).read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        files = None
    if not isinstance(files, dict):
        return []
    return [folder / rel for rel, size in _listing(folder).items() if files.get(rel) != size]


def publish_output(tmp: Path, out: Path, command: str) -> None:
    """Mark `tmp` as `command`'s output (the marker lists every file it holds, so that a later --overwrite removes
    exactly those), flush it to disk and move it onto `out`; an old `out` (checked by `staged_output`) is removed
    only once the new one is in place."""
    write_json(tmp / OUTPUT_MARKER, {"command": command, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                     "files": _listing(tmp)})
    for p in tmp.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    if old.exists():
        shutil.rmtree(old)


def move_aside(path: Path, why: str) -> Path:
    """Rename `path` to a sibling named for when and why it was set aside (`NAME.kept-20261201-2130-settings-
    changed`), so nothing is deleted; -> the new path."""
    slug = "".join(c if c.isalnum() else "-" for c in why.lower()).strip("-")[:40]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = path.with_name(f"{path.name}.kept-{stamp}-{slug}")
    n = 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}.kept-{stamp}-{slug}-{n}")
    os.replace(path, dest)
    return dest


def check_writable(path: Path) -> None:
    """Refuse, naming the place, an output path this process may not write (a read-only folder or mount, another
    user's folder), before any work; nothing is left behind (a probe file in the nearest existing folder)."""
    here = Path(path).absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    try:
        with tempfile.TemporaryFile(dir=here if here.is_dir() else here.parent):
            pass
    except OSError as e:
        e.filename = str(path)  # the output asked for (the probe's own name means nothing to the user)
        raise (unwritable(e) or e) from None
