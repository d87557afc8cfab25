"""eyas doctor: synthetic logs in every format, the seed case, the real peer logs, garbage input.

Every expected figure is computed here from the run's definition (N samples, W ranks, one sample per step,
E epochs): sharded, each rank runs ceil(N/W) steps per epoch; not sharded, N. The real peer logs carry
`[probe]` lines written by the wrappers that ran them; they give the truth, and are removed from the log
before the doctor reads it (real users' logs have none).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eyas.core.errors import EyasError
from eyas.doctor.diagnose import DoctorConfig, run

FIXTURES = Path(__file__).parent / "fixtures" / "peer-logs"
T0 = datetime.datetime(2025, 3, 1, 23, 58, 0)  # close to midnight: timestamps cross a day


def doctor(*logs, **kw) -> dict:
    return run(DoctorConfig(logs=tuple(str(p) for p in logs), quiet=True, **kw))["logs"]


def one(log, **kw) -> dict:
    return doctor(log, **kw)[0]


# -- synthetic runs --------------------------------------------------------------------------------------------
def per_epoch(n: int, w: int, sharded: bool) -> int:
    return math.ceil(n / w) if sharded else n


def lr_at(i: int, total: int, peak: float = 1e-4) -> float:
    """Cosine from peak (after step 1) to 0 at step `total` (1-based)."""
    return peak * 0.5 * (1 + math.cos(math.pi * (i - 1) / max(1, total - 1)))


def steps_of(n, w, sharded, epochs):
    p = per_epoch(n, w, sharded)
    return [(i, (i - 1) // p, lr_at(i, p * epochs)) for i in range(1, p * epochs + 1)]  # (step, epoch, lr)


def ts(sec: float) -> str:
    t = T0 + datetime.timedelta(seconds=sec)
    return t.strftime("%Y-%m-%d %H:%M:%S,") + f"{t.microsecond // 1000:03d}"


def write_eyas_run(folder: Path, n, w, sharded, epochs, audit=True) -> Path:
    from eyas.train.plan import compute_plan

    folder.mkdir(parents=True)
    rows = [{"step": i, "epoch": e, "lr": lr, "loss": 2.0, "loss_i": [2.0], "acc_i": [0.1], "tokens_per_s": 100.0,
             "samples_seen_global": i * w, "elapsed_s": i * 0.5} for i, e, lr in steps_of(n, w, sharded, epochs)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if audit:
        (folder / "plan.json").write_text(json.dumps(compute_plan(n, w, 1, 1, epochs).to_dict()))
        share = math.ceil(n / w)
        (folder / "audit.json").write_text(json.dumps({"samples": n, "world_size": w, "per_rank": share,
                                                       "padded": share * w - n, "disjoint": sharded or w == 1,
                                                       "covers": True}))
    return folder


def write_eyas_console(path: Path, n, w, sharded, epochs) -> Path:
    from eyas.train.plan import compute_plan

    p = per_epoch(n, w, sharded)
    verdict = "yes" if sharded or w == 1 else f"NO: {n} samples on more than one rank, e.g. 0, 1"
    lines = [f"data: {n:,} samples over {w} ranks -> {p:,} per rank per epoch (0 padded), disjoint: {verdict}"]
    lines += compute_plan(n, w, 1, 1, epochs).lines()
    lines += [f"{ts(i / 2)} step {i}/{p * epochs} epoch {e} loss 2.0 lr {lr:.4e}" for i, e, lr in
              steps_of(n, w, sharded, epochs)]
    path.write_text("\n".join(lines) + "\n")
    return path


def rich_record(step, epoch, lr, sec=None) -> list[str]:
    head = f"[{(T0 + datetime.timedelta(seconds=sec)).strftime('%H:%M:%S')}]" if sec is not None else " " * 10
    return [f"{head} INFO     train/loss_0=0.026,                           trainer.py:587",
            "                    train/full_acc_0=0.00e+00, train/loss=0.078,                ",
            f"                    profile/step_ms=500.0, epoch={epoch}, lr={lr:.2e},                 ",
            f"                    global_step={step}                                               "]


def write_speculators(path: Path, n, w, sharded, epochs) -> Path:
    lines = []
    if w > 1:  # torchrun's banner, and every process prints its own Python warnings
        lines += ["W0301 23:58:00.000000 1 torch/distributed/run.py:874] Setting OMP_NUM_THREADS environment "
                  "variable for each process to be 1 in default"]
    for warn in ("a.py:1: UserWarning: pin_memory", "b.py:2: UserWarning: autocast off"):
        lines += [warn] * w
    p = per_epoch(n, w, sharded)
    for i, e, lr in steps_of(n, w, sharded, epochs):
        if i % p == 1 or p == 1:
            lines.append(f"           INFO     Training epoch {e + 1}/{epochs} started         trainer.py:737")
        lines += rich_record(i - 1, e, lr, sec=i / 2 if i % 2 == 0 else None)
        if i % p == 0:
            lines.append(f"Epoch {e} 100% ━━━━━━━━━━━━━ {p}/{p}  [ 0:00:06 < 0:00:00 , 2 it/s ]")
            lines.append(f"           INFO     Training epoch {e + 1}/{epochs} completed       trainer.py:739")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_specforge(path: Path, n, w, sharded, epochs) -> Path:
    lines = []
    for i, _, lr in steps_of(n, w, sharded, epochs):
        rec = f"step {i}: {{'acc_0': 0.0, 'loss': 2.5, 'lr': {lr!r}, 'perf/optimizer_step_time_s': 0.25}}"
        if i == 1 and w > 1:
            lines += [rec * 2, ""] + [rec] * (w - 2)  # two ranks' first records share a line, as in the real log
        else:
            lines += [rec] * w
    path.write_text("\n".join(lines) + "\n")
    return path


def write_torchrun(path: Path, n, w, sharded, epochs) -> Path:
    lines = [f"[rank{r}]: {ts(0)} INFO Loaded {n} samples; batch_size: 1" for r in range(w)]
    for i, e, lr in steps_of(n, w, sharded, epochs):
        lines += [f"[rank{r}]: {ts(i / 2 + r * 0.01)} INFO epoch {e} step {i} loss 2.1 lr {lr:.6e}" for r in range(w)]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_generic(path: Path, n, w, sharded, epochs) -> Path:
    p = per_epoch(n, w, sharded)
    lines = [f"Dataset size: {n}", f"world_size: {w}", "batch size: 1"]
    lines += [f"{ts(i)} Epoch {e + 1}/{epochs} | step {i - e * p} | lr {lr:.6e} | loss 2.2"  # per-epoch counter
              for i, e, lr in steps_of(n, w, sharded, epochs)]
    path.write_text("\n".join(lines) + "\n")
    return path


# writer, hints the format needs (what such a log does not state), formats it must be recognised as
FORMATS = {
    "eyas-run": (lambda d, *a: write_eyas_run(d / "run", *a), {}, "eyas metrics.jsonl"),
    "eyas-metrics-only": (lambda d, n, w, s, e: write_eyas_run(d / "run", n, w, s, e, audit=False),
                          {"samples": True, "world_size": True}, "eyas metrics.jsonl"),
    "eyas-console": (lambda d, *a: write_eyas_console(d / "train.log", *a), {}, "eyas console"),
    "speculators": (lambda d, *a: write_speculators(d / "spec.log", *a), {"samples": True, "micro_batch": 1},
                    "speculators console"),
    "specforge": (lambda d, *a: write_specforge(d / "sf.log", *a), {"samples": True, "micro_batch": 1},
                  "SpecForge `step N: {...}`"),
    "torchrun": (lambda d, *a: write_torchrun(d / "tr.log", *a), {}, "torchrun [rankK]: prefixes"),
    "generic": (lambda d, *a: write_generic(d / "gen.log", *a), {}, "generic (step/epoch and lr)"),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("w", [1, 2, 4])
@pytest.mark.parametrize("sharded", [True, False])
def test_synthetic_verdicts(tmp_path, fmt, w, sharded):
    n, epochs = 37, 2  # odd: the sharded share pads
    write, needs, fmt_name = FORMATS[fmt]
    log = write(tmp_path, n, w, sharded, epochs)
    hints = {k: (n if k == "samples" else w if k == "world_size" else v) for k, v in needs.items()}
    rep = one(log, **hints)
    assert fmt_name in rep["formats"]
    p = per_epoch(n, w, sharded)
    assert rep["steps_per_rank"] == p * epochs
    assert rep["world_size"] == w
    assert rep["writers"] == (w if fmt in ("specforge", "torchrun") else 1)
    assert rep["verdict"] == ("sharded" if sharded or w == 1 else "not sharded"), rep["reasons"]
    assert rep["trivial"] == (w == 1 and fmt not in ("eyas-run", "eyas-console"))
    assert rep["ended"] or fmt in ("torchrun", "eyas-metrics-only"), rep
    assert rep["anomalies"] == [], rep["anomalies"]
    if rep["steps_per_epoch_seen"]:
        assert rep["steps_per_epoch_seen"] == p


def test_epoch_local_counter_over_three_epochs(tmp_path):
    log = write_generic(tmp_path / "g.log", 30, 2, False, 3)  # not sharded: 30 steps per epoch, counter 1..30 thrice
    rep = one(log)
    assert rep["steps_per_rank"] == 90 and rep["steps_per_epoch_seen"] == 30 and rep["anomalies"] == []
    assert rep["verdict"] == "not sharded" and rep["epoch"] == 3 and rep["step_in_epoch"] == 30


def test_synthetic_rates_and_progress(tmp_path):
    log = write_torchrun(tmp_path / "t.log", 40, 2, True, 3)  # 20 steps per epoch, a step every 0.5 s
    rep = one(log)
    assert rep["rate_steps_per_s"] == pytest.approx(2.0, rel=1e-3)
    assert rep["steps_per_epoch_seen"] == 20 and rep["epochs"] is None
    rep = one(log, epochs=3)
    assert rep["total_steps_per_rank"] == 60 and rep["epoch"] == 3 and rep["step_in_epoch"] == 20


# -- the seed case ---------------------------------------------------------------------------------------------
SEED_N, SEED_W, SEED_EPOCHS, SEED_RATE, SEED_SECONDS = 35_446, 4, 5, 1.4, 270  # 1.4 steps/s per rank, 4.5 min


def seed_steps() -> int:
    return math.floor(SEED_SECONDS * SEED_RATE)  # steps each rank completed in 4.5 minutes: 378


def write_seed_torchrun(path: Path) -> Path:
    """The log of the issue: every rank writes, batches/epoch and total steps printed without saying per what."""
    lines = ["[rank0]: Train batches/epoch: 35446", "[rank0]: Total training steps: 177230"]
    for i in range(1, seed_steps() + 1):
        lines += [f"[rank{r}]: {ts(i / SEED_RATE + 0.003 * r)} INFO step {i} epoch 0 lr 1.0000e-04 loss 3.1"
                  for r in range(SEED_W)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_seed_case_ambiguous_log(tmp_path):
    log = write_seed_torchrun(tmp_path / "seed.log")
    rep = one(log, samples=SEED_N)
    k = seed_steps()
    assert rep["writers"] == 4 and rep["world_size"] == 4
    assert rep["steps_per_rank"] == k == 378
    assert rep["rate_steps_per_s"] == pytest.approx(SEED_RATE, rel=1e-3)
    assert rep["elapsed_s"] == pytest.approx((k - 2) / SEED_RATE, abs=0.01)  # first step excluded (start-up)
    assert rep["verdict"] == "undecidable"
    sharded_total, unsharded_total = math.ceil(SEED_N / SEED_W) * SEED_EPOCHS, SEED_N * SEED_EPOCHS  # 44,310 / 177,230
    assert rep["eta_by_hypothesis"]["sharded"] == pytest.approx((sharded_total - k) / SEED_RATE, rel=1e-3)
    assert rep["eta_by_hypothesis"]["not sharded"] == pytest.approx((unsharded_total - k) / SEED_RATE, rel=1e-3)
    hours = {h: t / 3600 for h, t in rep["eta_by_hypothesis"].items()}
    assert 8.6 < hours["sharded"] < 8.8 and 35 < hours["not sharded"] < 35.2  # "about 8.8 h against about 35 h"
    assert any("8,862" in d and "35,446" in d for d in rep["decide_by"])
    rep = one(log)  # without the dataset size: the counts are still right, the verdict names what is missing
    assert rep["steps_per_rank"] == 378 and rep["verdict"] == "undecidable"
    assert any("--samples" in d for d in rep["decide_by"])


def write_seed_eyas_console(path: Path) -> Path:
    """The seed case as eyas's trainer prints it: the audit, the plan block, then one tqdm bar redrawn with \\r."""
    from eyas.train.plan import compute_plan

    plan = compute_plan(SEED_N, SEED_W, 1, 1, SEED_EPOCHS)
    bar = []
    for t in range(1, SEED_SECONDS + 1):  # tqdm redraws about once a second
        n = math.floor(t * SEED_RATE)
        left = (44_310 - n) / SEED_RATE
        bar.append(f"train:   {100 * n // 44_310}%|          | {n}/44310 [{t // 60:02d}:{t % 60:02d}<"
                   f"{int(left // 3600)}:{int(left % 3600 // 60):02d}:{int(left % 60):02d},  1.40step/s, loss=3.1]")
    audit = "data: 35,446 samples over 4 ranks -> 8,862 per rank per epoch (2 padded), disjoint: yes"
    lines = [*plan.lines(), bar[0] + audit, "\r".join(bar[1:])]  # the audit follows the bar's first draw
    path.write_text("\n".join(lines))  # still running: the bar's line is not finished
    return path


