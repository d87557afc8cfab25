"""The trainer on the tiny target's stores: sharding proven across real processes and nodes, DDP/FSDP2 equal to
one process, a real learning signal, the run folder's files, online mode, refusals."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from eyas.core.errors import EyasError
from eyas.draft.checkpoint import read_draft
from eyas.store.reader import StoreReader
from eyas.train.batches import nested_share
from eyas.train.settings import TrainConfig
from eyas.train.trainer import run
from tests.ports import free_port
from tests.train_fakes import write_store

ENTRY = str(Path(__file__).parent / "train_entry.py")
SMALL = dict(target="tiny", threads=1, draft_vocab=512, ttt_steps=3)
# validation, two epochs and checkpoints mid-epoch: 26 training samples / global batch 4 = 7 steps an epoch
VALIDATED = dict(val_fraction=0.2, epochs=2, checkpoint_every=4, keep_checkpoints=10)


@pytest.fixture(scope="module")
def store(tiny_target, tmp_path_factory):
    return write_store(tiny_target, tmp_path_factory.mktemp("store") / "s", n=32)


def argv(cfg: dict) -> list[str]:
    out = []
    for k, v in cfg.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + flag[2:])
        else:
            out += [flag, str(v)]
    return out


def torchrun(cfg: dict, nproc=2, ids_dir=None, extra=(), **popen):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if ids_dir:
        env["EYAS_TEST_IDS_DIR"] = str(ids_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", *extra, "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(popen.pop("port", free_port())), ENTRY, *argv(cfg)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def finish(p, timeout=240):
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def ids_by_rank(folder) -> dict[int, dict]:
    return {d["rank"]: d for d in (json.loads(p.read_text()) for p in Path(folder).glob("rank-*.json"))}


@pytest.fixture(scope="module")
def launched(store, tmp_path_factory):
    """Every multi-process run of this module, started at once (they overlap each other and the in-process
    runs); each test waits for its own. name -> (run folder, ids folder, [processes])."""
    root = tmp_path_factory.mktemp("launched")
    jobs = {}
    exact = dict(store=store, micro_batch=2, dtype="fp32", lr=1e-2, **SMALL)
    # --metrics-every 3: the figures of 3 steps read back at once (one all-reduce), then written step by step
    jobs["ddp"] = [torchrun({**exact, "out": root / "ddp", "metrics_every": 3}, ids_dir=root / "ddp-ids")]
    jobs["fsdp"] = [torchrun({**exact, "out": root / "fsdp", "parallel": "fsdp", "json": True})]
    jobs["fsdp-val"] = [torchrun({**VALIDATED, **exact, "out": root / "fsdp-val", "parallel": "fsdp",
                                  "metrics_every": 3})]
    port = free_port()  # two nodes of one process each; 32 samples = 2 x 16: 0 padded
    nodes = dict(store=store, out=root / "nodes", micro_batch=3, **SMALL)
    jobs["nodes"] = [torchrun(nodes, nproc=1, ids_dir=root / "nodes-ids", port=port,
                              extra=("--nnodes", "2", "--node_rank", str(n))) for n in (0, 1)]
    jobs["dup"] = [torchrun(dict(store=store, out=root / "dup", shard_data=False, **SMALL))]
    mixed = dict(store=store, micro_batch=2, dtype="bf16", lr=1e-2, num_layers=2, **SMALL)
    jobs["ddp-bf16"] = [torchrun({**mixed, "out": root / "ddp-bf16"})]
    jobs["fsdp-bf16"] = [torchrun({**mixed, "out": root / "fsdp-bf16", "parallel": "fsdp"})]
    yield {name: (root / name, root / f"{name}-ids", procs) for name, procs in jobs.items()}
    for procs in jobs.values():
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


@pytest.fixture(scope="module")
def reference(store, tmp_path_factory):
    """One process, micro-batch 2 x grad accum 2 (global batch 4), fp32."""
    out = tmp_path_factory.mktemp("ref") / "run"
    summary = run(TrainConfig(quiet=True, store=str(store), out=str(out), micro_batch=2, grad_accum=2, dtype="fp32",
                              lr=1e-2, **SMALL))
    return out, summary


def test_two_process_ddp_equals_one_process_and_shards_disjointly(store, launched, reference):
    ref, _ = reference
    run_dir, ids, (proc,) = launched["ddp"]
    code, _, err = finish(proc)
    assert code == 0, err[-3000:]
    assert "data: 32 samples over 2 ranks -> 16 per rank per epoch (0 padded), disjoint: yes" in err
    assert "plan: 2 ranks x micro-batch 2 (per rank) x grad accum 1 = global batch 4 samples" in err
    a, b = metrics(ref), metrics(run_dir)
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, 9))
    np.testing.assert_allclose([m["loss_i"] for m in b], [m["loss_i"] for m in a], rtol=1e-5)
    assert [m["samples_seen_global"] for m in b] == [4 * s for s in range(1, 9)]
    wa, wb = read_draft(ref / "final"), read_draft(run_dir / "final")
    for (k, x), (_, y) in zip(wa.state_dict().items(), wb.state_dict().items()):
        torch.testing.assert_close(y, x, rtol=1e-3, atol=1e-4, msg=k)  # Adam: lr-scale steps
    # what each rank's loader really read: disjoint halves of the store
    ranks = ids_by_rank(ids)
    assert sorted(ranks) == [0, 1] and all(len(r["ids"]) == 16 for r in ranks.values())
    assert not set(ranks[0]["ids"]) & set(ranks[1]["ids"])
    assert set(ranks[0]["ids"]) | set(ranks[1]["ids"]) == set(StoreReader(store).ids)


@pytest.mark.slow
def test_fsdp2_equals_one_process(launched, reference):
    ref, _ = reference
    run_dir, _, (proc,) = launched["fsdp"]
    code, out, err = finish(proc)
    assert code == 0, err[-3000:]
    (line,) = [x for x in out.splitlines() if x.startswith("{")]  # --json: one summary, from rank 0
    assert json.loads(line)["world_size"] == 2
    np.testing.assert_allclose([m["loss_i"] for m in metrics(run_dir)],
                               [m["loss_i"] for m in metrics(ref)], rtol=1e-5)


@pytest.mark.slow
def test_fsdp2_with_validation_checkpoints_and_resume_equals_one_process(store, launched, tmp_path):
    """FSDP2 with a validation pass at each epoch's end and checkpoints within epochs: the same losses and
    validation figures as one process; a copy cut back to its mid-epoch-2 checkpoint resumes under FSDP2 to the
    same end. (Validation runs forwards with no backward, after which FSDP2 had left its parameters unsharded:
    the epoch-end checkpoint then failed with a KeyError on both ranks.)"""
    run_dir, _, (proc,) = launched["fsdp-val"]
    one = tmp_path / "one"
    run(TrainConfig(quiet=True, store=str(store), out=str(one), micro_batch=2, grad_accum=2, dtype="fp32", lr=1e-2,
                    **VALIDATED, **SMALL))
    code, _, err = finish(proc)
    assert code == 0, err[-3000:]

    def validation(d):
        return [json.loads(x) for x in (Path(d) / "validation.jsonl").read_text().splitlines()]

    assert [v["epoch"] for v in validation(run_dir)] == [0, 1]
    for a, b in zip(validation(one), validation(run_dir)):
        np.testing.assert_allclose(b["loss_i"], a["loss_i"], rtol=1e-5)
    np.testing.assert_allclose([m["loss_i"] for m in metrics(run_dir)], [m["loss_i"] for m in metrics(one)],
                               rtol=1e-5)
    cut = tmp_path / "cut"
    shutil.copytree(run_dir, cut)
    steps = sorted(int(p.name.split("-")[1]) for p in (cut / "checkpoints").iterdir())
    assert 8 in steps and steps[-1] == 14
    for s in steps:
        if s > 8:
            shutil.rmtree(cut / "checkpoints" / f"step-{s:08d}")
    for name in ("final", "summary.json"):
        shutil.rmtree(cut / name) if (cut / name).is_dir() else (cut / name).unlink()
    resumed = torchrun({**VALIDATED, "store": store, "micro_batch": 2, "dtype": "fp32", "lr": 1e-2,
                        **SMALL, "out": cut, "parallel": "fsdp", "resume": True})
    code, _, err = finish(resumed)
    assert code == 0, err[-3000:]
    assert "resume:" in err and "step 8" in err
    np.testing.assert_allclose([m["loss_i"] for m in metrics(cut)], [m["loss_i"] for m in metrics(one)], rtol=1e-5)
    np.testing.assert_allclose(validation(cut)[-1]["loss_i"], validation(one)[-1]["loss_i"], rtol=1e-5)


@pytest.mark.slow
def test_fsdp2_in_bf16_with_two_layers_equals_ddp(launched):
    """FSDP2 as torchtitan applies it (each layer its own group, the root, frozen embeddings left out, bf16
    parameters gathered and gradients reduced in fp32) against DDP under bf16 autocast over fp32 weights: the
    same run to bf16 rounding, step for step, and the same final draft."""
    runs = {}
    for name in ("ddp-bf16", "fsdp-bf16"):
        run_dir, _, (proc,) = launched[name]
        code, _, err = finish(proc)
        assert code == 0, err[-3000:]
        runs[name] = run_dir
    a, b = metrics(runs["ddp-bf16"]), metrics(runs["fsdp-bf16"])
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, 9))
    np.testing.assert_allclose([m["loss_i"] for m in b], [m["loss_i"] for m in a], rtol=1e-2)
    np.testing.assert_allclose([m["grad_norm"] for m in b], [m["grad_norm"] for m in a], rtol=0.1)
    wa, wb = read_draft(runs["ddp-bf16"] / "final"), read_draft(runs["fsdp-bf16"] / "final")
    assert len(wa.layers) == 1  # two layers: the midlayer and one more
    for (k, x), (_, y) in zip(wa.state_dict().items(), wb.state_dict().items()):
        if x.is_floating_point():  # Adam at lr 1e-2 turns bf16 rounding into a few % after 8 steps (1e-4 in fp32)
            assert float((y - x).norm() / x.norm()) < 0.1, k
    # the strict check of the sharding itself is fp32's (test_fsdp2_equals_one_process, rtol 1e-5)


def test_two_nodes_on_one_machine_shard_by_global_rank(store, launched):
    """torchrun --nnodes 2: both nodes' processes have LOCAL_RANK 0; the data must be split by global rank."""
    _, ids, procs = launched["nodes"]
    results = [finish(p) for p in procs]
    assert all(code == 0 for code, _, _ in results), results[0][2][-2000:] + results[1][2][-2000:]
    assert "data: 32 samples over 2 ranks -> 16 per rank per epoch (0 padded), disjoint: yes" in results[0][2]
    ranks = ids_by_rank(ids)
    assert sorted(ranks) == [0, 1] and ranks[0]["local_rank"] == ranks[1]["local_rank"] == 0
    assert not set(ranks[0]["ids"]) & set(ranks[1]["ids"])
    assert len(ranks[0]["ids"]) == len(ranks[1]["ids"]) == 16
    assert set(ranks[0]["ids"]) | set(ranks[1]["ids"]) == set(StoreReader(store).ids)


