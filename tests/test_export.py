"""eyas export / import: round trips, the engines' key list, foreign layouts and bad input.

The expected names, shapes and layer ids below are written from the engines' loaders (docs/export.md), not read
back from eyas.draft.export, except where a test checks eyas.draft.export against engine_keys.json itself.
"""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.core.errors import EyasError
from eyas.draft.checkpoint import read_draft, save_draft
from eyas.draft.export import ExportConfig, engine_spec, run
from eyas.draft.importer import ImportConfig, run_import
from eyas.draft.model import DraftConfig, Eagle3Draft
from eyas.draft.vocab import build_draft_vocab

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _same_target(monkeypatch, tiny_target):
    """Import loads its --target; hand it the session's tiny target instead of rebuilding it each time."""
    monkeypatch.setattr("eyas.draft.importer.load_target_shell", lambda spec, **kw: tiny_target)


# EAGLE-3's variant switches: the EAGLE-3.1 paper's draft, and speculators 0.9's default one
VARIANTS = {"plain": {}, "eagle-3.1": {"fc_norm": True, "norm_output": True},
            "speculators-0.9": {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True}}


def make_checkpoint(target, folder: Path, draft_vocab: int = 500, seed: int = 0, fc_norm: bool = False,
                    **flags) -> Eagle3Draft:
    """A trained-looking eyas checkpoint for the tiny target: target embeddings/head, random everything else."""
    dc = DraftConfig.for_target(target, draft_vocab_size=draft_vocab, fc_norm=fc_norm, **flags)
    m = Eagle3Draft(dc)
    g = torch.Generator().manual_seed(seed)
    vocab = build_draft_vocab(torch.randint(0, 100, (target.vocab_size,), generator=g).numpy(), draft_vocab)
    m.init_weights(target.embed_tokens().weight, target.lm_head().weight, vocab.d2t, seed=seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)  # not all ones, so a lost norm shows
    save_draft(m, folder, extra={"training": {"steps": 7, "loss": 2.5}, "evaluation": {"tau": 1.9}})
    return m


def export(ckpt: Path, fmt: str, out: Path, **kw) -> dict:
    return run(ExportConfig(checkpoint=str(ckpt), format=fmt, out=str(out), quiet=True, **kw))


def import_(src: Path, out: Path, **kw) -> dict:
    return run_import(ImportConfig(source=str(src), out=str(out), target="tiny", quiet=True, **kw))


def assert_same(a: Eagle3Draft, b: Eagle3Draft):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert a.cfg == b.cfg


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
@pytest.mark.parametrize("fc_norm", [False, True])
def test_round_trip_identical(tiny_target, tmp_path, fmt, fc_norm):
    m = make_checkpoint(tiny_target, tmp_path / "ckpt", fc_norm=fc_norm)
    round_trip(tiny_target, tmp_path, fmt, m, fc_norm)


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
@pytest.mark.parametrize("variant", ["eagle-3.1", "speculators-0.9"])
def test_eagle31_variants_round_trip_with_vllms_names(tiny_target, tmp_path, fmt, variant):
    """Each switch is written as vLLM reads it (config flags, `input_norm.weight` with norm_before_fc) and read
    back to the same draft computing the same thing."""
    flags = VARIANTS[variant]
    m = make_checkpoint(tiny_target, tmp_path / "ckpt", **flags)
    cfg = round_trip(tiny_target, tmp_path, fmt, m, flags.get("fc_norm", False))
    for flag in ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual"):
        assert cfg[flag] is flags.get(flag, False), flag
    written = load_file(str(tmp_path / fmt / "model.safetensors"))
    assert ("input_norm.weight" in written) is flags.get("norm_before_fc", False)
    if "input_norm.weight" in written:
        assert written["input_norm.weight"].shape == (3 * 64,)