def test_seed_case_eyas_log(tmp_path):
    rep = one(write_seed_eyas_console(tmp_path / "train.log"))
    assert rep["verdict"] == "sharded" and rep["steps_per_rank"] == 378
    assert rep["formats"].keys() >= {"eyas console", "progress bar (tqdm/rich)"}
    assert rep["steps_per_epoch_seen"] is None and rep["steps_per_epoch_per_rank"] == 8862
    assert rep["total_steps_per_rank"] == 44310
    assert rep["rate_steps_per_s"] == pytest.approx(SEED_RATE, rel=0.01)
    assert rep["eta_s"] == pytest.approx((44310 - 378) / SEED_RATE, rel=0.01)
    assert rep["epoch"] == 1 and rep["step_in_epoch"] == 378 and not rep["ended"]


# -- eyas's own two-rank run (built from eyas.train.sharding, the sampler the trainer uses) ----------------------------
@pytest.mark.parametrize("sharded", [True, False])
def test_eyas_two_rank_run(tmp_path, sharded):
    """A run folder and console log as the trainer writes them: metrics from rank 0, the real Audit of 2 ranks."""
    sharding = pytest.importorskip("eyas.train.sharding")
    import numpy as np

    from eyas.train.plan import compute_plan

    n, w, epochs = 53, 2, 2
    spec = sharding.ShardSpec(world_size=w, sharded=sharded)
    shards = [sharding.shard_epoch(np.full(n, 10), 0, r, spec) for r in range(w)]
    audit = sharding.audit([s.sample_ids() for s in shards], samples=n, allowed=not sharded)
    steps = len(shards[0].steps)  # per rank per epoch: 27 sharded, 53 not
    assert steps == (27 if sharded else 53)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": i, "epoch": (i - 1) // steps, "lr": lr_at(i, steps * epochs), "loss": 1.0, "loss_i": [1.0],
             "acc_i": [0.5], "tokens_per_s": 10.0, "samples_seen_global": i * w, "elapsed_s": 0.25 * i}
            for i in range(1, steps * epochs + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "plan.json").write_text(json.dumps(compute_plan(n, w, 1, 1, epochs).to_dict()))
    (run_dir / "audit.json").write_text(json.dumps(audit.to_dict()))
    (tmp_path / "console.log").write_text("\n".join([audit.line(), *compute_plan(n, w, 1, 1, epochs).lines()]) + "\n")
    rep = one(run_dir)
    assert rep["verdict"] == ("sharded" if sharded else "not sharded"), rep["reasons"]
    assert rep["steps_per_rank"] == steps * epochs and rep["world_size"] == w and rep["ended"]
    assert rep["steps_per_epoch_seen"] == steps  # from the epoch counter, whatever the plan says
    con = one(tmp_path / "console.log")
    assert con["verdict"] == rep["verdict"] and con["steps_found"] == 0  # the audit decides before the first step
    assert "eyas console" in con["formats"]


