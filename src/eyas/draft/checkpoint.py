"""Training checkpoints that describe themselves and are written atomically; nothing is pickled.

    RUN/checkpoints/step-00000120/
        config.json            the draft's config (+ "training" so far): save_draft
        model.safetensors      the draft's weights (the eyas draft contract; loadable by read_draft)
        optimizer.safetensors  every optimizer state tensor, keyed "state/<parameter name>/<exp_avg|...>"
        trainer_state.json     step, data position (epoch, step in epoch), world size, counters, the full
                               TrainConfig, the optimizer's param groups and scalars,
                               and every rank's RNG states (as lists of ints)

A checkpoint is written into `step-N.tmp-<pid>/`, every file fsynced, then renamed to `step-N/` (and the folder
fsynced): a crash leaves either the whole checkpoint or a `.tmp` folder that the next start removes. Only the
newest `keep` are kept. The optimizer state goes through `torch.distributed.checkpoint.state_dict`, whose
full (unsharded) state dicts are keyed by parameter name for plain, DDP and FSDP2 models alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from eyas.core.config import changed_settings
from eyas.core.errors import EyasError, disk_full
from eyas.core.files import read_json, write_json
from eyas.draft.model import DraftConfig, Eagle3Draft

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"  # a draft folder: config and weights

CKPT_DIR = "checkpoints"
STATE_FILE, OPTIM_FILE = "trainer_state.json", "optimizer.safetensors"
FORMAT = 1
_NAME = re.compile(r"^step-(\d+)$")


# -- files that carry their own checksum ---------------------------------------------------------------------------
# A damaged byte (a bit flip, a partial copy) must be an error naming the file, never different weights: each
# safetensors file records a digest of its tensors (names, dtypes, shapes, bytes) in its metadata, each JSON file a
# digest of its content under "checksum". Files without one (written by hand or by an older eyas) are not checked.
def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for k in sorted(tensors):
        t = tensors[k].detach().cpu().contiguous()
        h.update(f"{k}:{t.dtype}:{list(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def json_digest(obj: dict) -> str:
    text = json.dumps(json.loads(json.dumps(obj, default=str)), sort_keys=True)  # as it reads back
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    save_file(tensors, str(path), metadata={**metadata, "checksum": tensors_digest(tensors)})


def load_tensors(path: Path, fix: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, checked against its recorded digest; EyasError naming it otherwise."""

    try:
        with safe_open(str(path), "pt") as f:
            want = (f.metadata() or {}).get("checksum")
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise EyasError(f"{path} is unreadable: {e}", "it was cut short or damaged after it was written", fix) from None
    if want is not None and want != tensors_digest(tensors):
        raise EyasError(f"{path} is damaged: its tensors differ from the checksum recorded when it was written",
                        "a byte changed after it was written (a bit flip, a bad copy)", fix)
    return tensors


def read_checked_json(path: Path, fix: str) -> dict:
    """A JSON object, checked against its "checksum" (which is removed); EyasError naming the file otherwise."""
    obj = read_json(path, fix, expect=None)
    want = obj.pop("checksum", None) if isinstance(obj, dict) else None
    if not isinstance(obj, dict) or (want is not None and want != json_digest(obj)):
        raise EyasError(f"{path} is damaged: its content differs from the checksum recorded when it was written",
                        "a byte changed after it was written (a bit flip, a bad copy)", fix)
    return obj


