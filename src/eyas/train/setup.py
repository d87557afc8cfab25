"""Setting a training run up: process tuning, sources, target check, draft vocabulary, model, plan, resume.

`setup(cfg, env, con)` builds a run's `TrainParts` (what eyas.train.trainer.Trainer works with) in this order:
1. the process: threads per rank, glibc allocator settings, seed;
2. the resume point (rank 0 picks the newest complete checkpoint; every rank loads it), refused under a different
   world size or changed settings (eyas.draft.checkpoint.check_resumable);
3. the data: the store (or the prepared dataset with --online) and the validation source;
4. the target: its identity must equal the store's. Offline, only its config, embeddings and output head are read
   (eyas.core.weights: no decoder layer, whatever the target's size); online, the whole target is loaded;
5. the draft vocabulary: the ranks count the loss-masked training token ids between them (no hidden state is
   read) and sum the counts;
6. the draft, wrapped for DDP/FSDP2, its optimizer (restored on resume);
7. the plan block (eyas.train.plan.compute_plan, checked against the sampler's own counts) and the metrics writer.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from eyas.core import dist
from eyas.core.errors import EyasError
from eyas.core.files import read_json, write_json
from eyas.core.log import fmt_int
from eyas.core.memory import tune_allocator
from eyas.core.options import trusted_code_line
from eyas.core.target import Target, load_target
from eyas.core.threads import Threads
from eyas.core.weights import load_target_shell, read_module
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
from eyas.train.batches import (
    PreparedSource,
    Subset,
    check_store_data,
    nested_share,
    open_store,
    split_holdout,
)
from eyas.train.heldout import store_feature_layers
from eyas.train.objective import TTTObjective, choose_path, resolve_dtype
from eyas.train.optimizer import make_optimizer
from eyas.train.parallelize import load_optimizer_state, wrap
from eyas.train.plan import Plan, compute_plan
from eyas.train.sharding import ShardSpec, epoch_units
from eyas.train.state import ResumePoint, TrainerState
from eyas.train.trackers import open_trackers, train_scalars, validation_scalars

METRICS, VALIDATION = "metrics.jsonl", "validation.jsonl"


@dataclasses.dataclass
class TrainParts:
    """Everything `setup` builds for a Trainer."""

    out: Path  # the run folder
    threads: int  # CPU threads of this rank at start-up
    cpu: Threads  # ... and their re-checks as the run goes
    dtype: str  # compute dtype: "bf16" (autocast) or "fp32"
    train_src: Any  # a StoreReader, a Subset of one, or a PreparedSource (--online)
    val_src: Any  # the same kinds, or None
    data_record: dict  # samples, skipped_samples, skipped_shards: kept in plan.json and every checkpoint
    layer_ids: list[int]  # the target's feature layers
    target: Target | None  # online only: the target computes the features in the loop
    vocab_info: dict  # the draft vocabulary's size, coverage, distinct_seen
    draft_cfg: DraftConfig
    model: nn.Module  # the TTT objective, wrapped for DDP or FSDP2
    params: list[nn.Parameter]  # the trainable ones
    optimizer: torch.optim.Optimizer
    head_rows: torch.Tensor  # [Vd, H] the target's output-head rows of the draft vocabulary (frozen)
    path: str  # the TTT path (eyas.train.objective.choose_path): gathered or static
    t2d: torch.Tensor  # [V] bool: target ids in the draft vocabulary
    weights: torch.Tensor  # [k] the loss weight of each TTT step
    spec: ShardSpec  # the training sampler
    val_spec: ShardSpec  # the validation sampler: unshuffled, one pass
    steps_per_epoch: list[int]  # optimizer steps (global), per epoch
    total_steps: int  # optimizer steps this run takes (--max-steps applied)
    warmup_steps: int
    plan: Plan  # the plan block (eyas.train.plan)
    plan_json: dict  # RUN/plan.json
    metrics: MetricsLog | NullMetrics  # rank 0 writes, the others do not
    resumed: TrainerState | None  # the checkpoint's state when resuming (the Trainer's own state starts from it)


def setup(cfg, env, con) -> TrainParts:
    cpu = tune_process(cfg.threads, env)
    threads, threads_why = cpu.n, cpu.why
    torch.manual_seed(cfg.seed)
    out, (dtype, why) = Path(cfg.out), resolve_dtype(cfg.dtype, env.device)
    if why:  # what auto chose and why, or why an explicit bf16 will be slow on this CPU
        con.print(why)
    ckpt = resume_point(cfg, env, con, out)
    train_src, val_src = sources(cfg)
    data_record = skipped_data(train_src, ckpt, con)
    if cfg.trust_remote_code:
        con.print(trusted_code_line(cfg.target))
    target, layer_ids = load_checked_target(cfg, env, dtype, (train_src, val_src))
    vocab_info, d2t = draft_vocab(cfg, env, target, train_src, ckpt)
    draft_cfg = DraftConfig.for_target(target, int(d2t.numel()), layer_ids, cfg.num_layers, cfg.fc_norm,
                                       cfg.norm_before_fc, cfg.norm_output, cfg.norm_before_residual)
    draft, head_rows = build_draft(cfg, env, dtype, target, draft_cfg, d2t, ckpt)
    path, compiled, path_line = choose_path(env.device, cfg.compile, env.distributed and cfg.parallel == "fsdp")
    con.print(path_line)
    model = wrap(TTTObjective(draft, cfg.ttt_steps, path, compiled, cfg.loss), cfg.parallel, env, dtype)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, env.device)
    if ckpt:
        load_optimizer_state(model, optimizer, ckpt.optimizer_state)
    spec, val_spec = samplers(cfg, env)
    steps, total, warmup, plan, plan_json = make_plan(cfg, env, con, train_src, spec, vocab_info,
                                                      (threads, threads_why), dtype, data_record)
    if env.is_main:
        write_json(out / "plan.json", plan_json)
    if ckpt:  # last: the RNG as the interrupted run had it at that step, after every draw setup made
        set_rng_state(ckpt.state.rng[env.rank])
    start = ckpt.state.progress.step if ckpt else 0
    return TrainParts(
        out=out, threads=threads, cpu=cpu, dtype=dtype, train_src=train_src, val_src=val_src, data_record=data_record,
        layer_ids=layer_ids, target=target if cfg.online else None, vocab_info=vocab_info, draft_cfg=draft_cfg,
        model=model, params=[p for p in model.parameters() if p.requires_grad], optimizer=optimizer,
        head_rows=head_rows, path=path, t2d=draft.t2d, weights=step_weights(cfg.ttt_steps, cfg.step_decay), spec=spec,
        val_spec=val_spec, steps_per_epoch=steps, total_steps=total, warmup_steps=warmup, plan=plan,
        plan_json=plan_json, metrics=MetricsLog(out, start, cfg) if env.is_main else NullMetrics(),
        resumed=ckpt.state if ckpt else None)


def skipped_data(train_src, ckpt: ResumePoint | None, con) -> dict:
    """Say which store samples --skip-bad-shards left out, and refuse to resume on other data than the
    checkpoint's: the epoch order, and the position within it, are computed over the samples."""
    reader = getattr(train_src, "source", train_src)  # a Subset's store, when validation is held out
    skipped = getattr(reader, "skipped", 0)
    bad = getattr(reader, "bad_shards", {}) if skipped else {}
    record = {"samples": len(reader), "skipped_samples": skipped, "skipped_shards": sorted(bad)}
    if skipped:
        con.print(f"store: {fmt_int(skipped)} samples left out (--skip-bad-shards), those of {len(bad)} shard(s): "
                  + "; ".join(f"{n} {why}" for n, why in list(bad.items())[:3]) + (" ..." if len(bad) > 3 else ""),
                  force=True)
    before = ckpt.state.data if ckpt else None
    if before is not None and before != record:
        raise EyasError(f"cannot resume {ckpt.folder}: the training data changed since the run that wrote it "
                        f"({before['samples']:,} samples then, shards left out {before['skipped_shards'] or 'none'}; "
                        f"{record['samples']:,} now, left out {record['skipped_shards'] or 'none'})",
                        "the epoch order and the position within it are computed over the samples",
                        "restore the store as it was when the run started, or start a new run in another --out "
                        "folder")
    return record


