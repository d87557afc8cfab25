"""Security: nothing from outside is unpickled or run, paths read from files stay in their folder, API keys are
never written anywhere.

(a) pickles: a pickle whose __reduce__ would create a marker file, wherever eyas reads weights (SpecForge
    `.ckpt.gz`, a draft or checkpoint folder, a target folder); and no `torch.load` without weights_only=True,
    no pickle/marshal/eval/exec in the source at all.
(b) trust_remote_code: a target folder whose config maps to a Python file that creates a marker is refused
    (an EyasError, no prompt) unless the user passes it; passed, the code does run (so the check can fail).
(c) paths from an index or manifest (store shards: tests/faults/test_corruption.py) cannot leave their folder.
(d) an API key (from $EYAS_API_KEY or --api-key-file) reaches the server's Authorization header and nowhere
    else: not the output files, console, summary, run folder (config copy, stage markers), nor failure reports of
    a server that echoes it back.
(tests/test_store_import.py already refuses a pickled object in a plain SpecForge .ckpt; not repeated here.)
"""

from __future__ import annotations

import ast
import gzip
import json
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eyas.core.errors import EyasError, Incomplete
from eyas.draft.checkpoint import read_draft, save_draft
from tests.faults.test_server_faults import FakeServer
from tests.test_model import small_draft

SRC = Path(__file__).resolve().parents[2] / "src" / "eyas"


