"""`eyas store import`: hidden states made elsewhere (vLLM/speculators, SGLang/SpecForge) into an eyas store.

Layouts read (the producer's sample i is prepared row i):
- speculators / vLLM `extract_hidden_states`: `SRC/hidden_states/hs_{i}.safetensors` with `token_ids [L]` and
  `hidden_states [L, 4, H]` (the three feature layers, then layer `num_layers`: vLLM captures the residual stream
  *before* the final norm, so eyas applies the target's final norm to it); `SRC/` itself is usually the
  `datasets.save_to_disk` folder (`input_ids`, `loss_mask`, `seq_len`) the requests were made from.
- SpecForge: `SRC/rows_*/data_{i}.ckpt` (or `.ckpt.gz`), a `torch.save`d dict with `input_ids [L]`, `loss_mask [L]`,
  `hidden_state [1, L, H]` (after the final norm: SGLang's last hidden state) and `aux_hidden_state [1, L, 3H]`.
  They are read with `torch.load(weights_only=True)`: tensors and plain containers only, nothing is unpickled.

With `--data`, every sample's token ids must equal the prepared row's, and the id and loss mask come from there.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import pickle
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file

from eyas.core.config import StageConfig, check, opt
from eyas.core.errors import EyasError
from eyas.core.lock import hold
from eyas.core.log import console, fmt_bytes, fmt_duration, fmt_int
from eyas.core.options import target_opt, trust_remote_code_opt, trusted_code_line
from eyas.core.target import default_feature_layers
from eyas.core.weights import load_target_shell, read_module
from eyas.data.prepared import open_prepared
from eyas.store.layout import SHARD_DIR, bytes_per_token, shard_name
from eyas.store.writer import ShardBuilder, check_coverage, write_manifest


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreImportConfig(StageConfig):
    source: str = opt("", "folder of foreign hidden states (speculators/vLLM layout or SpecForge .ckpt files)",
                      positional=True)
    store: str = opt("", "output store folder (must be new or empty)")
    target: str = target_opt(role="the one that produced them: its identity is recorded, its final norm "
                                  "completes vLLM's pre-norm last layer")
    trust_remote_code: bool = trust_remote_code_opt()
    layers: tuple[int, ...] = opt((), "HF hidden_states indices the producer captured; empty = [2, L//2, L-3]")
    layout: Literal["auto", "speculators", "specforge"] = opt("auto", "the source's layout")
    data: str = opt("", "prepared dataset to check token ids against (ids and loss masks are taken from it)")
    split: str = opt("train", "split of --data")
    final_norm: Literal["auto", "apply", "skip"] = opt("auto", "apply the target's final norm to the last layer "
                                                                "(auto: speculators yes, SpecForge no)")
    compact: bool = opt(False, "store fp8 e4m3 with per-row scales (see docs/store.md)")
    shard_mb: float = opt(256.0, "target size of a shard file in MiB")
    skip_bad: bool = opt(False, "skip and count unreadable or mismatching samples instead of stopping")

    def validate(self):
        check(bool(self.source), "no source folder given", "run eyas store import SRC --store DIR")
        check(bool(self.store), "--store is empty", "name the output store folder")
        check(len(self.layers) in (0, 3), f"--layers {list(self.layers)}: EAGLE-3 has three feature layers",
              "give three HF hidden_states indices or none")
        check(self.shard_mb > 0, f"--shard-mb {self.shard_mb} must be positive", "use e.g. 512")


@dataclasses.dataclass
class Foreign:
    input_ids: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor | None  # [L] or None when the file has none
    aux: torch.Tensor  # [L, 3, H]
    last: torch.Tensor  # [L, H], pre- or post-norm depending on the layout


# ---------------------------------------------------------------- foreign layouts

def detect_layout(src: Path) -> str:
    if (src / "hidden_states").is_dir():
        return "speculators"
    if next(src.rglob("data_*.ckpt*"), None) is not None:
        return "specforge"
    raise EyasError(f"{src} holds neither hidden_states/hs_*.safetensors nor data_*.ckpt files",
                    fix="give the folder vLLM/speculators or SpecForge wrote, or pass --layout")


def list_files(src: Path, layout: str) -> dict[int, Path]:
    """Sample index -> file, from the producer's file names (hs_{i}, data_{i})."""
    pattern, folder = ((r"hs_(\d+)\.safetensors$", src / "hidden_states") if layout == "speculators"
                       else (r"data_(\d+)\.ckpt(\.gz)?$", src))
    files: dict[int, Path] = {}
    for p in folder.rglob("*"):
        m = re.search(pattern, p.name)
        if m:
            i = int(m.group(1))
            if i in files:
                raise EyasError(f"sample {i} appears twice: {files[i]} and {p}", fix="remove the duplicate")
            files[i] = p
    if not files:
        raise EyasError(f"no {layout} hidden-state files under {folder}", fix="check the folder and --layout")
    return files