def tune_process(threads: int, env) -> Threads:
    """Threads per rank (eyas.core.threads: the free cores, re-checked as the run goes), and glibc told to keep
    freed memory (eyas.core.memory.tune_allocator: otherwise every step page-faults its large logit buffers in
    again, and the casts and weight-gradient matmuls slow down)."""
    tune_allocator()
    cpu = Threads(threads, env.local_world_size, env.device, env.local_rank)
    cpu.apply()
    return cpu


def resume_point(cfg, env, con, out: Path) -> ResumePoint | None:
    """The checkpoint to resume from, or None. Rank 0 decides; every rank loads it."""
    choice = None
    if env.is_main:
        if cfg.resume:
            remove_partial(out)
            found = latest_checkpoint(out)
            choice = str(found) if found else None
            if not found:
                con.print(f"resume: no checkpoint in {out / 'checkpoints'}: starting from step 0")
        elif (out / METRICS).exists() or list_checkpoints(out):
            choice = "exists"
    choice = dist.all_gather_objects(choice, env)[0]
    if choice == "exists":
        raise EyasError(f"{out} already holds a training run (metrics.jsonl or checkpoints)",
                        "starting over there would mix two runs' logs",
                        "pass --resume to continue it, or give another --out folder")
    if choice is None:
        return None
    if not Path(choice).is_dir():
        raise EyasError(f"rank {env.rank} cannot see the checkpoint {choice}",
                        "rank 0 chose it, but this node's file system does not have it",
                        "put --out on a file system every node shares")
    model_state, optimizer_state, state = load_checkpoint(choice)
    check_resumable(Path(choice), state, cfg.to_dict(), env.world_size, defaults=type(cfg)().to_dict())
    ckpt = ResumePoint(Path(choice), model_state, optimizer_state, TrainerState.from_dict(state))
    p = ckpt.state.progress
    con.print(f"resume: {choice} (step {fmt_int(p.step)}, epoch {p.epoch + 1}, step {fmt_int(p.step_in_epoch)} "
              "within it)")
    return ckpt


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
    if cfg.data_fraction < 1:  # a share of what is left for training; the held-out samples stay as they are
        before, share = len(train), nested_share(len(train), cfg.data_fraction, cfg.seed)
        source, indices = (train.source, train.indices[share]) if isinstance(train, Subset) else (train, share)
        train = Subset(source, indices, share_of=before)
    return train, val


