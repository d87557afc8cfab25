"""bench_peers.py's data, built once per settings and cached under $EYAS_CACHE/bench-peers/: GSM8K conversations
prepared and extracted by eyas (or the share of a given --store), then the same states in each peer's layout, and
a verifier folder the peers load the target from."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

DATA_VERSION = 1  # bump when the layouts written below change


def _eyas(*argv: str) -> None:
    print("$ eyas " + " ".join(argv), flush=True)
    if subprocess.run([sys.executable, "-m", "eyas", *argv, "--quiet"], check=False).returncode != 0:
        from eyas.core.errors import EyasError

        raise EyasError(f"bench: `eyas {' '.join(argv)}` failed", fix="see its message above")


def build_data(args) -> tuple:
    """Prepared data, the eyas store, the peers' layouts and a verifier folder, cached by a hash of the settings;
    with --store, that store (the share --data-fraction takes of it) in place of prepared GSM8K conversations.
    -> (the settings, with --store the store's feature layers in --layers; the folders and lengths)"""
    from eyas.core.paths import cache_dir
    from eyas.store.reader import StoreReader

    if args.store:
        return build_from_store(args)
    gsm8k = Path(args.gsm8k)
    key = {"samples": args.samples, "target": args.target, "layers": args.layers, "dtype": args.extract_dtype,
           "gsm8k": [str(gsm8k.resolve()), gsm8k.stat().st_size], "version": DATA_VERSION}
    if args.heldout:  # a new key only with held-out samples: the stores of earlier runs stay valid
        key["heldout"] = args.heldout
    root = cache_dir() / "bench-peers" / hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]
    d = {k: root / k for k in ("prepared", "store", "verifier", "speculators", "specforge")}
    root.mkdir(parents=True, exist_ok=True)
    (root / "settings.json").write_text(json.dumps(key, indent=1))
    if not (d["prepared"] / "summary.json").is_file():
        _eyas("prepare", "--target", args.target, "--data", str(gsm8k), "--out", str(d["prepared"]),
              "--max-samples", str(args.samples), "--validation", "0", "--overwrite")
    if not (d["store"] / "manifest.json").is_file():  # extract resumes a partial store
        _eyas("extract", "--data", str(d["prepared"]), "--store", str(d["store"]), "--target", args.target,
              "--layers", *map(str, args.layers), "--dtype", args.extract_dtype)
    if args.heldout:  # the next --heldout conversations, never trained on: the common accuracy's samples
        d["heldout"] = root / "heldout-store"
        if not (d["heldout"] / "manifest.json").is_file():
            lines = gsm8k.read_text().splitlines()[args.samples:args.samples + args.heldout]
            (root / "heldout.jsonl").write_text("\n".join(lines) + "\n")
            _eyas("prepare", "--target", args.target, "--data", str(root / "heldout.jsonl"), "--out",
                  str(root / "heldout-prepared"), "--validation", "0", "--overwrite")
            _eyas("extract", "--data", str(root / "heldout-prepared"), "--store", str(d["heldout"]), "--target",
                  args.target, "--layers", *map(str, args.layers), "--dtype", args.extract_dtype)
    return args, _layouts(args, d, root, StoreReader(d["store"]), None)


def build_from_store(args) -> tuple:
    """--store: the peers' layouts of the rows `eyas train --data-fraction F` trains on (the same seeded share, in
    the same order), cached by the store's manifest and the share; eyas trains on the store itself with that flag.
    Held-out scoring reads --heldout-store (a recipe's val-store)."""
    from eyas.core.errors import EyasError
    from eyas.core.paths import cache_dir
    from eyas.core.weights import load_target_shell
    from eyas.store.reader import StoreReader
    from eyas.train.batches import nested_share
    from eyas.train.heldout import store_feature_layers

    store_dir = Path(args.store).resolve()
    if not (store_dir / "manifest.json").is_file():
        raise EyasError(f"bench: --store {args.store} holds no eyas store (no manifest.json)",
                        fix="pass the folder `eyas extract --store` wrote, e.g. runs/smollm2-recipe/store")
    store = StoreReader(store_dir)
    store.check_target(load_target_shell(args.target).identity())  # the store's target is --target
    layers = store_feature_layers(store)
    if layers and layers != list(args.layers):
        print(f"bench: {args.store} holds layers {layers}: the peers are told those (not --layers "
              f"{' '.join(map(str, args.layers))})", flush=True)
        args = dataclasses.replace(args, layers=tuple(layers))
    rows = [int(i) for i in nested_share(len(store), args.data_fraction, args.seed)]
    manifest = (store_dir / "manifest.json").read_bytes()
    key = {"store": str(store_dir), "manifest": hashlib.sha256(manifest).hexdigest(), "fraction": args.data_fraction,
           "seed": args.seed, "target": args.target, "version": DATA_VERSION}
    root = cache_dir() / "bench-peers" / ("store-" + hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12])
    root.mkdir(parents=True, exist_ok=True)
    (root / "settings.json").write_text(json.dumps(key, indent=1))
    d = {"store": store_dir, **{k: root / k for k in ("verifier", "speculators", "specforge")}}
    if args.heldout_store:
        d["heldout"] = Path(args.heldout_store).resolve()
    return args, _layouts(args, d, root, store, rows)