# -- real logs -------------------------------------------------------------------------------------------------
def probe_truth(text: str) -> dict:
    """Ground truth from the wrappers' [probe] lines: ranks, steps per rank, dataset size, samples per rank."""
    ranks, steps, n, seen = set(), set(), set(), set()
    for m in re.finditer(r"\[probe\] rank=(\d+) .*", text):
        line = m.group(0)
        ranks.add(int(m.group(1)))
        for key, into in (("micro_steps_run", steps), ("steps_run", steps), ("source_refs", n),
                          ("train_dataset_len", n), ("samples_seen", seen)):
            hit = re.search(rf"\b{re.escape(key)}=(\d+)", line)
            if hit:
                into.add(int(hit.group(1)))
    assert len(steps) == len(n) == len(seen) == 1, (steps, n, seen)
    w, total, per_rank = len(ranks), n.pop(), seen.pop()
    return {"world": w, "steps": steps.pop(), "samples": total, "sharded": per_rank * w == total}


def real_log(tmp_path, name) -> tuple[Path, dict]:
    text = (FIXTURES / name).read_text(encoding="utf-8")
    truth = probe_truth(text)
    clean = "".join(line for line in text.splitlines(keepends=True) if not line.startswith("[probe]"))
    assert "[probe]" not in clean
    (tmp_path / name).write_text(clean, encoding="utf-8")
    return tmp_path / name, truth