def test_unsharded_configuration_is_stopped_by_the_audit(launched):
    run_dir, _, (proc,) = launched["dup"]
    code, _, err = finish(proc)
    assert code != 0
    assert "sharding audit failed for epoch 1" in err
    assert "data: 32 samples over 2 ranks -> 32 per rank per epoch (0 padded), disjoint: NO: 32 samples on more " \
           "than one rank" in err
    assert not (run_dir / "metrics.jsonl").exists() or not metrics(run_dir)


@pytest.mark.parametrize("loss", ["ce", "lk-hybrid"])
def test_training_drives_acc0_up(store, tmp_path, loss):
    """A real learning signal: top-1 agreement at TTT step 0 from ~1/512 to clearly above it, with EAGLE-3's soft
    cross-entropy and with the LK hybrid (--loss)."""
    run(TrainConfig(quiet=True, store=str(store), out=str(tmp_path / "learn"), epochs=12, micro_batch=4, lr=1e-2,
                    warmup_ratio=0.0, loss=loss, **{**SMALL, "ttt_steps": 2}))
    acc0 = [m["acc_i"][0] for m in metrics(tmp_path / "learn")]
    start, end = np.mean(acc0[:4]), np.mean(acc0[-16:])
    assert start < 0.02 and end > 0.08 and end > start + 0.06, (start, end)