# -- optimizer state <-> safetensors + JSON ------------------------------------------------------------------------
def flatten_optimizer_state(osd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """A full optimizer state dict (keyed by parameter name) -> (tensors, JSON-able scalars and param groups)."""
    tensors, scalars = {}, {}
    for name, entries in osd["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state/{name}/{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{name}/{key}"] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in osd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[str, dict] = {}
    for key, value in tensors.items():
        _, name, entry = key.split("/", 2)
        state.setdefault(name, {})[entry] = value
    for key, value in meta.get("scalars", {}).items():
        name, entry = key.rsplit("/", 1)
        state.setdefault(name, {})[entry] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


# -- RNG states -----------------------------------------------------------------------------------------------------
def rng_state() -> dict:
    """This process's RNG states as JSON-able values."""
    np_state = np.random.get_state()
    out = {"torch": torch.get_rng_state().tolist(),
           "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
           "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]]}
    if torch.cuda.is_available():  # this rank's GPU only (the current device): a resume may see other GPUs
        out["cuda"] = torch.cuda.get_rng_state().tolist()
    return out


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    saved = state.get("cuda")
    if saved and torch.cuda.is_available():
        if isinstance(saved[0], list):  # written by an older eyas: every visible GPU's state, this rank's among them
            here = torch.cuda.current_device()
            saved = saved[here] if here < len(saved) else None
        if saved is not None:
            torch.cuda.set_rng_state(torch.tensor(saved, dtype=torch.uint8))


# -- folders --------------------------------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for f in folder.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(folder)


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def remove_partial(run_dir: str | Path) -> list[str]:
    """Delete `.tmp` folders a crash left behind (rank 0, at start-up); returns their names."""
    root = Path(run_dir) / CKPT_DIR
    gone = []
    if root.is_dir():
        for p in root.iterdir():
            if ".tmp" in p.name and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p.name)
    return gone


def save_checkpoint(run_dir: str | Path, step: int, draft, optimizer_state: dict, trainer_state: dict,
                    keep: int) -> Path:
    """Write one checkpoint atomically (rank 0 only) and prune to the newest `keep`. `draft` is an Eagle3Draft
    holding the full weights; `optimizer_state` a full optimizer state dict keyed by parameter name."""
    root = Path(run_dir) / CKPT_DIR
    final = root / f"step-{step:08d}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        save_draft(draft, tmp, extra={"training": trainer_state.get("training", {})})
        tensors, meta = flatten_optimizer_state(optimizer_state)
        save_tensors(tensors, tmp / OPTIM_FILE, {"format": "eyas-optimizer", "version": str(FORMAT)})
        body = {"format": FORMAT, **trainer_state, "optimizer": meta}
        write_json(tmp / STATE_FILE, {**body, "checksum": json_digest(body)})
        _fsync_tree(tmp)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)  # half a checkpoint is of no use, and on a full disk it holds space
        err = no_space(e, final, latest_checkpoint(run_dir))
        if err is None:
            raise
        raise err from None
    if final.exists():  # a rerun reaching the same step: the new one wins, atomically
        old = root / f"{final.name}.tmp-old-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(root)
    for _, p in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    return final


def no_space(e: Exception, final: Path, last: Path | None) -> EyasError | None:
    """The error to show when checkpoint `final` could not be written for want of disk space, else None."""

    why = disk_full(e)
    if why is None:
        return None
    return EyasError(f"cannot write checkpoint {final}: {why}",
                     "the run folder's disk is full (or a size limit or quota was hit); the partial checkpoint was "
                     "removed, " + (f"{last.name} is the last complete one" if last
                                    else "no checkpoint is complete yet"),
                     "free space on that disk (or lower --keep-checkpoints) and rerun the same command with --resume: "
                     "training continues from the last complete checkpoint")