def read_speculators(path: Path) -> Foreign:
    try:
        d = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for damaged files
        raise EyasError(f"{path}: unreadable safetensors file ({e})", fix="regenerate this sample") from None
    ids, hs = d.get("token_ids"), d.get("hidden_states")
    if ids is None or hs is None or hs.dim() != 3 or hs.shape[1] < 4 or len(ids) != hs.shape[0]:
        raise EyasError(f"{path}: expected token_ids [L] and hidden_states [L, 4, H], found "
                        f"{ {k: list(v.shape) for k, v in d.items()} }", fix="regenerate this sample")
    return Foreign(ids.long(), None, hs[:, :3], hs[:, -1])


def read_specforge(path: Path) -> Foreign:
    """torch.load with weights_only=True: a pickled object that is not a tensor is refused, never run."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                d = torch.load(f, map_location="cpu", weights_only=True)
        else:
            d = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise EyasError(f"{path}: refused: it holds a pickled object that is not a tensor "
                        f"({str(e).splitlines()[-1][:200]})",
                        "eyas loads .ckpt files with torch.load(weights_only=True) and never unpickles code",
                        "regenerate the file with SpecForge, or remove it") from None
    except Exception as e:  # noqa: BLE001 - torch.load raises many types for a damaged file; all mean "unreadable"
        raise EyasError(f"{path}: unreadable checkpoint ({type(e).__name__}: {e})", fix="regenerate it") from None
    keys = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
    if not isinstance(d, dict) or any(not isinstance(d.get(k), torch.Tensor) for k in keys):
        found = {k: type(v).__name__ for k, v in d.items()} if isinstance(d, dict) else type(d).__name__
        raise EyasError(f"{path}: expected a dict of tensors {keys}, found {found}", fix="regenerate it")
    ids, mask = d["input_ids"].reshape(-1), d["loss_mask"].reshape(-1)
    last = d["hidden_state"].reshape(-1, d["hidden_state"].shape[-1])
    aux = d["aux_hidden_state"].reshape(last.shape[0], 3, -1) if d["aux_hidden_state"].shape[-1] % 3 == 0 else None
    if aux is None or not (len(ids) == len(mask) == last.shape[0] == aux.shape[0]) or aux.shape[2] != last.shape[1]:
        raise EyasError(f"{path}: inconsistent shapes { {k: list(d[k].shape) for k in keys} }",
                        fix="expected input_ids [L], loss_mask [L], hidden_state [1, L, H], "
                            "aux_hidden_state [1, L, 3H]")
    return Foreign(ids.long(), mask, aux, last)


# ---------------------------------------------------------------- the target, without its weights

def target_parts(spec: str, need_norm: bool, trust_remote_code: bool = False):
    """(identity, num_layers, hidden size, final norm module or None) without loading the weights.

    Imports exist for targets too large to load: the model is built on the meta device, and only the final
    norm's weight is read from the checkpoint when vLLM's pre-norm last layer needs it (eyas.core.weights).
    """
    t = load_target_shell(spec, trust_remote_code=trust_remote_code)
    norm = read_module(t, t.final_norm()) if need_norm else None
    return t.identity(), t.num_layers, t.hidden_size, norm


# ---------------------------------------------------------------- the run

def run(cfg: StoreImportConfig) -> dict:
    """The stage, holding its output's lock (eyas.core.lock) throughout."""
    with hold(Path(cfg.store), "store import"):
        return _run(cfg)


