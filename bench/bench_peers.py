"""Training throughput of eyas against speculators 0.9.0 and SpecForge 0.2.0: the same hidden states, the same draft
shape (one decoder layer, draft vocabulary 32,000, the same TTT steps, lr 1e-4, one epoch), the same machine.

    EYAS_CACHE=/tmp/eyascache python bench/bench_peers.py             # 300 GSM8K conversations, 3 repeats, 1 x 2
    python bench/bench_peers.py --samples 20 --repeats 1               # a quick check of the machinery
    python bench/bench_peers.py --layouts 1x2 2x1                      # also 2 ranks x 1 thread under torchrun

Data, built once and cached under $EYAS_CACHE/bench-peers/<hash of the settings>/: the first --samples GSM8K train
conversations with their original answers (`eyas prepare`, no validation split), `eyas extract` into a bf16 store,
then the same states copied from that store into each peer's layout. Final state: the store and SpecForge's
`hidden_state` hold it after the target's final norm (SpecForge's target head is a bare linear layer); speculators
applies `verifier_norm` itself before its LM head, so it gets final / norm.weight, which that RMSNorm maps back to
the stored state (RMSNorm ignores a row's scale; checked on sample 0). So all three train on the same features,
tokens, loss masks and target distribution.

Runs alternate, the order rotating every repeat, each trainer in fresh processes with OMP_NUM_THREADS and
torch.set_num_threads at the layout's threads per rank. Every trainer process starts through this file (`--_shim`),
which wraps the trainer's own one-epoch function with a wall clock: eyas `Trainer.train_epoch`, speculators
`Trainer.train_epoch`, SpecForge `TrainerController.fit` (one epoch). The epoch wall time thus covers the loader's
start and every step (data wait, forward, backward, optimizer, logging), and not imports, model building, vocabulary
maps, the post-epoch validation or checkpoint; with several ranks, the slowest rank's. Tokens are the store lengths
of the samples each rank's sampler gave it in that epoch, repeats included; tokens/s = tokens of all ranks / epoch
wall time. Also recorded: the process wall time, steps and samples per rank from each trainer's own log ([probe]
lines, eyas's summary), and `others`: the cores other processes used during the epoch (/proc/stat), the noise.

Time to accuracy (`--accuracy`): every trainer runs `--epochs` epochs (default 4) and the shim saves its draft at
each epoch's end as the trainer itself exports it (eyas `save_draft`, speculators `save_pretrained`, SpecForge its
draft module's `save_pretrained` without embeddings, as `specforge export --to sglang` writes it), the clock
stopped meanwhile. speculators runs without the three norm variants and the sliding window its 0.9.0 defaults add
(`--no-norm-before-residual --no-norm-before-fc --no-norm-output --full-attention-indices 0`), so its drafts are
EAGLE-3's architecture, which eyas trains and imports. After each run every snapshot is read (`eyas import` for
the peers) and scored by one evaluator, eyas's validation pass (eyas.train.heldout), on the next `--heldout` GSM8K train
conversations (default 50), never trained on. The bench prints acc_0 at each snapshot and the training seconds
each trainer took to reach a common acc_0 (the highest every run reached, or `--target-acc`), interpolated
between snapshots, and the faster peer's time over eyas's.

    python bench/bench_peers.py --samples 100 --accuracy --repeats 1 --eyas-args "--lr 1e-3"

At equal data on a recipe's own hidden states (issue 20, item 5): `--store` trains every trainer on that store
(`--data-fraction`: the seeded share `eyas train --data-fraction` takes, the same rows for all three), scores the
snapshots on `--heldout-store`, and `--export` keeps each run's final draft in eyas's format for one evaluation:

    python bench/bench_peers.py --store runs/smollm2-recipe/store --data-fraction 0.125 \
        --heldout-store runs/smollm2-recipe/val-store --accuracy --epochs 2 --repeats 1 --layouts 2x1 \
        --ttt-steps 5 --lr 1e-3 --draft-vocab 8192 --eyas-args "--step-decay 0.8 --max-tokens 1024" \
        --export runs/smollm2-recipe/peers
    eyas evaluate --draft runs/smollm2-recipe/peers/eyas-2x1-r1 \
        --baselines runs/smollm2-recipe/peers/speculators-2x1-r1 runs/smollm2-recipe/peers/specforge-2x1-r1 \
        prompt-lookup --bench mt_bench --per-category 1 --no-adaptive

Writes OUT/bench_peers.json and OUT/runs/<run>/log.txt; prints a table and eyas / the faster peer (medians).
The peers' venv: ../shared/peers/README.md, "Install".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import runpy
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHIM = "--_shim"
REPORT = "bench-epoch-rank"  # <run>/bench-epoch-rank<r>.json, one per rank (ranks share stdout)
PEERS_DIR = Path(__file__).resolve().parents[2] / "shared" / "peers"
DATA_VERSION = 1  # bump when the layouts written below change
TRAINERS = ("eyas", "speculators", "specforge")


# ---------------------------------------------------------------- inside each trainer process (either venv: stdlib)

def _shim(argv: list[str]) -> None:
    """`bench_peers.py --_shim TRAINER THREADS ARGS...`: time the trainer's epoch function, then run it as usual."""
    trainer, threads, rest = argv[0], int(argv[1]), argv[2:]
    import torch

    torch.set_num_threads(threads)
    {"eyas": _hook_eyas, "speculators": _hook_speculators, "specforge": _hook_specforge}[trainer]()
    if trainer == "eyas":
        from eyas import cli

        sys.exit(cli.main(["train", *rest]))
    sys.argv = rest  # the peer's wrapper script, then its arguments
    runpy.run_path(rest[0], run_name="__main__")


