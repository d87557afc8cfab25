"""eyas export: drafts in the folders vLLM, SGLang and speculators load unchanged (`eyas import` reads them back:
eyas.draft.importer).

Formats (every key, shape and config field, with the engine file that requires it: docs/export.md and
`engine_keys.json` next to this file):
- `eagle3`: the Hugging Face EAGLE-3 layout (`architectures: ["LlamaForCausalLMEagle3"]`, weights `fc`,
  `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`, `embed_tokens`). SGLang: `--speculative-algorithm EAGLE3
  --speculative-draft-model-path DIR`; vLLM: `--speculative-config '{"method": "eagle3", "model": DIR}'`.
- `speculators`: vllm-project/speculators' Eagle3 layout (`speculators_model_type: eagle3`, `layers.0.*` instead of
  `midlayer.*`); `vllm serve DIR` reads the verifier and the speculative settings from it.

Layer ids: eyas's `feature_layers` are HF `hidden_states` indices, which is what vLLM and speculators call
`eagle_aux_hidden_state_layer_ids`; SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` are one less.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from eyas.core.config import StageConfig, check, opt
from eyas.core.errors import EyasError
from eyas.core.files import check_replaceable, read_json, staged, write_json
from eyas.core.lock import hold
from eyas.core.log import console, fmt_bytes
from eyas.core.options import Dtype, dtype_opt, overwrite_opt
from eyas.core.paths import inside
from eyas.core.precision import FULL
from eyas.core.target import BUILTINS, TINY, hub_id, resolve_source
from eyas.draft.checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_tensors, read_checked_json, tensors_digest
from eyas.draft.model import DraftConfig, Eagle3Draft

FORMATS = ("eagle3", "speculators")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # by their full names
KEYS_FILE = Path(__file__).with_name("engine_keys.json")
DRAFT_FIX = "point at a draft folder holding config.json and model.safetensors, or re-export it"
_DTYPE_CHECK = {"float": torch.is_floating_point, "int64": lambda t: t.dtype == torch.int64,
                "bool": lambda t: t.dtype == torch.bool}
# Keys of foreign checkpoints that carry nothing the draft computes with (speculators' training-only copies).
IGNORED_KEYS = ("verifier_lm_head.weight", "verifier_norm.weight")
# EAGLE-3's variant switches, each one a DraftConfig field of the same name (EAGLE-3.1 and speculators' defaults)
VARIANT_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


# -- the engine list --------------------------------------------------------------------------------------------
@functools.cache
def engine_spec() -> dict:
    """engine_keys.json: per format, the weights (shape, dtype, presence) and config fields the engines need."""
    return read_json(KEYS_FILE, "reinstall eyas: its engine_keys.json is part of the package")


def dims(dc: DraftConfig) -> dict[str, int]:
    """The shape symbols of engine_keys.json for one draft."""
    return {"H": dc.hidden_size, "Ht": dc.target_hidden_size, "V": dc.vocab_size, "Vd": dc.draft_vocab_size,
            "I": dc.intermediate_size, "Nq": dc.num_attention_heads, "Nkv": dc.num_key_value_heads,
            "D": dc.head_dim, "fc_norm": int(dc.fc_norm), "norm_before_fc": int(dc.norm_before_fc)}


def shape_of(expr: list[str], d: dict[str, int]) -> tuple[int, ...]:
    """["Nq*D", "2*H"] -> (Nq*D, 2*H) for the dims d."""
    return tuple(math.prod(int(f) if f.isdigit() else d[f] for f in s.split("*")) for s in expr)


def present(rule: str, d: dict[str, int]) -> bool | None:
    """True: must be there, False: must not be, None: may be."""
    rules = {"required": True, "optional": None, "iff Vd != V": d["Vd"] != d["V"], "iff fc_norm": bool(d["fc_norm"]),
             "iff norm_before_fc": bool(d["norm_before_fc"])}
    return rules[rule]


def check_weights(fmt: str, tensors: dict[str, torch.Tensor], d: dict[str, int], where: str,
                  relaxed: tuple[str, ...] = ()) -> None:
    """Refuse, naming the key, any missing, unexpected, mis-shaped or mis-typed tensor. `relaxed`: keys that may
    be missing even when the engines need them (import fills them in)."""
    spec = engine_spec()["formats"][fmt]["weights"]
    for key in tensors:
        if key not in spec:
            raise EyasError(f"{where}: unexpected weight {key!r}", f"the {fmt} layout has no such key",
                            f"expected only: {', '.join(spec)}")
    for key, s in spec.items():
        need = present(s["presence"], d)
        if key not in tensors:
            if need and key not in relaxed:
                raise EyasError(f"{where}: missing weight {key!r}", f"the {fmt} layout requires it "
                                f"(shape {list(shape_of(s['shape'], d))})", "export the draft again, or complete it")
            continue
        if need is False and key not in relaxed:
            why = (f"the config has no {s['presence'].removeprefix('iff ')}" if s["presence"] in
                   ("iff fc_norm", "iff norm_before_fc") else
                   "the draft vocabulary is the whole vocabulary (vLLM then has no parameter for it)")
            raise EyasError(f"{where}: weight {key!r} must be absent", why, f"drop {key!r}")
        t, want = tensors[key], shape_of(s["shape"], d)
        if tuple(t.shape) != want:
            raise EyasError(f"{where}: weight {key!r} has shape {list(t.shape)}, expected {list(want)}",
                            f"shape {s['shape']} with {d}", "check that config.json belongs to these weights")
        if not _DTYPE_CHECK[s["dtype"]](t):
            raise EyasError(f"{where}: weight {key!r} has dtype {t.dtype}, expected {s['dtype']}",
                            fix="re-export the draft")


def _get(cfg: dict, dotted: str):
    for part in dotted.split("."):
        cfg = cfg.get(part) if isinstance(cfg, dict) else None
    return cfg


def check_config(fmt: str, cfg: dict, dc: DraftConfig, where: str) -> None:
    """Every config field the engines read has the value the draft needs (engine_keys.json, 'config')."""
    d, hf = dims(dc), list(dc.feature_layers)
    for key, s in engine_spec()["formats"][fmt]["config"].items():
        got = _get(cfg, key)
        if "value" in s:
            want = s["value"]
        elif "dim" in s:
            want = d[s["dim"]]
        elif "flag" in s:  # a variant switch of the draft's own config
            want = bool(getattr(dc, s["flag"]))
        elif "layers" in s:
            want = hf if s["layers"] == "hf" else [i - 1 for i in hf]
        else:  # free-form fields (lists, the verifier's path, which may be null) only need to exist
            parent = _get(cfg, key.rsplit(".", 1)[0]) if "." in key else cfg
            check(isinstance(parent, dict) and key.rsplit(".", 1)[-1] in parent,
                  f"{where}: config field {key!r} is missing", "export the draft again")
            continue
        if got != want:
            raise EyasError(f"{where}: config field {key!r} is {got!r}, expected {want!r}", fix="export again")


# -- eyas -> engine ---------------------------------------------------------------------------------------------
def to_engine(state: dict[str, torch.Tensor], dc: DraftConfig, fmt: str, dtype: torch.dtype,
              embed: bool) -> dict[str, torch.Tensor]:
    """eyas state dict -> the format's tensors: renamed, d2t/t2d dropped for a full vocabulary, floats cast."""
    out = {}
    for key, t in state.items():
        if key in ("d2t", "t2d") and dc.draft_vocab_size == dc.vocab_size:
            continue  # vLLM 0.32 has no draft_id_to_target_id parameter then (llama_eagle3.py:338-345)
        if key == "embed_tokens.weight" and not embed:
            continue
        if fmt == "speculators" and key.startswith("midlayer."):
            key = "layers.0." + key.removeprefix("midlayer.")
        out[key] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    return out


