"""Checkpoints: nothing pickled, atomic folders, pruning, exact resumption after SIGKILL, clear refusals."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from eyas.core.errors import EyasError
from eyas.draft.checkpoint import (
    check_resumable,
    flatten_optimizer_state,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_partial,
    rng_state,
    save_checkpoint,
    set_rng_state,
    unflatten_optimizer_state,
)
from eyas.train.parallelize import full_optimizer_state, load_optimizer_state
from eyas.train.settings import TrainConfig
from eyas.train.trainer import run
from tests.train_fakes import write_store


def adam_after_steps(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    for _ in range(3):
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_optimizer_state_roundtrip_continues_identically(tmp_path):
    from safetensors.torch import load_file, save_file

    model, opt = adam_after_steps()
    tensors, meta = flatten_optimizer_state(full_optimizer_state(model, opt))
    save_file(tensors, str(tmp_path / "o.safetensors"))
    (tmp_path / "o.json").write_text(json.dumps(meta))  # scalars and param groups are plain JSON
    tensors, meta = load_file(str(tmp_path / "o.safetensors")), json.loads((tmp_path / "o.json").read_text())
    model2, opt2 = adam_after_steps(seed=1)  # other weights and state
    model2.load_state_dict(model.state_dict())
    load_optimizer_state(model2, opt2, unflatten_optimizer_state(tensors, meta))
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (model2, opt2)):
        m(x).pow(2).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_rng_roundtrip():
    state = rng_state()
    json.dumps(state)
    a = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), a)


def small_draft():
    from tests.test_model import small_draft as make

    return make()


def test_atomic_folders_pruning_and_partial_leftovers(tmp_path):
    draft = small_draft()
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad])
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, draft, full_optimizer_state(draft, opt),
                        {"step": step, "world_size": 1, "config": {}}, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 6]
    (tmp_path / "checkpoints" / "step-00000008.tmp-123").mkdir()  # a crash mid-write
    assert latest_checkpoint(tmp_path).name == "step-00000006"
    assert remove_partial(tmp_path) == ["step-00000008.tmp-123"]
    model, _, state = load_checkpoint(latest_checkpoint(tmp_path))
    assert state["step"] == 6 and set(model) == set(draft.state_dict())
    for name in ("model.safetensors", "optimizer.safetensors"):  # safetensors, not pickles
        assert (latest_checkpoint(tmp_path) / name).read_bytes()[8:9] == b"{"
    os.remove(latest_checkpoint(tmp_path) / "optimizer.safetensors")
    with pytest.raises(EyasError, match="incomplete: optimizer.safetensors missing"):
        load_checkpoint(latest_checkpoint(tmp_path))


def test_resume_refuses_another_world_size_or_changed_settings(tmp_path):
    cfg = TrainConfig(store="s", out="o").to_dict()
    state = {"world_size": 2, "config": json.loads(json.dumps(cfg))}
    with pytest.raises(EyasError, match="written by a run with 2 ranks, this run has 1"):
        check_resumable(tmp_path, state, cfg, 1)
    with pytest.raises(EyasError, match="lr: 0.0001 -> 0.001"):
        check_resumable(tmp_path, state, {**cfg, "lr": 1e-3}, 2)
    check_resumable(tmp_path, state, {**cfg, "checkpoint_every": 7, "quiet": True, "resume": True}, 2)


def test_sigkill_and_resume_gives_the_same_losses(tiny_target, tmp_path):
    store = write_store(tiny_target, tmp_path / "store", n=24)
    kw = dict(store=str(store), target="tiny", threads=1, draft_vocab=512, ttt_steps=3, micro_batch=2, epochs=3,
              checkpoint_every=3, val_fraction=0.2, lr=1e-2)
    args = [a for k, v in kw.items() for a in ("--" + k.replace("_", "-"), str(v))]
    out = tmp_path / "killed"
    # Not overlapped with the uninterrupted run: had this process got past step 12 meanwhile, step 6's checkpoint
    # would be pruned (--keep-checkpoints 3) before the loop below looked for it.
    proc = subprocess.Popen([sys.executable, "-m", "eyas.train", *args, "--out", str(out), "--quiet"],
                            stderr=subprocess.PIPE)
    deadline = time.time() + 180
    while not (out / "checkpoints" / "step-00000006").is_dir():
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if x.endswith("}")]
    assert 6 <= max(done) < 30  # killed mid-run (19 training samples / 2 = 10 steps per epoch, 3 epochs)
    run(TrainConfig(quiet=True, out=str(tmp_path / "whole"), **kw))  # the uninterrupted run
    summary = run(TrainConfig(quiet=True, out=str(out), resume=True, **kw))
    whole = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in resumed] == [m["step"] for m in whole] == list(range(1, 31))
    for a, b in zip(whole, resumed):
        assert (a["loss"], a["loss_i"], a["acc_i"], a["lr"], a["samples_seen_global"]) == \
               (b["loss"], b["loss_i"], b["acc_i"], b["lr"], b["samples_seen_global"])
    va = [json.loads(x) for x in (tmp_path / "whole" / "validation.jsonl").read_text().splitlines()]
    vb = [json.loads(x) for x in (out / "validation.jsonl").read_text().splitlines()]
    assert va == vb
    assert summary["steps"] == 30


def test_a_checkpoint_of_an_older_eyas_resumes_when_the_new_settings_are_at_their_defaults(tmp_path):
    """Settings added since (fc_norm, data_fraction...) ran at their defaults then: no refusal for their absence,
    but a refusal when this run sets one of them otherwise."""
    defaults = TrainConfig().to_dict()
    older = {k: v for k, v in defaults.items() if k not in ("fc_norm", "data_fraction")}
    state = {"world_size": 2, "config": json.loads(json.dumps(older, default=str))}
    check_resumable(tmp_path, state, defaults, 2, defaults=defaults)
    with pytest.raises(EyasError, match=r"fc_norm: False -> True"):
        check_resumable(tmp_path, state, {**defaults, "fc_norm": True}, 2, defaults=defaults)
    with pytest.raises(EyasError, match=r"fc_norm: None -> False"):  # without defaults, as before
        check_resumable(tmp_path, state, defaults, 2)


def test_cuda_rng_is_this_ranks_gpu_only_and_an_older_every_gpu_state_restores(monkeypatch):
    """A resume may see other GPUs than the run that saved (8 on one node, then 4 on each of two): each rank saves
    and restores its own GPU's generator; a state saved by an older eyas (every visible GPU's) gives this rank's."""
    mine, restored = torch.arange(16, dtype=torch.uint8), []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a: mine)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, *a: restored.append((s.tolist(), a)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    state = rng_state()
    assert state["cuda"] == list(range(16))
    set_rng_state(json.loads(json.dumps(state)))
    assert restored == [(list(range(16)), ())]  # the current device: init() set it to cuda:LOCAL_RANK
    set_rng_state({**state, "cuda": [[0] * 16, [7] * 16]})  # older: GPU 0's state, then GPU 1's
    set_rng_state({**state, "cuda": [[0] * 16]})  # older, saved where this rank's GPU was not visible: skipped
    assert restored[1:] == [([7] * 16, ())]
