"""Where eyas keeps caches (converted targets) and runs. Read in this one place."""

import os
from pathlib import Path

from eyas.core.errors import EyasError


def cache_dir() -> Path:
    """The cache root: $EYAS_CACHE, else $XDG_CACHE_HOME/eyas, else ~/.cache/eyas. Never inside the repo."""
    if os.environ.get("EYAS_CACHE"):
        root = Path(os.environ["EYAS_CACHE"])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "eyas"
    root.mkdir(parents=True, exist_ok=True)
    return root


def shared_data_dir() -> Path | None:
    """$EYAS_SHARED_DATA, when set to a folder: an override of the data sets eyas ships (eyas.data.builtin).
    Nothing else is searched: eyas reads no folder beside its checkout."""
    given = os.environ.get("EYAS_SHARED_DATA")
    return Path(given) if given and Path(given).is_dir() else None


def inside(folder: Path, name: object, listed_in: Path) -> Path:
    """folder/name for a file name read from `listed_in` (an index or manifest); never a path out of `folder`."""
    p = Path(name) if isinstance(name, str) else None
    if p is None or not name or p.is_absolute() or ".." in p.parts or "\\" in name:
        raise EyasError(f"{listed_in} names the file {name!r}, which is not a file in {folder}",
                        "files listed there are read from that folder only; a path could read any file",
                        f"repair {listed_in.name} (file names relative to {folder}), or download the model again")
    return folder / p