def load_checked_target(cfg, env, dtype: str, srcs) -> tuple[Target, list[int]]:
    """The target, refused unless the sources were extracted from it, and the feature layer ids."""
    trust = cfg.trust_remote_code
    if cfg.online:  # the target computes the features: all of it, on the device
        target = load_target(cfg.target, device=env.device, dtype="bfloat16" if dtype == "bf16" else "float32",
                             trust_remote_code=trust)
    else:  # only its identity, shape, embeddings and output head: no decoder layer is read (eyas.core.weights)
        target = load_target_shell(cfg.target, trust_remote_code=trust)
    for src in srcs:
        if src is not None:
            src.check_target(target.identity())
    layer_ids = (target.default_feature_layers() if cfg.online else store_feature_layers(srcs[0])
                 or target.default_feature_layers())
    return target, layer_ids


def draft_vocab(cfg, env, target, train_src, ckpt: ResumePoint | None) -> tuple[dict, torch.Tensor]:
    """(vocabulary figures, d2t [Vd]): the checkpoint's, or the top K of the loss-masked training tokens. Each
    rank counts the token ids (never the hidden states) of every world_size-th sample, the counts are summed
    over ranks, and every rank picks the same K from the same sums."""
    if ckpt:
        info = {k: v for k, v in ckpt.state.vocab.items() if k != "d2t"}
        return info, ckpt.model_state["d2t"]
    mine = range(env.rank, len(train_src), env.world_size)
    counts = dist.all_reduce_counts(count_tokens((train_src.token_ids(i) for i in mine), target.vocab_size), env)
    v = build_draft_vocab(counts, min(cfg.draft_vocab, target.vocab_size))
    return {"coverage": v.coverage, "distinct_seen": v.distinct_seen, "size": v.size}, v.d2t