class Payload:
    """Unpickling this runs `open(marker, "w")`: the file's existence proves code from the pickle ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def evil_pickle(path: Path, marker: Path, gz: bool = False) -> Path:
    obj = {"input_ids": torch.arange(3), "loss_mask": torch.ones(3), "hidden_state": torch.zeros(1, 3, 64),
           "aux_hidden_state": torch.zeros(1, 3, 192), "x": Payload(marker)}
    if gz:
        with gzip.open(path, "wb") as f:
            torch.save(obj, f)
    else:
        torch.save(obj, path)
    return path


# ---------------------------------------------------------------- (a) no pickle from outside

def test_the_source_never_unpickles_nor_evaluates():
    """Every torch.load passes weights_only=True; no pickle, marshal, shelve, eval, exec, yaml.load, allow_pickle."""
    bad = []
    for path in sorted(SRC.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f"{getattr(f.value, 'id', '?')}.{f.attr}" if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            kw = {k.arg: k.value for k in node.keywords}
            where = f"{path.name}:{node.lineno} {name}"
            if name == "torch.load" and not (isinstance(kw.get("weights_only"), ast.Constant)
                                             and kw["weights_only"].value is True):
                bad.append(where + " without weights_only=True")
            if name.split(".")[0] in ("pickle", "marshal", "shelve", "dill", "joblib") and name.endswith("load") \
                    or name.endswith(".loads") and name.startswith(("pickle", "marshal")) or name in ("eval", "exec"):
                bad.append(where)
            if name == "yaml.load" or isinstance(kw.get("allow_pickle"), ast.Constant) and kw["allow_pickle"].value:
                bad.append(where)
            if isinstance(kw.get("trust_remote_code"), ast.Constant) and kw["trust_remote_code"].value is True:
                bad.append(where + " trust_remote_code=True")
    assert not bad, bad


def test_a_gzipped_specforge_pickle_is_refused_and_never_run(tmp_path, tally):
    from eyas.store.importers import StoreImportConfig, run

    src = tmp_path / "sf" / "rows_0-2000"
    src.mkdir(parents=True)
    marker = tmp_path / "code-ran"
    evil_pickle(src / "data_0.ckpt.gz", marker, gz=True)
    with pytest.raises(EyasError, match=r"data_0\.ckpt\.gz: refused: it holds a pickled object"):
        run(StoreImportConfig(source=str(tmp_path / "sf"), store=str(tmp_path / "s"), target="tiny", quiet=True))
    assert not marker.exists()
    tally("planted pickles refused")


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("draft") / "final"
    save_draft(small_draft(), folder)
    return folder


@pytest.mark.parametrize("loader", ["draft", "checkpoint"])
def test_pickled_weights_in_a_draft_or_checkpoint_are_refused_and_never_run(draft_folder, tmp_path, loader, tally):
    import shutil

    from eyas.draft.checkpoint import STATE_FILE, load_checkpoint

    folder = tmp_path / "step-00000001"
    shutil.copytree(draft_folder, folder)
    marker = tmp_path / "code-ran"
    evil_pickle(folder / "model.safetensors", marker)  # a torch.save pickle under the safetensors name
    (folder / "optimizer.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    (folder / STATE_FILE).write_text(json.dumps({"format": 1, "step": 1, "world_size": 1, "optimizer": {}}))
    with pytest.raises(EyasError, match="safetensors"):
        read_draft(folder) if loader == "draft" else load_checkpoint(folder)
    assert not marker.exists()
    tally("planted pickles refused")


def test_a_target_folder_with_pickled_weights_is_refused_and_never_run(tiny_target, tmp_path, tally):
    from eyas.core.target import load_target

    folder = tmp_path / "target"
    tiny_target.model.config.save_pretrained(folder)
    tiny_target.tokenizer.save_pretrained(folder)
    marker = tmp_path / "code-ran"
    state = {k: v for k, v in tiny_target.model.state_dict().items()}
    state["x"] = Payload(marker)
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(EyasError):
        load_target(str(folder))
    assert not marker.exists()
    tally("planted pickles refused")


# ---------------------------------------------------------------- (b) trust_remote_code only when passed

def remote_code_folder(tiny_target, root: Path, marker: Path) -> Path:
    """A target folder whose config maps AutoConfig/AutoModelForCausalLM to evil.py, which creates `marker`."""
    folder = root / "remote"
    tiny_target.model.save_pretrained(folder)
    tiny_target.tokenizer.save_pretrained(folder)
    kind = f"eyas_evil_{uuid.uuid4().hex[:8]}"  # a model type transformers cannot know
    (folder / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        f"class EvilConfig(LlamaConfig):\n    model_type = {kind!r}\n"
        "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type=kind, auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_remote_code_runs_only_when_the_user_passes_it(tiny_target, tmp_path, monkeypatch, tally):
    import transformers.dynamic_module_utils as dmu

    from eyas.core.target import load_target, load_tokenizer
    from eyas.store.importers import target_parts

    marker = tmp_path / "code-ran"
    folder = remote_code_folder(tiny_target, tmp_path, marker)
    with open("/dev/null") as stdin:  # a prompt would read "no" here; none must be shown
        monkeypatch.setattr("sys.stdin", stdin)
        for load in (lambda: load_target(str(folder)), lambda: target_parts(str(folder), False)):
            with pytest.raises(EyasError) as e:
                load()
            assert str(folder) in str(e.value) and "--trust-remote-code" in e.value.fix
            assert not marker.exists()
            tally("remote code refused")
    load_tokenizer(str(folder))  # the tokenizer files carry no code: loads, runs nothing
    assert not marker.exists()
    # passed explicitly, it does run: the marker check above can fail
    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    load_target(str(folder), trust_remote_code=True)
    assert marker.exists()


# ---------------------------------------------------------------- (c) paths from index files stay in their folder

@pytest.mark.parametrize("name", ["../outside.safetensors", "/ABS/outside.safetensors",
                                  "sub/../../outside.safetensors"])
def test_weight_index_paths_cannot_leave_the_folder(tiny_target, tmp_path, name, tally):
    """A sharded checkpoint's model.safetensors.index.json names files; one outside the folder is refused."""
    from eyas.core.target import load_target
    from eyas.draft.export import read_safetensors
    from eyas.store.importers import target_parts

    folder = tmp_path / "model"
    tiny_target.model.config.save_pretrained(folder)
    outside = tmp_path / "outside.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_target.model.state_dict().items()}, str(outside))
    name = name.replace("/ABS", str(tmp_path))
    index = {"metadata": {}, "weight_map": {k: name for k in tiny_target.model.state_dict()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    for load in (lambda: read_safetensors(folder), lambda: target_parts(str(folder), True),
                 lambda: load_target(str(folder))):
        with pytest.raises(EyasError) as e:
            load()
        assert "model.safetensors.index.json" in str(e.value) and repr(name) in str(e.value)
        tally("corrupted inputs detected")


# ---------------------------------------------------------------- (d) API keys are never written

SECRET = "sk-eyas-planted-" + uuid.uuid4().hex


def all_text(folder: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def assert_nowhere(secret: str, texts: dict[str, bytes | str]) -> int:
    leaks = [where for where, t in texts.items() if secret.encode() in (t if isinstance(t, bytes) else t.encode())]
    assert not leaks, f"the API key was written to {leaks}"
    return len(texts)


@pytest.fixture
def server():
    srv = FakeServer()
    yield srv
    srv.close()


def write_prompts(path: Path, n: int = 3) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"question {i}"}) + "\n" for i in range(n)))
    return path


