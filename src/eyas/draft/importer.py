"""eyas import: a draft in the eagle3 or speculators layout (eyas, SpecForge, speculators, EAGLE) into an eyas
checkpoint that `eyas evaluate` runs. The formats and where each key comes from: eyas.draft.export and docs/export.md.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from eyas.core.config import StageConfig, check, opt
from eyas.core.errors import EyasError
from eyas.core.files import check_replaceable, staged
from eyas.core.lock import hold
from eyas.core.log import console
from eyas.core.options import overwrite_opt, target_opt, trust_remote_code_opt, trusted_code_line
from eyas.core.target import default_feature_layers
from eyas.core.weights import load_target_shell, read_module
from eyas.draft.checkpoint import CONFIG_FILE, read_checked_json, save_draft
from eyas.draft.export import (
    DRAFT_FIX,
    IGNORED_KEYS,
    VARIANT_FLAGS,
    check_weights,
    dims,
    read_safetensors,
)
from eyas.draft.model import DraftConfig, Eagle3Draft


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImportConfig(StageConfig):
    source: str = opt(None, "an eagle3 or speculators draft folder (eyas, SpecForge, speculators, EAGLE)",
                      positional=True)
    out: str = opt("", "eyas checkpoint folder to write (default: SOURCE-eyas)")
    target: str = target_opt(role="the draft runs on it: its identity, its layer count and its embed_tokens when "
                                  "the draft has none")
    trust_remote_code: bool = trust_remote_code_opt()
    layers: tuple[int, ...] = opt((), "HF hidden_states indices of the draft's features, when its config has none")
    overwrite: bool = overwrite_opt("eyas import")

    def validate(self):
        check(bool(self.source), "no draft folder given", "run `eyas import DIR`")

    def out_dir(self) -> Path:
        src = Path(self.source)
        return Path(self.out) if self.out else src.with_name(f"{src.name}-eyas")


def detect_format(raw: dict, where: Path) -> str:
    if "eyas_draft" in raw:
        raise EyasError(f"{where} is already an eyas checkpoint", fix="use it directly with eyas evaluate")
    if "speculators_model_type" in raw:
        kind = raw["speculators_model_type"]
        check(kind == "eagle3", f"{where}: speculators_model_type {kind!r} is not supported",
              "eyas imports EAGLE-3 drafts only (speculators_model_type 'eagle3')")
        check(isinstance(raw.get("transformer_layer_config"), dict),
              f"{where}: config field 'transformer_layer_config' is missing", "a speculators Eagle3 config needs it")
        return "speculators"
    archs = raw.get("architectures") or []
    if any("eagle3" in str(a).lower() for a in archs):
        return "eagle3"
    raise EyasError(f"{where}: unknown draft format (config field 'architectures' is {archs!r})",
                    "eyas reads EAGLE-3 drafts: architectures LlamaForCausalLMEagle3 (eagle3) or a "
                    "speculators_model_type (speculators)", "export the draft in one of these formats")


def normalise_keys(tensors: dict[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
    """Foreign names -> eyas names: `model.` prefixes dropped, `layers.0.` -> `midlayer.`, training-only keys
    dropped."""
    out = {}
    for key, t in tensors.items():
        if key in IGNORED_KEYS or key.endswith("rotary_emb.inv_freq"):
            continue
        key = key.removeprefix("model.")
        if key.startswith("layers.0."):
            key = "midlayer." + key.removeprefix("layers.0.")
        elif key.startswith(("layers.", "additional_layers.")):
            raise EyasError(f"{where}: weight {key!r} belongs to a second draft layer",
                            "eyas imports one-layer EAGLE-3 drafts", "import a one-layer draft")
        check(key not in out, f"{where}: weight {key!r} appears twice (with and without a prefix)", "keep one copy")
        out[key] = t
    return out


def resolve_layers(raw: dict, num_layers: int, given: tuple[int, ...], where: Path) -> tuple[list[int], str]:
    """The draft's features as HF hidden_states indices, and where they came from (docs/export.md, fact 6)."""

    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        ids, how = list(raw["eagle_aux_hidden_state_layer_ids"]), "eagle_aux_hidden_state_layer_ids (HF indices)"
    elif nested:
        ids, how = [i + 1 for i in nested], "eagle_config.eagle_aux_hidden_state_layer_ids (SGLang ids + 1)"
    elif given:
        ids, how = list(given), "--layers"
    else:
        ids, how = default_feature_layers(num_layers), f"the default [2, L//2, L-3] for L = {num_layers}"
    check(not given or sorted(given) == sorted(ids), f"--layers {list(given)} contradicts {where}: {how} = {ids}",
          "drop --layers; the draft's config records its layers")
    check(len(set(ids)) == 3 and min(ids) >= 0 and max(ids) < num_layers,
          f"{where}: feature layers {ids} ({how}) are not 3 distinct HF indices in [0, {num_layers - 1}]",
          "pass the right --target, or --layers for a config that records none")
    return sorted(ids), how