def load_checkpoint(folder: str | Path) -> tuple[dict, dict, dict]:
    """(model state keyed like Eagle3Draft.state_dict(), full optimizer state dict, trainer state); every file is
    checked against its checksum."""

    folder = Path(folder)
    files = [folder / STATE_FILE, folder / OPTIM_FILE, folder / WEIGHTS_FILE]
    fix = "delete that folder to resume from the one before, or start a new run in another --out"
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise EyasError(f"checkpoint {folder} is incomplete: {', '.join(missing)} missing", fix=fix)
    state = read_checked_json(files[0], fix)
    try:
        optim = unflatten_optimizer_state(load_tensors(files[1], fix), state["optimizer"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise EyasError(f"checkpoint {folder} is unreadable: {files[0].name} lacks the optimizer's state ({e})",
                        fix=fix) from None
    model = load_tensors(files[2], fix)
    if state.get("format") != FORMAT:
        raise EyasError(f"checkpoint {folder} has format {state.get('format')}, this eyas reads {FORMAT}",
                        fix="resume with the eyas version that wrote it, or start a new run")
    return model, optim, state


# Settings that may change between a run and its resumption: they do not change what is computed.
RESUMABLE_CHANGES = {"quiet", "json", "resume", "checkpoint_every", "keep_checkpoints", "tracker", "threads",
                     "collective_timeout", "compile", "metrics_every",
                     "prefetch", "device",
                     "out",  # a run folder moved or copied (to another disk, off a cluster) resumes where it is
                     "skip_bad_shards"}  # the data it leaves out is compared on its own (train_setup.skipped_data)


def check_resumable(folder: Path, state: dict, config: dict, world_size: int, defaults: dict | None = None) -> None:
    """Refuse to resume under a different world size or with settings that change the computation. `defaults`: the
    settings' default values, taken for those a checkpoint written by an older eyas does not record."""
    if state["world_size"] != world_size:
        raise EyasError(
            f"cannot resume {folder}: it was written by a run with {state['world_size']} ranks, this run has "
            f"{world_size}",
            "each rank's share of the epoch and the position within it depend on the world size",
            f"resume with the same number of ranks (torchrun --nproc_per_node ... giving {state['world_size']} in "
            f"all), or start a new run in another --out folder")
    config = json.loads(json.dumps(config, default=str))  # tuples -> lists, as they were stored
    # a setting added to eyas after the checkpoint was written ran at its default then; `defaults` names them
    old = {**{k: v for k, v in (defaults or {}).items() if k not in state.get("config", {})}, **state.get("config", {})}
    changed = changed_settings(old, config, ignore=RESUMABLE_CHANGES)
    if changed:
        diffs = ", ".join(f"{k}: {old.get(k)!r} -> {config.get(k)!r}" for k in changed[:6])
        raise EyasError(f"cannot resume {folder}: settings differ from the run that wrote it ({diffs})",
                        "resuming exactly needs the same data order, batch, schedule and model",
                        "rerun with the original settings (see trainer_state.json), or start a new run in another "
                        "--out folder")


# ---------------------------------------------------------------- a draft folder

def save_draft(draft: Eagle3Draft, folder: str | Path, extra: dict | None = None) -> Path:
    """config.json (DraftConfig + `extra`, e.g. training figures) and model.safetensors, atomically; each
    records its own checksum (eyas.draft.checkpoint), so a damaged file is never loaded as weights."""

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
    tmp = folder / (WEIGHTS_FILE + ".tmp")
    save_tensors(tensors, tmp, {"format": "pt", "producer": "eyas"})
    tmp.replace(folder / WEIGHTS_FILE)
    body = {"eyas_draft": draft.cfg.to_dict(), **(extra or {})}
    write_json(folder / CONFIG_FILE, {**body, "checksum": json_digest(body)})
    return folder

def read_draft(folder: str | Path, device: str = "cpu", dtype: torch.dtype | None = None) -> Eagle3Draft:
    """The draft a `save_draft` folder holds, checked (config and weights checksums, names and shapes), in eval mode."""

    folder = Path(folder)
    cfg_path, w_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not cfg_path.is_file() or not w_path.is_file():
        raise EyasError(f"{folder} is not an eyas draft checkpoint", f"it lacks {CONFIG_FILE} or {WEIGHTS_FILE}",
                        "point at a training output's final/ folder, or import a foreign draft with `eyas import`")
    fix = "use another checkpoint of the run, or train (or import) the draft again"
    meta = read_checked_json(cfg_path, fix)
    if "eyas_draft" not in meta:
        raise EyasError(f"{cfg_path} has no eyas_draft section", "it is not an eyas checkpoint",
                        "convert an eagle3/speculators draft with `eyas import DIR`")
    try:
        model = Eagle3Draft(DraftConfig.from_dict(meta["eyas_draft"]))
    except (TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise EyasError(f"{cfg_path}: its eyas_draft section is not a draft config ({e})", fix=fix) from None
    state = load_tensors(w_path, fix)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a weight of another shape
        raise EyasError(f"{w_path}: weights do not match {cfg_path.name} ({str(e)[:300]})", fix=fix) from None
    if missing or unexpected:
        raise EyasError(f"{w_path}: weights do not match the config",
                        f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}",
                        "re-export the checkpoint with this version of eyas")
    model = model.to(device)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()