@pytest.mark.parametrize("name", ["specforge-1rank.log", "specforge-2rank.log", "speculators-1rank.log",
                                  "speculators-2rank-ddp.log"])
def test_real_logs_counts(tmp_path, name):
    log, truth = real_log(tmp_path, name)
    rep = one(log)
    assert rep["steps_per_rank"] == truth["steps"]
    assert rep["world_size"] == truth["world"]
    assert rep["writers"] == (truth["world"] if name.startswith("specforge") else 1)  # SpecForge: every rank writes
    assert rep["ended"] and rep["anomalies"] == []
    expected = "sharded" if truth["world"] == 1 else "undecidable"  # no dataset size in these logs
    assert rep["verdict"] == expected


def test_real_specforge_verdict(tmp_path):
    log, truth = real_log(tmp_path, "specforge-2rank.log")
    rep = one(log, samples=truth["samples"], micro_batch=1)  # SpecForge takes one sample per step (--batch-size 1)
    assert truth["sharded"] and rep["verdict"] == "sharded", rep["reasons"]


def test_real_speculators_verdict(tmp_path):
    one_rank, _ = real_log(tmp_path, "speculators-1rank.log")
    two, truth = real_log(tmp_path, "speculators-2rank-ddp.log")
    rep = one(two, samples=truth["samples"])  # packed batches: steps alone cannot say
    assert rep["verdict"] == "undecidable" and rep["steps_per_epoch_seen"] == truth["steps"]
    assert any("another number of ranks" in d for d in rep["decide_by"])
    out = run(DoctorConfig(logs=(str(one_rank), str(two)), quiet=True))
    assert truth["sharded"] and out["comparison"]["verdict"] == "sharded"
    assert out["logs"][1]["verdict"] == "sharded"


