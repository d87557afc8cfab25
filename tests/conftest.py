"""Shared fixtures. Converted targets are cached outside the repo ($EYAS_CACHE, default ~/.cache/eyas)."""

import os
import random

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