def round_trip(tiny_target, tmp_path, fmt, m, fc_norm) -> dict:
    """Export `m` (saved in tmp_path/ckpt) in `fmt`, import it back, check it is the same draft; -> the config."""
    export(tmp_path / "ckpt", fmt, tmp_path / fmt)
    # vLLM's names for EAGLE-3.1's per-feature norms (llama_eagle3.py: config fc_norm, weights fc_norm.{i})
    written = load_file(str(tmp_path / fmt / "model.safetensors"))
    assert json.loads((tmp_path / fmt / "config.json").read_text())["fc_norm"] is fc_norm
    assert sorted(k for k in written if k.startswith("fc_norm.")) == \
        (["fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"] if fc_norm else [])
    card = (tmp_path / fmt / "README.md").read_text()
    variant = any(getattr(m.cfg, f) for f in ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual"))
    assert ("sglang.launch_server" in card) is (fmt == "eagle3" and not variant)  # SGLang unchecked for variants
    s = import_(tmp_path / fmt, tmp_path / "back")
    back = read_draft(tmp_path / "back")
    assert_same(m, back)
    assert s["embed_tokens_from"] == "draft" and s["feature_layers"] == [2, 4, 5]
    meta = json.loads((tmp_path / "back" / "config.json").read_text())
    assert meta["training"] == {"steps": 7, "loss": 2.5} and meta["evaluation"] == {"tau": 1.9}
    # the same draft computes the same thing: one pass on the same inputs
    ids, aux, pos = torch.randint(0, 49152, (1, 9)), torch.randn(1, 9, 192), torch.arange(9)[None]
    with torch.no_grad():
        assert torch.equal(m.logits(m(ids, aux, pos)[0]), back.logits(back(ids, aux, pos)[0]))
    return json.loads((tmp_path / fmt / "config.json").read_text())


def expected_from_engines(fmt: str, V: int, Vd: int, H: int = 64, inter: int = 128, nq: int = 4, nkv: int = 2,
                          d: int = 16) -> dict:
    """Names and shapes as the engines' model classes declare them (vLLM/SGLang LlamaForCausalLMEagle3,
    speculators Eagle3DraftModel), written out by hand for the tiny target's draft."""
    layer = "midlayer." if fmt == "eagle3" else "layers.0."
    w = {"embed_tokens.weight": (V, H), "fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (Vd, H),
         layer + "input_layernorm.weight": (H,), layer + "hidden_norm.weight": (H,),
         layer + "self_attn.q_proj.weight": (nq * d, 2 * H), layer + "self_attn.k_proj.weight": (nkv * d, 2 * H),
         layer + "self_attn.v_proj.weight": (nkv * d, 2 * H), layer + "self_attn.o_proj.weight": (H, nq * d),
         layer + "post_attention_layernorm.weight": (H,), layer + "mlp.gate_proj.weight": (inter, H),
         layer + "mlp.up_proj.weight": (inter, H), layer + "mlp.down_proj.weight": (H, inter)}
    if Vd != V:
        w |= {"d2t": (Vd,), "t2d": (V,)}
    return w


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
@pytest.mark.parametrize("draft_vocab", [500, 49152])
def test_export_matches_engines(tiny_target, tmp_path, fmt, draft_vocab):
    make_checkpoint(tiny_target, tmp_path / "ckpt", draft_vocab)
    export(tmp_path / "ckpt", fmt, tmp_path / "out")
    w = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {k: tuple(t.shape) for k, t in w.items()} == expected_from_engines(fmt, 49152, draft_vocab)
    if draft_vocab != 49152:
        assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
        assert w["t2d"].sum() == draft_vocab
    assert all(t.dtype == torch.float32 for k, t in w.items() if k not in ("d2t", "t2d"))
    # the derived list in the repo says the same
    spec = engine_spec()["formats"][fmt]["weights"]
    d = {"H": 64, "Ht": 64, "V": 49152, "Vd": draft_vocab, "I": 128, "Nq": 4, "Nkv": 2, "D": 16}
    for key, t in w.items():
        assert tuple(t.shape) == tuple(math.prod(int(f) if f.isdigit() else d[f] for f in s.split("*"))
                                       for s in spec[key]["shape"]), key
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    layer = cfg if fmt == "eagle3" else cfg["transformer_layer_config"]
    assert layer["vocab_size"] == 49152 and layer["hidden_size"] == 64 and layer["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == draft_vocab and cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM/speculators: HF hidden_states indices
    if fmt == "eagle3":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["tie_word_embeddings"] is False
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang: HF index - 1
    else:
        assert cfg["speculators_model_type"] == "eagle3"
        assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert "tau" in (tmp_path / "out" / "README.md").read_text()


def test_bfloat16_export(tiny_target, tmp_path):
    m = make_checkpoint(tiny_target, tmp_path / "ckpt")
    export(tmp_path / "ckpt", "eagle3", tmp_path / "out", dtype="bfloat16")
    w = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert w["fc.weight"].dtype == torch.bfloat16 and w["d2t"].dtype == torch.int64
    assert torch.equal(w["fc.weight"], m.fc.weight.detach().to(torch.bfloat16))


def test_specforge_style_draft(tiny_target, tmp_path):
    """SpecForge/EAGLE release layout: midlayer.* without embed_tokens, layer ids only in SGLang's eagle_config."""
    m = make_checkpoint(tiny_target, tmp_path / "ckpt")
    export(tmp_path / "ckpt", "eagle3", tmp_path / "e3")
    sf = tmp_path / "specforge"
    sf.mkdir()
    w = load_file(str(tmp_path / "e3" / "model.safetensors"))
    del w["embed_tokens.weight"]
    save_file(w, str(sf / "model.safetensors"))
    cfg = json.loads((tmp_path / "e3" / "config.json").read_text())
    for k in ("eagle_aux_hidden_state_layer_ids", "eyas", "rope_parameters"):
        del cfg[k]
    (sf / "config.json").write_text(json.dumps(cfg))
    s = import_(sf, tmp_path / "back")
    assert s["embed_tokens_from"] == "target" and s["feature_layers"] == [2, 4, 5]  # [1, 3, 4] + 1
    assert_same(m, read_draft(tmp_path / "back"))  # embed_tokens were the target's anyway
    del cfg["eagle_config"]  # no ids at all: the default [2, L//2, L-3] of the 8-layer target
    (sf / "config.json").write_text(json.dumps(cfg))
    assert import_(sf, tmp_path / "back2")["feature_layers"] == [2, 4, 5]
    with pytest.raises(EyasError, match="contradicts"):
        import_(tmp_path / "e3", tmp_path / "back3", layers=(1, 2, 3))


def _broken(tmp_path, tiny_target, fmt="eagle3", edit_w=None, edit_cfg=None) -> Path:
    make_checkpoint(tiny_target, tmp_path / "ckpt")
    export(tmp_path / "ckpt", fmt, tmp_path / "good")
    bad = tmp_path / "bad"
    bad.mkdir()
    w = load_file(str(tmp_path / "good" / "model.safetensors"))
    cfg = json.loads((tmp_path / "good" / "config.json").read_text())
    edit_w and edit_w(w)
    edit_cfg and edit_cfg(cfg)
    save_file(w, str(bad / "model.safetensors"))
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


@pytest.mark.parametrize("edit_w, edit_cfg, message", [
    (lambda w: w.pop("midlayer.self_attn.q_proj.weight"), None, "missing weight 'midlayer.self_attn.q_proj.weight'"),
    (lambda w: w.update({"fc.weight": torch.zeros(64, 64)}), None,
     r"'fc.weight' has shape \[64, 64\], expected \[64, 192\]"),
    (lambda w: w.pop("d2t"), None, "missing weight 'd2t'"),
    (lambda w: w.update({"fc_norm.0.weight": torch.ones(64)}), None, "weight 'fc_norm.0.weight' must be absent"),
    (None, lambda c: c.update({"fc_norm": True}), "missing weight 'fc_norm.0.weight'"),
    (lambda w: w.update({"d2t": torch.zeros(500, dtype=torch.long)}), None, "'t2d' disagrees with 'd2t'"),
    (None, lambda c: c.update({"architectures": ["LlamaForCausalLM"]}), "unknown draft format"),
    (None, lambda c: c.update({"norm_before_fc": True}), "missing weight 'input_norm.weight'"),
    (lambda w: w.update({"input_norm.weight": torch.ones(192)}), None, "weight 'input_norm.weight' must be absent"),
    (None, lambda c: (c.update({"norm_output": True}), c.pop("eyas")),  # SpecForge writes it meaning another thing
     "norm_output = true in an eagle3-layout config not written by eyas is ambiguous"),
    (None, lambda c: c.update({"sliding_window": 2048}), "sliding_window = 2048: the draft attends to a window"),
    (None, lambda c: c.pop("hidden_size"), "config field 'hidden_size' is missing"),
    (None, lambda c: c.update({"vocab_size": 1000}), "vocab_size 1000"),
])
def test_bad_input_named(tiny_target, tmp_path, edit_w, edit_cfg, message):
    bad = _broken(tmp_path, tiny_target, edit_w=edit_w, edit_cfg=edit_cfg)
    with pytest.raises(EyasError, match=message):
        import_(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bad_speculators_type_and_pickles(tiny_target, tmp_path):
    bad = _broken(tmp_path, tiny_target, "speculators", edit_cfg=lambda c: c.update({"speculators_model_type": "mlp"}))
    with pytest.raises(EyasError, match="speculators_model_type 'mlp'"):
        import_(bad, tmp_path / "out")
    (bad / "model.safetensors").rename(bad / "pytorch_model.bin")
    (bad / "config.json").write_text((tmp_path / "good" / "config.json").read_text())
    with pytest.raises(EyasError, match="never unpickles"):
        import_(bad, tmp_path / "out")


@pytest.mark.parametrize("command", ["export", "import"])
def test_overwrite_never_deletes_what_the_command_did_not_write(tiny_target, tmp_path, command):
    """A copy of a training run (checkpoints, metrics) given as --out with --overwrite is refused and left whole;
    the command's own earlier output is replaced."""
    make_checkpoint(tiny_target, tmp_path / "ckpt")
    run_copy = tmp_path / "run-copy"
    (run_copy / "checkpoints" / "step-00000010").mkdir(parents=True)
    (run_copy / "checkpoints" / "step-00000010" / "model.safetensors").write_bytes(b"hours of training")
    (run_copy / "metrics.jsonl").write_text('{"step": 10}\n')
    do = (lambda out, **kw: export(tmp_path / "ckpt", "eagle3", out, **kw)) if command == "export" else None
    if command == "import":
        export(tmp_path / "ckpt", "eagle3", tmp_path / "exported")
        do = lambda out, **kw: import_(tmp_path / "exported", out, **kw)  # noqa: E731
    with pytest.raises(EyasError, match=f"(?s)refuses to replace .*not a folder `eyas {command}` wrote"):
        do(run_copy, overwrite=True)
    assert (run_copy / "checkpoints" / "step-00000010" / "model.safetensors").read_bytes() == b"hours of training"
    assert (run_copy / "metrics.jsonl").read_text() == '{"step": 10}\n'
    do(tmp_path / "mine")
    do(tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "model.safetensors").is_file()
    # issue 45: a file the user put into the command's own output, or one changed since, is never deleted
    (tmp_path / "mine" / "NOTES.md").write_text("mine")
    with pytest.raises(EyasError, match=r"(?s)holds 1 file\(s\) .*did not write, such as .*NOTES\.md"):
        do(tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "NOTES.md").read_text() == "mine"
    (tmp_path / "mine" / "NOTES.md").unlink()
    with open(tmp_path / "mine" / "config.json", "a") as f:
        f.write("\n")  # an edit by hand
    with pytest.raises(EyasError, match=r"such as .*config\.json"):
        do(tmp_path / "mine", overwrite=True)
    do(tmp_path / "mine2")
    (tmp_path / "mine2" / "sub").mkdir()  # an empty folder holds nothing to lose
    do(tmp_path / "mine2", overwrite=True)
    assert not (tmp_path / "mine2" / "sub").exists()


def test_export_refuses_bad_checkpoint_and_keeps_existing(tiny_target, tmp_path):
    make_checkpoint(tiny_target, tmp_path / "ckpt")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(EyasError, match="already exists"):
        export(tmp_path / "ckpt", "eagle3", tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    with pytest.raises(EyasError, match="refuses to replace"):  # not an export: --overwrite never deletes it
        export(tmp_path / "ckpt", "eagle3", tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    (tmp_path / "out" / "keep.txt").unlink()
    export(tmp_path / "ckpt", "eagle3", tmp_path / "out", overwrite=True)  # an empty folder is taken
    export(tmp_path / "ckpt", "speculators", tmp_path / "out", overwrite=True)  # its own export is replaced
    assert json.loads((tmp_path / "out" / "config.json").read_text())["speculators_model_type"] == "eagle3"
    w = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    del w["norm.weight"]
    save_file(w, str(tmp_path / "ckpt" / "model.safetensors"))
    with pytest.raises(EyasError, match="'norm.weight' is missing"):
        export(tmp_path / "ckpt", "speculators", tmp_path / "out2")


def test_cli_export(tiny_target, tmp_path, capsys):
    from eyas.cli import main

    make_checkpoint(tiny_target, tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), "--format", "speculators", "--out", str(tmp_path / "o"),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["format"] == "speculators"
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "o2")]) == 2


# -- the real speculators loader ---------------------------------------------------------------------------------
_SPECULATORS_CHECK = textwrap.dedent("""
    import json, sys, torch
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from eyas.draft.checkpoint import read_draft
    export_dir, ckpt = sys.argv[1], sys.argv[2]
    cfg = Eagle3SpeculatorConfig.from_pretrained(export_dir)
    cfg.transformer_layer_config._attn_implementation = "eager"  # its flex-attention default needs a GPU-sized T
    theirs = Eagle3DraftModel.from_pretrained(export_dir, config=cfg).eval()
    ours = read_draft(ckpt)
    g = torch.Generator().manual_seed(1)
    T = 12
    ids, aux, pos = (torch.randint(0, ours.cfg.vocab_size, (1, T), generator=g), torch.randn(1, T, 192, generator=g),
                     torch.arange(T)[None])
    logits = []
    theirs.lm_head.register_forward_hook(lambda m, i, o: logits.append(o.detach()))
    with torch.no_grad():
        theirs(hidden_states=aux, input_ids=ids, document_ids=torch.zeros(1, T, dtype=torch.long),
               position_ids=pos.clone(), ttt_steps=2)
        h, cache = ours(ids, aux, pos)
        # TTT step 2 at the last position = one cached inference step: speculators feeds its right-pad token 0,
        # the previous pre-norm output, at position + 1
        h2, _ = ours(torch.zeros(1, 1, dtype=torch.long), h[:, -1:], pos[:, -1:] + 1, cache)
    print(json.dumps({"step0": (logits[0] - ours.logits(h)).abs().max().item(),
                      "step1": (logits[1][:, -1:] - ours.logits(h2)).abs().max().item(),
                      "scale": ours.logits(h).abs().max().item(),
                      "d2t": torch.equal(theirs.d2t, ours.d2t), "t2d": torch.equal(theirs.t2d, ours.t2d),
                      "layer_ids": theirs.config.eagle_aux_hidden_state_layer_ids}))
""")


def speculators_python() -> str:
    """A Python that imports speculators: this one, $EYAS_SPECULATORS_PYTHON, or a venv made once in the cache
    (system packages visible; speculators pins transformers <= 5.19, so it must not touch the main environment)."""
    if subprocess.run([sys.executable, "-c", "import speculators"], capture_output=True, check=False).returncode == 0:
        return sys.executable
    if os.environ.get("EYAS_SPECULATORS_PYTHON"):
        return os.environ["EYAS_SPECULATORS_PYTHON"]
    from eyas.core.paths import cache_dir

    venv = cache_dir() / "speculators-venv"
    py = venv / "bin" / "python"
    if not py.exists() or subprocess.run([str(py), "-c", "import speculators"], capture_output=True,
                                         check=False).returncode:
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-c", str(REPO / "constraints.txt"), "speculators"],
                       check=True)
        # its torchvision/torchaudio are CUDA builds that break `import transformers` on this CPU torch
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio"], check=True)
    return str(py)


@pytest.mark.integration
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_speculators_loads_our_export(tiny_target, tmp_path, variant):
    """speculators' own Eagle3DraftModel, loaded from our export, computes what eyas's draft computes: TTT step 1 and
    step 2 (which reads the previous step's output: post-norm with norm_output), for each variant's switches."""
    make_checkpoint(tiny_target, tmp_path / "ckpt", **VARIANTS[variant])
    tiny_target.model.save_pretrained(tmp_path / "verifier")  # a local verifier: speculators validates the ids
    export(tmp_path / "ckpt", "speculators", tmp_path / "sp", verifier=str(tmp_path / "verifier"))
    (tmp_path / "check.py").write_text(_SPECULATORS_CHECK)
    py = speculators_python()
    r = subprocess.run([py, str(tmp_path / "check.py"), str(tmp_path / "sp"), str(tmp_path / "ckpt")],
                       capture_output=True, text=True, timeout=600, check=False,
                       env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["d2t"] and res["t2d"] and res["layer_ids"] == [2, 4, 5]
    assert res["step0"] <= 1e-5 * max(1.0, res["scale"]) and res["step1"] <= 1e-5 * max(1.0, res["scale"]), res


def test_docs_cite_every_engine_key():
    """docs/export.md's provenance tables cover the whole engine list, with the commits of its sources."""
    doc = (REPO / "docs" / "export.md").read_text()
    spec = engine_spec()
    for fmt in spec["formats"].values():
        for key in [*fmt["weights"], *fmt["config"]]:
            assert f"`{key}`" in doc, key
    for src in spec["sources"].values():
        for commit in [src.get("commit"), *src.get("commits", {}).values()]:
            assert commit is None or commit in doc, commit


@pytest.mark.parametrize("edit", [{"sliding_window": None}, {"sliding_window": 4096, "use_sliding_window": False}])
def test_a_disabled_sliding_window_imports(tiny_target, tmp_path, edit):
    """Full attention stated either way (no window, or a window switched off) is eyas's own attention."""
    good = _broken(tmp_path, tiny_target, edit_cfg=lambda c: c.update(edit))
    assert import_(good, tmp_path / "out")["format"] == "eagle3"


def test_model_card_carries_the_runs_data_and_evaluation(tiny_target, tmp_path):
    """A run's exported card shows the data the draft was trained on and the figures evaluate measured for it
    (it said 'Data: not recorded' and 'tau: not measured' although the run had both)."""
    from eyas.train.settings import TrainConfig
    from eyas.train.trainer import run as train
    from tests.train_fakes import write_store

    run_dir = tmp_path / "run"
    store = write_store(tiny_target, run_dir / "store", n=12)
    train(TrainConfig(quiet=True, store=str(store), out=str(run_dir / "train"), target="tiny", threads=1,
                      draft_vocab=512, ttt_steps=2, max_steps=2))
    final = run_dir / "train" / "final"
    bench = tmp_path / "b.jsonl"
    bench.write_text('{"prompt": "What is 2+2?", "category": "math"}\n')
    from eyas.cli import main

    assert main(["evaluate", "--target", "tiny", "--draft", str(final), "--bench", str(bench), "--out",
                 str(run_dir / "evaluate"), "--chain", "2", "--no-tree", "--max-new-tokens", "6", "--baselines",
                 "--no-hf-generate", "--latency-prefix", "8", "--threads", "1", "--dtype", "bfloat16",
                 "--quiet"]) == 0
    results = json.loads((run_dir / "evaluate" / "results.json").read_text())
    tau = results["configs"][0]["tau"]
    export(final, "eagle3", tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "not recorded" not in card.split("## Data")[1].split("##")[0]
    assert "| train_samples | 12 |" in card
    assert f"Acceptance length tau: {tau}" in card and "| draft_precision | bfloat16 as trained |" in card
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**results, "draft": {**results["draft"], "path": str(tmp_path / "elsewhere")}}))
    with pytest.raises(EyasError, match="measured the draft"):  # figures of another draft never go on this card
        export(final, "eagle3", tmp_path / "out2", evaluation=str(other))


