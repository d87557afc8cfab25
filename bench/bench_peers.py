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
torch.set_num_threads at the layout's threads per rank. Every trainer process starts through peers_shim.py,
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

import dataclasses
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

from peers_data import build_data
from peers_runs import run_all, time_to

from eyas.core.config import check, opt, parse
from eyas.core.errors import EyasError
from eyas.core.files import write_json
from eyas.core.options import target_opt
from eyas.data.builtin import builtin_file

PEERS_DIR = Path(__file__).resolve().parents[2] / "shared" / "peers"
TRAINERS = ("eyas", "speculators", "specforge")
SAMPLES = 300  # --samples's default: with --store, any other value is refused
OWNED = {"--seed", "--data-fraction", "--val-fraction", "--val-store", "--store", "--epochs", "--threads"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeersConfig:
    samples: int = opt(SAMPLES, "the first N GSM8K train conversations")
    gsm8k: str = opt("", "GSM8K train JSONL (empty: the copy eyas ships, gsm8k-train)")
    target: str = target_opt()
    layers: tuple[int, ...] = opt((2, 15, 27), "HF hidden-state indices of the features (three)")
    extract_dtype: Literal["bf16", "fp32"] = opt("bf16", "the target's forward pass")
    ttt_steps: int = opt(3, "every trainer's TTT steps")
    draft_vocab: int = opt(32000, "every trainer's draft vocabulary")
    lr: float = opt(1e-4, "every trainer's learning rate")
    repeats: int = opt(3, "runs of every trainer and layout, alternated")
    layouts: tuple[str, ...] = opt(("1x2",), "processes x threads per process: 1x2, 2x1")
    trainers: tuple[str, ...] = opt(TRAINERS, "the trainers run", choices=TRAINERS)
    peers_python: str = opt("/tmp/peers-venv/bin/python", "the python of the peers' venv (speculators, SpecForge)")
    peers_dir: str = opt(str(PEERS_DIR), "holds spec_cpu_train.py and sf_cpu_train.py")
    spec_total_seq_len: int = opt(512, "speculators' packing length (the peers' README measured 512); raised to the "
                                       "longest sample")
    spec_autocast: Literal["cpu", "as-shipped"] = opt(
        "cpu", "cpu: speculators' bf16 autocast runs on the CPU, as it does on GPUs; as-shipped: it names cuda, a "
               "no-op here (fp32 compute)")
    sf_batch_size: int = opt(1, "SpecForge training.batch_size (its default)")
    sf_lm_head_key: str = opt("model.embed_tokens.weight", "SmolLM2 ties its output head")
    eyas_args: str = opt("", "extra `eyas train` flags, e.g. '--micro-batch 8'")
    spec_args: str = opt("", "extra speculators flags")
    sf_args: str = opt("", "extra SpecForge dotted overrides, e.g. training.batch_size=2")
    keep_outputs: bool = opt(False, "keep the trainers' checkpoints")
    accuracy: bool = opt(False, "time to accuracy: a snapshot of each draft at every epoch's end, scored on held-out "
                                "samples")
    epochs: int = opt(0, "epochs per run (0: 1, or 4 with --accuracy)")
    heldout: int = opt(0, "held-out GSM8K conversations after the training ones (0: none, or 50 with --accuracy)")
    target_acc: float = opt(0.0, "the common acc_0 to reach (0: the highest every run reached)")
    store: str = opt("", "train on this eyas store (e.g. a recipe's runs/<name>/store) instead of GSM8K conversations")
    data_fraction: float = opt(1.0, "with --store: the seeded share `eyas train --data-fraction` takes (every "
                                    "trainer, same rows)")
    heldout_store: str = opt("", "with --store --accuracy: the held-out store scored")
    seed: int = opt(0, "every trainer's seed (and the share's)")
    export: str = opt("", "keep each run's final draft in eyas's format under EXPORT/<run> (peers through `eyas "
                          "import`), for `eyas evaluate --baselines`")
    out: str = opt("/tmp/eyas-bench-peers", "the bench's folder: bench_peers.json and runs/")

    def __post_init__(self):
        check(len(self.layers) == 3, f"--layers {' '.join(map(str, self.layers))}: not three indices",
              "give the three feature layers, e.g. --layers 2 15 27")
        check(bool(self.trainers), "--trainers given no value", "name one trainer or more, or leave it out")
        bad = [x for x in self.layouts if not re.fullmatch(r"[1-9]\d*x[1-9]\d*", x)]
        check(bool(self.layouts), "--layouts given no value", "give one layout or more, e.g. --layouts 1x2 2x1")
        check(not bad, f"--layouts {' '.join(bad)}: not PROCESSESxTHREADS", "give layouts such as --layouts 1x2 2x1")
        check(not (self.store and self.accuracy and not self.heldout_store),
              "--store with --accuracy needs --heldout-store", "e.g. --heldout-store runs/smollm2-recipe/val-store")
        check(not self.heldout_store or bool(self.store and self.accuracy),
              "--heldout-store is scored only with --store and --accuracy", "add them, or leave --heldout-store out")
        check(not (self.store and (self.heldout or self.samples != SAMPLES)),
              "--samples and --heldout choose GSM8K conversations", "with --store, use --data-fraction and "
              "--heldout-store")
        clash = sorted(OWNED & {x.split("=")[0] for x in self.eyas_args.split()})
        # they choose the samples or the epochs, which every trainer must share
        check(not clash, f"--eyas-args sets {' '.join(clash)}, which the bench sets for every trainer alike",
              "use the bench's own options")
        check(0 < self.data_fraction <= 1 and (self.data_fraction == 1 or bool(self.store)),
              f"--data-fraction {self.data_fraction:g} is not a share in (0, 1] of a --store",
              "give --store with a share, or leave --data-fraction out")

    @property
    def snapshots(self) -> bool:
        """Save each draft at every epoch's end (--accuracy scores them, --export keeps the last)."""
        return self.accuracy or bool(self.export)

    def settled(self) -> PeersConfig:
        """The defaults that depend on other settings, filled in: --epochs 0 is 1 (4 with --accuracy), --heldout 0
        is 50 with --accuracy on GSM8K, an empty --gsm8k the copy eyas ships (gsm8k-train)."""
        return dataclasses.replace(self, gsm8k=self.gsm8k or str(builtin_file("gsm8k-train")),
                                   epochs=self.epochs or (4 if self.accuracy else 1),
                                   heldout=self.heldout or (50 if self.accuracy and not self.store else 0))


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
    if not (Path(python).is_file() and subprocess.run([python, "-c", "import speculators, specforge"],
                                                      capture_output=True, check=False).returncode == 0):
        raise EyasError(f"no Python with speculators and SpecForge at {python}",
                        "the peers need a venv of their own: their pins conflict with eyas's",
                        f"build it as {PEERS_DIR / 'README.md'} says under \"Install\" (python3 -m venv "
                        "/tmp/peers-venv, then its pip lines, run beside pin.txt), or pass --peers-python")


def main() -> None:
    args = parse(PeersConfig, description=__doc__).settled()
    t0 = time.perf_counter()
    if os.getloadavg()[0] > 1.0:
        print(f"bench: the machine is busy (load average {os.getloadavg()[0]:.1f}): expect noisy figures", flush=True)
    try:
        check_peers(args.peers_python)
        args, d = build_data(args)
        records = run_all(args, d)
    except EyasError as e:
        sys.exit(f"bench: error: {e}")
    summary = summarise(records, args.ttt_steps, args.target_acc)
    print_table(summary)
    out = Path(args.out) / "bench_peers.json"
    write_json(out, {"settings": {**dataclasses.asdict(args), "snapshots": args.snapshots},
                     "command": " ".join(sys.argv), "data": str(d["root"]),
                     "samples": len(d["lengths"]), "tokens_in_store": sum(d["lengths"]), **summary, "runs": records,
                     "bench_wall_s": time.perf_counter() - t0})
    print(f"-> {out} ({time.perf_counter() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
