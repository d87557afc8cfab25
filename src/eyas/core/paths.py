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
    """The workplace's shared data folder (MT-Bench, GSM8K), if present: $EYAS_SHARED_DATA, else a `shared/data`
    beside any folder above the installed package or above the working directory."""
    candidates = [os.environ.get("EYAS_SHARED_DATA")]
    for start in (Path(__file__).resolve(), Path.cwd().resolve()):
        candidates += [str(p / "shared" / "data") for p in start.parents]
    for c in candidates:
        if c and Path(c).is_dir():
            return Path(c)
    return None


def inside(folder: Path, name: object, listed_in: Path) -> Path:
    """folder/name for a file name read from `listed_in` (an index or manifest); never a path out of `folder`."""
    p = Path(name) if isinstance(name, str) else None
    if p is None or not name or p.is_absolute() or ".." in p.parts or "\\" in name:
        raise EyasError(f"{listed_in} names the file {name!r}, which is not a file in {folder}",
                        "files listed there are read from that folder only; a path could read any file",
                        f"repair {listed_in.name} (file names relative to {folder}), or download the model again")
    return folder / p