def build_draft(cfg, env, dtype: str, target, draft_cfg: DraftConfig, d2t: torch.Tensor,
                ckpt: ResumePoint | None) -> tuple[Eagle3Draft, torch.Tensor]:
    """The draft on its device (initialised from the target, or the checkpoint's weights) and the frozen
    output-head rows [Vd, H] in the compute dtype."""
    embed = read_module(target, target.embed_tokens()).weight.detach()  # [V,H] as stored (bf16 in most checkpoints)
    head = read_module(target, target.lm_head()).weight.detach()  # [V,H], the same tensor when tied
    draft = Eagle3Draft(draft_cfg)
    if ckpt:
        draft.load_state_dict(ckpt.model_state)
    else:
        draft.init_weights(embed, head, d2t, seed=cfg.seed)
        if cfg.init_from_target:
            init_from_target(draft, target)
    compute = torch.float32 if dtype == "fp32" else torch.bfloat16
    head_rows = head[draft.target_ids().to(head.device)].to(env.device, compute)  # [Vd,H] frozen: the target's p
    if cfg.freeze_head:
        draft.lm_head.weight.requires_grad_(False)
    return draft.to(env.device), head_rows


def init_from_target(draft: Eagle3Draft, target) -> None:
    """--init-from-target: the draft layer starts from the target's last decoder layer (read by name from its
    checkpoint, like the embeddings: no other layer is loaded)."""
    last = read_module(target, target.decoder_layers()[-1])
    try:
        draft.init_from_layer(dict(last.state_dict()))
    except ValueError as e:
        raise EyasError(f"train: --init-from-target: {e}", "the draft layer has the target's layer shape only for "
                        "plain (Llama-style) attention", "drop --init-from-target for this target") from None


def samplers(cfg, env) -> tuple[ShardSpec, ShardSpec]:
    """The training sampler and the validation one (one unshuffled pass, the same micro-batch and packing)."""
    train = ShardSpec(world_size=env.world_size, micro_batch=cfg.micro_batch, grad_accum=cfg.grad_accum,
                      seed=cfg.seed, shuffle=cfg.shuffle, drop_remainder=cfg.drop_remainder,
                      max_tokens=cfg.max_tokens, group_window=cfg.group_window, sharded=cfg.shard_data)
    val = ShardSpec(world_size=env.world_size, micro_batch=cfg.micro_batch, shuffle=False, max_tokens=cfg.max_tokens)
    return train, val


