"""An output path the process may not write is one clear error naming it (exit 2), in every stage that writes:
prepare, regenerate, extract, train, export and evaluate (each gave a raw OSError traceback)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from eyas.cli import main
from eyas.draft.checkpoint import save_draft
from tests.speculate_helpers import trained_draft
from tests.train_fakes import write_store

# sysfs refuses new entries even to root (EPERM): a place no process can write, on any Linux
READ_ONLY = Path("/sys/eyas-read-only")
pytestmark = pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs Linux's /sys")


@pytest.fixture(scope="module")
def inputs(tiny_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"{2 * i}"}) + "\n"
                            for i in range(6)))
    assert main(["prepare", "--target", "tiny", "--data", str(data), "--out", str(root / "prepared"), "--quiet"]) == 0
    store = write_store(tiny_target, root / "store", n=8)
    draft = root / "draft"
    save_draft(trained_draft(tiny_target, steps=5), draft)
    return {"data": str(data), "prepared": str(root / "prepared"), "store": str(store), "draft": str(draft)}


@pytest.mark.parametrize("stage", ["prepare", "regenerate", "extract", "train", "export", "evaluate"])
def test_an_unwritable_output_is_a_clear_error(inputs, stage, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = str(READ_ONLY / "out")
    argv = {
        "prepare": ["prepare", "--target", "tiny", "--data", inputs["data"], "--out", out],
        "regenerate": ["regenerate", "--target", "tiny", "--data", inputs["data"], "--out", f"{out}.jsonl",
                       "--max-new-tokens", "2", "--max-samples", "1"],
        "extract": ["extract", "--target", "tiny", "--data", inputs["prepared"], "--store", out],
        "train": ["train", "--target", "tiny", "--store", inputs["store"], "--out", out, "--draft-vocab", "64",
                  "--ttt-steps", "1", "--max-steps", "1"],
        "export": ["export", inputs["draft"], "--out", out],
        "evaluate": ["evaluate", "--target", "tiny", "--draft", inputs["draft"], "--out", out, "--num-prompts", "1",
                     "--max-new-tokens", "4", "--chain", "2", "--no-tree", "--baselines", "--no-hf-generate",
                     "--latency-prefix", "8"],
    }[stage]
    assert main([*argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"cannot write {READ_ONLY}" in err and "choose an output path in a writable folder" in err, err
    assert not os.path.exists(READ_ONLY)