def foreign_config(raw: dict, layer: dict, target, given: tuple[int, ...], where: Path) -> tuple[DraftConfig, str]:
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        check(isinstance(layer.get(key), int), f"{where}: config field {key!r} is missing", "complete config.json")
    for key, ok in (("num_hidden_layers", 1), ("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        check(layer.get(key, ok) == ok, f"{where}: config field {key!r} is {layer.get(key)!r}",
              f"eyas's draft has {key} = {ok!r}; import a standard one-layer EAGLE-3 draft")
    # norm_output in an eagle3-layout config: vLLM's (the next step reads the post-norm state) when eyas wrote it;
    # SpecForge writes it true meaning only "norm before lm_head", so from elsewhere it is ambiguous
    check(not raw.get("norm_output") or "speculators_model_type" in raw or "eyas" in raw,
          f"{where}: norm_output = true in an eagle3-layout config not written by eyas is ambiguous: vLLM reads it as "
          "'the next draft step reads the post-norm state', SpecForge writes it meaning 'norm before lm_head'",
          "set norm_output to false if the draft was trained feeding the pre-norm state forward (SpecForge), keep it "
          "true only if it was trained feeding the post-norm state (then add \"eyas\": {} to config.json)")
    window = raw.get("sliding_window", layer.get("sliding_window"))
    windowed = window is not None and layer.get("use_sliding_window", raw.get("use_sliding_window")) is not False
    check(not windowed, f"{where}: sliding_window = {window!r}: the draft attends to a window of {window} tokens, "
          "eyas's draft to the whole context (its tau and outputs would differ from how it was trained)",
          "if it was in fact trained with full attention (a field copied from the verifier's config), set "
          "sliding_window to null in config.json; otherwise evaluate it in its own engine")
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    check(rope.get("rope_type", rope.get("type", "default")) == "default", f"{where}: rope scaling {rope!r}",
          "eyas's draft implements the default (unscaled) rotary embedding only")
    H, V, heads = layer["hidden_size"], layer["vocab_size"], layer["num_attention_heads"]
    Ht = raw.get("target_hidden_size") or layer.get("target_hidden_size") or H
    check(V == target.vocab_size and Ht == target.hidden_size, f"{where}: vocab_size {V} / target_hidden_size {Ht} "
          f"do not match the target {target.name} ({target.vocab_size} / {target.hidden_size})",
          "pass the --target the draft was trained for")
    layers, how = resolve_layers(raw, target.num_layers, given, where)
    dc = DraftConfig(hidden_size=H, intermediate_size=layer["intermediate_size"], num_attention_heads=heads,
                     num_key_value_heads=layer.get("num_key_value_heads") or heads,
                     head_dim=layer.get("head_dim") or H // heads, vocab_size=V,
                     draft_vocab_size=raw.get("draft_vocab_size") or layer.get("draft_vocab_size") or V,
                     target_hidden_size=Ht, feature_layers=tuple(layers), num_layers=1,
                     **{flag: bool(raw.get(flag, layer.get(flag, False))) for flag in VARIANT_FLAGS},
                     rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
                     rope_theta=float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))),
                     max_position_embeddings=int(layer.get("max_position_embeddings", 8192)),
                     target=tuple(sorted(target.identity().items())))
    return dc, how


