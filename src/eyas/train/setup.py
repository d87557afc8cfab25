"""Setting a training run up: process tuning, sources, target check, draft vocabulary, model, plan, resume.

`setup(trainer)` fills the Trainer's fields (eyas.train.trainer) in this order:
1. the process: threads per rank, glibc allocator settings, seed;
2. the resume point (rank 0 picks the newest complete checkpoint; every rank loads it), refused under a different
   world size or changed settings (eyas.draft.checkpoint.check_resumable);
3. the data: the store (or the prepared dataset with --online) and the validation source;
4. the target: its identity must equal the store's; its embeddings and output-head rows are taken, then (offline)
   it is freed;
5. the draft vocabulary: rank 0 counts the loss-masked training tokens, everyone receives the map;
6. the draft, wrapped for DDP/FSDP2, its optimizer (restored on resume);
7. the plan block (eyas.train.plan.compute_plan, checked against the sampler's own counts) and the metrics writer.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from eyas.core import dist
from eyas.core.errors import EyasError
from eyas.core.log import fmt_int, write_json
from eyas.core.target import load_target
from eyas.draft.checkpoint import (
    check_resumable,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_partial,
    set_rng_state,
)
from eyas.draft.model import DraftConfig, Eagle3Draft
from eyas.draft.ttt import step_weights
from eyas.draft.vocab import build_draft_vocab, count_tokens
from eyas.store.extract import tune_allocator
from eyas.train.data import (
    PreparedSource,
    Subset,
    check_store_data,
    open_store,
    split_holdout,
)
from eyas.train.engine import (
    TTTObjective,
    load_optimizer_state,
    make_optimizer,
    resolve_dtype,
    wrap,
)
from eyas.train.plan import compute_plan
from eyas.train.sharding import ShardSpec, epoch_units

METRICS, VALIDATION = "metrics.jsonl", "validation.jsonl"


def setup(t) -> None:
    cfg, env = t.cfg, t.env
    t.threads = tune_process(cfg.threads, env)
    torch.manual_seed(cfg.seed)

    t.out, t.dtype, t.tag, t.bar = Path(cfg.out), resolve_dtype(cfg.dtype, env.device), "", None
    ckpt = resume_point(t)
    t.train_src, t.val_src = sources(cfg)
    skipped_data(t, ckpt)
    target = load_checked_target(t)
    build_model(t, target, ckpt)
    t.target = target if cfg.online else None
    make_plan(t)
    counters(t, ckpt)
    t.metrics = MetricsLog(t.out, t.step, cfg.tensorboard) if env.is_main else NullMetrics()


def skipped_data(t, ckpt) -> None:
    """Say which store samples --skip-bad-shards left out, and refuse to resume on other data than the
    checkpoint's: the epoch order, and the position within it, are computed over the samples."""
    reader = getattr(t.train_src, "source", t.train_src)  # a Subset's store, when validation is held out
    skipped = getattr(reader, "skipped", 0)
    bad = getattr(reader, "bad_shards", {}) if skipped else {}
    t.data_record = {"samples": len(reader), "skipped_samples": skipped, "skipped_shards": sorted(bad)}
    if skipped:
        t.con.print(f"store: {fmt_int(skipped)} samples left out (--skip-bad-shards), those of {len(bad)} shard(s): "
                    + "; ".join(f"{n} {why}" for n, why in list(bad.items())[:3]) + (" ..." if len(bad) > 3 else ""),
                    force=True)
    before = ckpt[3].get("data") if ckpt else None
    if before is not None and before != t.data_record:
        raise EyasError(f"cannot resume {ckpt[0]}: the training data changed since the run that wrote it "
                        f"({before['samples']:,} samples then, shards left out {before['skipped_shards'] or 'none'}; "
                        f"{t.data_record['samples']:,} now, left out {t.data_record['skipped_shards'] or 'none'})",
                        "the epoch order and the position within it are computed over the samples",
                        "restore the store as it was when the run started, or start a new run in another --out "
                        "folder")