def _run(cfg: StoreImportConfig) -> dict:
    t0 = time.perf_counter()
    con = console(0, cfg.quiet, cfg.json)
    src, store = Path(cfg.source), Path(cfg.store)
    if not src.is_dir():
        raise EyasError(f"source {src} is not a folder", fix="give the folder the producer wrote")
    if store.exists() and any(store.iterdir()):
        raise EyasError(f"{store} is not empty", fix="import into a new folder (an import never overwrites a store)")
    layout = detect_layout(src) if cfg.layout == "auto" else cfg.layout
    files = list_files(src, layout)
    apply_norm = cfg.final_norm == "apply" or (cfg.final_norm == "auto" and layout == "speculators")
    if cfg.trust_remote_code:
        con.print(trusted_code_line(cfg.target))
    identity, num_layers, hidden, norm = target_parts(cfg.target, apply_norm, cfg.trust_remote_code)

    layer_ids = list(cfg.layers) or default_feature_layers(num_layers)
    rows, fingerprint = _reference_rows(cfg, src, layout, files)
    con.print(f"import: {fmt_int(len(rows))} samples from {src} ({layout}), target {identity['name']}, layers "
              f"{layer_ids}, final norm {'applied' if apply_norm else 'as stored'}")
    fresh = not store.exists()
    (store / SHARD_DIR).mkdir(parents=True, exist_ok=True)
    try:
        shards, skipped = _write_shards(cfg, con, rows, files, layout, hidden, norm)
        problems = check_coverage(shards, None if skipped else len(rows))
        if problems:
            raise EyasError(f"import into {store}: " + "; ".join(problems[:5]), fix="check the source for duplicates")
        totals = _finish(cfg, store, src, layout, identity, layer_ids, hidden, apply_norm, fingerprint, rows, shards)
    except BaseException:  # the store was empty: what it holds now is this import's, and a retry needs it empty
        for entry in list(store.iterdir()):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        if fresh:
            store.rmdir()
        raise
    elapsed = time.perf_counter() - t0
    con.summary(f"import: {fmt_int(totals['samples'])} samples, {fmt_int(totals['tokens'])} tokens -> {store} "
                f"({fmt_bytes(totals['bytes'])}; {skipped} skipped) in {fmt_duration(elapsed)}")
    return {"store": str(store), "layout": layout, **totals, "skipped": skipped, "elapsed_s": round(elapsed, 2)}


def _finish(cfg, store: Path, src: Path, layout: str, identity: dict, layer_ids: list[int], hidden: int,
            apply_norm: bool, fingerprint: str | None, rows, shards) -> dict:
    """The store's manifest: its header (what it holds and where it came from) and its shards."""
    header = {"source": f"eyas store import ({layout}: {src.resolve()})", "target": identity, "layer_ids": layer_ids,
              "hidden_size": hidden, "dtype": "float8_e4m3fn" if cfg.compact else "bfloat16",
              "compact": cfg.compact, "forward_dtype": None, "final_norm_applied_on_import": apply_norm,
              "dataset": {"path": str(Path(cfg.data).resolve()) if cfg.data else None,
                          "split": cfg.split if cfg.data else None, "fingerprint": fingerprint, "samples": len(rows)}}
    return write_manifest(store, header, shards)


class Rows:
    """The store's rows in order, each a dict: file index, id, expected token ids and loss mask (None: take the
    file's). Read lazily from the (memory-mapped) dataset, so a million samples are never all in memory."""

    def __init__(self, indices: list[int], ds, where: str, names: dict[int, str]):
        self.indices, self.ds, self.where, self.names = indices, ds, where, names

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self):
        return (self[k] for k in range(len(self)))

    def __getitem__(self, k: int) -> dict:
        i = self.indices[k]
        r = self.ds[i] if self.ds is not None else {}
        return {"index": i, "id": r.get("id", self.names.get(i, str(i))), "input_ids": r.get("input_ids"),
                "loss_mask": r.get("loss_mask"), "where": f"{self.where} {i}"}


def _reference_rows(cfg, src: Path, layout: str, files: dict[int, Path]) -> tuple[Rows, str | None]:
    if cfg.data:

        prepared = open_prepared(cfg.data, cfg.split)
        ds, fingerprint = prepared.ds, prepared.fingerprint
        extra = sorted(i for i in files if i >= len(ds))
        if extra and not cfg.skip_bad:
            raise EyasError(f"{len(extra)} hidden-state files have no row in {cfg.data} [{cfg.split}] "
                            f"({len(ds)} rows), e.g. {files[extra[0]]}",
                            fix="pass the prepared dataset they were made from (or --skip-bad to leave them out)")
        cols = ds.select_columns(["id", "input_ids", "loss_mask"])
        return Rows(list(range(len(ds))), cols, f"{cfg.data} [{cfg.split}] row", {}), fingerprint
    own = _own_dataset(src) if layout == "speculators" else None
    if layout == "speculators" and own is None:
        raise EyasError(f"{src} has no dataset with loss masks beside hidden_states/",
                        fix="pass --data PREPARED (the prepared dataset the requests were made from)")
    beyond = [i for i in files if own is not None and i >= len(own)]
    if beyond:
        raise EyasError(f"{files[beyond[0]]} is sample {beyond[0]}, but {src} holds {len(own)} rows",
                        fix="give the dataset folder the requests were made from, or pass --data PREPARED")
    names = {i: f"{src.name}/{p.name.split('.')[0]}" for i, p in files.items()}
    return Rows(sorted(files), own, f"{src} sample", names), None