def complete(t: dict[str, torch.Tensor], dc: DraftConfig, target, where: Path) -> str:
    """Fill what engines share from the target: embed_tokens, and d2t/t2d of a full vocabulary. -> embed source."""
    source = "draft"
    if "embed_tokens.weight" not in t:
        embed = read_module(target, target.embed_tokens()).weight  # by name from the checkpoint (eyas.core.weights)
        t["embed_tokens.weight"], source = embed.detach().float().cpu().clone(), "target"
    if "d2t" not in t:
        check(dc.draft_vocab_size == dc.vocab_size, f"{where}: missing weight 'd2t'",
              f"the draft vocabulary ({dc.draft_vocab_size}) is smaller than the target's ({dc.vocab_size}); "
              "without d2t its tokens cannot be mapped")
        t["d2t"] = torch.zeros(dc.draft_vocab_size, dtype=torch.long)
    ids = torch.arange(dc.draft_vocab_size) + t["d2t"].long()
    check(int(ids.min()) >= 0 and int(ids.max()) < dc.vocab_size and ids.unique().numel() == ids.numel(),
          f"{where}: weight 'd2t' maps draft ids outside [0, {dc.vocab_size}) or twice", "re-export the draft")
    t2d = torch.zeros(dc.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    check(torch.equal(t.setdefault("t2d", t2d).bool(), t2d), f"{where}: weight 't2d' disagrees with 'd2t'",
          "re-export the draft")
    return source


def run_import(cfg: ImportConfig) -> dict:
    """The stage, holding its output's lock (eyas.core.lock) throughout."""
    with hold(cfg.out_dir(), "import"):
        return _import(cfg)


def _import(cfg: ImportConfig) -> dict:
    con = console(0, cfg.quiet, cfg.json)
    src, out = Path(cfg.source), cfg.out_dir()
    raw = read_checked_json(src / CONFIG_FILE, DRAFT_FIX)
    fmt = detect_format(raw, src)
    layer = raw["transformer_layer_config"] if fmt == "speculators" else raw
    tensors = normalise_keys(read_safetensors(src), src)
    check_replaceable(out, "import", cfg.overwrite)
    if cfg.trust_remote_code:
        con.print(trusted_code_line(cfg.target))
    # its identity, shape and (if needed) embeddings: no decoder layer
    target = load_target_shell(cfg.target, trust_remote_code=cfg.trust_remote_code)
    dc, how = foreign_config(raw, layer, target, cfg.layers, src)
    check_weights("eagle3", tensors, dims(dc), str(src), relaxed=("embed_tokens.weight", "d2t", "t2d"))
    embed = complete(tensors, dc, target, src)
    prov = raw.get("eyas") or {}
    theirs = (prov.get("draft") or {}).get("target", {}).get("config_hash")
    check(theirs in (None, target.identity()["config_hash"]), f"{src}: exported for another target ({theirs})",
          f"pass the --target it was trained for (given: {cfg.target})")
    model = Eagle3Draft(dc)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=True)
    extra = {k: prov[k] for k in ("data", "training", "evaluation") if k in prov}
    with staged(out, "import", cfg.overwrite) as tmp:
        save_draft(model, tmp, extra={**extra, "imported_from": {"path": str(src), "format": fmt, "layers_from": how,
                                                                     "embed_tokens_from": embed}})
    summary = {"source": str(src), "format": fmt, "out": str(out), "feature_layers": list(dc.feature_layers),
               "layers_from": how, "embed_tokens_from": embed, "draft_vocab_size": dc.draft_vocab_size}
    con.summary(f"import: {fmt} draft {src} -> eyas checkpoint {out} (features {list(dc.feature_layers)} from {how}; "
                f"embed_tokens from the {embed})")
    return summary
