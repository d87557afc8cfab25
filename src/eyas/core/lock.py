"""One writer per output: an exclusive lock beside each output a stage writes (`.NAME.lock` next to NAME), held
for the whole run and dropped by the kernel when the process ends, even by SIGKILL. The lock file names its
holder (pid, host, command line, start), so a second run is refused with who is writing and since when.

Under torchrun, rank 0 takes the lock for every rank of its run (`eyas.core.dist.agree` hands its refusal to the
others), so the ranks of one run share it and a second launch is refused on all of its ranks.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO

from eyas.core.errors import EyasError


def lock_path(out: Path) -> Path:
    return out.with_name(f".{out.name}.lock")


def hold(out: Path, command: str, kind: str = "folder") -> IO:
    """The lock of `out` for this process (keep the returned file open while writing; closing it releases it), or
    an EyasError naming the run that holds it, or one saying why `out` cannot be the `kind` (folder or file) the
    stage writes: a link to nowhere, a file for a folder (or the reverse), a file on the way to it."""
    out = Path(out)
    check_place(out, command, kind)
    out.parent.mkdir(parents=True, exist_ok=True)
    path = lock_path(out)
    f = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = _describe(f.read())
        f.close()
        raise EyasError(f"another eyas run is writing {out}{holder}",
                        "two runs writing one output would mix or overwrite each other's work",
                        f"wait for it to finish or stop it, or give `eyas {command}` another output") from None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
                        "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    f.flush()
    return f


def check_place(out: Path, command: str, kind: str) -> None:
    """Refuse, before any work, an output path that cannot hold what `eyas COMMAND` writes there."""
    fix = f"give `eyas {command}` another output path"
    if out.is_symlink() and not out.exists():
        raise EyasError(f"{out} is a link to {os.readlink(out)}, which does not exist",
                        "eyas would write through it into a missing place", f"remove or repoint the link, or {fix}")
    if out.exists() and (out.is_dir() != (kind == "folder")):
        other = "folder" if out.is_dir() else "file"
        raise EyasError(f"{out} is a {other}, and `eyas {command}` writes a {kind} there", "", fix)
    for parent in out.parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise EyasError(f"{out} cannot be made: {parent} is "
                                + ("a link to nowhere" if parent.is_symlink() and not parent.exists() else "a file"),
                                "", fix)
            break


def _describe(text: str) -> str:
    try:
        h = json.loads(text)
        return f" (pid {h['pid']} on {h['host']} since {h['since']}: {h['command']})"
    except (ValueError, KeyError, TypeError):
        return ""