def test_real_specforge_pair_is_compared(tmp_path):
    """Two finished SpecForge runs of the same data, 1 and 2 processes: no epoch counter, but 40 steps on one rank
    and 20 per rank on two halve with the ranks."""
    one_rank, _ = real_log(tmp_path, "specforge-1rank.log")
    two, truth = real_log(tmp_path, "specforge-2rank.log")
    out = run(DoctorConfig(logs=(str(one_rank), str(two)), quiet=True))
    assert truth["sharded"] and out["comparison"]["verdict"] == "sharded", out["comparison"]
    assert "whole run" in out["comparison"]["evidence"]
    assert out["logs"][1]["verdict"] == "sharded" and out["logs"][1]["eta_by_hypothesis"] == {}


# -- anomalies -------------------------------------------------------------------------------------------------
def test_restart_duplicate_and_stall(tmp_path):
    old = time.time() - 3600  # the last line was written an hour ago, at a step a second
    rows = [{"step": i, "epoch": 0, "lr": 1e-4, "loss": 1.0, "elapsed_s": i * 1.0} for i in range(1, 51)]
    rows += [{"step": i, "epoch": 0, "lr": 1e-4, "loss": 1.0, "elapsed_s": 60 + i * 1.0} for i in range(41, 61)]
    for r in rows:
        r["time"] = old - 120 + r["elapsed_s"]
    rows.insert(10, rows[9])  # a duplicated line
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.utime(log, (old, old))
    rep = one(log)
    kinds = [a["kind"] for a in rep["anomalies"]]
    assert "restart" in kinds and "duplicate" in kinds and "stall" in kinds
    assert rep["liveness"].startswith("stalled or dead: the file was last written 60.0 min ago")
    copied = time.time() - 3600 + 1000  # the same log copied later: its age is the copy's, not the run's
    os.utime(log, (copied, copied))
    rep = one(log)
    assert "stall" not in [a["kind"] for a in rep["anomalies"]] and rep["liveness"].startswith("not judged")
    restart = next(a for a in rep["anomalies"] if a["kind"] == "restart")
    assert restart["line"] == 52 and "from 50" in restart["message"] and "to 41" in restart["message"]
    assert rep["steps_per_rank"] == 60


