"""A target without its weights (eyas.core.weights), Hub ids, and the draft vocabulary counted from token ids only:
what offline training reads of a target must not grow with it (issue 22, items 1, 2, 6)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import eyas.core.weights as weights
from eyas.core.dist import DistEnv
from eyas.core.errors import EyasError
from eyas.core.target import hub_id, load_target
from eyas.core.weights import load_target_shell, read_module
from eyas.draft.vocab import build_draft_vocab, count_tokens

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The tiny target saved as a sharded bf16 checkpoint (an index and several files), untied."""
    folder = tmp_path_factory.mktemp("sharded") / "tiny-hf"
    tiny = load_target("tiny")
    tiny.model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="2MB")
    tiny.tokenizer.save_pretrained(folder)
    return folder


def opened_files(monkeypatch) -> list[str]:
    seen = []
    real = weights.safe_open

    def spy(path, *a, **kw):
        seen.append(Path(path).name)
        return real(path, *a, **kw)

    monkeypatch.setattr(weights, "safe_open", spy)
    return seen


def test_a_shell_has_the_loaded_targets_identity_and_reads_only_the_files_holding_its_tables(sharded, monkeypatch):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 3  # really sharded
    full = load_target(str(sharded), dtype="bfloat16")
    seen = opened_files(monkeypatch)
    shell = load_target_shell(str(sharded))
    assert all(p.is_meta for p in shell.model.parameters()) and shell.tokenizer is None
    assert shell.identity() == full.identity()
    embed = read_module(shell, shell.embed_tokens()).weight
    head = read_module(shell, shell.lm_head()).weight
    assert embed.dtype == torch.bfloat16 and not embed.is_meta  # the stored dtype, no fp32 copy
    assert torch.equal(embed, full.embed_tokens().weight) and torch.equal(head, full.lm_head().weight)
    assert sorted(set(seen)) == sorted({index["model.embed_tokens.weight"], index["lm_head.weight"]})
    assert all(p.is_meta for p in shell.decoder_layers().parameters())  # no decoder weight was read
    assert read_module(full, full.lm_head()) is full.lm_head()  # a loaded target's module as it is


def test_a_tied_head_is_read_under_the_embeddings_name_and_stays_tied(tmp_path):
    shell = load_target_shell("smollm2-135m")  # tied: the checkpoint has no lm_head.weight
    assert shell.config.tie_word_embeddings
    head = read_module(shell, shell.lm_head()).weight
    assert shell.embed_tokens().weight is head  # read once, for both
    full = load_target("smollm2-135m")
    assert torch.equal(head, full.lm_head().weight) and shell.identity() == full.identity()


def test_a_checkpoint_missing_a_tensor_is_refused_with_its_name(sharded, tmp_path):
    folder = tmp_path / "cut"
    folder.mkdir()
    for f in sharded.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    os.remove(folder / index["weight_map"]["lm_head.weight"])
    shell = load_target_shell(str(folder))
    with pytest.raises(EyasError, match="is missing"):
        read_module(shell, shell.lm_head())


def test_hub_ids_are_told_from_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub_id("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", None)
    assert hub_id("Qwen/Qwen3-8B@main") == ("Qwen/Qwen3-8B", "main")
    (tmp_path / "models" / "mine").mkdir(parents=True)
    assert hub_id("models/mine") is None  # a local folder wins
    assert hub_id("smollm2-135m") is None and hub_id("a/b/c") is None and hub_id("x/y.gguf") is None