def test_run_folder_files_and_counts(store, reference):
    out, summary = reference
    rows = metrics(out)
    keys = {"step", "epoch", "lr", "loss", "loss_i", "acc_i", "tokens_per_s", "samples_seen_global", "elapsed_s"}
    assert all(keys <= set(r) and len(r["loss_i"]) == len(r["acc_i"]) == 3 for r in rows)
    reader = StoreReader(store)
    plan = json.loads((out / "plan.json").read_text())
    assert (plan["samples"], plan["global_batch"], plan["optimizer_steps_total"]) == (32, 4, 8)
    assert plan["tokens"] == int(reader.lengths.sum())
    audit = json.loads((out / "audit.json").read_text())
    assert audit["disjoint"] and audit["ok"] and audit["per_rank"] == [32]
    final = json.loads((out / "final" / "config.json").read_text())
    t = final["training"]
    assert (t["steps"], t["epochs"], t["samples"]) == (8, 1, 32)
    assert t["tokens"] == int(reader.lengths.sum()) and len(t["final_acc_i"]) == 3
    # the vocabulary covers all loss-masked tokens (fewer than 512 distinct ids), by hand
    masked = np.concatenate([reader[i].input_ids[reader[i].loss_mask > 0].numpy() for i in range(len(reader))])
    assert len(np.unique(masked)) < 512 and t["vocab_coverage"] == 1.0
    draft = read_draft(out / "final")
    assert draft.t2d[torch.from_numpy(masked)].all()
    assert summary["steps"] == 8 and summary["world_size"] == 1


