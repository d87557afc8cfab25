"""eyas doctor on long logs of the seed run (tests/seedlogs.py): 4 ranks, 35,446 samples, 1.4 steps/s, stopped
mid-epoch, in speculators', SpecForge's and torchrun's formats. Every expected figure comes from the `SeedRun`
that wrote the log: sharded, a rank runs ceil(35,446 / 4) = 8,862 steps per epoch, 44,310 in 5 epochs; not
sharded, 35,446 and 177,230."""

from __future__ import annotations

import datetime
import os
import threading
import time

import pytest

from eyas.core.errors import EyasError
from eyas.doctor import logformats
from eyas.doctor.diagnose import DoctorConfig, run
from tests.seedlogs import SeedRun, write
from tests.seedlogs import lines as seed_lines

HINTS = {"samples": 35_446, "world_size": 4, "micro_batch": 1}


def doctor(*logs, **kw) -> list[dict]:
    return run(DoctorConfig(logs=tuple(str(p) for p in logs), quiet=True, **kw))["logs"]


def one(log, **kw) -> dict:
    return doctor(log, **kw)[0]


def seed(tmp_path, **kw) -> tuple[SeedRun, object]:
    r = SeedRun(**kw)
    return r, write(tmp_path / f"{r.fmt}-{'sh' if r.sharded else 'un'}-{r.stop_at}.log", r)


def eta(r: SeedRun, total: int) -> float:
    return (total - r.last_step) / r.rate


# -- 1. the core case: past step 8,862 still in epoch 0 --------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["torchrun", "speculators"])
@pytest.mark.parametrize("hints", [{}, HINTS])
def test_unsharded_past_a_sharded_epoch_is_not_sharded(tmp_path, fmt, hints):
    r, log = seed(tmp_path, fmt=fmt, sharded=False, stop_at=12_000)
    assert r.per_rank_epoch == 35_446 and r.total == 177_230
    rep = one(log, **hints)
    assert rep["verdict"] == "not sharded", rep["reasons"]
    assert rep["steps_per_rank"] == 12_000 and rep["world_size"] == 4
    proof = rep["reasons"][0]
    assert "still in epoch 0" in proof and "8,862" in proof
    line = int(proof.split("(line ")[1].split(":")[0])  # the line that proves it: the first step past 8,862
    text = log.read_text().splitlines()[line - 1]
    assert ("step 8863 " in text or "step 8864 " in text) if fmt == "torchrun" else "train/loss_0" in text
    assert rep["eta_by_hypothesis"] == {} and rep["decide_by"] == []  # only the unsharded ETA remains
    assert rep["total_steps_per_rank"] == 177_230
    assert rep["eta_s"] == pytest.approx(eta(r, 177_230), rel=1e-3)


@pytest.mark.parametrize("fmt", ["torchrun", "speculators", "specforge"])
def test_before_step_8862_both_etas_stand(tmp_path, fmt):
    r, log = seed(tmp_path, fmt=fmt, sharded=False, stop_at=5_000)
    rep = one(log, **HINTS)
    assert rep["verdict"] == "undecidable" and rep["steps_per_rank"] == 5_000
    assert rep["eta_by_hypothesis"]["sharded"] == pytest.approx(eta(r, 44_310), rel=1e-3)
    assert rep["eta_by_hypothesis"]["not sharded"] == pytest.approx(eta(r, 177_230), rel=1e-3)
    assert any("8,862" in d and "35,446" in d for d in rep["decide_by"])


@pytest.mark.parametrize("fmt", ["torchrun", "speculators"])
def test_sharded_mirror_crosses_the_epoch_at_8862(tmp_path, fmt):
    r, log = seed(tmp_path, fmt=fmt, sharded=True, stop_at=12_000)
    rep = one(log, micro_batch=1)
    assert rep["verdict"] == "sharded", rep["reasons"]
    assert rep["steps_per_epoch_seen"] == 8_862 and rep["epoch"] == 2 and rep["step_in_epoch"] == 12_000 - 8_862
    assert rep["eta_s"] == pytest.approx(eta(r, 44_310), rel=1e-3) and rep["eta_by_hypothesis"] == {}


# -- 2. the seed's header ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["torchrun", "speculators", "specforge"])
def test_header_figures_are_read(tmp_path, fmt):
    _, log = seed(tmp_path, fmt=fmt, stop_at=300)
    rep = one(log)
    assert rep["samples"] == 35_446 and "Train files: 35446" in rep["samples_source"]
    assert rep["stated_per_epoch"] == 35_446 and rep["stated_total"] == 177_230 and rep["epochs"] == 5
    assert rep["world_size"] == 4