def _busy_s() -> float:
    """CPU seconds the whole machine has been busy (every process, every core) since boot."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


# the training clock of this process: epochs' wall time, without the snapshots taken inside one (SpecForge's)
CLOCK = {"done": 0.0, "start": None, "paused": 0.0, "snapshots": 0}


def _train_s() -> float:
    running = 0.0 if CLOCK["start"] is None else time.perf_counter() - CLOCK["start"] - CLOCK["paused"]
    return CLOCK["done"] + running


def _snapshot(save, tag: str) -> None:
    """--accuracy: save(folder) writes the draft as its trainer exports it, into BENCH_SNAPSHOT_DIR/<n>-<tag>, with
    the training seconds so far; the time it takes is not training time."""
    root = os.environ.get("BENCH_SNAPSHOT_DIR")
    if not root:
        return
    t0 = time.perf_counter()
    folder = Path(root) / f"{CLOCK['snapshots']:03d}-{tag}"
    save(folder)
    (folder / "bench-clock.json").write_text(json.dumps({"train_s": _train_s(), "tag": tag}))
    CLOCK["snapshots"] += 1
    CLOCK["paused"] += time.perf_counter() - t0


def _timed(cls, name: str, trainer: str, after) -> None:
    """Wrap cls.name with a wall clock; after(self, args) -> (rank, sample indices, trainable parameters), called
    with the clock stopped. Called once per epoch (eyas, speculators) or once for all (SpecForge's fit), the record
    sums the calls: epoch_s is the training time so far, samples every sample fed."""
    import resource

    import torch

    orig = getattr(cls, name)
    total = {"cpu_s": 0.0, "machine_busy_s": 0.0, "samples": []}

    def timed(self, *a, **k):
        t0, cpu0, busy0 = time.perf_counter(), time.process_time(), _busy_s()
        CLOCK.update(start=t0, paused=0.0)
        out = orig(self, *a, **k)
        seconds = time.perf_counter() - t0 - CLOCK["paused"]
        CLOCK.update(done=CLOCK["done"] + seconds, start=None, paused=0.0)
        total["cpu_s"] += time.process_time() - cpu0
        total["machine_busy_s"] += _busy_s() - busy0
        rank, samples, trainable = after(self, a)
        total["samples"] = samples if trainer == "specforge" else total["samples"] + samples  # SpecForge's: all
        rec = {"trainer": trainer, "rank": rank, "epoch_s": CLOCK["done"], "cpu_s": total["cpu_s"],
               "machine_busy_s": total["machine_busy_s"], "samples": total["samples"], "trainable": trainable,
               "threads": torch.get_num_threads(),
               "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        Path(os.environ.get("BENCH_REPORT_DIR", "."), f"{REPORT}{rank}.json").write_text(json.dumps(rec))
        return out

    setattr(cls, name, timed)


def _trainable(module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _hook_eyas() -> None:
    from eyas.draft.checkpoint import save_draft
    from eyas.train.trainer import Trainer

    def after(t, a):  # train_epoch(epoch, shard, start, bar); shard ids are store rows
        own, rep = a[1].sample_ids()
        if t.env.is_main:
            _snapshot(lambda folder: save_draft(t.full_draft(), folder), f"epoch{a[0] + 1}")
        return t.env.rank, own + rep, _trainable(t.parts.model)

    _timed(Trainer, "train_epoch", "eyas", after)


def _hook_speculators() -> None:
    import speculators.train.trainer as T

    if os.environ.get("BENCH_SPEC_AUTOCAST") == "cpu":  # without an accelerator it autocasts "cuda": a no-op here
        setup = T.Trainer.setup_trainer

        def cpu_autocast(self):
            self.device_type = "cpu"
            return setup(self)

        T.Trainer.setup_trainer = cpu_autocast

    def after(t, a):  # train_epoch(epoch); the train split starts at row 0
        idx = [int(i) for b in t.train_loader.batch_sampler._generate_batches(a[0]) for i in b]
        if t.rank == 0:  # its own export: config.json (speculators format) and model.safetensors
            _snapshot(getattr(t.model, "module", t.model).save_pretrained, f"epoch{a[0] + 1}")
        return t.rank, idx, _trainable(t.model)

    _timed(T.Trainer, "train_epoch", "speculators", after)


def _hook_specforge() -> None:
    import specforge.training.controller as C
    import specforge.training.model_loading as ML
    import torch.distributed as dist

    vocab = int(os.environ.get("BENCH_SF_DRAFT_VOCAB", "0"))
    if vocab:  # its EAGLE-3 draft config fixes draft_vocab_size at 32,000 unless a whole config file is given
        generate = ML._generate_draft_config

        def sized(cfg, provider):
            config = generate(cfg, provider)
            config.draft_vocab_size = vocab
            return config

        ML._generate_draft_config = sized

    seen: list[str] = []
    step = C.TrainerCore.train_step

    def counting(self, batch, *a, **k):
        seen.extend(batch.sample_ids)
        return step(self, batch, *a, **k)

    C.TrainerCore.train_step = counting

    def export(c, folder: Path) -> None:  # as its `specforge export --to sglang` writes a draft: without embeddings
        module = c.core.strategy.trainable_module()
        module = getattr(module, "module", module)  # inside its DDP wrapper
        draft = getattr(module, "draft_model", module)
        draft.save_pretrained(folder, state_dict={k: v for k, v in draft.state_dict().items()
                                                  if "embed" not in k.lower()})

    def save_checkpoint(c, step):  # --accuracy sets save_interval to an epoch's steps: a snapshot, not its save
        if (dist.get_rank() if dist.is_initialized() else 0) == 0:
            _snapshot(lambda folder: export(c, folder), f"step{step}")
        c.last_checkpoint_step = step  # as its own save records it (no second save of the same step after fit)

    if os.environ.get("BENCH_SNAPSHOT_DIR"):
        C.TrainerController.save_checkpoint = save_checkpoint

    def after(c, a):  # sample ids are "<run id>:<index in the sorted list of feature files>"
        rank = dist.get_rank() if dist.is_initialized() else 0
        return rank, [int(s.rsplit(":", 1)[1]) for s in seen], _trainable(c.core.strategy.trainable_module())

    _timed(C.TrainerController, "fit", "specforge", after)


# ---------------------------------------------------------------- the data, built once per settings

def _eyas(*argv: str) -> None:
    print("$ eyas " + " ".join(argv), flush=True)
    if subprocess.run([sys.executable, "-m", "eyas", *argv, "--quiet"], check=False).returncode != 0:
        from eyas.core.errors import EyasError

        raise EyasError(f"bench: `eyas {' '.join(argv)}` failed", fix="see its message above")


def build_data(args) -> dict:
    """Prepared data, the eyas store, the peers' layouts and a verifier folder, cached by a hash of the settings;
    with --store, that store (the share --data-fraction takes of it) in place of prepared GSM8K conversations."""
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
    return _layouts(args, d, root, StoreReader(d["store"]), None)


def build_from_store(args) -> dict:
    """--store: the peers' layouts of the rows `eyas train --data-fraction F` trains on (the same seeded share, in
    the same order), cached by the store's manifest and the share; eyas trains on the store itself with that flag.
    Held-out scoring reads --heldout-store (a recipe's val-store)."""
    from eyas.core.errors import EyasError
    from eyas.core.paths import cache_dir
    from eyas.core.weights import load_target_shell
    from eyas.store.reader import StoreReader
    from eyas.train.data import nested_share
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
        args.layers = layers
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
    return _layouts(args, d, root, store, rows)


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


# ---------------------------------------------------------------- the runs

def eyas_args(args, d, out: Path, nproc: int, threads: int) -> list[str]:
    return ["--store", str(d["store"]), "--target", args.target, "--out", str(out), "--epochs", str(args.epochs),
            "--num-layers", "1", "--draft-vocab", str(args.draft_vocab), "--ttt-steps", str(args.ttt_steps),
            "--lr", str(args.lr), "--threads", str(threads), "--seed", str(args.seed),
            *(["--data-fraction", repr(args.data_fraction)] if args.store and args.data_fraction < 1 else []),
            "--json", *args.eyas_args.split()]


def speculators_args(args, d, out: Path, nproc: int, threads: int) -> list[str]:
    n = len(d["lengths"])
    return [str(Path(args.peers_dir) / "spec_cpu_train.py"), "--verifier-name-or-path", str(d["verifier"]),
            "--data-path", str(d["speculators"]), "--save-path", str(out / "checkpoints"), "--log-dir", str(out),
            "--speculator-type", "eagle3", "--num-layers", "1", "--draft-vocab-size", str(args.draft_vocab),
            "--target-layer-ids", *map(str, args.layers), "--ttt-steps", str(args.ttt_steps), "--lr", str(args.lr),
            "--optimizer", "adamw", "--scheduler-type", "cosine", "--epochs", str(args.epochs),
            "--total-seq-len", str(max(args.spec_total_seq_len, max(d["lengths"]))),  # never truncates a sample
            "--train-data-ratio", repr((n + 0.5) / (n + 1)),  # rows 0..n-1 train, the copy of row 0 validates
            "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers", "0",
            "--on-missing", "raise", "--no-resume-from-checkpoint", "--seed", str(args.seed),
            # --accuracy, --export: the EAGLE-3 draft eyas imports (its 0.9.0 defaults add three norm variants and a
            # 2,048-token window)
            *(["--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output", "--full-attention-indices", "0"]
              if args.snapshots else []),
            *args.spec_args.split()]


def specforge_args(args, d, out: Path, nproc: int, threads: int) -> list[str]:
    cfg = {"model": {"target_model_path": str(d["verifier"]), "draft_num_hidden_layers": 1,
                     "lm_head_key": args.sf_lm_head_key, "aux_hidden_state_layer_ids": args.layers},
           "data": {"hidden_states_path": str(d["specforge"]), "cache_dir": str(d["root"] / "specforge-cache")},
           "training": {"num_epochs": args.epochs, "batch_size": args.sf_batch_size, "learning_rate": args.lr,
                        "ttt_length": args.ttt_steps, "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD",
                        "seed": args.seed},  # draft vocabulary: its default for EAGLE-3 is 32,000
           "deployment": {"trainer": {"nproc_per_node": nproc}}, "output_dir": str(out), "run_id": "bench"}
    if args.snapshots:  # a snapshot at every epoch's end (the shim takes it in place of its checkpoint)
        cfg["training"]["save_interval"] = max(1, len(d["lengths"]) // (args.sf_batch_size * nproc))
    out.mkdir(parents=True)
    (out / "specforge.json").write_text(json.dumps(cfg, indent=1))
    return [str(Path(args.peers_dir) / "sf_cpu_train.py"), "train", "-c", str(out / "specforge.json"),
            *args.sf_args.split()]


ARGS = {"eyas": eyas_args, "speculators": speculators_args, "specforge": specforge_args}


def run_one(args, d, trainer: str, nproc: int, threads: int, run_dir: Path) -> dict:
    """One epoch of one trainer in fresh processes; the parsed record (EyasError when it fails)."""
    shutil.rmtree(run_dir, ignore_errors=True)  # this bench's own earlier output
    run_dir.mkdir(parents=True)
    out = run_dir / "output"
    python = sys.executable if trainer == "eyas" else args.peers_python
    launch = [python] if nproc == 1 else [python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                          "--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    cmd = [*launch, str(Path(__file__).resolve()), SHIM, trainer, str(threads),
           *ARGS[trainer](args, d, out, nproc, threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", BENCH_SPEC_AUTOCAST=args.spec_autocast, BENCH_REPORT_DIR=str(run_dir),
               BENCH_SF_DRAFT_VOCAB=str(args.draft_vocab))
    if args.snapshots:
        env["BENCH_SNAPSHOT_DIR"] = str(run_dir / "snapshots")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=run_dir, check=False)
    wall = time.perf_counter() - t0
    (run_dir / "log.txt").write_text(f"$ {' '.join(cmd)}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}")
    if p.returncode != 0:
        from eyas.core.errors import EyasError

        raise EyasError(f"bench: {trainer} ({nproc} x {threads}) failed with status {p.returncode}",
                        p.stderr[-2500:], f"read {run_dir / 'log.txt'}")
    rec = parse_run(trainer, nproc, p.stdout, d, run_dir)
    rec.update(threads=threads, process_wall_s=wall, startup_and_teardown_s=wall - rec["epoch_s"],
               log=str(run_dir / "log.txt"))
    if args.accuracy:
        rec["curve"] = score_snapshots(args, d, trainer, run_dir / "snapshots")
    if args.export:
        rec["export"] = str(export_last(args, trainer, run_dir / "snapshots", Path(args.export) / run_dir.name))
    if args.snapshots and not args.keep_outputs:
        shutil.rmtree(run_dir / "snapshots", ignore_errors=True)  # a draft per epoch, tens of MB each
    if not args.keep_outputs:
        shutil.rmtree(out, ignore_errors=True)  # checkpoints, up to hundreds of MB per run
    return rec


def _snapshots(folder: Path) -> list[Path]:
    """A run's snapshots as its trainer saved them, oldest first (not the -eyas copies made of them)."""
    return sorted(p for p in folder.glob("*") if p.is_dir() and not p.name.endswith("-eyas"))


def _as_eyas(args, trainer: str, snap: Path) -> Path:
    """The snapshot as an eyas draft folder: eyas's own, or a peer's read once with `eyas import` into <snap>-eyas."""
    if trainer == "eyas":
        return snap
    from eyas.draft.importer import ImportConfig, run_import

    imported = snap.with_name(snap.name + "-eyas")
    if not imported.is_dir():  # run_one starts every run in an empty folder: an existing one is this run's
        run_import(ImportConfig(source=str(snap), out=str(imported), target=args.target, layers=tuple(args.layers),
                                overwrite=True, quiet=True))
    return imported


def export_last(args, trainer: str, folder: Path, out: Path) -> Path:
    """--export: the run's last snapshot (its final draft) as an eyas draft folder at `out`, a peer's read with
    `eyas import`, for `eyas evaluate --baselines`."""
    from eyas.core.errors import EyasError

    snaps = _snapshots(folder)
    if not snaps:
        raise EyasError(f"bench: {trainer} saved no draft in {folder}", fix="read its log.txt beside that folder")
    if out.exists():
        if not (out / "bench-source.json").is_file():
            raise EyasError(f"bench: --export would replace {out}, which this bench did not write",
                            fix="pass another --export folder, or move that one away")
        shutil.rmtree(out)  # this bench's own earlier export of the same run name
    shutil.copytree(_as_eyas(args, trainer, snaps[-1]), out)
    (out / "bench-source.json").write_text(json.dumps({"trainer": trainer, "snapshot": snaps[-1].name,
                                                       "command": " ".join(sys.argv)}, indent=1))
    return out


def score_snapshots(args, d: dict, trainer: str, folder: Path) -> list[dict]:
    """Every snapshot of a run scored on the held-out store by one evaluator, eyas's validation pass
    (eyas.train.heldout): a peer's snapshot is first read with `eyas import`. -> [{tag, train_s, acc_i, ...}]"""
    from eyas.draft.checkpoint import read_draft
    from eyas.train.heldout import held_out_accuracy

    curve, tags = [], set()
    for snap in _snapshots(folder):
        clock = json.loads((snap / "bench-clock.json").read_text())
        if clock["tag"] in tags:  # the same step saved twice
            continue
        tags.add(clock["tag"])
        got = held_out_accuracy(read_draft(_as_eyas(args, trainer, snap)), str(d["heldout"]), args.target,
                                args.ttt_steps)
        curve.append({"tag": clock["tag"], "train_s": clock["train_s"], **got})
    return curve


def time_to(curve: list[dict], acc: float) -> float | None:
    """Training seconds at which acc_0 on the held-out samples first reaches `acc`, interpolated linearly between
    snapshots (the first snapshot's time when it is already there); None if never."""
    before = None
    for pt in curve:
        a = pt["acc_i"][0]
        if a >= acc:
            if before is None or before[1] >= acc:
                return pt["train_s"]
            t0, a0 = before
            return t0 + (acc - a0) / (a - a0) * (pt["train_s"] - t0)
        before = (pt["train_s"], a)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_run(trainer: str, nproc: int, stdout: str, d: dict, run_dir: Path) -> dict:
    """Epoch time (slowest rank), tokens and samples per rank (the shim), steps per rank (the trainer's own log)."""
    ranks = sorted((json.loads(p.read_text()) for p in run_dir.glob(REPORT + "*.json")), key=lambda r: r["rank"])
    if len(ranks) != nproc:
        raise RuntimeError(f"bench: {trainer}: {len(ranks)} timed epochs reported for {nproc} ranks")
    if trainer == "specforge":  # feature-file index -> store row
        for r in ranks:
            r["samples"] = [int(Path(d["sf_files"][i]).stem.split("_")[1]) for i in r["samples"]]
    seen = [i for r in ranks for i in r["samples"]]
    epoch = max(r["epoch_s"] for r in ranks)
    rec = {"trainer": trainer, "nproc": nproc, "epoch_s": epoch, "epoch_s_per_rank": [r["epoch_s"] for r in ranks],
           "tokens": sum(d["lengths"][i] for i in seen), "samples_per_rank": [len(r["samples"]) for r in ranks],
           "coverage": {"distinct": len(set(seen)), "of": len(d["lengths"]), "repeats": len(seen) - len(set(seen))},
           "steps_per_rank": _steps(trainer, nproc, stdout), "threads_seen": [r["threads"] for r in ranks],
           "trainable_params": ranks[0]["trainable"], "peak_rss_mb": [round(r["peak_rss_mb"]) for r in ranks],
           "epoch_cpu_s": [r["cpu_s"] for r in ranks], "probe": re.findall(r"\[probe\][^\n]*", stdout)}
    rec["tokens_per_s"] = rec["tokens"] / epoch
    rec["others_cores"] = (ranks[0]["machine_busy_s"] - sum(rec["epoch_cpu_s"])) / ranks[0]["epoch_s"]
    return rec


def _steps(trainer: str, nproc: int, stdout: str) -> list[int]:
    if trainer == "eyas":
        summary = json.loads([x for x in stdout.splitlines() if x.startswith("{")][-1])
        return [summary["steps"]] * nproc  # every rank takes every optimizer step
    key = "steps_run" if trainer == "speculators" else "micro_steps_run"  # one write each, even if lines interleave
    found = {int(r): int(n) for r, n in re.findall(rf"\[probe\] rank=(\d+) (?:epoch=\d+ )?{key}=(\d+)", stdout)}
    return [found.get(r, -1) for r in range(nproc)]


def run_all(args, d: dict) -> list[dict]:
    """Every trainer and layout, `repeats` times, alternating; the order rotates every repeat."""
    plan = [(t, *map(int, lay.split("x"))) for lay in args.layouts for t in args.trainers]
    records = []
    for k in range(args.repeats):
        for trainer, nproc, threads in plan[k % len(plan):] + plan[:k % len(plan)]:
            name = f"{trainer}-{nproc}x{threads}-r{k + 1}"
            rec = {**run_one(args, d, trainer, nproc, threads, Path(args.out) / "runs" / name), "repeat": k + 1}
            records.append(rec)
            print(f"{name}: epoch {rec['epoch_s']:.1f} s, {rec['tokens']:,} tokens, {rec['tokens_per_s']:,.0f} tokens/s"
                  f"; steps/rank {rec['steps_per_rank']}, samples/rank {rec['samples_per_rank']}, threads "
                  f"{rec['threads_seen']}; process {rec['process_wall_s']:.0f} s; other processes used "
                  f"{rec['others_cores']:.2f} cores", flush=True)
    return records


# ---------------------------------------------------------------- summary

def summarise(records: list[dict], ttt: int, target_acc: float = 0.0) -> dict:
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["trainer"], r["nproc"], r["threads"]), []).append(r)
    rows = []
    for (trainer, nproc, threads), rs in groups.items():
        tps, ep = [r["tokens_per_s"] for r in rs], [r["epoch_s"] for r in rs]
        rows.append({"trainer": trainer, "layout": f"{nproc}x{threads}", "ttt": ttt, "runs": len(rs),
                     "epoch_s_median": statistics.median(ep), "epoch_s_range": [min(ep), max(ep)],
                     "tokens_per_s_median": statistics.median(tps), "tokens_per_s_range": [min(tps), max(tps)],
                     "others_cores_max": max(r["others_cores"] for r in rs),
                     **{k: rs[0][k] for k in ("tokens", "steps_per_rank", "samples_per_rank", "trainable_params")}})
    accuracy = None
    curves = [r for r in records if r.get("curve")]
    if curves:
        target = target_acc or min(max(pt["acc_i"][0] for pt in r["curve"]) for r in curves)
        for row in rows:
            rs = groups[row["trainer"], *map(int, row["layout"].split("x"))]
            times = [time_to(r["curve"], target) for r in rs]
            row["time_to_acc_s"] = statistics.median(times) if None not in times else None
            row["acc0_by_snapshot"] = [[round(pt["acc_i"][0], 4) for pt in r["curve"]] for r in rs]
            row["snapshot_s"] = [[round(pt["train_s"], 1) for pt in r["curve"]] for r in rs]
        accuracy = {"target_acc0": target, "heldout_samples": curves[0]["curve"][0]["samples"]}
    ratios = {}
    for layout in dict.fromkeys(r["layout"] for r in rows):
        by = {r["trainer"]: r["tokens_per_s_median"] for r in rows if r["layout"] == layout}
        peers = {t: v for t, v in by.items() if t != "eyas"}
        if "eyas" in by and peers:
            best = max(peers, key=peers.get)
            ratios[layout] = {"eyas": by["eyas"], "faster_peer": best, "peer": peers[best],
                              "ratio": by["eyas"] / peers[best]}
            times = {r["trainer"]: r.get("time_to_acc_s") for r in rows if r["layout"] == layout}
            if accuracy and times["eyas"] and any(times[t] for t in peers):
                quick = min((t for t in peers if times[t]), key=times.get)
                ratios[layout]["time_to_acc"] = {"eyas_s": times["eyas"], "faster_peer": quick,
                                                 "peer_s": times[quick], "ratio": times[quick] / times["eyas"]}
    return {"rows": rows, "ratios": ratios, "accuracy": accuracy}


