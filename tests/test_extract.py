"""eyas extract: read-back equals the target's own hidden states, rank splitting, restarts, kills, torchrun."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from datasets import Dataset, Features, Sequence, Value

from eyas.core.errors import EyasError
from eyas.store.extract import ExtractConfig, run
from eyas.store.layout import COMPACT_ABS_DIV, COMPACT_REL, bytes_per_token
from eyas.store.reader import StoreReader
from eyas.store.shard_plan import plan_batches, plan_shards, shard_indices

LAYERS = [2, 4, 5]  # the tiny target's default features [2, L//2, L-3]


# ---------------------------------------------------------------- shared helpers (also used by test_store_import)

def write_prepared(root: Path, n: int = 20, seed: int = 0, lo: int = 5, hi: int = 60) -> Path:
    """A prepared dataset folder as eyas prepare writes it (docs/architecture.md), with random token ids."""
    g = torch.Generator().manual_seed(seed)
    rows = {"id": [], "input_ids": [], "loss_mask": [], "num_tokens": []}
    for i in range(n):
        L = int(torch.randint(lo, hi + 1, (1,), generator=g))
        rows["id"].append(f"sample-{i}")
        rows["input_ids"].append(torch.randint(3, 49000, (L,), generator=g).tolist())
        rows["loss_mask"].append([0] * (L // 3) + [1] * (L - L // 3))
        rows["num_tokens"].append(L)
    feats = Features({"id": Value("string"), "input_ids": Sequence(Value("int32")),
                      "loss_mask": Sequence(Value("int8")), "num_tokens": Value("int32")})
    Dataset.from_dict(rows, features=feats).save_to_disk(str(root / "train"))
    (root / "summary.json").write_text(json.dumps({"fingerprint": f"test-{n}-{seed}"}))
    return root


def prepared_rows(root: Path) -> list[dict]:
    from datasets import load_from_disk

    return list(load_from_disk(str(root / "train")))


def manifest(store: Path) -> dict:
    m = json.loads((store / "manifest.json").read_text())
    m["dataset"].pop("path")  # where the prepared folder lives is not content
    return m


def env_one_thread() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1] / "src")}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bf16_tiny():
    from eyas.core.target import load_target

    return load_target("tiny", dtype="bf16")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return write_prepared(tmp_path_factory.mktemp("prepared"), n=20)


def cfg(prepared, store, **kw):
    return ExtractConfig(data=str(prepared), store=str(store), target="tiny", quiet=True,
                         **{"dtype": "bf16", "shard_mb": 0.02, "batch_tokens": 160, **kw})  # as bf16_tiny


# ---------------------------------------------------------------- the plan

@pytest.mark.parametrize("n", [0, 1, 5, 8, 23, 100])
def test_shard_indices_are_disjoint_and_complete(n):
    for world in range(1, 9):
        parts = [shard_indices(n, r, world) for r in range(world)]
        flat = [k for p in parts for k in p]
        assert sorted(flat) == list(range(n))  # complete, and no shard twice
        assert max(map(len, parts)) - min(map(len, parts)) <= 1  # balanced


def test_shard_indices_refuse_a_rank_outside_the_world():
    with pytest.raises(ValueError):
        shard_indices(10, 2, 2)


def test_plan_shards_and_batches_cover_every_row_once_within_budgets():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 300, (200,), generator=g).tolist()
    shards = plan_shards(lengths, token_bytes=10, shard_bytes=20_000)
    rows = [r for s in shards for r in s]
    assert sorted(rows) == list(range(200))
    assert [lengths[r] for r in rows] == sorted(lengths)  # length order
    assert all(sum(lengths[r] for r in s) * 10 <= 20_000 or len(s) == 1 for s in shards)
    for s in shards:
        ls = [lengths[r] for r in s]
        batches = plan_batches(ls, 700)
        assert sorted(p for b in batches for p in b) == list(range(len(s)))
        assert all(len(b) * max(ls[p] for p in b) <= 700 or len(b) == 1 for b in batches)


def test_an_engine_gets_concurrency_requests_whatever_the_batch_tokens():
    """--engine vllm: plan_batches by --batch-tokens 8192 gave samples of 2,048 tokens four to a batch, so four of
    --concurrency 16 requests were in flight; an engine's groups hold 4 x concurrency samples, within a memory
    bound on their states, every sample once, in order."""
    from eyas.store.shard_plan import ENGINE_GROUP_BYTES, plan_engine_batches

    lengths = [2048] * 200
    assert max(len(b) for b in plan_batches(lengths, 8192)) == 4
    groups = plan_engine_batches(lengths, 16, bytes_per_token=4 * 576 * 4)
    assert [p for g in groups for p in g] == list(range(200))
    assert all(len(g) == 64 for g in groups[:-1])
    wide = plan_engine_batches(lengths, 16, bytes_per_token=4 * 7168 * 4)  # a large target: memory bounds the group
    assert all(sum(lengths[p] for p in g) * 4 * 7168 * 4 <= ENGINE_GROUP_BYTES for g in wide)
    assert min(len(g) for g in wide[:-1]) >= 16  # still the concurrency asked for
    assert plan_engine_batches([10**9], 4, 1) == [[0]]  # a sample larger than the bound goes alone


def test_small_data_is_cut_into_min_shards_so_ranks_share_it_evenly():
    """The demo's 310 samples (308 MiB) made two shards of 256 MiB and 52 MiB, and rank 0 of two extracted 83% of
    the tokens: data smaller than min_shards shards is cut into about min_shards, and round-robin evens it out."""
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(20, 430, (310,), generator=g).tolist()  # ~70k tokens, as the demo's
    budget = 256 * 2**20
    old = plan_shards(lengths, 4613, budget)  # the budget alone: two shards, one small, as the demo had
    assert len(old) == 2 and sum(lengths[r] for r in old[0]) > 3 * sum(lengths[r] for r in old[1])
    shards = plan_shards(lengths, 4613, budget, min_shards=64)
    assert 64 <= len(shards) <= 96 and sorted(r for s in shards for r in s) == list(range(310))
    for world in (2, 4):
        share = [sum(lengths[r] for k in shard_indices(len(shards), rank, world) for r in shards[k])
                 for rank in range(world)]
        assert max(share) / min(share) < 1.1, share
    big = [500] * 400  # data of more than min_shards budgets: cut by the budget, as before
    assert plan_shards(big, 1000, 10_000, min_shards=4) == plan_shards(big, 1000, 10_000)


# ---------------------------------------------------------------- read-back against the target

def reference_states(model, ids: torch.Tensor, layers) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's own output_hidden_states for ids [B, T]: aux [B, T, 3H] and final [B, T, H] (post-norm)."""
    with torch.inference_mode():
        hs = model(ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in layers], dim=-1), hs[-1]


