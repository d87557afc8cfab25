"""eyas store import: speculators/vLLM and SpecForge layouts give the same store as a native extraction."""

import json
import os
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import save_file

from eyas.core.errors import EyasError
from eyas.core.target import load_target
from eyas.store.extract import ExtractConfig
from eyas.store.extract import run as extract
from eyas.store.importers import StoreImportConfig, run, target_parts
from eyas.store.reader import StoreReader
from tests.test_extract import LAYERS, prepared_rows, write_prepared

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A prepared dataset, its native store (eager attention: batch-independent) and the target's own states."""
    root = tmp_path_factory.mktemp("import")
    prepared = write_prepared(root / "prepared", n=10, seed=3)
    target = load_target("tiny", dtype="bf16")
    target.model.set_attn_implementation("eager")
    extract(ExtractConfig(data=str(prepared), store=str(root / "native"), target="tiny", attn="eager",
                          shard_mb=0.02, batch_tokens=128, quiet=True), target=target)
    states = []  # per row: ids [L], mask [L], aux [L, 3, H], pre-norm last layer [L, H], post-norm final [L, H]
    pre = {}
    hook = target.final_norm().register_forward_pre_hook(lambda m, a: pre.__setitem__("x", a[0]))
    for row in prepared_rows(prepared):
        ids = torch.tensor(row["input_ids"])
        with torch.inference_mode():
            hs = target.model(ids[None], output_hidden_states=True).hidden_states
        states.append((ids, torch.tensor(row["loss_mask"]), torch.stack([hs[i][0] for i in LAYERS], dim=1),
                       pre["x"][0].clone(), hs[-1][0]))
    hook.remove()
    return {"root": root, "prepared": prepared, "native": root / "native", "states": states}


def write_speculators(folder: Path, states, with_dataset=True) -> Path:
    (folder / "hidden_states").mkdir(parents=True)
    for i, (ids, mask, aux, pre, _) in enumerate(states):
        hs = torch.cat([aux, pre[:, None]], dim=1)  # [L, 4, H]: three feature layers, then layer num_layers
        save_file({"token_ids": ids, "hidden_states": hs.contiguous()}, str(folder / "hidden_states" /
                                                                          f"hs_{i}.safetensors"))
    if with_dataset:
        Dataset.from_dict({"input_ids": [s[0].tolist() for s in states], "loss_mask": [s[1].tolist() for s in states],
                           "seq_len": [len(s[0]) for s in states]}).save_to_disk(str(folder))
    return folder


def write_specforge(folder: Path, states) -> Path:
    for i, (ids, mask, aux, _, final) in enumerate(states):
        d = folder / "rows_0-2000"
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"input_ids": ids, "loss_mask": mask.long(), "hidden_state": final[None].clone(),
                    "aux_hidden_state": aux.reshape(len(ids), -1)[None].clone()}, d / f"data_{i}.ckpt")
    return folder


def same_content(a: Path, b: Path, ids_too=True) -> None:
    ra, rb = StoreReader(a), StoreReader(b)
    assert len(ra) == len(rb) and ra.identity == rb.identity and ra.layer_ids == rb.layer_ids
    for i in range(len(ra)):
        x, y = ra[i], rb[i]
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        assert torch.equal(x.aux, y.aux) and torch.equal(x.final, y.final)
        assert x.id == y.id or not ids_too
    checks = [[s["checksum"] for s in r.manifest["samples"]] for r in (ra, rb)]
    assert checks[0] == checks[1]  # per-sample checksums cover content only, not shard layout


def test_speculators_layout_imports_to_the_native_store(world, tmp_path):
    src = write_speculators(tmp_path / "spec", world["states"])
    out = run(StoreImportConfig(source=str(src), store=str(tmp_path / "s"), target="tiny", data=str(world["prepared"]),
                                shard_mb=0.01, quiet=True))
    assert out["layout"] == "speculators" and out["skipped"] == 0 and out["shards"] > 1
    same_content(world["native"], tmp_path / "s")
    fp = json.loads((world["prepared"] / "summary.json").read_text())["fingerprint"]
    assert StoreReader(tmp_path / "s").manifest["dataset"]["fingerprint"] == fp