def _rope(dc: DraftConfig) -> dict:
    # Both spellings: transformers 5 reads rope_parameters, SGLang and transformers 4 read rope_theta.
    return {"rope_theta": dc.rope_theta, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": dc.rope_theta}}


def _llama_fields(dc: DraftConfig, dtype: str) -> dict:
    return {"model_type": "llama", "hidden_size": dc.hidden_size, "intermediate_size": dc.intermediate_size,
            "num_attention_heads": dc.num_attention_heads, "num_key_value_heads": dc.num_key_value_heads,
            "head_dim": dc.head_dim, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": dc.rms_norm_eps,
            "max_position_embeddings": dc.max_position_embeddings, "vocab_size": dc.vocab_size,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": dtype,
            "dtype": dtype, **_rope(dc)}


def eagle3_config(dc: DraftConfig, dtype: str, provenance: dict) -> dict:
    hf = list(dc.feature_layers)
    return {"architectures": ["LlamaForCausalLMEagle3"], **_llama_fields(dc, dtype),
            "draft_vocab_size": dc.draft_vocab_size, "target_hidden_size": dc.target_hidden_size,
            **{flag: getattr(dc, flag) for flag in VARIANT_FLAGS},
            "eagle_aux_hidden_state_layer_ids": hf,  # vLLM: HF hidden_states indices
            "eagle_config": {"use_aux_hidden_state": True,  # SGLang: decoder-layer index = HF index - 1
                             "eagle_aux_hidden_state_layer_ids": [i - 1 for i in hf]},
            "eyas": provenance}


def speculators_config(dc: DraftConfig, dtype: str, verifier: tuple[str | None, list[str]], tokens: int,
                       provenance: dict) -> dict:
    greedy = {"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1, "accept_tolerance": 0.0}
    return {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
            "speculators_config": {"algorithm": "eagle3", "proposal_methods": [greedy],
                                   "default_proposal_method": "greedy",
                                   "verifier": {"name_or_path": verifier[0], "architectures": verifier[1]}},
            "transformer_layer_config": _llama_fields(dc, dtype),
            "draft_vocab_size": dc.draft_vocab_size, "target_hidden_size": dc.target_hidden_size,
            # explicit: vLLM's speculators translation defaults norm_before_residual to TRUE when absent
            **{flag: getattr(dc, flag) for flag in VARIANT_FLAGS},
            "embed_requires_grad": False, "eagle_aux_hidden_state_layer_ids": list(dc.feature_layers),
            "tie_word_embeddings": False, "dtype": dtype, "eyas": provenance}


# -- reading and writing folders ---------------------------------------------------------------------------------
def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or the shards a model.safetensors.index.json lists, each checked against the checksum it
    records (eyas's own files; a file without one is read as it is). Pickles are refused; a file cut short or not
    safetensors at all is an EyasError naming it."""

    index = folder / "model.safetensors.index.json"
    files = (sorted(set(read_json(index, DRAFT_FIX)["weight_map"].values()), key=str) if index.is_file()
             else [WEIGHTS_FILE])
    for name in files:
        inside(folder, name, index)
    if not (folder / files[0]).is_file():
        bins = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        raise EyasError(f"{folder}: no {files[0]}", "eyas reads safetensors only and never unpickles "
                        f"({', '.join(bins) or 'no weight file'} found)",
                        "convert the weights to model.safetensors (safetensors.torch.save_file)")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_tensors(folder / name, DRAFT_FIX))
    return out


def read_checkpoint(folder: Path) -> tuple[dict, DraftConfig, dict[str, torch.Tensor]]:
    """(config.json, DraftConfig, weights) of an eyas checkpoint, checked against Eagle3Draft's own state dict."""
    meta = read_checked_json(folder / CONFIG_FILE, DRAFT_FIX)
    if "eyas_draft" not in meta:
        raise EyasError(f"{folder / CONFIG_FILE} has no 'eyas_draft' section", "it is not an eyas draft checkpoint",
                        "export a training output's final/ folder, or `eyas import` a foreign draft first")
    dc = DraftConfig.from_dict(meta["eyas_draft"])
    state = read_safetensors(folder)
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in Eagle3Draft(dc).state_dict().items()}
    for key in sorted(set(want) | set(state)):
        if key not in state or key not in want or tuple(state[key].shape) != want[key]:
            got = list(state[key].shape) if key in state else "missing"
            raise EyasError(f"{folder / WEIGHTS_FILE}: weight {key!r} is {got}, expected "
                            f"{list(want[key]) if key in want else 'no such key'}",
                            "the weights do not match the checkpoint's config.json", "use the checkpoint as trained")
    return meta, dc, state


# -- eyas export -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportConfig(StageConfig):
    checkpoint: str = opt(None, "eyas draft checkpoint folder (config.json + model.safetensors)", positional=True)
    format: Literal["eagle3", "speculators"] = opt("eagle3", "eagle3 (SGLang, vLLM method eagle3) or speculators "
                                                   "(vllm serve DIR, speculators)")
    out: str = opt("", "output folder (default: CHECKPOINT-FORMAT beside the checkpoint)")
    dtype: Dtype = dtype_opt("the floating-point weights", auto="fp32, the checkpoint's own: lossless")
    verifier: str = opt("", "speculators only: the target the draft serves with (HF id, folder or eyas built-in); "
                        "default: the checkpoint's built-in target")
    speculative_tokens: int = opt(3, "speculators only: draft tokens per step that `vllm serve DIR` uses")
    embed: bool = opt(True, "include embed_tokens (self-contained); --no-embed lets engines take the target's")
    overwrite: bool = overwrite_opt("eyas export")
    evaluation: str = opt("", "eyas evaluate's results.json of this draft, for the model card's figures; empty: the "
                               "one in the checkpoint's run folder that measured it, if any")

    def validate(self):
        check(bool(self.checkpoint), "no checkpoint given", "run `eyas export CHECKPOINT --format eagle3|speculators`")
        check(self.speculative_tokens >= 1, f"--speculative-tokens {self.speculative_tokens} is below 1",
              "use 1 or more (3 is usual)")

    def out_dir(self) -> Path:
        ckpt = Path(self.checkpoint)
        return Path(self.out) if self.out else ckpt.with_name(f"{ckpt.name}-{self.format}")


def resolve_verifier(spec: str, identity: dict) -> tuple[str | None, list[str]]:
    """(name_or_path, architectures) of the verifier: a local folder's path, or the string as given (a hub id)."""

    arch = [identity["architecture"]] if identity.get("architecture") else []
    name = identity.get("name", "")
    if not spec:
        spec = name if (name in BUILTINS and name not in TINY) or hub_id(name) else ""
    if not spec:
        return None, arch  # vLLM then needs --model; speculators skips the verifier
    if hub_id(spec):
        return spec, arch  # a Hub id: written verbatim, as the engines take it
    try:
        _, folder = resolve_source(spec)
    except EyasError:
        return spec, arch  # not resolvable here: written verbatim for the engine to resolve
    return str(folder.resolve()), read_json(folder / "config.json", DRAFT_FIX).get("architectures") or arch


def run(cfg: ExportConfig) -> dict:
    """The stage, holding its output's lock (eyas.core.lock) throughout."""
    with hold(cfg.out_dir(), "export"):
        return _run(cfg)


def _run(cfg: ExportConfig) -> dict:
    con = console(0, cfg.quiet, cfg.json)
    src, out = Path(cfg.checkpoint), cfg.out_dir()
    meta, dc, state = read_checkpoint(src)
    check(dc.num_layers == 1, f"{src}: the draft has {dc.num_layers} layers",
          "export supports the one-layer EAGLE-3 draft every engine's LlamaForCausalLMEagle3 loads; train with 1 layer")
    check_replaceable(out, "export", cfg.overwrite)
    dtype = "float32" if cfg.dtype == "auto" else FULL[cfg.dtype]  # auto: the checkpoint's own (fp32), lossless
    tensors = to_engine(state, dc, cfg.format, DTYPES[dtype], cfg.embed)
    check_weights(cfg.format, tensors, dims(dc), str(out))
    found = evaluation_of(src, cfg.evaluation)
    if found is not None:
        meta = {**meta, "evaluation": found}
    prov = provenance(meta, src)
    if cfg.format == "eagle3":
        config = eagle3_config(dc, dtype, prov)
        verifier = (None, [])
    else:
        verifier = resolve_verifier(cfg.verifier, dc.target_identity)
        config = speculators_config(dc, dtype, verifier, cfg.speculative_tokens, prov)
    check_config(cfg.format, config, dc, str(out))

    with staged(out, "export", cfg.overwrite) as tmp:
        # the checksum eyas import checks (the engines read only "format")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "producer": "eyas",
                                                              "checksum": tensors_digest(tensors)})
        write_json(tmp / CONFIG_FILE, config)
        (tmp / "README.md").write_text(model_card(cfg.format, dc, meta, verifier[0]), encoding="utf-8")
    size = (out / WEIGHTS_FILE).stat().st_size
    summary = {"format": cfg.format, "out": str(out), "tensors": len(tensors), "bytes": size, "dtype": dtype,
               "draft_vocab_size": dc.draft_vocab_size, "vllm_layer_ids": list(dc.feature_layers),
               "sglang_layer_ids": [i - 1 for i in dc.feature_layers], "verifier": verifier[0], "fc_norm": dc.fc_norm,
               "variants": variants(dc)}
    con.summary(f"export: {cfg.format} draft -> {out} ({len(tensors)} tensors, {fmt_bytes(size)}, {dtype}; "
                f"layer ids vLLM {summary['vllm_layer_ids']} / SGLang {summary['sglang_layer_ids']})")
    return summary