def test_readback_equals_output_hidden_states_exactly_with_eager_attention(bf16_tiny, prepared, tmp_path):
    """Eager attention: batched, padded extraction is bit-identical to each sample's own unpadded forward."""
    try:
        run(cfg(prepared, tmp_path / "s", attn="eager"), target=bf16_tiny)
        reader = StoreReader(tmp_path / "s")
        rows = prepared_rows(prepared)
        assert len(reader) == len(rows) and reader.layer_ids == LAYERS
        for i, row in enumerate(rows):
            s = reader[i]
            ids = torch.tensor(row["input_ids"])
            aux, final = reference_states(bf16_tiny.model, ids[None], LAYERS)
            assert s.id == row["id"] and torch.equal(s.input_ids, ids) and s.input_ids.dtype == torch.int64
            assert s.loss_mask.tolist() == row["loss_mask"]
            assert s.aux.dtype == torch.bfloat16 and torch.equal(s.aux, aux[0])
            assert torch.equal(s.final, final[0])
    finally:
        bf16_tiny.model.set_attn_implementation("sdpa")


def test_extraction_runs_no_output_head_and_asks_for_no_hidden_states(bf16_tiny, prepared, tmp_path, monkeypatch):
    """Only the hooked layers' outputs are kept: the output head (262k rows on gemma3-270m) never runs, and the
    model is never asked for all its layers' hidden states."""
    base = bf16_tiny.model.model
    forward = base.forward
    calls = []

    def checked(*args, **kw):
        assert not kw.get("output_hidden_states"), "the base model was asked for every layer's hidden states"
        calls.append(1)
        return forward(*args, **kw)

    def head(*_):
        raise AssertionError("the output head ran during extraction")

    monkeypatch.setattr(base, "forward", checked)
    handle = bf16_tiny.lm_head().register_forward_pre_hook(head)
    try:
        run(cfg(prepared, tmp_path / "s"), target=bf16_tiny)
    finally:
        handle.remove()
    assert calls and len(StoreReader(tmp_path / "s")) == len(prepared_rows(prepared))