# -- 3. an ETA the log has ruled out is not printed ----------------------------------------------------------------
def test_observed_epoch_rules_out_the_stated_total(tmp_path):
    r, log = seed(tmp_path, fmt="speculators", sharded=True, stop_at=9_500)
    rep = one(log)  # no --micro-batch: 8,862 steps is sharded at 1 sample a step, or not at 4 (packing)
    assert rep["verdict"] == "undecidable"
    assert rep["eta_by_hypothesis"] == {}
    assert rep["eta_s"] == pytest.approx(eta(r, 44_310), rel=1e-3)
    assert any("177,230" in x and "8,862" in x for x in rep["ruled_out"]), rep["ruled_out"]


# -- 5. the last partial batch: padded or dropped ------------------------------------------------------------------
def test_dropped_last_batch(tmp_path):
    r, log = seed(tmp_path, fmt="specforge", samples=41, world=2, micro_batch=2, epochs=1, drop_last=True,
                  stop_at=10_000)
    assert r.per_rank_epoch == 10  # ceil(41/2) = 21 samples per rank, 10 whole batches of 2
    rep = one(log, samples=41, micro_batch=2)
    assert rep["steps_per_rank"] == 10 and rep["verdict"] == "sharded", rep["reasons"]
    pred = rep["predictions"]["sharded"]
    assert (pred["steps_per_epoch"], pred["steps_per_epoch_drop"]) == (11, 10)
    _, early = seed(tmp_path, fmt="torchrun", samples=41, world=2, micro_batch=2, epochs=3, drop_last=True, stop_at=4)
    rep = one(early, samples=41, micro_batch=2)
    assert rep["verdict"] == "undecidable"
    assert any("11 (last partial batch kept) or 10 (dropped)" in d for d in rep["decide_by"]), rep["decide_by"]


# -- 6. a torchrun crash ---------------------------------------------------------------------------------------------
def test_torchrun_crash_names_the_rank_and_the_error(tmp_path):
    r, log = seed(tmp_path, fmt="torchrun", stop_at=700, crash_rank=2)
    rep = one(log)
    assert rep["ended"].startswith("it crashed")
    crash = next(a for a in rep["anomalies"] if a["kind"] == "crash")
    msg = crash["message"]
    assert msg.startswith("rank 2 died first: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.50 GiB")
    assert "train_eagle3.py, line 367, in train_step" in msg
    assert "then ranks 0, 1, 3 were stopped (NCCL watchdog timeouts" in msg
    assert "torchrun names rank 2 as the root cause" in msg
    lines = log.read_text().splitlines()
    assert lines[crash["line"] - 1].startswith("[rank2]: torch.OutOfMemoryError")


# -- 7. world size from one warning each process prints --------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_world_size_from_one_repeated_warning(tmp_path, world):
    _, log = seed(tmp_path, fmt="speculators", world=world, stop_at=200, header=False)
    rep = one(log)
    assert rep["world_size"] == world and "appears" in rep["world_size_source"]


# -- 8. liveness from the log's own clock ------------------------------------------------------------------------------
def _live(tmp_path, fmt: str, last_written_ago: float, mtime_after_stamp: float, zone_h: float = 0.0):
    """A log whose last stamp is `last_written_ago` s before now, in a writer's zone `zone_h` hours from UTC."""
    steps = 600
    r = SeedRun(fmt=fmt, stop_at=steps)
    utc_last = time.time() - last_written_ago
    last_local = datetime.datetime.fromtimestamp(utc_last, datetime.UTC).replace(tzinfo=None)
    last_local += datetime.timedelta(hours=zone_h)
    r = SeedRun(fmt=fmt, stop_at=steps, start=last_local - (r.stamp(steps) - r.start))
    log = write(tmp_path / f"live-{fmt}-{last_written_ago:.0f}-{mtime_after_stamp:.0f}.log", r)
    m = utc_last + mtime_after_stamp
    os.utime(log, (m, m))
    return one(log)


@pytest.mark.parametrize("fmt,zone", [("torchrun", 0.0), ("speculators", 5.5), ("speculators", -8.0)])
def test_liveness_from_timestamps_against_mtime(tmp_path, fmt, zone):
    dead = _live(tmp_path, fmt, 3600, 1.0, zone)  # written by the run an hour ago
    assert dead["liveness"].startswith("stalled or dead") and "stall" in [a["kind"] for a in dead["anomalies"]]
    live = _live(tmp_path, fmt, 3, 1.0, zone)
    assert live["liveness"].startswith("running") and not any(a["kind"] == "stall" for a in live["anomalies"])
    copied = _live(tmp_path, fmt, 3600, 400.0, zone)  # copied off the cluster 400 s after its last line
    assert copied["liveness"].startswith("not judged") and not any(a["kind"] == "stall" for a in copied["anomalies"])