def test_lr_schedule_longer_than_run(tmp_path):
    # the scheduler was sized for 4x the steps each rank runs (the unsharded count): lr still high at the end
    n, w, total_planned = 40, 4, 40
    lines = [f"{ts(i)} step {i} epoch 0 lr {lr_at(i, total_planned):.6e} loss 1.0" for i in range(1, 11)]
    lines.append("Training finished")
    (tmp_path / "t.log").write_text("\n".join(lines) + "\n")
    rep = one(tmp_path / "t.log", samples=n, world_size=w, micro_batch=1, epochs=1)
    assert rep["verdict"] == "sharded"
    assert rep["lr_schedule_steps"] == pytest.approx(total_planned, abs=1)
    assert [a["kind"] for a in rep["anomalies"]] == ["lr schedule"]


# -- follow ----------------------------------------------------------------------------------------------------
def test_follow_growing_log(tmp_path):
    log = tmp_path / "live.log"
    log.write_text("")

    def writer():  # starts once the doctor follows (a fresh-clone run once saw every line before it began)
        time.sleep(0.3)
        with open(log, "a") as f:
            for i in range(1, 13):
                f.write(f"step {i}: {{'loss': 1.0, 'lr': 0.0001}}\n")
                f.flush()
                time.sleep(0.15)

    t = threading.Thread(target=writer)
    t.start()
    start = time.monotonic()
    rep = run(DoctorConfig(logs=(str(log),), follow=True, follow_timeout=1.0, poll=0.05, quiet=True))["logs"][0]
    t.join()
    assert time.monotonic() - start < 10
    assert rep["steps_per_rank"] == 12
    assert rep["rate_steps_per_s"] == pytest.approx(1 / 0.15, rel=0.5)  # timed by arrival: the log has no timestamps
    assert rep["rate_source"].startswith("arrival")


# -- garbage ---------------------------------------------------------------------------------------------------
def test_garbage_inputs(tmp_path):
    (tmp_path / "bin.log").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "empty.log").write_bytes(b"")
    (tmp_path / "words.log").write_text("hello\nno steps here, lr unknown\n" * 50)
    (tmp_path / "huge.log").write_text("step 1: {" + "x" * 3_000_000 + "\nstep 2: {'lr': 0.1}\n")
    for name, what in (("bin.log", "not a text log"), ("empty.log", "empty"), ("missing.log", "not found")):
        with pytest.raises(EyasError, match=what):
            one(tmp_path / name)
    rep = one(tmp_path / "words.log")
    assert rep["verdict"] == "undecidable" and rep["steps_found"] == 0 and "no training step lines" in rep["reasons"][0]
    (tmp_path / "died.log").write_text("[rank1]: Traceback (most recent call last):\n[rank1]:   File x\n"
                                       "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")
    rep = one(tmp_path / "died.log")
    assert rep["steps_found"] == 0 and [(a["kind"], a["line"]) for a in rep["anomalies"]] == [("crash", 3)]
    rep = one(tmp_path / "huge.log")
    assert rep["steps_found"] == 2 and rep["truncated_lines"] == 1
    with pytest.raises(EyasError, match="without metrics.jsonl"):
        one(tmp_path)