def test_readback_equals_output_hidden_states_of_the_same_padded_batches(bf16_tiny, prepared, tmp_path):
    """Default (sdpa) attention: exact against the target's own states for the same right-padded batches."""
    c = cfg(prepared, tmp_path / "s")
    run(c, target=bf16_tiny)
    reader = StoreReader(tmp_path / "s")
    rows = prepared_rows(prepared)
    lengths = [len(r["input_ids"]) for r in rows]
    for shard in plan_shards(lengths, bytes_per_token(64, False), int(c.shard_mb * 2**20), c.min_shards):
        for batch in plan_batches([lengths[r] for r in shard], c.batch_tokens):
            members = [shard[p] for p in batch]
            T = max(lengths[r] for r in members)
            ids = torch.zeros(len(members), T, dtype=torch.int64)
            for b, r in enumerate(members):
                ids[b, : lengths[r]] = torch.tensor(rows[r]["input_ids"])
            aux, final = reference_states(bf16_tiny.model, ids, LAYERS)
            for b, r in enumerate(members):
                assert torch.equal(reader[r].aux, aux[b, : lengths[r]])
                assert torch.equal(reader[r].final, final[b, : lengths[r]])


def test_compact_store_is_within_the_stated_tolerance_at_about_half_the_bytes(bf16_tiny, prepared, tmp_path):
    full = run(cfg(prepared, tmp_path / "bf16", attn="eager"), target=bf16_tiny)
    small = run(cfg(prepared, tmp_path / "fp8", attn="eager", compact=True), target=bf16_tiny)
    bf16_tiny.model.set_attn_implementation("sdpa")
    a, b = StoreReader(tmp_path / "bf16"), StoreReader(tmp_path / "fp8")
    worst = 0.0
    for i in range(len(a)):
        for x, y in ((a[i].aux.view(-1, 3, 64), b[i].aux.view(-1, 3, 64)), (a[i].final, b[i].final)):
            x, y = x.float(), y.float()
            bound = x.abs() * COMPACT_REL + x.abs().amax(-1, keepdim=True) / COMPACT_ABS_DIV
            assert ((x - y).abs() <= bound).all()
            worst = max(worst, ((x - y).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)).max().item())
    assert worst < 0.05  # per-row relative error (RMS-like) stays a few percent
    assert small["bytes_per_token"] / full["bytes_per_token"] < 0.53  # 4H+9 vs 8H+5 at H=64, plus headers
    assert bytes_per_token(4096, True) / (8 * 4096) < 0.5004


# ---------------------------------------------------------------- plan, disk, restarts

def test_dry_run_prints_the_plan_and_writes_nothing(bf16_tiny, prepared, tmp_path):
    plan = run(cfg(prepared, tmp_path / "s", dry_run=True), target=bf16_tiny)
    assert not (tmp_path / "s").exists()
    tokens = sum(len(r["input_ids"]) for r in prepared_rows(prepared))
    assert plan["samples"] == 20 and plan["tokens"] == tokens and plan["todo_bytes"] >= tokens * (8 * 64 + 5)


def test_refuses_to_start_when_the_disk_is_short_and_says_how_much_is_missing(bf16_tiny, prepared, tmp_path,
                                                                              monkeypatch):
    monkeypatch.setattr("eyas.store.extract.free_bytes", lambda p: 1000)
    with pytest.raises(EyasError, match="missing") as e:
        run(cfg(prepared, tmp_path / "s"), target=bf16_tiny)
    assert "needs" in str(e.value) and not (tmp_path / "s").exists()


