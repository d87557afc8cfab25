"""--trust-remote-code (issue 44): every stage that loads a target takes it, off by default; a target whose config
needs its own code is refused with the fix without it, loads with it, and the console says so."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from eyas.core.target import load_target
from eyas.pipeline.registry import COMMANDS

CONFIG_PY = '''
from transformers import LlamaConfig


class MineConfig(LlamaConfig):
    model_type = "eyas_mine"
'''
MODELING_PY = '''
from transformers import LlamaForCausalLM

from .configuration_mine import MineConfig


class MineForCausalLM(LlamaForCausalLM):
    config_class = MineConfig
'''


@pytest.fixture(scope="module")
def custom(tmp_path_factory):
    """The tiny target saved as a folder whose config and model classes are code shipped beside them, as
    Kimi-K2's are: transformers loads it only with trust_remote_code."""
    folder = tmp_path_factory.mktemp("custom") / "mine"
    tiny = load_target("tiny")
    tiny.model.to(torch.float32).save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    (folder / "configuration_mine.py").write_text(CONFIG_PY)
    (folder / "modeling_mine.py").write_text(MODELING_PY)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="eyas_mine", architectures=["MineForCausalLM"],
               auto_map={"AutoConfig": "configuration_mine.MineConfig",
                         "AutoModelForCausalLM": "modeling_mine.MineForCausalLM"})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_every_command_that_loads_a_target_takes_trust_remote_code_off_by_default():
    for name, command in COMMANDS.items():
        fields = {f.name: f for f in dataclasses.fields(command.config)}
        if "target" in fields:
            assert "trust_remote_code" in fields, f"eyas {name} loads a target but has no --trust-remote-code"
            assert fields["trust_remote_code"].default is False, name


def eyas(*args, cwd, env):
    return subprocess.run([sys.executable, "-m", "eyas", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_a_target_with_its_own_code_goes_through_every_stage_only_when_trusted(custom, tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}  # transformers copies the code there
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"{2 * i}."}) + "\n"
                             for i in range(8)))
    t = ["--target", str(custom)]
    refused = eyas("prepare", *t, "--data", str(chats), "--out", "prep", cwd=tmp_path, env=env)
    assert refused.returncode == 2 and "pass --trust-remote-code" in refused.stderr, refused.stderr[-2000:]
    assert not (tmp_path / "prep").exists()
    trusted = "--trust-remote-code"
    line = f"--trust-remote-code: transformers may run the Python code shipped with {custom}"
    for args in (("prepare", "--data", str(chats), "--out", "prep", "--validation", "0"),
                 ("plan", "--data", "prep"),
                 ("extract", "--data", "prep", "--store", "store"),
                 ("train", "--store", "store", "--out", "run", "--max-steps", "1"),
                 ("evaluate", "--draft", "run/final", "--bench", str(chats), "--num-prompts", "1",
                  "--max-new-tokens", "4", "--baselines", "prompt-lookup", "--out", "eval")):
        proc = eyas(*args, *t, trusted, cwd=tmp_path, env=env)
        assert proc.returncode == 0, f"{args[0]}:\n{proc.stderr[-3000:]}"
        assert line in proc.stdout + proc.stderr, args[0]
    refused = eyas("extract", *t, "--data", "prep", "--store", "store2", cwd=tmp_path, env=env)
    assert refused.returncode == 2 and "pass --trust-remote-code" in refused.stderr, refused.stderr[-2000:]