def test_cli_json(tmp_path, capsys):
    from eyas.cli import main

    log = write_specforge(tmp_path / "sf.log", 10, 2, True, 1)
    assert main(["doctor", str(log), "--samples", "10", "--micro-batch", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["logs"][0]["verdict"] == "sharded" and out["logs"][0]["steps_per_rank"] == 5
    assert main(["doctor", str(log)]) == 0
    text = capsys.readouterr().out
    assert "verdict: UNDECIDABLE" in text and "--samples" in text
    assert main(["doctor", str(tmp_path / "nope.log")]) == 2


# -- fuzzing: any bytes give an EyasError or a report, never a traceback or a hang -------------------------------
FRAGMENTS = ["step 3: {'lr': 1e-4, 'loss': 2}", "step 0: {'lr': nan, 'perf/optimizer_step_time_s': inf}", "[rank1]: ",
             "[default0]: ", "global_step=", "epoch=0, lr=", "\r", "\n", '{"step": -1}',
             '{"step": 2, "epoch": 1e308, "elapsed_s": 1e999}', "[23:59:59] INFO     train/loss=0.1", " " * 20,
             "2025-02-29 23:59:59,999 ", "W0229 24:61:00.1 ",
             "data: 0 samples over 0 ranks -> 0 per rank per epoch (0 padded), disjoint: yes",
             "plan: dataset 5 samples (global), 0 epochs", "plan: optimizer steps (global): 0 per epoch, 0 in all",
             "Epoch 0 100% ━━ 3/0  [", "Training epoch 0/0 completed", "a.py:1: UserWarning: x", "Traceback (most "
             "recent call last)", "lr 0.0", "step 999999999999", "epoch 1/0", "Train batches/epoch: 0", "world_size: 0",
             "Total training steps: 0", "epoch 0: 0 samples processed (global) of 0", "batch_size: 0", "%|", "=" * 50,
             "train:  50%|█    | 5/10 [00:01<00:18, 4.4step/s]", "Epoch 1 100% ━━ 7/7  [ 0:00:06 < 0:00:00 , 2 it/s ]",
             "validation (epoch 1)", "[DUPLICATE DATA] ", "plan: this run takes 0 optimizer steps"]
LOGS = st.one_of(
    st.binary(max_size=2000),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=30), st.integers(-5, 10**6).map(str)),
             max_size=80).map(lambda parts: "".join(parts).encode("utf-8", "replace")))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=LOGS, samples=st.integers(0, 50), world=st.integers(0, 5), mb=st.integers(0, 3), epochs=st.integers(0, 3))
def test_fuzz_never_crashes(tmp_path, data, samples, world, mb, epochs):
    log = tmp_path / "fuzz.log"
    log.write_bytes(data)
    try:
        rep = one(log, samples=samples, world_size=world, micro_batch=mb, epochs=epochs)
    except EyasError:
        return
    assert rep["verdict"] in ("sharded", "not sharded", "undecidable")
    json.dumps(rep)  # the --json summary must serialise


def test_parsers_linear_on_hostile_lines(tmp_path):
    from eyas.doctor.logformats import LogParser

    hostile = [" " * 60000 + "x", "1%" * 30000, "step 1: {" + "'a': 1, " * 8000, "=" * 60000, "[rank1]: " * 6000,
               "a" * 60000 + ".py:1", "           INFO     x" + " " * 60000]
    parser = LogParser()
    start = time.perf_counter()
    for i, line in enumerate(hostile, 1):
        parser.feed(i, line)
    for i in range(20000):  # an endless rich record is cut into bounded pieces
        parser.feed(100 + i, " " * 20 + "train/loss=1, global_step=" + str(i))
    parser.finish()
    assert time.perf_counter() - start < 5


def test_only_rank0_writes_steps_under_torchrun(tmp_path):
    lines = [f"[rank{r}]: a.py:1: UserWarning: slow path" for r in range(4)]
    lines += [f"[rank0]: {ts(i)} step {i} epoch {(i - 1) // 10} lr 1e-4" for i in range(1, 31)]
    (tmp_path / "t.log").write_text("\n".join(lines) + "\n")
    rep = one(tmp_path / "t.log", samples=40, micro_batch=1)
    assert rep["writers"] == 1 and rep["world_size"] == 4 and "[rank3]" in rep["world_size_source"]
    assert rep["verdict"] == "sharded" and rep["steps_per_epoch_seen"] == 10


def test_pause_crash_and_markers_before_the_steps(tmp_path):
    lines = ["Traceback (most recent call last):", "RuntimeError: first attempt died",  # an earlier attempt
             "loading the train split ... done"]  # says "train ... done" but comes before the steps: not an end
    lines += [f"{ts(i)} step {i} lr 1e-4" for i in range(1, 21)]
    lines += [f"{ts(20 + 120 + i)} step {20 + i} lr 1e-4" for i in range(1, 11)]  # two minutes without a step
    lines += ["Traceback (most recent call last):", "torch.OutOfMemoryError: CUDA out of memory"]
    (tmp_path / "t.log").write_text("\n".join(lines) + "\n")
    rep = one(tmp_path / "t.log", samples=100, world_size=2, micro_batch=1, epochs=1)
    assert rep["ended"].startswith("it crashed") and "line 35" in rep["ended"] and "out of memory" in rep["ended"]
    kinds = [a["kind"] for a in rep["anomalies"]]
    assert "pause" in kinds and "crash" in kinds and "stall" not in kinds
    pause = next(a for a in rep["anomalies"] if a["kind"] == "pause")
    assert pause["line"] == 24 and "2.0 min" in pause["message"]
    assert rep["steps_per_rank"] == 30 and rep["eta_s"] is None and rep["eta_by_hypothesis"] == {}  # over: no ETA