def _layouts(args, d: dict, root: Path, store, rows: list[int] | None) -> dict:
    """The verifier folder and both peers' layouts of the store's `rows` (all when None), position i holding row
    rows[i]: every trainer's sample ids are then positions in that list (eyas's --data-fraction ids are too)."""
    rows = list(range(len(store))) if rows is None else rows
    _once(d["verifier"], lambda tmp: write_verifier(args.target, tmp))
    _once(d["speculators"], lambda tmp: write_speculators(store, rows, args.target, tmp))
    _once(d["specforge"], lambda tmp: write_specforge(store, rows, tmp))
    d.update(root=root, lengths=[int(store.lengths[i]) for i in rows],
             sf_files=sorted(os.path.abspath(p) for p in d["specforge"].rglob("*.ckpt")))  # SpecForge's order
    return d


def _once(folder: Path, write) -> None:
    """Write `folder` into a temporary sibling renamed at the end: a folder that exists is complete."""
    if folder.is_dir():
        return
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # this bench's own leftover from an interrupted build
    tmp.mkdir(parents=True)
    write(tmp)
    os.replace(tmp, folder)


def write_verifier(target: str, out: Path) -> None:
    """The target's HF folder (symlinks) plus the model.safetensors.index.json SpecForge's loaders need."""
    from safetensors import safe_open

    from eyas.core.target import resolve_source

    src = resolve_source(target)[1]
    for f in src.iterdir():
        (out / f.name).symlink_to(f.resolve())
    if not list(src.glob("*.index.json")):
        files, weight_map = sorted(src.glob("*.safetensors")), {}
        for w in files:
            with safe_open(str(w), framework="pt") as f:
                weight_map.update(dict.fromkeys(f.keys(), w.name))
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(w.stat().st_size for w in files)}, "weight_map": weight_map}))


def write_speculators(store, rows: list[int], target: str, out: Path) -> None:
    """A datasets folder (input_ids, loss_mask, seq_len) + hidden_states/hs_{i}.safetensors {token_ids [L] int64,
    hidden_states [L, 4, H] bf16: the three features, then final / norm.weight}, plus token_freq.pt (loss-masked
    ids) for its vocabulary map, of the store's `rows` in order. A last row, a copy of the first, is the validation
    split speculators insists on."""
    from collections import Counter

    import datasets
    import torch
    from safetensors.torch import save_file

    from eyas.store.importers import target_parts

    norm = target_parts(target, True)[3]
    w = norm.weight.detach().float()  # [H]
    (out / "hidden_states").mkdir()
    cols: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    freq: Counter = Counter()
    for k, i in enumerate([*rows, rows[0]]):
        s = store[i]
        L, H = s.final.shape
        last = (s.final.float() / w).to(torch.bfloat16)  # [L, H]: speculators' RMSNorm brings it back to final
        if k == 0:
            with torch.no_grad():
                err = float((norm(last.float()) - s.final.float()).norm() / s.final.float().norm())
            assert err < 0.02, f"RMSNorm(final / weight) differs from the stored final state by {err:.2%}"
        hs = torch.cat([s.aux.view(L, 3, H), last.view(L, 1, H)], 1).contiguous()  # [L, 4, H]
        save_file({"token_ids": s.input_ids.clone(), "hidden_states": hs},
                  str(out / "hidden_states" / f"hs_{k}.safetensors"))
        cols["input_ids"].append(s.input_ids.tolist())
        cols["loss_mask"].append(s.loss_mask.long().tolist())
        cols["seq_len"].append(L)
        if k < len(rows):
            freq.update(s.input_ids[s.loss_mask.bool()].tolist())
    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict(cols)
    ds.set_format(type="torch")
    ds.save_to_disk(str(out))
    torch.save(dict(freq), out / "token_freq.pt")


def write_specforge(store, rows: list[int], out: Path) -> None:
    """rows_{g}-{g+2000}/data_{i}.ckpt = torch.save({input_ids [L] int64, loss_mask [L] int64, hidden_state [1, L, H]
    (after the final norm), aux_hidden_state [1, L, 3H]}), as SpecForge's scripts/prepare_hidden_states.py writes;
    file i holds the store's row rows[i]."""
    import torch

    for i, row in enumerate(rows):
        s = store[row]
        folder = out / f"rows_{i // 2000 * 2000}-{i // 2000 * 2000 + 2000}"
        folder.mkdir(exist_ok=True)
        torch.save({"input_ids": s.input_ids.clone(), "loss_mask": s.loss_mask.long(),  # clones: torch.save of a
                    "hidden_state": s.final.clone()[None], "aux_hidden_state": s.aux.clone()[None]},  # view writes
                   folder / f"data_{i}.ckpt")  # its whole storage, here the shard's mapping