def test_restart_skips_finished_shards_and_gives_the_same_manifest(bf16_tiny, prepared, tmp_path):
    store = tmp_path / "s"
    first = run(cfg(prepared, store), target=bf16_tiny)
    tokens = sum(len(r["input_ids"]) for r in prepared_rows(prepared))
    assert first["extracted_tokens"] == first["tokens"] == tokens and first["extracted_samples"] == 20
    before = manifest(store)
    shards = sorted((store / "shards").glob("*.safetensors"))
    assert len(shards) == first["shards"] > 3
    stamps = {p.name: p.stat().st_mtime_ns for p in shards}
    shards[2].unlink()
    (store / "manifest.json").unlink()
    again = run(cfg(prepared, store), target=bf16_tiny)
    assert again["resumed_shards"] == len(shards) - 1 and again["extracted_samples"] > 0
    assert manifest(store) == before
    for p in shards:
        if p != shards[2]:
            assert p.stat().st_mtime_ns == stamps[p.name]  # untouched


def test_restart_with_other_settings_or_into_a_foreign_folder_is_refused(bf16_tiny, prepared, tmp_path):
    run(cfg(prepared, tmp_path / "s"), target=bf16_tiny)
    with pytest.raises(EyasError, match="other settings"):
        run(cfg(prepared, tmp_path / "s", layers=(1, 3, 6)), target=bf16_tiny)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(EyasError, match="not an extract in progress"):
        run(cfg(prepared, tmp_path / "other"), target=bf16_tiny)


def test_bad_layers_are_refused_with_the_valid_range(bf16_tiny, prepared, tmp_path):
    with pytest.raises(EyasError, match="outside 1..7"):
        run(cfg(prepared, tmp_path / "s", layers=(2, 4, 8)), target=bf16_tiny)
    with pytest.raises(EyasError, match="exactly three"):
        cfg(prepared, tmp_path / "s", layers=(2, 4))


# ---------------------------------------------------------------- real processes

def extract_argv(prepared, store) -> list[str]:
    return ["extract", "--data", str(prepared), "--store", str(store), "--target", "tiny", "--shard-mb", "0.02",
            "--batch-tokens", "160", "--dtype", "bf16", "--quiet"]


SLOW_COMMIT = """
import sys, time
import eyas.store.writer
commit = eyas.store.writer.ShardBuilder.commit
def slow_commit(self, folder):
    time.sleep(0.4)  # widen the window in which the kill lands
    return commit(self, folder)
eyas.store.writer.ShardBuilder.commit = slow_commit
from eyas.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def test_sigkill_mid_run_then_rerun_gives_the_uninterrupted_store(bf16_tiny, prepared, tmp_path):
    run(cfg(prepared, tmp_path / "ref"), target=bf16_tiny)
    store = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_COMMIT, *extract_argv(prepared, store)],
                            env=env_one_thread(), stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while len(list((store / "shards").glob("shard-*"))) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    assert not (store / "manifest.json").exists()  # killed mid-run
    again = run(cfg(prepared, store), target=bf16_tiny)  # the same command, rerun (in-process: faster)
    assert 0 < again["resumed_shards"] < again["shards"]
    assert manifest(store) == manifest(tmp_path / "ref")
    assert not list((store / "shards").glob(".*tmp*"))  # the killed run's temp file is gone


def test_torchrun_two_processes_write_the_same_store_as_one(bf16_tiny, prepared, tmp_path):
    run(cfg(prepared, tmp_path / "one"), target=bf16_tiny)
    store = tmp_path / "two"
    out = subprocess.run(["torchrun", "--standalone", "--nproc-per-node", "2", "--module", "eyas",
                          *extract_argv(prepared, store)], env=env_one_thread(), capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert manifest(store) == manifest(tmp_path / "one")
    by_rank = [json.loads((store / "index" / f"rank-{r:05d}-of-00002.json").read_text()) for r in (0, 1)]
    names = [{s["name"] for s in part} for part in by_rank]
    assert names[0] and names[1] and not names[0] & names[1]  # each rank wrote its own shards
    a, b = StoreReader(tmp_path / "one"), StoreReader(store)
    assert all(torch.equal(a[i].aux, b[i].aux) and torch.equal(a[i].final, b[i].final) for i in range(len(a)))