def test_vocab_coverage_when_smaller_than_the_data(store, tmp_path):
    reader = StoreReader(store)
    masked = np.concatenate([reader[i].input_ids[reader[i].loss_mask > 0].numpy() for i in range(len(reader))])
    _, counts = np.unique(masked, return_counts=True)
    top = np.sort(counts)[::-1][:64].sum() / counts.sum()  # by hand: the 64 most frequent ids' share
    s = run(TrainConfig(quiet=True, store=str(store), out=str(tmp_path / "v"), max_steps=1,
                        **{**SMALL, "draft_vocab": 64}))
    assert abs(s["vocab_coverage"] - top) < 1e-12


def test_validation_pass_and_max_steps(store, tmp_path):
    s = run(TrainConfig(quiet=True, store=str(store), out=str(tmp_path / "val"), val_fraction=0.25, epochs=2,
                        micro_batch=3, **SMALL))
    lines = [json.loads(x) for x in (tmp_path / "val" / "validation.jsonl").read_text().splitlines()]
    assert [v["epoch"] for v in lines] == [0, 1] and all(v["samples"] == 8 for v in lines)
    for v in lines:  # the chain's expected acceptance length: 1 + a0 + a0 a1 + a0 a1 a2 (3 TTT steps)
        a = v["acc_i"]
        chains = [1 + a[0], 1 + a[0] + a[0] * a[1], 1 + a[0] + a[0] * a[1] + a[0] * a[1] * a[2]]
        np.testing.assert_allclose(v["expected_tau_by_chain"], chains, rtol=1e-12)
        assert v["expected_tau"] == v["expected_tau_by_chain"][-1]
    assert s["steps"] == 2 * 8  # 24 training samples / 3 per step
    s2 = run(TrainConfig(quiet=True, store=str(store), out=str(tmp_path / "short"), max_steps=3, **SMALL))
    assert s2["steps"] == 3 and len(metrics(tmp_path / "short")) == 3


def test_step_figures_are_read_back_once_per_interval_and_equal_the_per_step_reads(store, tmp_path, monkeypatch):
    """--metrics-every 5: the device's figures come back in one read for 5 steps (the first step alone, an epoch's
    end and a checkpoint read what is pending), and metrics.jsonl and the checkpoint's progress are the ones a
    read after every step gives."""
    from eyas.train.trainer import Trainer

    reads = []
    real = Trainer.read_steps

    def counted(self):
        if self.pending:
            reads.append([r.step for r in self.pending])
        real(self)

    monkeypatch.setattr(Trainer, "read_steps", counted)
    cfg = dict(store=str(store), micro_batch=2, grad_accum=1, epochs=2, checkpoint_every=7, keep_checkpoints=10,
               lr=1e-2, dtype="fp32", **SMALL)
    every = run(TrainConfig(quiet=True, out=str(tmp_path / "every"), metrics_every=1, **cfg))
    del reads[:]
    batched = run(TrainConfig(quiet=True, out=str(tmp_path / "five"), metrics_every=5, **cfg))
    # 16 steps an epoch: read after step 1, 6, 7 (checkpoint), 12, 14 (checkpoint), 16 (epoch end), 21, 26,
    # 28 (checkpoint), 32
    assert reads == [[1], [2, 3, 4, 5, 6], [7], [8, 9, 10, 11, 12], [13, 14], [15, 16], [17, 18, 19, 20, 21],
                     [22, 23, 24, 25, 26], [27, 28], [29, 30, 31, 32]]
    a, b = metrics(tmp_path / "every"), metrics(tmp_path / "five")
    timing = {"tokens_per_s", "elapsed_s", "time"}
    assert [{k: v for k, v in m.items() if k not in timing} for m in b] == \
        [{k: v for k, v in m.items() if k not in timing} for m in a]
    assert all(x["time"] <= y["time"] for x, y in zip(b, b[1:]))  # each step stamped when it ended, in order
    for key in ("steps", "samples", "tokens", "final_loss", "final_acc_i"):
        assert batched[key] == every[key], key
    state = json.loads((tmp_path / "five" / "checkpoints" / "step-00000007" / "trainer_state.json").read_text())
    assert (state["step"], state["samples_seen_global"], state["epoch_samples_global"]) == (7, 7 * 2, 7 * 2)


