"""eyas plan: the figures of a run, computed by hand here and compared with compute_plan and the CLI."""

from __future__ import annotations

import collections
import json

import pytest

from eyas.core.errors import EyasError
from eyas.train.plan import PlanConfig, compute_plan, run, storage_bytes


def test_seed_case_padded():
    # 35,446 samples, 4 ranks, batch 1, 5 epochs, 1.4 steps/s (the case), remainder padded (the default)
    p = compute_plan(35_446, 4, 1, 1, 5, steps_per_s=1.4)
    assert p.samples_per_rank_per_epoch == 8_862  # ceil(35,446 / 4) = ceil(8,861.5)
    assert p.padded_samples == 2  # 4 x 8,862 - 35,446
    assert p.dropped_samples == 0
    assert p.micro_batches_per_rank_per_epoch == 8_862
    assert p.micro_batches_per_rank_total == 44_310  # 8,862 x 5
    assert p.optimizer_steps_per_epoch == 8_862 and p.optimizer_steps_total == 44_310
    assert p.global_batch == 4
    assert p.unsharded_micro_batches_per_rank_per_epoch == 35_446 and p.unsharded_optimizer_steps_total == 177_230
    assert p.eta_s == pytest.approx(44_310 / 1.4)  # 31,650 s
    assert p.eta_s / 3600 == pytest.approx(8.79, abs=0.01)
    assert p.eta_unsharded_s / 3600 == pytest.approx(35.16, abs=0.01)  # 177,230 / 1.4 s


def test_seed_case_dropped():
    p = compute_plan(35_446, 4, 1, 1, 5, drop_remainder=True)
    assert p.micro_batches_per_rank_per_epoch == 8_861  # floor(35,446 / 4)
    assert p.dropped_samples == 2 and p.padded_samples == 0
    assert p.micro_batches_per_rank_total == 44_305
    assert p.eta_s is None


@pytest.mark.parametrize("args, drop, expect", [
    # (N, W, b, g, E): per rank, padded, dropped, micro-batches/rank/epoch, steps/epoch, global batch, unsharded mb
    ((1000, 8, 4, 2, 3), False, (125, 0, 0, 32, 16, 64, 250)),  # 125 = 31 x 4 + 1: the last micro-batch is short
    ((1000, 8, 4, 2, 3), True, (120, 0, 40, 30, 15, 64, 250)),  # 15 whole global batches of 64 = 960 samples
    ((10, 3, 2, 1, 1), False, (4, 2, 0, 2, 2, 6, 5)),
    ((10, 3, 2, 1, 1), True, (2, 0, 4, 1, 1, 6, 5)),
    ((7, 1, 3, 1, 2), False, (7, 0, 0, 3, 3, 3, 3)),
    ((64, 4, 1, 16, 1), False, (16, 0, 0, 16, 1, 64, 64)),
])
def test_figures_by_hand(args, drop, expect):
    p = compute_plan(*args, drop_remainder=drop)
    got = (p.samples_per_rank_per_epoch, p.padded_samples, p.dropped_samples, p.micro_batches_per_rank_per_epoch,
           p.optimizer_steps_per_epoch, p.global_batch, p.unsharded_micro_batches_per_rank_per_epoch)
    assert got == expect
    assert p.optimizer_steps_total == p.optimizer_steps_per_epoch * args[4]


@pytest.mark.parametrize("bad", [dict(samples=0), dict(world_size=0), dict(micro_batch=-1), dict(epochs=1.5),
                                 dict(steps_per_s=0.0), dict(steps_per_s=float("nan"))])
def test_bad_input(bad):
    kw = dict(samples=100, world_size=2) | bad
    with pytest.raises(EyasError):
        compute_plan(**kw)


def test_too_few_samples_to_drop():
    with pytest.raises(EyasError, match="do not fill one global batch"):
        compute_plan(5, 8, 1, 1, 1, drop_remainder=True)


def test_lines_are_labelled():
    lines = compute_plan(35_446, 4, 1, 1, 5, steps_per_s=1.4, tokens=87_800_000).lines()
    text = "\n".join(lines)
    assert all(("per rank" in line or "global" in line) for line in lines), lines
    for figure in ("8,862", "44,310", "2 padded", "8.8 h", "35.2 h", "35,446", "global batch 4", "87,800,000"):
        assert figure in text
    dropped = "\n".join(compute_plan(35_446, 4, 1, 1, 5, drop_remainder=True).lines())
    assert "8,861" in dropped and "2 dropped" in dropped and "177,230" in dropped


def test_storage():
    per_token, total = storage_bytes(87_800_000, 7168, "bfloat16")
    assert per_token == (3 + 1) * 7168 * 2 == 57_344
    assert total == 87_800_000 * 57_344  # 5.03 TB
    assert storage_bytes(10, 64, "float32") == (1024, 10_240)
    with pytest.raises(EyasError):
        storage_bytes(10, 64, "int3")


def _fake_disk(free):
    return lambda path: collections.namedtuple("usage", "total used free")(free * 2, free, free)