@pytest.mark.parametrize("source", ["env", "file"])
def test_api_key_reaches_the_server_and_nothing_else(server, tmp_path, monkeypatch, capsys, source, tally):
    from eyas.data.regenerate import RegenerateConfig, run

    data, out = write_prompts(tmp_path / "in" / "data.jsonl"), tmp_path / "out" / "regen.jsonl"
    kw = {}
    if source == "env":
        monkeypatch.setenv("EYAS_API_KEY", SECRET)
    else:
        (tmp_path / "secret").mkdir()
        (tmp_path / "secret" / "key").write_text(SECRET + "\n")
        kw["api_key_file"] = str(tmp_path / "secret" / "key")
    summary = run(RegenerateConfig(data=(str(data),), out=str(out), server=server.url, **kw))
    assert summary["done"] == 3
    assert {r[3] for r in server.requests} == {f"Bearer {SECRET}"} and server.models_asked == 1
    seen = capsys.readouterr()
    n = assert_nowhere(SECRET, {**all_text(out.parent), "stdout": seen.out, "stderr": seen.err,
                                "summary": json.dumps(summary)})
    tally("planted secrets checked: output files", n)


def test_api_key_echoed_by_a_failing_server_is_not_reported(server, tmp_path, monkeypatch, capsys, tally):
    """A proxy answering 401 with the key it received in its body: the failure report must not carry it."""
    from eyas.data.regenerate import RegenerateConfig, run

    server.decide = lambda n, body: "echo-auth"
    monkeypatch.setenv("EYAS_API_KEY", SECRET)
    data, out = write_prompts(tmp_path / "data.jsonl"), tmp_path / "out" / "regen.jsonl"
    with pytest.raises(Incomplete) as stopped:  # every conversation failed: left to do
        run(RegenerateConfig(data=(str(data),), out=str(out), server=server.url, model="m", retries=1,
                             retry_time=1, timeout=2))
    summary = stopped.value.summary
    assert summary["failed"] == 3 and SECRET in server.echoed  # the server did echo the key back
    seen = capsys.readouterr()
    n = assert_nowhere(SECRET, {**all_text(out.parent), "stdout": seen.out, "stderr": seen.err,
                                "summary": json.dumps(summary), "error": str(stopped.value)})
    tally("planted secrets checked: output files", n)


def test_api_key_stays_out_of_a_pipeline_run_folder(server, tmp_path, monkeypatch, capsys, tally):
    """`eyas run CONFIG.toml`: the run folder's config copy, pipeline.json and stage markers hold no key."""
    from eyas.core.config import from_mapping
    from eyas.data.regenerate import RegenerateConfig
    from eyas.pipeline.demo import RunConfig, run_config

    with pytest.raises(EyasError, match="unknown setting") as e:  # the key itself is no setting
        from_mapping(RegenerateConfig, {"data": ["x"], "api_key": SECRET}, "test")
    assert SECRET not in str(e.value)
    data = write_prompts(tmp_path / "data.jsonl")
    written = tmp_path / "written.toml"  # a key written into the config file: refused before the run folder copies it
    written.write_text(f'[run]\nname = "written"\n[regenerate]\nserver = "{server.url}"\napi_key = "{SECRET}"\n'
                       f'data = ["{data}"]\nout = "{{run}}/regenerated.jsonl"\n')
    with pytest.raises(EyasError, match="unknown setting.*api_key") as e:
        run_config(RunConfig(config=str(written), runs_dir=str(tmp_path / "runs")))
    assert SECRET not in str(e.value) and not server.requests
    assert_nowhere(SECRET, all_text(tmp_path / "runs") if (tmp_path / "runs").exists() else {})
    monkeypatch.setenv("EYAS_API_KEY", SECRET)
    toml = tmp_path / "leak.toml"
    toml.write_text(f'[run]\nname = "leak"\n[regenerate]\nserver = "{server.url}"\ndata = ["{data}"]\n'
                    f'out = "{{run}}/regenerated.jsonl"\nquiet = true\n')
    res = run_config(RunConfig(config=str(toml), runs_dir=str(tmp_path / "runs")))
    run_dir = tmp_path / "runs" / "leak"
    assert res["stages"]["regenerate"]["done"] == 3 and (run_dir / "stages" / "regenerate.json").is_file()
    assert {r[3] for r in server.requests} == {f"Bearer {SECRET}"}
    seen = capsys.readouterr()
    n = assert_nowhere(SECRET, {**all_text(run_dir), "stdout": seen.out, "stderr": seen.err,
                                "result": json.dumps(res)})
    tally("planted secrets checked: output files", n)