def test_held_out_accuracy_of_a_saved_draft_equals_the_trainers_validation(tiny_target, store, tmp_path):
    """eyas.train.heldout scores any draft on a store as training's validation pass does: the final draft on the
    run's validation store gives the figures of the run's last validation pass, count for count."""
    from eyas.train.heldout import held_out_accuracy

    held = write_store(tiny_target, tmp_path / "held", n=7)  # tokens of the training samples' pool
    run(TrainConfig(quiet=True, store=str(store), out=str(tmp_path / "r"), val_store=str(held), epochs=4,
                    micro_batch=2, lr=1e-2, **SMALL))
    last = json.loads((tmp_path / "r" / "validation.jsonl").read_text().splitlines()[-1])
    got = held_out_accuracy(read_draft(tmp_path / "r" / "final"), str(held), "tiny", SMALL["ttt_steps"], micro_batch=2)
    assert got["samples"] == last["samples"] == 7 and min(got["count_i"]) > 0
    assert got["acc_i"] == last["acc_i"]  # the same positions counted, the same argmaxes
    np.testing.assert_allclose(got["loss_i"], last["loss_i"], rtol=1e-6)
    assert 0 < max(got["acc_i"]) < 1  # a real, partial accuracy: not every position or none


def test_packing_trains_every_sample_once(store, tmp_path):
    s = run(TrainConfig(quiet=True, store=str(store), out=str(tmp_path / "pack"), max_tokens=96, **SMALL))
    audit = json.loads((tmp_path / "pack" / "audit.json").read_text())
    assert audit["ok"] and audit["units"] < 32 and s["samples"] == 32


def test_refuses_a_store_of_another_target(tiny_target, tmp_path):
    path = write_store(tiny_target, tmp_path / "other", n=4)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["target"]["config_hash"] = "0123456789abcdef"
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EyasError, match="extracted from another target"):
        run(TrainConfig(quiet=True, store=str(path), out=str(tmp_path / "r"), **SMALL))


def test_a_missing_shard_stops_training_unless_its_samples_are_left_out_and_counted(tiny_target, tmp_path, capsys):
    path = write_store(tiny_target, tmp_path / "s", n=12, per_shard=4)
    shard = path / "shards" / "shard-000001.safetensors"
    saved = shard.read_bytes()
    shard.unlink()
    with pytest.raises(EyasError, match="shard-000001.safetensors is missing") as e:
        run(TrainConfig(quiet=True, store=str(path), out=str(tmp_path / "r"), **SMALL))
    assert "--skip-bad-shards" in e.value.fix
    cfg = dict(store=str(path), out=str(tmp_path / "r2"), val_fraction=0.25, checkpoint_every=2, **SMALL)
    s = run(TrainConfig(quiet=True, skip_bad_shards=True, **cfg))
    assert s["skipped_samples"] == 4 and s["samples"] == 6  # 8 left, 2 of them held out for validation
    assert "store: 4 samples left out (--skip-bad-shards), those of 1 shard(s): shard-000001" in capsys.readouterr().err
    plan = json.loads((tmp_path / "r2" / "plan.json").read_text())
    assert plan["data"] == {"samples": 8, "skipped_samples": 4, "skipped_shards": ["shard-000001.safetensors"]}
    run(TrainConfig(quiet=True, skip_bad_shards=True, resume=True, **cfg))  # the same data: resumes
    shard.write_bytes(saved)  # the shard is back: 12 samples, another epoch order
    with pytest.raises(EyasError, match="training data changed .*8 samples then.*12 now") as e:
        run(TrainConfig(quiet=True, skip_bad_shards=True, resume=True, **cfg))
    assert "another --out" in e.value.fix


def test_refuses_to_overwrite_a_run(store, reference):
    out, _ = reference
    with pytest.raises(EyasError, match="already holds a training run"):
        run(TrainConfig(quiet=True, store=str(store), out=str(out), micro_batch=2, grad_accum=2, dtype="fp32", lr=1e-2,
                        **SMALL))


