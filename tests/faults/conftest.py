"""The reliability suite (docs/reliability.md): faults injected into real runs of the stages.

`faults_full` says whether the suite runs at full strength (`pytest tests/faults --faults-full`, before resolving a
reliability change) or as the fast subset CI runs. `tally(kind, n)` counts what a test survived (kills per stage,
corrupted inputs tried, fuzz cases run); at the end of the session the counts are printed and written to
$EYAS_CACHE/reliability/last-run.json, where docs/reliability.md takes its figures from.
"""

from __future__ import annotations

import collections
import json
import time

import pytest

from eyas.core.paths import cache_dir

_TALLY: collections.Counter = collections.Counter()


@pytest.fixture(scope="session")
def faults_full(pytestconfig) -> bool:
    return bool(pytestconfig.getoption("--faults-full"))


@pytest.fixture
def tally():
    """tally("kills survived: extract", 1): add n to a named figure of this session's reliability run."""
    def add(kind: str, n: int = 1) -> None:
        _TALLY[kind] += n
    return add


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _TALLY:
        return
    full = bool(config.getoption("--faults-full"))
    terminalreporter.section(f"reliability figures ({'full' if full else 'fast subset'})")
    for kind, n in sorted(_TALLY.items()):
        terminalreporter.write_line(f"{n:>8,}  {kind}")
    out = cache_dir() / "reliability" / "last-run.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"full": full, "exit_status": int(exitstatus), "when": time.strftime("%Y-%m-%d %H:%M"),
                               "figures": dict(sorted(_TALLY.items()))}, indent=2))
    terminalreporter.write_line(f"written to {out}")