# -- the model card ----------------------------------------------------------------------------------------------
def provenance(meta: dict, src: Path) -> dict:
    """What an export keeps of its checkpoint (config.json key `eyas`): the draft, data, training and evaluation."""
    return {"draft": meta["eyas_draft"], "source_checkpoint": str(src),
            **{k: meta[k] for k in ("data", "training", "evaluation") if meta.get(k) is not None}}


def evaluation_of(src: Path, given: str) -> dict | None:
    """The headline figures of an `eyas evaluate` of the draft `src`: from `given` (refused if it measured another
    draft), else from the results.json files in src's run folder (RUN/*/results.json for RUN/train/final) that
    measured it; None when there is none."""
    mine = src.resolve()
    if given:
        files = [Path(given)]
    else:
        run = src.resolve().parent.parent
        files = sorted(run.glob("*/results.json")) if run != run.parent else []
    for f in files:
        res = read_json(f, "give the results.json that `eyas evaluate --out DIR` wrote")
        path = (res.get("draft") or {}).get("path")
        if not isinstance(path, str) or Path(path).resolve() != mine:
            if given:
                raise EyasError(f"{f} measured the draft {path!r}, not {src}", "its figures belong to another draft",
                                "give the results.json of an `eyas evaluate --draft` of this checkpoint")
            continue
        drafted = [c for c in res.get("configs") or [] if c.get("drafter") == "eagle3"]
        best = max(drafted, key=lambda c: c.get("speedup") or 0.0, default=None)
        if best is None:
            continue
        b = res.get("bench") or {}
        return {"results": str(f), "bench": b.get("name"), "prompts": b.get("prompts"), "turns": b.get("turns"),
                "config": best.get("name"), "tau": best.get("tau"), "speedup": best.get("speedup"),
                "lossless": (best.get("lossless") or {}).get("lossless", (best.get("lossless") or {}).get("identical")),
                "draft_precision": (res.get("draft") or {}).get("precision", "not recorded"),
                "temperature": (res.get("settings") or {}).get("temperature")}
    return None