def test_online_mode_matches_the_store(tiny_target, store, tmp_path):
    """--online computes the features with the target in the loop: same first-step loss as the store (which holds
    the same features in bf16)."""
    import datasets

    reader = StoreReader(store)
    rows = [reader[i] for i in range(len(reader))]
    ds = datasets.Dataset.from_dict({"id": [r.id for r in rows],
                                     "input_ids": [r.input_ids.int().tolist() for r in rows],
                                     "loss_mask": [r.loss_mask.tolist() for r in rows],
                                     "num_tokens": [len(r.input_ids) for r in rows]})
    ds.save_to_disk(str(tmp_path / "prep" / "train"))
    (tmp_path / "prep" / "summary.json").write_text(json.dumps({"target": tiny_target.identity()}))
    kw = dict(max_steps=2, micro_batch=2, dtype="fp32", **SMALL)
    online = run(TrainConfig(quiet=True, online=True, data=str(tmp_path / "prep"), out=str(tmp_path / "on"), **kw))
    offline = run(TrainConfig(quiet=True, store=str(store), out=str(tmp_path / "off"), **kw))
    a, b = metrics(tmp_path / "on"), metrics(tmp_path / "off")
    np.testing.assert_allclose(a[0]["loss_i"], b[0]["loss_i"], rtol=1e-3)
    assert online["samples"] == offline["samples"] == 4


@pytest.mark.parametrize("kind", ["ce", "tv", "nla", "lk-hybrid"])
def test_fused_head_losses_equal_their_plain_formulas(kind):
    """eyas.draft.cross_entropy.soft_cross_entropy (used by ttt_forward) with each --loss against the loss written
    plainly (eyas.draft.losses.reference_loss: -sum p log q, 1/2 sum |p - q|, -log sum min(p, q), the LK hybrid)
    under autograd: values and gradients, rows weighted."""
    from eyas.draft.cross_entropy import soft_cross_entropy
    from eyas.draft.losses import reference_loss

    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, requires_grad=True)  # 37 rows: not a multiple of the chunk
    W = torch.randn(50, 16, generator=g, requires_grad=True)
    tl = torch.log_softmax(torch.randn(37, 50, generator=g) * 3, -1)
    row_w = torch.rand(37, generator=g)
    loss, hit = soft_cross_entropy(h, W, tl, kind=kind)
    (loss * row_w).sum().backward()
    gh, gW = h.grad.clone(), W.grad.clone()
    h.grad = W.grad = None
    z = h @ W.T
    ref = reference_loss(kind, z, tl.exp())
    (ref * row_w).sum().backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(hit, z.argmax(-1) == tl.argmax(-1))
    torch.testing.assert_close(gh, h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gW, W.grad, rtol=1e-5, atol=1e-6)
    empty, _ = soft_cross_entropy(h[:0], W.detach(), tl[:0], kind=kind)  # no counted rows, frozen head
    assert empty.shape == (0,)
    if kind == "tv":  # 1 - sum min(p, q) is the total variation
        q = torch.softmax(z.detach(), -1)
        torch.testing.assert_close(loss, 1 - torch.minimum(tl.exp(), q).sum(-1), rtol=1e-5, atol=1e-6)


def test_lr_schedule_from_the_real_step_count(reference):
    """Warmup then cosine to min_lr_ratio, over the run's real optimizer steps (by hand), as logged."""
    import math

    from eyas.train.optimizer import lr_at

    assert [lr_at(s, 10, 2, 1.0, 0.1) for s in (0, 1)] == [0.5, 1.0]
    assert lr_at(2, 10, 2, 1.0, 0.1) == 1.0 and abs(lr_at(10, 10, 2, 1.0, 0.1) - 0.1) < 1e-12
    assert abs(lr_at(6, 10, 2, 1.0, 0.1) - (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))) < 1e-12
    out, _ = reference  # 8 steps, warmup int(0.02 * 8) = 0, peak 1e-2, min ratio 0.1
    logged = [m["lr"] for m in metrics(out)]
    want = [1e-2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / 8))) for s in range(8)]
    np.testing.assert_allclose(logged, want, rtol=1e-12)


def test_eta_counts_max_steps(store, tmp_path, capsys):
    """The ETA is that of the steps the run takes: --max-steps 8 of 3 epochs x 8 planned steps."""
    run(TrainConfig(quiet=False, store=str(store), out=str(tmp_path / "r"), max_steps=8, epochs=3, micro_batch=4,
                    **SMALL))
    err = capsys.readouterr().err
    plan = json.loads((tmp_path / "r" / "plan.json").read_text())
    rate = plan["steps_per_s"]
    assert plan["optimizer_steps_run"] == 8 and plan["optimizer_steps_total"] == 24
    assert abs(plan["eta_s"] * rate - 8) < 1e-6  # not 24 steps' worth
    assert "for the run's 8 optimizer steps (--max-steps 8 of 24 planned)" in err