def print_table(summary: dict) -> None:
    print(f"\n{'trainer':<12} {'procs x threads':<16} {'TTT':>3}  {'epoch wall s':<20} {'tokens/s':<22} "
          f"{'steps/rank':<11} {'samples/rank':<13} {'trainable':<10} others")
    for r in summary["rows"]:
        ep = "{:.1f} [{:.1f}-{:.1f}]".format(r["epoch_s_median"], *r["epoch_s_range"])
        tp = "{:,.0f} [{:,.0f}-{:,.0f}]".format(r["tokens_per_s_median"], *r["tokens_per_s_range"])
        print(f"{r['trainer']:<12} {r['layout'].replace('x', ' x '):<16} {r['ttt']:>3}  {ep:<20} {tp:<22} "
              f"{'/'.join(map(str, r['steps_per_rank'])):<11} {'/'.join(map(str, r['samples_per_rank'])):<13} "
              f"{r['trainable_params'] / 1e6:<10.1f} {r['others_cores_max']:.2f} cores")
    for layout, q in summary["ratios"].items():
        print(f"eyas / faster peer ({q['faster_peer']}), {layout.replace('x', ' x ')}, medians: "
              f"{q['eyas']:,.0f} / {q['peer']:,.0f} tokens/s = {q['ratio']:.2f}x")
    acc = summary.get("accuracy")
    if not acc:
        return
    print(f"\nacc_0 on {acc['heldout_samples']} held-out conversations (eyas's validation pass for every draft), at "
          f"each snapshot (training seconds in brackets); the common target is {acc['target_acc0']:.4f}")
    for r in summary["rows"]:
        curves = "; ".join(" ".join(f"{a:.3f} ({t:.0f} s)" for a, t in zip(accs, secs))
                           for accs, secs in zip(r["acc0_by_snapshot"], r["snapshot_s"]))
        took = f"{r['time_to_acc_s']:.1f} s" if r.get("time_to_acc_s") else "not reached in every run"
        print(f"  {r['trainer']:<12} {r['layout']:<5} to {acc['target_acc0']:.4f}: {took:<26} {curves}")
    for layout, q in summary["ratios"].items():
        t = q.get("time_to_acc")
        if t:
            print(f"time to acc_0 {acc['target_acc0']:.4f}, {layout.replace('x', ' x ')}, medians: faster peer "
                  f"({t['faster_peer']}) {t['peer_s']:.1f} s / eyas {t['eyas_s']:.1f} s = {t['ratio']:.2f}x")


