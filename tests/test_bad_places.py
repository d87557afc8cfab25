"""Every command that writes, pointed at a place that cannot hold its output (a file for a folder, a link to
nowhere, a path through a file) or at a full disk, stops with eyas's error (exit 2: what, why, fix) before it
writes anything, and never with a traceback (issue 45)."""

import json
import os
import resource
import subprocess
import sys

import pytest

from eyas import cli
from tests.test_export import make_checkpoint

CHAT = {"question": "What is 2 + 2?", "answer": "4."}


@pytest.fixture(scope="module")
def inputs(tiny_target, tmp_path_factory):
    """A chat file, a prepared dataset, a store and a draft checkpoint: what the commands read."""
    from tests.train_fakes import write_store

    root = tmp_path_factory.mktemp("inputs")
    (root / "chats.jsonl").write_text(json.dumps(CHAT) + "\n")
    assert cli.main(["prepare", "--target", "tiny", "--data", str(root / "chats.jsonl"), "--out",
                     str(root / "prep"), "--quiet"]) == 0
    write_store(tiny_target, root / "store", n=8)
    make_checkpoint(tiny_target, root / "ckpt")
    assert cli.main(["export", str(root / "ckpt"), "--out", str(root / "exported"), "--quiet"]) == 0
    return root


def commands(i, out):
    """command -> its argv writing to `out` (a folder, or a file for regenerate and prompts)."""
    return {
        "prepare": ["prepare", "--target", "tiny", "--data", str(i / "chats.jsonl"), "--out", out],
        "regenerate": ["regenerate", "--target", "tiny", "--data", str(i / "chats.jsonl"), "--out", out],
        "prompts": ["prompts", "--target", "tiny", "--num-prompts", "1", "--out", out],
        "extract": ["extract", "--target", "tiny", "--data", str(i / "prep"), "--store", out],
        "train": ["train", "--target", "tiny", "--store", str(i / "store"), "--out", out, "--max-steps", "1"],
        "evaluate": ["evaluate", "--target", "tiny", "--draft", str(i / "ckpt"), "--num-prompts", "1", "--out", out],
        "export": ["export", str(i / "ckpt"), "--out", out],
        "import": ["import", str(i / "exported"), "--target", "tiny", "--out", out],
        "store import": ["store", "import", str(i / "store"), "--target", "tiny", "--store", out],
    }


FILE_OUTPUT = {"regenerate", "prompts"}


@pytest.mark.parametrize("place", ["a file for a folder", "a link to nowhere", "a path through a file",
                                   "a folder for a file"])
def test_every_command_refuses_a_place_that_cannot_hold_its_output(inputs, tmp_path, place, capsys):
    for name in commands(inputs, "x"):
        work = tmp_path / name.replace(" ", "-")
        work.mkdir()
        if place == "a file for a folder":
            if name in FILE_OUTPUT:
                continue
            out = work / "out"
            out.write_text("mine")
        elif place == "a folder for a file":
            if name not in FILE_OUTPUT:
                continue
            out = work / "out.jsonl"
            out.mkdir()
        elif place == "a link to nowhere":
            out = work / "out"
            out.symlink_to(work / "missing")
        else:
            (work / "file").write_text("mine")
            out = work / "file" / "out"
        before = sorted(p.name for p in work.rglob("*"))
        code = cli.main([*commands(inputs, str(out))[name], "--quiet"])
        err = capsys.readouterr().err
        assert code == 2, (name, err)
        assert err.startswith("eyas: error: ") and "fix: " in err and "Traceback" not in err, (name, err)
        assert sorted(p.name for p in work.rglob("*")) == before, name  # nothing written, nothing left behind
        if place != "a path through a file":
            assert out.is_symlink() or out.exists()


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))  # a disk that fills after 20 kB a file


@pytest.mark.parametrize("name", ["prepare", "export", "import"])
def test_a_full_disk_is_an_error_naming_the_file_not_a_traceback(inputs, tmp_path, name):
    out = tmp_path / "out"
    argv = commands(inputs, str(out))[name]
    if name == "prepare":  # enough records to fill 20 kB
        argv = ["prepare", "--target", "tiny", "--data", "gsm8k-test", "--max-samples", "300", "--out", str(out)]
    proc = subprocess.run([sys.executable, "-m", "eyas", *argv, "--quiet"],
                          capture_output=True, text=True, timeout=300, preexec_fn=_limit_file_size,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "eyas: error: cannot write" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "file size limit" in proc.stderr or "no space left" in proc.stderr
    assert not out.exists()  # the staged output is never published half written
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]  # nor left behind
