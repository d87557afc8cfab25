"""Shared fixtures. Converted targets are cached outside the repo ($EYAS_CACHE, default ~/.cache/eyas)."""

import os
import random
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# A user's clone has nothing beside it: no test may read the workplace's ../shared folder, nor be pointed at it.
# EYAS_SHARED_DATA is dropped (child processes inherit that), and any open() of a file under ../shared is
# recorded and fails the run (issue 44: tests never skip, nor pass, for data eyas ships).
os.environ.pop("EYAS_SHARED_DATA", None)
BESIDE = (Path(__file__).resolve().parents[1].parent / "shared").as_posix() + "/"
READ_BESIDE: list[str] = []


def _no_reads_beside(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        if os.path.abspath(path).startswith(BESIDE):
            READ_BESIDE.append(path)
            raise PermissionError(f"a test opened {path}: nothing beside the checkout may be read")


sys.addaudithook(_no_reads_beside)


def pytest_sessionfinish(session, exitstatus):
    if READ_BESIDE:
        print(f"\nfiles beside the checkout were opened: {sorted(set(READ_BESIDE))[:5]}", file=sys.stderr)
        session.exitstatus = 1


@pytest.fixture(scope="session")
def tiny_target():
    """The seeded random 8-layer Llama with SmolLM2's tokenizer (float32, CPU)."""
    from eyas.core.target import load_target

    return load_target("tiny")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from eyas.core.target import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests (`pytestmark = pytest.mark.usefixtures("one_thread")`): tiny models
    gain nothing from threads, and on a shared 2-core machine OpenMP's barriers make two several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)
    yield


def pytest_addoption(parser):
    parser.addoption("--faults-full", action="store_true",
                     help="reliability suite at full strength (tests/faults: 10+ kill points per stage, more fuzz "
                          "cases); without it a fast subset runs, as in CI")