def test_run_storage_and_disk(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("eyas.train.plan.shutil.disk_usage", _fake_disk(10**12))
    out = run(PlanConfig(samples=35_446, world_size=4, micro_batch=1, epochs=5, steps_per_s=1.4, tokens=87_800_000,
                         hidden_size=7168, num_layers=61, store=str(tmp_path / "not" / "yet")))
    text = capsys.readouterr().out
    assert out["plan"]["micro_batches_per_rank_per_epoch"] == 8_862
    s = out["storage"]
    assert s["bytes_per_token"] == 57_344 and s["total_bytes"] == 87_800_000 * 57_344
    assert s["disk"] == {"path": str(tmp_path), "free_bytes": 10**12} and s["fits"] is False
    assert "5.03 TB" in text and "NOT enough" in text and "[2, 30, 58]" in text


def test_run_target_and_prepared_dir(tmp_path, monkeypatch):
    monkeypatch.setattr("eyas.train.plan.shutil.disk_usage", _fake_disk(10**15))
    data = tmp_path / "prepared"
    data.mkdir()
    (data / "summary.json").write_text(json.dumps({"kept": 1000, "samples": {"train": 900, "validation": 100},
                                                   "tokens": 150_000, "tokens_by_split": {"train": 135_000}}))
    out = run(PlanConfig(data=str(data), world_size=2, target="tiny", dtype="float32", quiet=True))
    assert out["plan"]["samples"] == 900 and out["plan"]["tokens"] == 135_000
    assert out["storage"]["bytes_per_token"] == 4 * 64 * 4  # the tiny target: H = 64, float32
    assert out["storage"]["fits"] is True
    with pytest.raises(EyasError, match="not a prepared dataset"):
        run(PlanConfig(data=str(tmp_path / "nothing")))


def test_prepared_dir_without_summary(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"id": ["a", "b", "c"], "input_ids": [[1] * 5, [2] * 7, [3] * 9],
                                     "loss_mask": [[1] * 5, [1] * 7, [0] * 9], "num_tokens": [5, 7, 9]})
    ds.save_to_disk(str(tmp_path / "train"))
    out = run(PlanConfig(data=str(tmp_path), quiet=True))
    assert out["plan"]["samples"] == 3 and out["plan"]["tokens"] == 21


def test_cli(capsys):
    from eyas.cli import main

    assert main(["plan", "--samples", "35446", "--world-size", "4", "--micro-batch", "1", "--epochs", "5",
                 "--steps-per-s", "1.4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["optimizer_steps_total"] == 44_310
    assert out["plan"]["eta_unsharded_s"] == pytest.approx(126_592.86)
    assert main(["plan", "--world-size", "4"]) == 2  # no dataset size: a clear error, not a traceback
    assert "--samples" in capsys.readouterr().err


@pytest.mark.parametrize("n, w, b, g, drop", [(35_446, 4, 1, 1, False), (35_446, 4, 1, 1, True), (1000, 8, 4, 2, False),
                                              (1000, 8, 4, 2, True), (10, 3, 2, 1, False), (97, 5, 3, 2, True)])
def test_agrees_with_the_sampler(n, w, b, g, drop):
    """The plan's figures are what eyas.train.sharding actually deals out, rank by rank (an independent
    implementation)."""
    sharding = pytest.importorskip("eyas.train.sharding")
    import numpy as np

    spec = sharding.ShardSpec(world_size=w, micro_batch=b, grad_accum=g, drop_remainder=drop, shuffle=False)
    shards = [sharding.shard_epoch(np.ones(n, dtype=np.int64), 0, r, spec) for r in range(w)]
    p = compute_plan(n, w, b, g, 1, drop_remainder=drop)
    for s in shards:
        assert len(s.micro_batches) == p.micro_batches_per_rank_per_epoch
        assert len(s.steps) == p.optimizer_steps_per_epoch
        assert s.num_samples == p.samples_per_rank_per_epoch
    assert shards[0].padded_units == p.padded_samples and shards[0].dropped_units == p.dropped_samples


def test_plan_assumes_the_trainers_defaults():
    """`eyas plan` with no batch flags plans the run `eyas train` with no batch flags makes."""
    from eyas.train.settings import TrainConfig

    for name in ("micro_batch", "grad_accum", "epochs", "drop_remainder"):
        assert getattr(PlanConfig(samples=10), name) == getattr(TrainConfig(), name), name


def test_the_unsharded_figures_are_a_labelled_hypothesis_with_the_seeds_177230():
    """The seed's log said 'Total training steps: 177230': the plan prints that number, labelled as what an
    unsharded run would do, and the words NOT sharded never appear in a plan (they are a verdict, doctor's)."""
    lines = compute_plan(35_446, 4, 1, 1, 5, steps_per_s=1.4).lines()
    (hypo,) = [line for line in lines if "not sharded" in line]
    assert hypo.startswith("plan: if the data were not sharded (every rank reading all 35,446 samples): ")
    assert "35,446 micro-batches per rank per epoch, 177,230 optimizer steps per rank in all, taking 35.2 h" in hypo
    assert not any("NOT sharded" in line for line in lines)


@pytest.mark.parametrize("flags, said", [
    (dict(samples=-35446), "--samples -35,446 is outside 0..1,000,000,000,000"),
    (dict(samples=10**26), "--samples 100,000,000,000,000,000,000,000,000 is outside"),
    (dict(samples=35446, world_size=99999999999999999999), "--world-size 99,999,999,999,999,999,999 is outside"),
    (dict(samples=35446, steps_per_s=1e-300), "--steps-per-s 1e-300 is outside 1e-06..1e+06"),
])
def test_bad_input_names_the_valid_range(flags, said):
    import re

    with pytest.raises(EyasError, match=re.escape(said)):
        PlanConfig(**flags)


def test_an_eta_past_a_year_says_so():
    from eyas.core.log import fmt_duration

    assert fmt_duration(3 * 86400) == "3.0 days"
    assert fmt_duration(2 * 365.25 * 86400) == "more than a year"
    assert fmt_duration(1e300) == "more than 1,000 years"
    lines = compute_plan(10**12, 1, 1, 1, 1, steps_per_s=1e-6).lines()
    assert any("ETA more than 1,000 years" in line for line in lines)