def test_follow_stops_when_the_run_ends(tmp_path):
    log = tmp_path / "live.log"
    log.write_text("")

    def writer():
        with open(log, "a") as f:
            for i in range(1, 6):
                f.write(f"{ts(i)} step {i} lr 1e-4\n")
                f.flush()
                time.sleep(0.05)
            f.write("Training finished\n")

    t = threading.Thread(target=writer)
    t.start()
    start = time.monotonic()
    rep = run(DoctorConfig(logs=(str(log),), follow=True, follow_timeout=30, poll=0.05, quiet=True))["logs"][0]
    t.join()
    assert time.monotonic() - start < 5 and rep["ended"].startswith("the log says so")
    assert rep["steps_per_rank"] == 5 and rep["rate_steps_per_s"] == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["eyas-2rank", "eyas-2rank-unsharded"])
def test_real_eyas_runs(name):
    folder = FIXTURES / name
    audit = json.loads((folder / "audit.json").read_text())
    plan = json.loads((folder / "plan.json").read_text())
    n, w, per_rank = audit["samples"], audit["world_size"], audit["per_rank"]
    truth = "sharded" if sum(per_rank) - audit["padded"] == n else "not sharded"  # each sample once, or on every rank
    steps_per_epoch = math.ceil(max(per_rank) / plan["micro_batch"] / plan["grad_accum"])
    rows = (folder / "metrics.jsonl").read_text().splitlines()
    for log in (folder, folder / "console.log"):
        rep = one(log)
        assert rep["verdict"] == truth, (log, rep["reasons"])
        assert rep["world_size"] == w and rep["samples"] == n
        assert rep["steps_per_rank"] == len(rows) == steps_per_epoch * plan["epochs"]
        assert rep["steps_per_epoch_per_rank"] == steps_per_epoch
        assert rep["ended"] and rep["rate_steps_per_s"] > 0
        assert [a["kind"] for a in rep["anomalies"]] == ([] if truth == "sharded" else ["duplicate data"])


def test_a_damaged_plan_gives_no_predictions_rather_than_a_crash():
    """The fuzz test found it: a plan.json saying -1 samples made 0 steps per epoch, and a modulo by zero."""
    from eyas.doctor.verdict import _per_epoch_from_total, predictions

    assert predictions(-1, 2, 1, 0) == {} and predictions(10, 0, 1, 1) == {} and predictions(10, 2, -4, 1) == {}
    good = predictions(100, 4, 5, 2)
    assert good["sharded"]["steps_per_epoch"] == 5 and good["not sharded"]["steps_per_epoch"] == 20
    assert _per_epoch_from_total(3, None, {"x": {"steps_per_epoch": 0}}, "3") == (None, "")


def test_many_anomalies_of_one_kind_print_as_a_few_and_a_count():
    """Issue 45: a long log's thousands of anomalies of one kind print as the first three and a count with their
    lines; every kind is shown, in the order first seen; --json keeps them all."""
    from eyas.doctor.diagnose import _render_anomalies
    from eyas.doctor.series import anomaly

    many = [anomaly("loss spike", 100 + i, f"loss spike at step {i}") for i in range(2095)]
    lines = _render_anomalies([anomaly("restart", 50, "step went back"), *many, anomaly("restart", 9000, "again")])
    assert lines == ["  anomaly (restart): step went back", "  anomaly (restart): again",
                     "  anomaly (loss spike): loss spike at step 0", "  anomaly (loss spike): loss spike at step 1",
                     "  anomaly (loss spike): loss spike at step 2",
                     "  anomaly (loss spike): 2,092 more of this kind, lines 103-2,194 (--json lists every one)"]
    assert _render_anomalies([]) == ["  anomalies: none"]