@pytest.mark.parametrize("damage", ["bit-flip", "truncated", "not-safetensors", "config-edited"])
def test_export_and_import_refuse_a_damaged_draft_by_its_checksums(tiny_target, tmp_path, damage):
    """Issue 45: a draft whose bytes changed after eyas wrote it is refused by export (an eyas checkpoint) and by
    import (an eyas export), naming the file, as evaluate refuses it; never converted into other weights."""
    make_checkpoint(tiny_target, tmp_path / "ckpt")
    export(tmp_path / "ckpt", "eagle3", tmp_path / "exported")
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["eyas"]  # not a checksummed config

    def damaged(folder):
        weights, config = folder / "model.safetensors", folder / "config.json"
        if damage == "bit-flip":  # one bit in the last tensor's bytes: the file still parses
            data = bytearray(weights.read_bytes())
            data[-3] ^= 0x10
            weights.write_bytes(bytes(data))
            return "is damaged: its tensors differ from the checksum", weights
        if damage == "truncated":
            weights.write_bytes(weights.read_bytes()[:-1000])
            return "is unreadable", weights
        if damage == "not-safetensors":
            weights.write_text("<html>404 not found</html>")
            return "is unreadable", weights
        cfg = json.loads(config.read_text())
        cfg["eyas_draft"]["rms_norm_eps"] = 1e-3  # a value changed by hand
        config.write_text(json.dumps(cfg))
        return "is damaged: its content differs from the checksum", config

    said, name = damaged(tmp_path / "ckpt")
    with pytest.raises(EyasError, match=said) as e:
        export(tmp_path / "ckpt", "eagle3", tmp_path / "out")
    assert str(name) in str(e.value) and not (tmp_path / "out").exists()
    if damage != "config-edited":  # an export's config.json is the engines' (no checksum); its weights have one
        said, name = damaged(tmp_path / "exported")
        with pytest.raises(EyasError, match=said) as e:
            import_(tmp_path / "exported", tmp_path / "imported")
        assert str(name) in str(e.value) and not (tmp_path / "imported").exists()