def _own_dataset(src: Path):
    if not (src / "state.json").is_file():
        return None
    import datasets  # heavy (pyarrow): loaded only where a dataset is read or written

    return datasets.load_from_disk(str(src))


def _samples(cfg, rows, files, layout, hidden, norm) -> Iterator[tuple[dict, Foreign | None, str | None]]:
    """(row, sample or None, problem or None) in row order, each sample checked and completed."""
    read = read_speculators if layout == "speculators" else read_specforge
    norms: dict[torch.dtype, torch.nn.Module] = {}
    for row in rows:
        path = files.get(row["index"])
        try:
            if path is None:
                raise EyasError(f"{row['where']} (id {row['id']}): no hidden-state file for it in {cfg.source}")
            f = read(path)
            _check(f, row, path, hidden)
        except EyasError as e:
            if not cfg.skip_bad:
                raise
            yield row, None, str(e).split("\n")[0]
            continue
        if norm is not None:
            if f.last.dtype not in norms:  # the final norm in the states' own dtype, as the target ran it
                norms[f.last.dtype] = copy.deepcopy(norm).to(f.last.dtype)
            with torch.inference_mode():
                f.last = norms[f.last.dtype](f.last)  # vLLM's layer `num_layers` is before the final norm
        yield row, f, None


def _check(f: Foreign, row: dict, path: Path, hidden: int) -> None:
    if f.aux.shape[-1] != hidden:
        raise EyasError(f"{path}: hidden size {f.aux.shape[-1]}, the target's is {hidden}",
                        fix="pass the --target that produced these hidden states")
    if row["input_ids"] is not None:
        want = torch.as_tensor(row["input_ids"], dtype=torch.int64)
        if len(want) != len(f.input_ids) or not torch.equal(want, f.input_ids):
            n = min(len(want), len(f.input_ids))
            at = next((j for j in range(n) if want[j] != f.input_ids[j]), n)
            raise EyasError(f"{path}: token ids differ from {row['where']} (id {row['id']}) at position {at} "
                            f"({len(f.input_ids)} vs {len(want)} tokens)",
                            "the hidden states were made from other tokens than the prepared sample",
                            "regenerate this sample from the same prepared data, or pass --skip-bad")
    if row["loss_mask"] is None and f.loss_mask is None:
        raise EyasError(f"{path}: no loss mask for it", fix="pass --data PREPARED")


def _write_shards(cfg, con, rows, files, layout, hidden, norm) -> tuple[list[dict], int]:
    """Group samples (row order) into shards of about --shard-mb and write them; (shard indexes, skipped)."""
    folder = Path(cfg.store) / SHARD_DIR
    budget, bpt = int(cfg.shard_mb * 2**20), bytes_per_token(hidden, cfg.compact)
    shards, pending, skipped = [], [], 0
    bar = con.progress(total=len(rows), desc="import", unit="sample")
    for r, (row, f, problem) in enumerate(_samples(cfg, rows, files, layout, hidden, norm)):
        bar.update(1)
        if problem:
            skipped += 1
            con.print(f"skipped: {problem}")
            continue
        mask = f.loss_mask if row["loss_mask"] is None else torch.as_tensor(row["loss_mask"])
        pending.append((r, row["id"], f.input_ids, mask, list(f.aux.unbind(1)), f.last))
        if sum(len(p[2]) for p in pending) * bpt >= budget:
            shards.append(_flush(pending, len(shards), hidden, cfg.compact, folder))
            pending = []
    if pending:
        shards.append(_flush(pending, len(shards), hidden, cfg.compact, folder))
    bar.close()
    return shards, skipped


def _flush(pending: list, k: int, hidden: int, compact: bool, folder: Path) -> dict:
    b = ShardBuilder(shard_name(k), sum(len(p[2]) for p in pending), hidden, compact)
    for p in pending:
        b.add(*p)
    return b.commit(folder)