@pytest.mark.parametrize("native", [False, True])
def test_an_explicit_bf16_on_a_cpu_that_emulates_it_is_warned_about(store, tmp_path, capsys, monkeypatch, native):
    """--dtype bf16 where the CPU has no bf16 in hardware trains as asked, and says it will be slow (as extract,
    regenerate and evaluate do); where the CPU has it, nothing is said."""
    from eyas.core import precision
    monkeypatch.setattr(precision, "native_bf16", lambda device: native)
    run(TrainConfig(quiet=False, store=str(store), out=str(tmp_path / "r"), max_steps=1, dtype="bf16", **SMALL))
    err = capsys.readouterr().err
    assert json.loads((tmp_path / "r" / "plan.json").read_text())["dtype"] == "bf16"
    assert ("dtype: bfloat16 is emulated on this CPU" in err) is not native


def test_an_explicit_omp_num_threads_wins(store, tmp_path, monkeypatch):
    """OMP_NUM_THREADS=1 set by the user is what train uses (it used the machine's 2 cores regardless), and the
    plan says why (--threads wins over both: tests/test_threads.py)."""
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        kw = {**SMALL, "threads": 0}
        run(TrainConfig(quiet=True, store=str(store), out=str(tmp_path / "r"), max_steps=1, **kw))
        plan = json.loads((tmp_path / "r" / "plan.json").read_text())
        assert plan["threads_per_rank"] == 1 and plan["threads_why"] == "OMP_NUM_THREADS=1"
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_nested_share_is_a_seeded_prefix_so_smaller_shares_lie_within_larger_ones():
    shares = [set(nested_share(1000, f, seed=3).tolist()) for f in (0.125, 0.25, 0.5, 1.0)]
    assert [len(s) for s in shares] == [125, 250, 500, 1000]
    assert all(a < b for a, b in zip(shares, shares[1:]))  # strictly nested
    assert shares[0] != set(nested_share(1000, 0.125, seed=4).tolist())  # the seed picks which
    assert len(nested_share(3, 0.01, seed=0)) == 1  # never empty


def test_data_fraction_trains_a_share_and_leaves_the_validation_samples_alone(store, tmp_path):
    s = run(TrainConfig(quiet=True, store=str(store), out=str(tmp_path / "half"), data_fraction=0.5, **SMALL))
    assert s["samples"] == 16  # half of the 32 samples, once each
    plan = json.loads((tmp_path / "half" / "plan.json").read_text())
    assert any("--data-fraction 0.5: 16 of the 32 training samples" in line for line in plan["lines"])
    v = run(TrainConfig(quiet=True, store=str(store), out=str(tmp_path / "vq"), val_fraction=0.25, data_fraction=0.25,
                        **SMALL))
    assert v["samples"] == 6  # a quarter of the 24 left after 8 are held out
    lines = json.loads((tmp_path / "vq" / "plan.json").read_text())["lines"]
    assert any("--data-fraction 0.25: 6 of the 24 training samples" in line for line in lines)
    held = [json.loads(x) for x in (tmp_path / "vq" / "validation.jsonl").read_text().splitlines()]
    assert held[-1]["samples"] == 8
    with pytest.raises(EyasError, match="--data-fraction 0"):
        TrainConfig(data_fraction=0)


def test_feature_noise_changes_training_reproducibly_and_is_refused_when_negative(store, tmp_path):
    def losses(name, **kw):
        run(TrainConfig(quiet=True, store=str(store), out=str(tmp_path / name), max_steps=3, **SMALL, **kw))
        return [m["loss"] for m in metrics(tmp_path / name)]

    plain, noisy, again = losses("plain"), losses("noisy", feature_noise=0.5), losses("again", feature_noise=0.5)
    assert noisy == again  # the noise comes from the seeded RNG
    assert noisy[0] != plain[0]  # the first step's loss already sees it
    with pytest.raises(EyasError, match="--feature-noise -0.1 is negative"):
        TrainConfig(feature_noise=-0.1)


def test_fc_norm_trains_the_feature_norms_and_the_checkpoint_says_so(store, tmp_path):
    run(TrainConfig(quiet=True, store=str(store), out=str(tmp_path / "n"), max_steps=3, fc_norm=True, lr=1e-2, **SMALL))
    draft = read_draft(tmp_path / "n" / "final")
    assert draft.cfg.fc_norm
    assert all(not torch.equal(n.weight, torch.ones_like(n.weight)) for n in draft.fc_norm)  # trained, not left at 1