def fake_hub_cache(root: Path, repo: str, src: Path) -> Path:
    """A Hugging Face cache as `hf download` leaves it: blobs, a snapshot of links, refs/main."""
    base = root / ("models--" + repo.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = base / "snapshots" / commit
    (base / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        blob = base / "blobs" / f"{i:040x}"
        blob.write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)
    return snap


def test_a_hub_id_resolves_through_the_offline_hub_cache(sharded, tmp_path):
    cache = tmp_path / "hub"
    snap = fake_hub_cache(cache, "eyas-test/tiny-llama", sharded)
    script = textwrap.dedent("""
        import json, torch
        torch.set_num_threads(1)
        from eyas.core.errors import EyasError
        from eyas.core.target import load_target, load_tokenizer
        from eyas.core.weights import load_target_shell, read_module
        full = load_target("eyas-test/tiny-llama", dtype="bfloat16")
        shell = load_target_shell("eyas-test/tiny-llama")
        head = read_module(shell, shell.lm_head()).weight
        out = {"name": full.name, "source": full.source, "same": shell.identity() == full.identity(),
               "head": torch.equal(head, full.lm_head().weight), "tok": len(load_tokenizer("eyas-test/tiny-llama"))}
        try:
            load_target("eyas-test/absent")
        except EyasError as e:
            out["absent"] = str(e)
        print(json.dumps(out))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["name"] == "eyas-test/tiny-llama" and Path(out["source"]) == snap
    assert out["same"] and out["head"] and out["tok"] == 49152
    assert "not in the Hugging Face cache" in out["absent"] and "hf download eyas-test/absent" in out["absent"]


# 70B-class (Llama-3.1-70B's layer shape) with a 16,384-token vocabulary so its two tables fit a test: 2 x 256 MiB.
BIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192, intermediate_size=28672,
           num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=16384,
           max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
           torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)


def test_offline_training_reads_a_70b_targets_tables_in_a_few_hundred_mib(tmp_path):
    """The decoder files of the index do not even exist: a shell never opens them. Peak host memory of the target
    side of training setup stays near the two tables' bytes (the 70B target itself is ~140 GB in bf16)."""
    folder = tmp_path / "big"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(BIG))
    V, H = BIG["vocab_size"], BIG["hidden_size"]
    g = torch.Generator().manual_seed(0)
    save_file({"model.embed_tokens.weight": torch.randn(V, H, generator=g).bfloat16()},
              str(folder / "model-00001-of-00003.safetensors"))
    save_file({"lm_head.weight": torch.randn(V, H, generator=g).bfloat16(),
               "model.norm.weight": torch.ones(H).bfloat16()}, str(folder / "model-00003-of-00003.safetensors"))
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00003.safetensors",
                  "lm_head.weight": "model-00003-of-00003.safetensors",
                  "model.norm.weight": "model-00003-of-00003.safetensors"}
    weight_map.update({f"model.layers.{i}.self_attn.q_proj.weight": "model-00002-of-00003.safetensors"
                       for i in range(80)})  # a missing file: opening it would fail
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    script = textwrap.dedent(f"""
        import json, time, torch
        from eyas.core.weights import load_target_shell, read_module
        from eyas.draft.model import DraftConfig

        def hwm():  # the process's peak resident memory since the last reset, bytes
            line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM"))
            return int(line.split()[1]) * 1024

        open("/proc/self/clear_refs", "w").write("5")  # reset the peak to the current resident size
        base = hwm()
        t0 = time.perf_counter()
        t = load_target_shell({str(folder)!r})
        embed = read_module(t, t.embed_tokens()).weight
        head = read_module(t, t.lm_head()).weight
        rows = head[torch.arange(0, 16384, 2)].float()  # a draft vocabulary's rows, as training takes them
        total = float(embed.sum()) + float(rows.sum())  # every byte of both read
        dc = DraftConfig.for_target(t, 8192, None, 1)
        peak = hwm()
        print(json.dumps({{"grew": peak - base, "s": time.perf_counter() - t0, "layers": t.num_layers,
                          "dtype": str(embed.dtype), "hidden": dc.hidden_size, "features": list(dc.feature_layers),
                          "params": sum(p.numel() for p in t.model.parameters())}}))
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    tables = 2 * V * H * 2 + V // 2 * H * 4  # two bf16 tables and the fp32 rows: 768 MiB
    assert out["params"] > 68e9 and out["layers"] == 80 and out["hidden"] == 8192  # the real 70B shape
    assert out["dtype"] == "torch.bfloat16" and out["features"] == [2, 40, 77]
    print(f"70B-class shell: host memory grew {out['grew'] / 2**20:.0f} MiB in {out['s']:.1f} s")
    assert 2 * V * H < out["grew"] < tables + 512 * 2**20, f"host memory grew {out['grew'] / 2**20:.0f} MiB"


def test_the_vocabulary_counted_by_ranks_between_them_equals_one_count(tmp_path):
    rng = np.random.default_rng(0)
    samples = [(rng.integers(0, 500, n).astype(np.int32), (rng.random(n) > 0.3).astype(np.int8))
               for n in rng.integers(5, 300, 64)]
    whole = count_tokens(iter(samples), 500)
    reference = np.zeros(500, dtype=np.int64)
    for ids, mask in samples:
        np.add.at(reference, ids[mask > 0], 1)
    assert np.array_equal(whole, reference)
    assert np.array_equal(count_tokens(iter(samples), 500, batch=7), reference)  # flushed many times
    world = 3
    parts = [count_tokens((samples[i] for i in range(r, len(samples), world)), 500) for r in range(world)]
    assert np.array_equal(sum(parts), whole)
    one = build_draft_vocab(whole, 100)
    assert torch.equal(build_draft_vocab(sum(parts), 100).d2t, one.d2t)


def test_the_draft_vocabulary_reads_no_hidden_state(tmp_path, monkeypatch):
    """Training setup counts the token ids (ids and mask only) of a store; a store's __getitem__, which reads and
    checks the features, is never called for it, and the counts are the samples' own."""
    from eyas.store.reader import StoreReader
    from eyas.train import setup
    from tests.test_store import build_store, samples

    data = samples(12)
    reader = StoreReader(build_store(tmp_path / "store", data))
    for i, (_, _, ids, mask, _, _) in enumerate(data):
        got = reader.token_ids(i)
        assert np.array_equal(got[0], ids.numpy()) and np.array_equal(got[1], mask.numpy())
    reference = count_tokens(((d[2].numpy(), d[3].numpy()) for d in data), 1000)
    monkeypatch.setattr(StoreReader, "__getitem__", lambda *a: pytest.fail("a hidden state was read"))
    target = type("T", (), {"vocab_size": 1000})()
    cfg = type("C", (), {"draft_vocab": 64})()
    info, d2t = setup.draft_vocab(cfg, DistEnv(), target, reader, None)
    assert torch.equal(d2t, build_draft_vocab(reference, 64).d2t) and info["size"] == 64


def test_the_default_feature_layers_are_three_distinct_layers():
    """EAGLE-3's [2, L//2, L-3]: distinct from 7 layers on; 6 layers gave [2, 3, 3] (two features the same)."""
    from eyas.core.errors import EyasError
    from eyas.core.target import default_feature_layers

    assert default_feature_layers(7) == [2, 3, 4] and default_feature_layers(30) == [2, 15, 27]
    for n in range(7, 80):
        assert len(set(default_feature_layers(n))) == 3
    with pytest.raises(EyasError, match="too shallow"):
        default_feature_layers(6)