# ---------------------------------------------------------------- main

def check_peers(python: str) -> None:
    from eyas.core.errors import EyasError

    if not (Path(python).is_file() and subprocess.run([python, "-c", "import speculators, specforge"],
                                                      capture_output=True, check=False).returncode == 0):
        raise EyasError(f"no Python with speculators and SpecForge at {python}",
                        "the peers need a venv of their own: their pins conflict with eyas's",
                        f"build it as {PEERS_DIR / 'README.md'} says under \"Install\" (python3 -m venv "
                        "/tmp/peers-venv, then its pip lines, run beside pin.txt), or pass --peers-python")


def parse_args(argv: list[str]):
    from eyas.core.paths import shared_data_dir

    data = shared_data_dir()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=300, help="the first N GSM8K train conversations")
    ap.add_argument("--gsm8k", default=str(data / "gsm8k" / "train.jsonl") if data else "", help="GSM8K train JSONL")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--layers", type=int, nargs=3, default=[2, 15, 27], help="HF hidden-state indices of the features")
    ap.add_argument("--extract-dtype", default="bf16", choices=("bf16", "fp32"), help="the target's forward pass")
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--repeats", type=int, default=3, help="runs of every trainer and layout, alternated")
    ap.add_argument("--layouts", nargs="+", default=["1x2"], help="processes x threads per process: 1x2, 2x1")
    ap.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS)
    ap.add_argument("--peers-python", default="/tmp/peers-venv/bin/python")
    ap.add_argument("--peers-dir", default=str(PEERS_DIR), help="holds spec_cpu_train.py and sf_cpu_train.py")
    ap.add_argument("--spec-total-seq-len", type=int, default=512,
                    help="speculators' packing length (the peers' README measured 512); raised to the longest sample")
    ap.add_argument("--spec-autocast", default="cpu", choices=("cpu", "as-shipped"),
                    help="cpu: speculators' bf16 autocast runs on the CPU, as it does on GPUs; as-shipped: it names "
                         "cuda, a no-op here (fp32 compute)")
    ap.add_argument("--sf-batch-size", type=int, default=1, help="SpecForge training.batch_size (its default)")
    ap.add_argument("--sf-lm-head-key", default="model.embed_tokens.weight", help="SmolLM2 ties its output head")
    ap.add_argument("--eyas-args", default="", help="extra `eyas train` flags, e.g. '--micro-batch 8'")
    ap.add_argument("--spec-args", default="", help="extra speculators flags")
    ap.add_argument("--sf-args", default="", help="extra SpecForge dotted overrides, e.g. training.batch_size=2")
    ap.add_argument("--keep-outputs", action="store_true", help="keep the trainers' checkpoints")
    ap.add_argument("--accuracy", action="store_true",
                    help="time to accuracy: a snapshot of each draft at every epoch's end, scored on held-out samples")
    ap.add_argument("--epochs", type=int, default=0, help="epochs per run (0: 1, or 4 with --accuracy)")
    ap.add_argument("--heldout", type=int, default=0,
                    help="held-out GSM8K conversations after the training ones (0: none, or 50 with --accuracy)")
    ap.add_argument("--target-acc", type=float, default=0.0,
                    help="the common acc_0 to reach (0: the highest every run reached)")
    ap.add_argument("--store", default="",
                    help="train on this eyas store (e.g. a recipe's runs/<name>/store) instead of GSM8K conversations")
    ap.add_argument("--data-fraction", type=float, default=1.0,
                    help="with --store: the seeded share `eyas train --data-fraction` takes (every trainer, same rows)")
    ap.add_argument("--heldout-store", default="", help="with --store --accuracy: the held-out store scored")
    ap.add_argument("--seed", type=int, default=0, help="every trainer's seed (and the share's)")
    ap.add_argument("--export", default="",
                    help="keep each run's final draft in eyas's format under EXPORT/<run> (peers through `eyas "
                         "import`), for `eyas evaluate --baselines`")
    ap.add_argument("--out", default="/tmp/eyas-bench-peers")
    a = ap.parse_args(argv)
    if a.store and a.accuracy and not a.heldout_store:
        ap.error("--store with --accuracy needs --heldout-store (e.g. runs/smollm2-recipe/val-store)")
    if a.heldout_store and not (a.store and a.accuracy):
        ap.error("--heldout-store is scored only with --store and --accuracy")
    if a.store and (a.heldout or a.samples != ap.get_default("samples")):
        ap.error("--samples and --heldout choose GSM8K conversations: with --store, use --data-fraction and "
                 "--heldout-store")
    owned = {"--seed", "--data-fraction", "--val-fraction", "--val-store", "--store", "--epochs", "--threads"}
    clash = sorted(owned & {x.split("=")[0] for x in a.eyas_args.split()})
    if clash:  # they choose the samples or the epochs, which every trainer must share
        ap.error(f"--eyas-args sets {' '.join(clash)}, which the bench sets for every trainer alike: use the bench's "
                 "own options")
    if not 0 < a.data_fraction <= 1 or (a.data_fraction < 1 and not a.store):
        ap.error("--data-fraction is a share in (0, 1] of a --store")
    a.snapshots = a.accuracy or bool(a.export)
    a.epochs = a.epochs or (4 if a.accuracy else 1)
    a.heldout = a.heldout or (50 if a.accuracy and not a.store else 0)
    return a


def main() -> None:
    if sys.argv[1:2] == [SHIM]:
        return _shim(sys.argv[2:])
    from eyas.core.errors import EyasError
    from eyas.core.files import write_json

    args = parse_args(sys.argv[1:])
    t0 = time.perf_counter()
    if os.getloadavg()[0] > 1.0:
        print(f"bench: the machine is busy (load average {os.getloadavg()[0]:.1f}): expect noisy figures", flush=True)
    try:
        check_peers(args.peers_python)
        d = build_data(args)
        records = run_all(args, d)
    except EyasError as e:
        sys.exit(f"bench: error: {e}")
    summary = summarise(records, args.ttt_steps, args.target_acc)
    print_table(summary)
    out = Path(args.out) / "bench_peers.json"
    write_json(out, {"settings": vars(args), "command": " ".join(sys.argv), "data": str(d["root"]),
                     "samples": len(d["lengths"]), "tokens_in_store": sum(d["lengths"]), **summary, "runs": records,
                     "bench_wall_s": time.perf_counter() - t0})
    print(f"-> {out} ({time.perf_counter() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