def test_speculators_eagle31_switches_train_and_the_checkpoint_says_so(store, tmp_path):
    """--norm-before-fc --norm-output --norm-before-residual (speculators 0.9's defaults): the input norm is trained
    and the switches reach the checkpoint; --fc-norm with --norm-before-fc is refused."""
    run(TrainConfig(quiet=True, store=str(store), out=str(tmp_path / "s"), max_steps=3, norm_before_fc=True,
                    norm_output=True, norm_before_residual=True, lr=1e-2, **SMALL))
    draft = read_draft(tmp_path / "s" / "final")
    assert draft.cfg.norm_before_fc and draft.cfg.norm_output and draft.cfg.norm_before_residual
    assert not torch.equal(draft.input_norm.weight, torch.ones_like(draft.input_norm.weight))
    with pytest.raises(EyasError, match="exclude each other"):
        TrainConfig(store=str(store), fc_norm=True, norm_before_fc=True).validate()


def test_init_from_target_starts_the_draft_layer_from_the_targets_last_layer(store, tmp_path, tiny_target):
    run(TrainConfig(quiet=True, store=str(store), out=str(tmp_path / "i"), max_steps=1, init_from_target=True,
                    lr=1e-12, **SMALL))
    mid = dict(read_draft(tmp_path / "i" / "final").midlayer.named_parameters())
    last = dict(tiny_target.decoder_layers()[-1].named_parameters())
    H = tiny_target.hidden_size
    close = lambda a, b: torch.allclose(a.float(), b.float(), atol=1e-6)  # noqa: E731 (one step at lr 1e-12)
    assert close(mid["self_attn.q_proj.weight"][:, H:], last["self_attn.q_proj.weight"])
    assert close(mid["self_attn.v_proj.weight"][:, H:], last["self_attn.v_proj.weight"])
    assert close(mid["mlp.down_proj.weight"], last["mlp.down_proj.weight"])
    assert close(mid["hidden_norm.weight"], last["input_layernorm.weight"])
    assert not close(mid["self_attn.q_proj.weight"][:, :H], last["self_attn.q_proj.weight"])  # embedding half: own


def test_a_compiled_run_equals_the_eager_one(store, tmp_path, monkeypatch):
    """--compile on: the static TTT path (every position, padded to a fixed length) under
    torch.compile(fullgraph=True), here traced by aot_eager (the graph inductor would compile on a GPU), trains as
    the CPU's eager gathered path does: the same losses, accuracies and validation, step for step, in fp32."""
    torch._dynamo.reset()
    monkeypatch.setattr("eyas.train.objective.COMPILE_BACKEND", "aot_eager")
    runs = {}
    for mode in ("off", "on"):
        out = tmp_path / mode
        run(TrainConfig(quiet=True, store=str(store), out=str(out), micro_batch=2, grad_accum=2, dtype="fp32",
                        lr=1e-2, max_steps=4, val_fraction=0.25, max_tokens=96, compile=mode, **SMALL))
        runs[mode] = metrics(out), [json.loads(x) for x in (out / "validation.jsonl").read_text().splitlines()]
    (eager, eager_val), (compiled, compiled_val) = runs["off"], runs["on"]
    assert len(eager) == len(compiled) >= 2
    for a, b in zip(eager, compiled):
        assert (a["step"], a["samples_seen_global"]) == (b["step"], b["samples_seen_global"])
        np.testing.assert_allclose(b["loss_i"], a["loss_i"], rtol=1e-5)
        np.testing.assert_allclose(b["acc_i"], a["acc_i"], atol=1e-9)
        np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=1e-4)
    np.testing.assert_allclose(compiled_val[-1]["loss_i"], eager_val[-1]["loss_i"], rtol=1e-5)


def test_the_collective_timeout_reaches_the_process_group(store, tmp_path, monkeypatch):
    """--collective-timeout is the timeout torch.distributed gets (train and extract); 0 or less is refused."""
    from eyas.store.extract import ExtractConfig
    from eyas.store.extract import run as extract

    seen = []

    def init(device, timeout_s):
        seen.append(timeout_s)
        raise KeyboardInterrupt  # stop right there

    monkeypatch.setattr("eyas.core.dist.init", init)
    with pytest.raises(KeyboardInterrupt):
        run(TrainConfig(quiet=True, store=str(store), out=str(tmp_path / "r"), collective_timeout=1800, **SMALL))
    with pytest.raises(KeyboardInterrupt):
        extract(ExtractConfig(target="tiny", data=str(tmp_path), store=str(tmp_path / "s"), collective_timeout=90,
                              quiet=True))
    assert seen == [1800, 90]
    with pytest.raises(EyasError, match="collective-timeout 0"):
        TrainConfig(store=str(store), out=str(tmp_path / "r"), collective_timeout=0)