def test_liveness_not_judged_without_stamps(tmp_path):
    _, log = seed(tmp_path, fmt="specforge", stop_at=300)  # SpecForge's step lines carry no time
    old = time.time() - 86400
    os.utime(log, (old, old))
    rep = one(log)
    assert rep["liveness"].startswith("not judged") and not any(a["kind"] == "stall" for a in rep["anomalies"])


# -- 9. --world-size against the writers the log shows ---------------------------------------------------------------
def test_world_size_hint_that_contradicts_the_log(tmp_path):
    _, log = seed(tmp_path, fmt="specforge", world=2, stop_at=300)
    rep = one(log, world_size=3)
    assert rep["world_size"] == 2 and rep["world_size_source"].startswith("the log, not --world-size 3")
    assert any(a["kind"] == "world size" for a in rep["anomalies"])
    _, log = seed(tmp_path, fmt="torchrun", world=4, stop_at=300)
    rep = one(log, world_size=2)
    assert rep["world_size"] == 4 and "[rankK]: prefixes name rank 3" in rep["world_size_source"]
    assert one(log, world_size=4)["world_size_source"] == "--world-size"


# -- 12. not a regular file -------------------------------------------------------------------------------------------
def test_devices_and_pipes(tmp_path):
    with pytest.raises(EyasError, match="is a character device"):
        one("/dev/null")
    fifo = tmp_path / "train.pipe"
    os.mkfifo(fifo)
    r = SeedRun(fmt="torchrun", stop_at=50)
    writer = threading.Thread(target=write, args=(fifo, r))
    writer.start()
    rep = one(fifo)
    writer.join()
    assert rep["steps_per_rank"] == 50 and rep["writers"] == 4
    assert rep["liveness"].startswith("not judged")
    with pytest.raises(EyasError, match="named pipe"):
        run(DoctorConfig(logs=(str(fifo),), follow=True, quiet=True))


# -- a long log in bounded memory -----------------------------------------------------------------------------------
def test_thinned_sample_gives_the_same_report(tmp_path, monkeypatch):
    """With the kept sample forced far below the log's records, every figure and verdict stays the same."""
    logs = [seed(tmp_path, fmt=f, sharded=s, stop_at=12_000)[1] for f in ("torchrun", "speculators") for s in (1, 0)]
    full = [one(log) for log in logs]
    monkeypatch.setattr(logformats.StepSample, "HEAD", 300)
    monkeypatch.setattr(logformats.StepSample, "TAIL", 300)
    monkeypatch.setattr(logformats.StepSample, "LIMIT", 2_000)
    for log, ref in zip(logs, full):
        parser = logformats.LogParser()
        for i, line in enumerate(log.read_text().splitlines(), 1):
            parser.feed(i, line)
        assert len(parser.steps) < 2_700 < parser.step_records
        thin = one(log)
        for key in ("verdict", "steps_found", "steps_per_rank", "writers", "world_size", "log_every",
                    "steps_per_epoch_seen", "rate_steps_per_s", "eta_s", "eta_by_hypothesis", "anomalies", "epoch",
                    "step_in_epoch", "last_step_line"):
            assert thin[key] == ref[key], key
        assert len(thin["reasons"]) == len(ref["reasons"])  # the proof may cite a later kept line: still epoch 0
    assert [r["verdict"] for r in full] == ["undecidable", "not sharded", "undecidable", "not sharded"]


def test_pauses_survive_thinning(tmp_path, monkeypatch):
    monkeypatch.setattr(logformats.StepSample, "HEAD", 100)
    monkeypatch.setattr(logformats.StepSample, "TAIL", 100)
    monkeypatch.setattr(logformats.StepSample, "LIMIT", 500)
    r = SeedRun(fmt="torchrun", stop_at=6_000)
    lines = list(seed_lines(r))
    cut = next(i for i, s in enumerate(lines) if " step 4000 " in s)
    shifted = []
    for s in lines[cut:]:  # a 5-minute pause before step 4,000: every later stamp moves
        stamp = s.split("]: ", 1)[1][:23]
        t = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f") + datetime.timedelta(minutes=5)
        shifted.append(s.replace(stamp, t.strftime("%Y-%m-%d %H:%M:%S,") + f"{t.microsecond // 1000:03d}", 1))
    log = tmp_path / "pause.log"
    log.write_text("\n".join(lines[:cut] + shifted) + "\n")
    rep = one(log)
    pauses = [a for a in rep["anomalies"] if a["kind"] == "pause"]
    assert len(pauses) == 1 and "5.0 min" in pauses[0]["message"], rep["anomalies"]
    assert rep["rate_steps_per_s"] == pytest.approx(6_000 / (6_000 / 1.4 + 300), rel=0.01)