def _scalars(d, prefix: str = "") -> list[tuple[str, object]]:
    """Flatten numbers and strings of a (nested) dict into (dotted key, value) rows."""
    rows = []
    for k, v in (d or {}).items() if isinstance(d, dict) else []:
        if isinstance(v, dict):
            rows += _scalars(v, f"{prefix}{k}.")
        elif isinstance(v, (int, float, str, bool)):
            rows.append((f"{prefix}{k}", v))
    return rows


def _tau(evaluation) -> object | None:
    for key, v in _scalars(evaluation):
        if key.rsplit(".", 1)[-1] in ("tau", "acceptance_length", "mean_acceptance_length"):
            return v
    return None


def _table(rows: list[tuple[str, object]], empty: str) -> str:
    if not rows:
        return empty
    return "| figure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows[:30])


def variants(dc: DraftConfig) -> list[str]:
    """The variant switches the draft has on (EAGLE-3.1's and speculators' norms)."""
    return [flag for flag in VARIANT_FLAGS if getattr(dc, flag)]


def model_card(fmt: str, dc: DraftConfig, meta: dict, verifier: str | None) -> str:
    t, hf = dc.target_identity, list(dc.feature_layers)
    on = ", ".join(f"`{f}`" for f in variants(dc))
    tau = _tau(meta.get("evaluation"))
    data = meta.get("data") or (meta.get("training") or {}).get("data")
    run = ("vLLM: `python -m vllm.entrypoints.openai.api_server --model TARGET --speculative-config "
           "'{\"method\": \"eagle3\", \"model\": \"THIS_FOLDER\", \"num_speculative_tokens\": 3}'`\n\n"
           + (f"SGLang: not checked for drafts with {on} (EAGLE-3.1's and speculators' variants); serve this one "
              "with vLLM" if on else "SGLang: `python -m sglang.launch_server --model-path TARGET "
              "--speculative-algorithm EAGLE3 --speculative-draft-model-path THIS_FOLDER`")) if fmt == "eagle3" else (
           f"vLLM: `vllm serve THIS_FOLDER` or `python -m vllm.entrypoints.openai.api_server --model THIS_FOLDER` "
           f"(serves the verifier `{verifier}`; edit `speculators_config.verifier.name_or_path` to move it)\n\n"
           + "speculators: `Eagle3DraftModel.from_pretrained(\"THIS_FOLDER\")`")
    return f"""# EAGLE-3 draft for {t.get('name', 'an unrecorded target')}

Written by `eyas export --format {fmt}`. Every key, shape and config field follows the engines' loaders
(eyas docs/export.md).

## Run it
{run}

## Target
| field | value |
|---|---|
{chr(10).join(f"| {k} | {v} |" for k, v in sorted(t.items())) or "| (not recorded) | |"}

## Draft
| field | value |
|---|---|
| layers | {dc.num_layers} (hidden {dc.hidden_size}, {dc.num_attention_heads} heads, {dc.num_key_value_heads} \
KV heads, head dim {dc.head_dim}, MLP {dc.intermediate_size}) |
| vocabulary | {dc.draft_vocab_size:,} draft tokens of {dc.vocab_size:,} (target id = draft id + d2t[draft id]) |
| target features | HF hidden_states {hf} = vLLM/speculators `eagle_aux_hidden_state_layer_ids` {hf} = \
SGLang `eagle_config` ids {[i - 1 for i in hf]} |

## Data
{_table(_scalars(data) if isinstance(data, dict) else ([("data", data)] if data else []), "not recorded")}

## Training
{_table(_scalars(meta.get("training")), "not measured")}

## Evaluation
Acceptance length tau: {tau if tau is not None else "not measured"}

{_table(_scalars(meta.get("evaluation")), "")}
"""