def tune_process(threads: int, env) -> int:
    """Threads per rank (the node's cores shared among its ranks), and glibc told to keep freed memory
    (eyas.store.extract.tune_allocator: otherwise every step page-faults its large logit buffers in again; measured here
    2-3x slower casts and weight-gradient matmuls)."""

    if not env.device.startswith("cuda"):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = threads or max(1, cores // max(1, env.local_world_size))
        torch.set_num_threads(threads)
    tune_allocator()
    return threads or torch.get_num_threads()


def resume_point(t):
    """(folder, model state, optimizer state, trainer state) to resume from, or None. Rank 0 decides."""

    cfg, env = t.cfg, t.env
    choice = None
    if env.is_main:
        if cfg.resume:
            remove_partial(t.out)
            found = latest_checkpoint(t.out)
            choice = str(found) if found else None
            if not found:
                t.con.print(f"resume: no checkpoint in {t.out / 'checkpoints'}: starting from step 0")
        elif (t.out / METRICS).exists() or list_checkpoints(t.out):
            choice = "exists"
    choice = dist.all_gather_objects(choice, env)[0]
    if choice == "exists":
        raise EyasError(f"{t.out} already holds a training run (metrics.jsonl or checkpoints)",
                        "starting over there would mix two runs' logs",
                        "pass --resume to continue it, or give another --out folder")
    if choice is None:
        return None
    if not Path(choice).is_dir():
        raise EyasError(f"rank {env.rank} cannot see the checkpoint {choice}",
                        "rank 0 chose it, but this node's file system does not have it",
                        "put --out on a file system every node shares")
    model_state, optim_state, state = load_checkpoint(choice)
    check_resumable(Path(choice), state, cfg.to_dict(), env.world_size)
    t.con.print(f"resume: {choice} (step {fmt_int(state['step'])}, epoch {state['epoch'] + 1}, "
                f"step {fmt_int(state['step_in_epoch'])} within it)")
    return Path(choice), model_state, optim_state, state


def sources(cfg):
    """(training source, validation source or None)."""

    if cfg.online:
        train = PreparedSource(cfg.data, "train")
        has_val = (Path(cfg.data) / "validation" / "state.json").is_file()
        val = PreparedSource(cfg.data, "validation") if has_val else None
        val = val if val is not None and len(val) else None
    else:
        train = open_store(cfg.store, cfg.skip_bad_shards)
        if cfg.data:  # the store must hold this prepared dataset's tokens
            check_store_data(train, cfg.data)
        val = open_store(cfg.val_store, cfg.skip_bad_shards) if cfg.val_store else None
    if len(train) == 0:
        raise EyasError(f"the training data {cfg.data if cfg.online else cfg.store} has no samples",
                        fix="extract (or prepare) some data first")
    if val is None and cfg.val_fraction > 0:
        keep, held = split_holdout(len(train), cfg.val_fraction, cfg.seed)
        train, val = Subset(train, keep), Subset(train, held)
    return train, val


def store_layers(src) -> list[int] | None:
    for holder in (src, getattr(src, "source", None)):
        ids = getattr(holder, "layer_ids", None) if holder is not None else None
        if ids:
            return [int(i) for i in ids]
    ident = getattr(src, "identity", None) or {}
    return [int(i) for i in ident["layer_ids"]] if ident.get("layer_ids") else None


def load_checked_target(t):
    """The target, refused unless the store was extracted from it; sets the feature layer ids."""

    cfg = t.cfg
    online_bf16 = cfg.online and t.dtype == "bf16"
    target = load_target(cfg.target, device=t.env.device if cfg.online else "cpu",
                         dtype="bfloat16" if online_bf16 else "float32")
    for src in (t.train_src, t.val_src):
        if src is not None:
            src.check_target(target.identity())
    t.layer_ids = (target.default_feature_layers() if cfg.online else store_layers(t.train_src)
                   or target.default_feature_layers())
    return target


def build_vocab(t, vocab_size: int) -> dict:
    """Rank 0 counts the loss-masked training tokens and picks the top K; every rank gets the same map."""

    payload = None
    if t.env.is_main:
        src = t.train_src
        pairs = ((src[i].input_ids.numpy(), src[i].loss_mask.numpy()) for i in range(len(src)))
        v = build_draft_vocab(count_tokens(pairs, vocab_size), min(t.cfg.draft_vocab, vocab_size))
        payload = {"d2t": v.d2t.tolist(), "coverage": v.coverage, "distinct_seen": v.distinct_seen, "size": v.size}
    return dist.all_gather_objects(payload, t.env)[0]


def build_model(t, target, ckpt) -> None:
    """The draft (initialised from the target, or the checkpoint's weights), wrapped; optimizer; frozen head."""

    cfg, env = t.cfg, t.env
    embed = target.embed_tokens().weight.detach().float().cpu()  # [V,H]
    head = target.lm_head().weight.detach().float().cpu()  # [V,H]
    if ckpt:
        t.vocab_info = ckpt[3]["vocab"]
        d2t = ckpt[1]["d2t"]
    else:
        t.vocab_info = build_vocab(t, target.vocab_size)
        d2t = torch.tensor(t.vocab_info["d2t"], dtype=torch.long)
    t.vocab_info.pop("d2t", None)
    t.draft_cfg = DraftConfig.for_target(target, int(d2t.numel()), t.layer_ids, cfg.num_layers)
    draft = Eagle3Draft(t.draft_cfg)
    if ckpt:
        draft.load_state_dict(ckpt[1])
    else:
        draft.init_weights(embed, head, d2t, seed=cfg.seed)
    compute = torch.float32 if t.dtype == "fp32" else torch.bfloat16
    t.head_rows = head[draft.target_ids()].to(env.device, compute)  # [Vd,H] frozen: the target's distribution
    if cfg.freeze_head:
        draft.lm_head.weight.requires_grad_(False)
    draft.to(env.device)
    t.t2d = draft.t2d
    t.model = wrap(TTTObjective(draft, cfg.ttt_steps), cfg.parallel, env)
    t.params = [p for p in t.model.parameters() if p.requires_grad]
    t.optimizer = make_optimizer(t.model, cfg.lr, cfg.weight_decay, env.device)
    if ckpt:
        load_optimizer_state(t.model, t.optimizer, ckpt[2])

    t.weights = step_weights(cfg.ttt_steps, cfg.step_decay)  # [k]


def make_plan(t) -> None:
    """The sampler's spec, the optimizer-step counts (compute_plan's, per epoch: packing varies them), the
    schedule length, and the plan block on the console and in RUN/plan.json."""

    cfg, env = t.cfg, t.env
    t.spec = ShardSpec(world_size=env.world_size, micro_batch=cfg.micro_batch, grad_accum=cfg.grad_accum,
                       seed=cfg.seed, shuffle=cfg.shuffle, drop_remainder=cfg.drop_remainder,
                       max_tokens=cfg.max_tokens, group_window=cfg.group_window, sharded=cfg.shard_data)
    lengths = np.asarray(t.train_src.lengths)
    world = env.world_size if cfg.shard_data else 1  # unsharded, every rank runs all of it
    units = [len(epoch_units(lengths, e, t.spec)) if cfg.max_tokens else len(lengths) for e in range(cfg.epochs)]
    t.steps_per_epoch = [compute_plan(u, world, cfg.micro_batch, cfg.grad_accum, 1, cfg.drop_remainder)
                         .optimizer_steps_per_epoch for u in units]
    planned = sum(t.steps_per_epoch)
    t.total_steps = min(planned, cfg.max_steps) if cfg.max_steps else planned
    t.warmup_steps = int(cfg.warmup_ratio * t.total_steps)
    t.plan = compute_plan(units[0], env.world_size, cfg.micro_batch, cfg.grad_accum, cfg.epochs,
                          cfg.drop_remainder, tokens=int(lengths.sum()))
    lines = []
    if cfg.max_tokens:
        lines.append(f"packing: {fmt_int(len(lengths))} samples -> {fmt_int(units[0])} sequences of at most "
                     f"{fmt_int(cfg.max_tokens)} tokens in epoch 1 (global); the plan's samples are these sequences")
    lines += t.plan.lines()
    if planned != t.plan.optimizer_steps_total or t.total_steps != planned:
        lines.append(f"plan: this run takes {fmt_int(t.total_steps)} optimizer steps (global)"
                     + (f": --max-steps {cfg.max_steps} of {fmt_int(planned)} planned" if cfg.max_steps else
                        f"; per epoch {', '.join(fmt_int(s) for s in t.steps_per_epoch)} (packing varies)"))
    v = t.vocab_info
    lines.append(f"plan: draft vocabulary {fmt_int(v['size'])} tokens covering {100 * v['coverage']:.2f}% of the "
                 f"loss-masked training tokens ({fmt_int(v['distinct_seen'])} distinct ids seen)")
    lines.append(f"plan: {env.world_size} ranks x {t.threads} threads, {t.dtype}, "
                 f"{cfg.parallel if env.distributed else 'one process'}, device {env.device}, TTT {cfg.ttt_steps}, "
                 f"warmup {fmt_int(t.warmup_steps)} steps, then cosine to step {fmt_int(t.total_steps)}")
    for line in lines:
        t.con.print(line)
    t.plan_json = {**t.plan.to_dict(), "optimizer_steps_run": t.total_steps, "steps_per_epoch_actual":
                   t.steps_per_epoch, "max_tokens": cfg.max_tokens, "units_per_epoch": units, "vocab": v,
                   "dtype": t.dtype, "threads_per_rank": t.threads, "parallel": cfg.parallel, "lines": lines,
                   "data": t.data_record}
    if env.is_main:
        write_json(t.out / "plan.json", t.plan_json)


def counters(t, ckpt) -> None:
    """Step, data position and running totals: zero, or the checkpoint's (and this rank's RNG states)."""

    st = ckpt[3] if ckpt else {}
    t.step, t.epoch, t.step_in_epoch = st.get("step", 0), st.get("epoch", 0), st.get("step_in_epoch", 0)
    t.samples_seen, t.tokens_seen = st.get("samples_seen_global", 0), st.get("tokens_seen_global", 0)
    t.epoch_samples = st.get("epoch_samples_global", 0)
    t.elapsed0, t.t0 = float(st.get("elapsed_s", 0.0)), time.perf_counter()
    t.tokens_run, t.last, t.val, t.step_times = 0, None, None, []
    t.data_wait_s = t.loop_s = t.epoch_loop_s = t.epoch_wait_s = 0.0
    t.audits = {}
    if ckpt:
        set_rng_state(st["rng"][t.env.rank])
        prev = ckpt[3].get("training", {})
        t.val = prev.get("validation")
        audit_file = t.out / "audit.json"
        if audit_file.is_file():
            t.audits = json.loads(audit_file.read_text()).get("epochs", {})


class MetricsLog:
    """Rank 0's metrics: RUN/metrics.jsonl (one JSON object per optimizer step), RUN/validation.jsonl, and
    optionally TensorBoard. On resume, lines past the checkpoint's step (written before the crash) are dropped,
    so every step appears once."""

    def __init__(self, out: Path, step: int, tensorboard: bool):
        out.mkdir(parents=True, exist_ok=True)
        self.files = {}
        for name in (METRICS, VALIDATION):
            path = out / name
            if path.exists():
                _truncate_after(path, step)
            self.files[name] = open(path, "a", encoding="utf-8")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional dependency (--tensorboard)
            except ImportError:
                raise EyasError("--tensorboard needs the tensorboard package", fix="pip install tensorboard") from None
            self.tb = SummaryWriter(str(out / "tensorboard"))

    def write(self, rec: dict) -> None:
        self._line(METRICS, rec)
        if self.tb is not None:
            for key in ("loss", "lr", "tokens_per_s", "grad_norm"):
                self.tb.add_scalar(f"train/{key}", rec[key], rec["step"])
            for i, (loss, acc) in enumerate(zip(rec["loss_i"], rec["acc_i"])):
                self.tb.add_scalar(f"train/loss_{i}", loss, rec["step"])
                self.tb.add_scalar(f"train/acc_{i}", acc, rec["step"])

    def write_validation(self, rec: dict) -> None:
        self._line(VALIDATION, rec)
        if self.tb is not None:
            self.tb.add_scalar("val/loss", rec["loss"], rec["step"])
            for i, acc in enumerate(rec["acc_i"]):
                self.tb.add_scalar(f"val/acc_{i}", acc, rec["step"])

    def _line(self, name: str, rec: dict) -> None:
        f = self.files[name]
        f.write(json.dumps(rec) + "\n")
        f.flush()

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        if self.tb is not None:
            self.tb.close()


class NullMetrics:
    """What non-zero ranks get: nothing is written."""

    def write(self, rec: dict) -> None:
        pass

    def write_validation(self, rec: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _truncate_after(path: Path, step: int) -> None:
    """Keep the complete lines whose step is <= `step` (atomically: temp file, fsync, rename)."""
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by the crash
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
            keep.append(line)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in keep))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
