"""bench_peers.py's trainer processes start through this file: `peers_shim.py TRAINER THREADS ARGS...` wraps the
trainer's own one-epoch function with a wall clock (eyas `Trainer.train_epoch`, speculators `Trainer.train_epoch`,
SpecForge `TrainerController.fit`), then runs the trainer as usual: eyas's `train` command, or a peer's wrapper
script (ARGS[0]) with the rest of ARGS. Each rank writes its record to $BENCH_REPORT_DIR/bench-epoch-rank<r>.json;
with $BENCH_SNAPSHOT_DIR set, the draft is saved at each epoch's end, the clock stopped meanwhile.

It runs in either venv (eyas's or the peers'), so it imports nothing but the standard library at the top.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

REPORT = "bench-epoch-rank"  # <run>/bench-epoch-rank<r>.json, one per rank (ranks share stdout)


def main(argv: list[str]) -> None:
    """`peers_shim.py TRAINER THREADS ARGS...`: time the trainer's epoch function, then run it as usual."""
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


if __name__ == "__main__":
    main(sys.argv[1:])
