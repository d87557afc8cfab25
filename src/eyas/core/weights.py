"""A target without its weights: the module tree on the meta device, and single modules read by name.

Offline training needs of a target only its identity, its shape and two tables (input embeddings, output head);
importing a store needs the final norm. Loading the whole model for that is what breaks at scale (a 70B target in
fp32 on each of 8 ranks is 2.2 TB of host memory; a 1T one cannot load at all). So `load_target_shell` builds the
model from its config on the meta device (no memory, no file read beyond config.json) and `read_module` fills one
module from the checkpoint's safetensors files: only the files that hold its tensors are opened, only its tensors
are read, in the dtype they are stored in.

Tensor names are the model's own parameter names (`model.embed_tokens.weight`, `lm_head.weight`), looked up in
`model.safetensors.index.json` for sharded checkpoints. A tied output head has no tensor of its own: it is read
under the name of the parameter it shares (the embeddings).
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from eyas.core.errors import EyasError
from eyas.core.files import read_json
from eyas.core.paths import inside
from eyas.core.target import TINY, Target, fetch_file, hub_id, load_target, refusing_code, resolve_source

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def load_target_shell(spec: str, trust_remote_code: bool = False) -> Target:
    """The target's config and module tree on the meta device, with no weight read (`tokenizer` is None).
    `identity()`, the sizes and the module names are those of the loaded target; `read_module` reads weights.
    Code-built targets (`TINY`) have no files: they are loaded whole (they are small)."""
    if spec in TINY:
        return load_target(spec)
    # heavy (seconds to import): loaded only where a model is
    from transformers import AutoConfig, AutoModelForCausalLM

    name, folder = resolve_source(spec, weights=False)
    with torch.device("meta"), refusing_code(folder):  # never the folder's own code unless asked
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return Target(name=name, model=model.eval().requires_grad_(False), tokenizer=None, source=str(folder),
                  hub=hub_id(spec))


def read_module(target: Target, module: torch.nn.Module) -> torch.nn.Module:
    """`module` of `target` (a shell's, or a loaded target's) with its tensors read from the checkpoint, on the CPU
    in their stored dtype, in place: every module sharing a parameter (a tied head) gets the read one too. A module
    with nothing left on the meta device is returned as it is."""
    model = target.model
    first = {}  # id(parameter) -> its first name in the model: the one the checkpoint stores a shared tensor under
    for n, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), n)
    wanted = {first[id(p)]: id(p) for p in module.parameters() if p.is_meta}  # {checkpoint name: parameter}
    if not wanted:
        return module
    read = {}
    for file, keys in _files_of(target, set(wanted)).items():
        with safe_open(str(file), "pt") as f:
            stored = set(f.keys())
            read.update({wanted[k]: f.get_tensor(k) for k in keys if k in stored})
    missing = sorted(k for k, pid in wanted.items() if pid not in read)
    if missing:
        raise EyasError(f"{target.source}: the checkpoint has no tensor {missing[0]!r}"
                        + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""),
                        f"{type(model).__name__} names its parameters so, and eyas reads tensors by name",
                        "use a checkpoint saved by transformers (save_pretrained), or load the model and save it again")
    new = {pid: torch.nn.Parameter(t, requires_grad=False) for pid, t in read.items()}  # the stored dtype, no copy
    for n, p in list(model.named_parameters(remove_duplicate=False)):
        if id(p) in new:
            owner, _, attr = n.rpartition(".")
            setattr(model.get_submodule(owner), attr, new[id(p)])
    return module


def _files_of(target: Target, keys: set[str]) -> dict:
    """{safetensors file: the keys it holds} for `keys` (fetched from the Hub cache on demand)."""
    folder = target.source_folder
    index = folder / INDEX
    if index.is_file() or (target.hub and _try_fetch(target, INDEX)):
        weight_map = read_json(index, "download the model again").get("weight_map") or {}
        by_file: dict = {}
        for k in sorted(keys):
            if k in weight_map:
                by_file.setdefault(weight_map[k], set()).add(k)
        return {_local(target, inside(folder, name, index), name, ks): ks for name, ks in by_file.items()}
    single = folder / SINGLE
    if not single.is_file() and not (target.hub and _try_fetch(target, SINGLE)):
        raise EyasError(f"{folder} has neither {SINGLE} nor {INDEX}",
                        "eyas reads a target's tensors from safetensors files only (never pickled weights)",
                        "convert the weights to safetensors (load the model and save_pretrained it again)")
    return {single: keys}


def _try_fetch(target: Target, name: str) -> bool:
    try:
        fetch_file(target, name)
        return True
    except EyasError:
        return False


def _local(target: Target, path, name: str, keys: set[str]):
    """The file `name` of the index, fetched from the Hub cache when the target is a Hub snapshot."""
    if path.is_file():
        return path
    if target.hub:
        return fetch_file(target, name)
    raise EyasError(f"{path} is missing", f"{INDEX} says it holds {sorted(keys)[0]!r}, which the run needs",
                    "download the model again (all the files its index names)")
