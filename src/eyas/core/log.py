"""Console output: rank 0 speaks, other ranks get a null logger chosen once.

`console(env_or_rank, quiet)` returns a `Console`; stages call `con.print`, `con.progress`, `con.summary`.
Progress bars (tqdm) show rate and ETA on rank 0 only and are off when quiet.
"""

from __future__ import annotations

import sys
from typing import Iterable, TypeVar

from tqdm import tqdm

T = TypeVar("T")


class Console:
    """Rank 0's console."""

    def __init__(self, quiet: bool = False, stream=None):
        self.quiet = quiet
        self.stream = stream or sys.stderr

    def print(self, *parts, force: bool = False) -> None:
        """A line, written above any progress bar that is showing."""
        if force or not self.quiet:
            tqdm.write(" ".join(str(x) for x in parts), file=self.stream)
            self.stream.flush()

    def progress(self, iterable: Iterable[T] | None = None, *, total: float | None = None, desc: str = "",
                 unit: str = "it", **kw) -> tqdm:
        return tqdm(iterable, total=total, desc=desc, unit=unit, disable=self.quiet, file=self.stream,
                    dynamic_ncols=True, mininterval=0.5, **kw)

    def summary(self, line: str) -> None:
        """The one-line summary that ends every stage (printed even when quiet, never with --json)."""
        if self.stream is not None:
            print(line, file=self.stream, flush=True)


class NullConsole(Console):
    """What non-zero ranks get: everything is swallowed, progress bars are disabled."""

    def __init__(self):
        super().__init__(quiet=True)

    def print(self, *parts, force: bool = False) -> None:
        pass

    def summary(self, line: str) -> None:
        pass


def console(rank: int = 0, quiet: bool = False, as_json: bool = False) -> Console:
    if rank != 0:
        return NullConsole()
    return Console(quiet=quiet or as_json)


def fmt_int(n: float) -> str:
    return f"{int(round(n)):,}"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


YEAR_S = 365.25 * 86400


def fmt_duration(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    if seconds < YEAR_S:
        return f"{seconds / 86400:.1f} days"
    return "more than a year" if seconds < 1000 * YEAR_S else "more than 1,000 years"