def test_specforge_ckpt_files_import_to_the_native_store(world, tmp_path):
    src = write_specforge(tmp_path / "sf", world["states"])
    run(StoreImportConfig(source=str(src), store=str(tmp_path / "s"), target="tiny", data=str(world["prepared"]),
                          quiet=True))
    same_content(world["native"], tmp_path / "s")
    run(StoreImportConfig(source=str(src), store=str(tmp_path / "bare"), target="tiny", quiet=True))  # no --data
    same_content(world["native"], tmp_path / "bare", ids_too=False)


def test_token_ids_that_differ_from_the_prepared_data_are_named_or_skipped(world, tmp_path):
    states = list(world["states"])
    ids, *rest = states[4]
    states[4] = (torch.cat([ids[:2], ids[2:3] + 1, ids[3:]]), *rest)
    src = write_speculators(tmp_path / "spec", states, with_dataset=False)
    with pytest.raises(EyasError, match=r"hs_4\.safetensors: token ids differ .* row 4 \(id sample-4\) at position 2"):
        run(StoreImportConfig(source=str(src), store=str(tmp_path / "s"), target="tiny",
                              data=str(world["prepared"]), quiet=True))
    out = run(StoreImportConfig(source=str(src), store=str(tmp_path / "s2"), target="tiny",
                                data=str(world["prepared"]), skip_bad=True, quiet=True))
    assert out["skipped"] == 1 and out["samples"] == 9


class Payload:
    """Unpickling this would create a file: the proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_ckpt_with_a_pickled_object_is_refused_and_never_run(world, tmp_path):
    src = write_specforge(tmp_path / "sf", world["states"][:2])
    marker = tmp_path / "code-ran"
    torch.save({"input_ids": torch.arange(3), "loss_mask": torch.ones(3), "hidden_state": torch.zeros(1, 3, 64),
                "aux_hidden_state": torch.zeros(1, 3, 192), "extra": Payload(str(marker))},
               src / "rows_0-2000" / "data_1.ckpt")
    with pytest.raises(EyasError, match=r"data_1\.ckpt: refused: it holds a pickled object"):
        run(StoreImportConfig(source=str(src), store=str(tmp_path / "s"), target="tiny", quiet=True))
    assert not marker.exists()
    assert not (tmp_path / "s").exists()  # issue 45: nothing left behind to make the next import "not empty"
    (tmp_path / "empty").mkdir()  # a folder the user made: emptied of what the import wrote, and kept
    with pytest.raises(EyasError, match="refused: it holds a pickled object"):
        run(StoreImportConfig(source=str(src), store=str(tmp_path / "empty"), target="tiny", quiet=True))
    assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())
    torch.save({"input_ids": [1, 2, 3], "loss_mask": torch.ones(3), "hidden_state": torch.zeros(1, 3, 64),
                "aux_hidden_state": torch.zeros(1, 3, 192)}, src / "rows_0-2000" / "data_1.ckpt")
    with pytest.raises(EyasError, match="expected a dict of tensors"):
        run(StoreImportConfig(source=str(src), store=str(tmp_path / "s3"), target="tiny", quiet=True))


def test_an_import_never_writes_into_an_existing_store(world, tmp_path):
    src = write_specforge(tmp_path / "sf", world["states"][:2])
    with pytest.raises(EyasError, match="not empty"):
        run(StoreImportConfig(source=str(src), store=str(world["native"]), target="tiny", quiet=True))


def test_target_parts_match_the_loaded_target_without_loading_its_weights(tmp_path):
    tiny = load_target("tiny")
    tiny.model.save_pretrained(tmp_path / "hf")
    tiny.tokenizer.save_pretrained(tmp_path / "hf")
    identity, layers, hidden, norm = target_parts(str(tmp_path / "hf"), need_norm=True)
    assert identity == load_target(str(tmp_path / "hf")).identity()
    assert (layers, hidden) == (8, 64) and torch.equal(norm.weight, tiny.final_norm().weight)
    assert os.path.getsize(tmp_path / "hf" / "model.safetensors") > 1e6