def make_plan(cfg, env, con, train_src, spec: ShardSpec, vocab: dict, threads: tuple[int, str], dtype: str,
              data: dict):
    """(optimizer steps per epoch (compute_plan's; packing varies them), steps this run takes, warmup steps, the
    plan, RUN/plan.json's content), the plan block printed on the console."""
    lengths = np.asarray(train_src.lengths)
    world = env.world_size if cfg.shard_data else 1  # unsharded, every rank runs all of it
    units = [len(epoch_units(lengths, e, spec)) if cfg.max_tokens else len(lengths) for e in range(cfg.epochs)]
    steps = [compute_plan(u, world, cfg.micro_batch, cfg.grad_accum, 1, cfg.drop_remainder).optimizer_steps_per_epoch
             for u in units]
    planned = sum(steps)
    total = min(planned, cfg.max_steps) if cfg.max_steps else planned
    warmup = int(cfg.warmup_ratio * total)
    plan = compute_plan(units[0], env.world_size, cfg.micro_batch, cfg.grad_accum, cfg.epochs, cfg.drop_remainder,
                        tokens=int(lengths.sum()))
    lines = []
    if cfg.data_fraction < 1:
        lines.append(f"data: --data-fraction {cfg.data_fraction:g}: {fmt_int(len(lengths))} of the "
                     f"{fmt_int(train_src.share_of)} training samples ({fmt_int(int(lengths.sum()))} tokens), a "
                     "seeded share")
    if cfg.max_tokens:
        lines.append(f"packing: {fmt_int(len(lengths))} samples -> {fmt_int(units[0])} sequences of at most "
                     f"{fmt_int(cfg.max_tokens)} tokens in epoch 1 (global); the plan's samples are these sequences")
    lines += plan.lines()
    if planned != plan.optimizer_steps_total or total != planned:
        lines.append(f"plan: this run takes {fmt_int(total)} optimizer steps (global)"
                     + (f": --max-steps {cfg.max_steps} of {fmt_int(planned)} planned" if cfg.max_steps else
                        f"; per epoch {', '.join(fmt_int(s) for s in steps)} (packing varies)"))
    lines.append(f"plan: draft vocabulary {fmt_int(vocab['size'])} tokens covering {100 * vocab['coverage']:.2f}% of "
                 f"the loss-masked training tokens ({fmt_int(vocab['distinct_seen'])} distinct ids seen)")
    lines.append(f"plan: {env.world_size} ranks x {threads[0]} threads ({threads[1]}), {dtype}, "
                 f"{cfg.parallel if env.distributed else 'one process'}, device {env.device}, TTT {cfg.ttt_steps}, "
                 f"warmup {fmt_int(warmup)} steps, then cosine to step {fmt_int(total)}")
    for line in lines:
        con.print(line)
    plan_json = {**plan.to_dict(), "optimizer_steps_run": total, "steps_per_epoch_actual": steps,
                 "max_tokens": cfg.max_tokens, "units_per_epoch": units, "vocab": vocab, "dtype": dtype,
                 "threads_per_rank": threads[0], "threads_why": threads[1], "parallel": cfg.parallel, "lines": lines,
                 "data": data}
    return steps, total, warmup, plan, plan_json


def audits_so_far(out: Path) -> dict:
    """epoch -> sharding audit, as RUN/audit.json holds them (a resumed run goes on adding to them)."""
    audit_file = out / "audit.json"
    fix = "restore RUN/audit.json as the run left it, or start a new run in another --out folder"
    return read_json(audit_file, fix).get("epochs", {}) if audit_file.is_file() else {}


class MetricsLog:
    """Rank 0's metrics: RUN/metrics.jsonl (one JSON object per optimizer step), RUN/validation.jsonl, and the
    trackers of --tracker (eyas.train.trackers). On resume, lines past the checkpoint's step (written before the
    crash) are dropped, so every step appears once."""

    def __init__(self, out: Path, step: int, cfg):
        out.mkdir(parents=True, exist_ok=True)
        self.files = {}
        for name in (METRICS, VALIDATION):
            path = out / name
            if path.exists():
                _truncate_after(path, step)
            self.files[name] = open(path, "a", encoding="utf-8")
        self.trackers = open_trackers(cfg.tracker, out, dataclasses.asdict(cfg)) if cfg.tracker else []

    def write(self, rec: dict) -> None:
        self._line(METRICS, rec)
        for t in self.trackers:
            t.log(train_scalars(rec), rec["step"])

    def write_validation(self, rec: dict) -> None:
        self._line(VALIDATION, rec)
        for t in self.trackers:
            t.log(validation_scalars(rec), rec["step"])

    def _line(self, name: str, rec: dict) -> None:
        f = self.files[name]
        f.write(json.dumps(rec) + "\n")
        f.flush()

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        for t in self.trackers:
            t.close()


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
