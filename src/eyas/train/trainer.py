"""eyas train: the EAGLE-3 draft on a hidden-state store (or online), one process or many under torchrun.

    python -m eyas.train --store runs/demo/store --out runs/demo/draft            (or: eyas train ...)
    torchrun --nproc_per_node 2 -m eyas.train --store runs/demo/store --out runs/demo/draft

Before the first step rank 0 prints the sharding audit (`data: ... disjoint: yes`, from every rank's actual
sample ids) and the plan block (`eyas.train.plan`), then one progress bar; `RUN/metrics.jsonl` gets one JSON object
per optimizer step. The loop below reads like the algorithm; the pieces live in eyas.train.sharding (who trains on
what), eyas.train.batches (batches), eyas.train.objective (the loss), eyas.train.parallelize (DDP, FSDP2),
eyas.train.optimizer (AdamW and its schedule) and eyas.draft.checkpoint (exact resumption).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from eyas.core import dist
from eyas.core.errors import EyasError, disk_full
from eyas.core.files import write_json
from eyas.core.log import console, fmt_duration, fmt_int
from eyas.draft.checkpoint import rng_state, save_checkpoint, save_draft
from eyas.draft.model import Eagle3Draft
from eyas.train.batches import (
    Prefetcher,
    capture_features,
    load_micro_batch,
    valid_masks,
)
from eyas.train.heldout import expected_acceptance_length, masked_batches, per_step, validation_sums
from eyas.train.objective import STATIC_MIN_LENGTH, autocast, targets
from eyas.train.optimizer import lr_at
from eyas.train.parallelize import draft_of, full_model_state, full_optimizer_state, no_sync
from eyas.train.plan import compute_plan
from eyas.train.settings import TrainConfig
from eyas.train.setup import TrainParts, audits_so_far, setup
from eyas.train.sharding import audit, shard_epoch
from eyas.train.state import Progress, TrainerState

SUMMARY_FILE = "summary.json"  # in --out: what the run did (rank 0 writes it last, after the final draft)


@dataclasses.dataclass
class StepStats:
    loss: float  # sum_i decay**i * loss_i: what is minimised
    loss_i: list[float]  # per TTT step: cross-entropy per counted position (global)
    acc_i: list[float]  # per TTT step: top-1 agreement with the target (global)
    counts: list[int]  # counted positions per TTT step (global)
    samples: int  # samples in this optimizer step (global, repeats included)
    tokens: int  # real tokens fed to the draft (global)
    lr: float
    grad_norm: float
    seconds: float


@dataclasses.dataclass
class PendingStep:
    """An optimizer step whose figures are still on the device, until the interval's one read (Trainer.read_steps)."""

    epoch: int
    step: int  # its global optimizer step number
    sums: torch.Tensor  # [3, k] float64, this rank's: loss sums, top-1 agreements, counted positions per TTT step
    totals: torch.Tensor  # [k + 2] float64, global: counted positions per TTT step, samples, tokens
    norm: torch.Tensor  # 0-d, global: the gradient norm before clipping
    lr: float
    busy_s: float  # the host's time in the step (its queueing, on a GPU: the rest shows in the read's wait)
    done: float  # perf_counter at the step's end


class Trainer:
    """One training run: set up from the config (or a checkpoint), then `fit()`.

    What setup builds is `self.parts` (eyas.train.setup.TrainParts); where the run is, `self.progress` (saved in
    every checkpoint); the rest below is this process's own bookkeeping."""

    def __init__(self, cfg: TrainConfig, env: dist.DistEnv, con):
        self.cfg, self.env, self.con = cfg, env, con
        self.parts: TrainParts = setup(cfg, env, con)  # sources, target, vocabulary, model, optimizer, plan, resume
        resumed = self.parts.resumed  # a checkpoint's TrainerState, or None for a new run
        self.progress: Progress = dataclasses.replace(resumed.progress) if resumed else Progress()
        self.val: dict | None = resumed.validation if resumed else None  # the last validation figures
        self.audits: dict = audits_so_far(self.parts.out) if resumed else {}  # epoch -> sharding audit (audit.json)
        self.tag = ""  # "[DUPLICATE DATA] " on every line once an audit failed under --allow-duplicate-data
        self.t2d_host = self.parts.t2d.cpu()  # [V] the draft vocabulary on the host: counts without a device sync
        self.step_weights = self.parts.weights.to(env.device)  # [k] each TTT step's weight in the loss
        self.bar = None  # the progress bar while the loop runs
        self.last: StepStats | None = None  # the latest optimizer step's figures (as read back)
        self.pending: list[PendingStep] = []  # steps not yet read back from the device (at most --metrics-every)
        self.metrics_every = cfg.metrics_every or (10 if env.device.startswith("cuda") else 1)
        self.step_times: list[float] = []  # the first steps' seconds, for the measured rate
        self.rate_reported = False
        self.tokens_run = 0  # tokens trained on by this process (a resumed run counts from its restart)
        self.loop_s = self.data_wait_s = 0.0  # the training loop's time, and the share spent waiting for data
        self.epoch_loop_s = self.epoch_wait_s = 0.0  # the same, for the current epoch
        self.t0 = time.perf_counter()

    # -- the loop ---------------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg, p, g = self.cfg, self.parts, self.progress
        first_epoch = g.epoch  # where this process starts: a resumed run goes on inside it
        running = first_epoch < cfg.epochs and g.step < p.total_steps
        first = self.audited_shard(first_epoch, True) if running else None  # the audit line comes before the bar
        bar = self.bar = self.con.progress(total=p.total_steps, initial=g.step, desc="train", unit="step")
        try:
            for epoch in range(first_epoch, cfg.epochs):
                if g.step >= p.total_steps:
                    break
                shard = first if epoch == first_epoch else self.audited_shard(epoch, False)
                start = g.step_in_epoch if epoch == first_epoch else 0
                g.epoch, g.step_in_epoch = epoch, start
                if self.train_epoch(epoch, shard, start, bar):
                    self.end_epoch(epoch)
        finally:
            bar.close()
            self.bar = None
            p.metrics.close()
        return self.finish()

    def train_epoch(self, epoch: int, shard, start: int, bar) -> bool:
        """Run the epoch's optimizer steps from `start`; True when the epoch completed."""
        batches = Prefetcher(self.batches(shard, start), self.cfg.prefetch)
        it = iter(batches)
        self.epoch_loop_s = 0.0
        try:
            for index in range(start, len(shard.steps)):
                t0 = time.perf_counter()
                window = [next(it) for _ in shard.steps[index]]
                self.pending.append(self.train_step(window, epoch))
                self.progress.step += 1
                self.progress.step_in_epoch = index + 1
                bar.update(1)
                if not self.step_times or len(self.pending) >= self.metrics_every:  # this process's first step is
                    self.read_steps()  # read alone: it carries the warm-up (compilation) the measured rate leaves out
                self.epoch_loop_s += time.perf_counter() - t0  # the loop's time, without checkpoints
                last = index + 1 == len(shard.steps)
                if self.progress.step >= self.parts.total_steps and not last:
                    self.save()
                    return False
                if self.cfg.checkpoint_every and self.progress.step % self.cfg.checkpoint_every == 0 and not last:
                    self.save()
            t0 = time.perf_counter()
            self.read_steps()  # the epoch's last steps
            self.epoch_loop_s += time.perf_counter() - t0
        finally:
            batches.close()
            self.epoch_wait_s = batches.wait_s
            self.data_wait_s += batches.wait_s
            self.loop_s += self.epoch_loop_s
        return True

    def batches(self, shard, start: int):
        """The epoch's micro-batches from optimizer step `start` on, as Batches (runs on the prefetch thread)."""
        pin = self.env.device.startswith("cuda")
        for s in range(start, len(shard.steps)):
            for m, micro in enumerate(shard.steps[s]):
                repeats = sum(len(u) for j, u in enumerate(micro) if (s, m, j) in shard.padded)
                yield load_micro_batch(self.parts.train_src, micro, repeats, pin)

    def train_step(self, window, epoch: int) -> PendingStep:
        """One optimizer step over this rank's micro-batches `window`; the loss of TTT step i is normalised by
        the global count of its counted positions (all ranks, all micro-batches), so any world size computes the
        same gradient for the same global batch. Nothing is read back from the device: the step's figures stay
        there until `read_steps`, so the device's queue stays full from one optimizer step to the next."""
        t0 = time.perf_counter()
        cfg, env, p, k = self.cfg, self.env, self.parts, self.cfg.ttt_steps
        # The counted positions come from the host's copy of the batch, so they are known before the first forward;
        # their global sums are reduced where the device can use them without the host reading them.
        valid = [valid_masks(b.input_ids, b.loss_mask, b.doc_ids, self.t2d_host, k) for b in window]  # [k,B,T]
        local = torch.cat((torch.stack([v.sum((1, 2)) for v in valid]).sum(0).double(),
                           torch.tensor([sum(b.samples for b in window), sum(b.tokens for b in window)],
                                        dtype=torch.float64)))
        totals = dist.all_reduce_tensor(local.to(env.device, non_blocking=True), env)  # [k + 2], global
        batches = [self.noisy(self.to_device(b), j) for j, b in enumerate(window)]
        valid = [v.to(env.device, non_blocking=True) for v in valid]
        scale = self.step_weights / totals[:k].float().clamp(min=1) * env.world_size  # [k]
        sums = torch.zeros(3, k, dtype=torch.float64, device=env.device)
        for j, (b, v) in enumerate(zip(batches, valid)):
            with no_sync(p.model, j == len(batches) - 1):
                with autocast(env.device, p.dtype):
                    with torch.no_grad():
                        logp, index = targets(p.path, b.final, p.head_rows, v)
                    # `scale`: each step's weight in the loss, so the head's gradient is finished in the forward
                    loss_sum, correct, count = p.model(b.input_ids, b.aux, logp, index, b.loss_mask,
                                                       b.position_ids, b.doc_ids, scale)
                    loss = (loss_sum.float() * scale).sum()
                loss.backward()
            sums += torch.stack([loss_sum.detach().double(), correct.double(), count.double()])
        norm = self.clip()
        lr = lr_at(self.progress.step, p.total_steps, p.warmup_steps, cfg.lr, cfg.min_lr_ratio)
        for group in p.optimizer.param_groups:
            group["lr"] = lr
        p.optimizer.step()
        p.optimizer.zero_grad(set_to_none=True)
        done = time.perf_counter()
        return PendingStep(epoch, self.progress.step + 1, sums, totals, norm, lr, done - t0, done)

    def read_steps(self) -> None:
        """Read the pending steps' figures back in one transfer (after one all-reduce for them all), then count and
        write each step in order. The steps share the wait for the device evenly: their seconds add up to the
        interval's time."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        k, env = self.cfg.ttt_steps, self.env
        t0 = time.perf_counter()
        sums = dist.all_reduce_tensor(torch.stack([r.sums.flatten() for r in pending]), env)  # [n, 3k]
        rows = torch.cat((sums, torch.stack([r.totals for r in pending]),
                          torch.stack([r.norm.double().reshape(1).to(sums.device) for r in pending])), 1)
        rows = rows.tolist()  # the one host read of the interval
        now = time.perf_counter()
        share = (now - t0) / len(pending)
        for i, (r, row) in enumerate(zip(pending, rows)):
            red, totals, grad_norm = row[:3 * k], row[3 * k:4 * k + 2], row[-1]
            if [round(c) for c in red[2 * k:]] != [round(c) for c in totals[:k]]:
                raise RuntimeError(f"eyas internal error: counted positions {red[2 * k:]} != precomputed "
                                   f"{totals[:k]} at step {r.step}")
            loss_i = [red[j] / max(1.0, totals[j]) for j in range(k)]
            acc_i = [red[k + j] / max(1.0, totals[j]) for j in range(k)]
            loss = float(sum(w * x for w, x in zip(self.parts.weights.tolist(), loss_i)))
            stats = StepStats(loss, loss_i, acc_i, [int(c) for c in totals[:k]], int(totals[k]),
                              int(totals[k + 1]), r.lr, grad_norm, r.busy_s + share)
            self.record(r, stats, r.done + (i + 1) * share - now)

    def to_device(self, batch):
        """To the device (features in the compute dtype); online: the target computes the features here."""
        feat = torch.float32 if self.parts.dtype == "fp32" else torch.bfloat16
        batch = batch.to(self.env.device, feat)
        if self.cfg.online:
            batch = capture_features(self.parts.target, self.parts.layer_ids, batch).to(self.env.device, feat)
        return batch.padded(STATIC_MIN_LENGTH) if self.parts.path == "static" else batch

    def noisy(self, batch, micro: int):
        """The batch with --feature-noise added to its target features: a generator seeded by the seed, rank, step
        and micro-batch, so ranks draw different noise and a resumed run the noise the uninterrupted one drew."""
        if self.cfg.feature_noise:
            seed = ((self.cfg.seed * 1_000_003 + self.env.rank) * 1_000_003 + self.progress.step) * 1_024 + micro
            g = torch.Generator(device=batch.aux.device).manual_seed(seed % 2**63)
            noise = torch.randn(batch.aux.shape, generator=g, device=batch.aux.device, dtype=batch.aux.dtype)
            batch.aux = batch.aux + self.cfg.feature_noise * noise
        return batch

    def clip(self) -> torch.Tensor:
        """The gradient norm before clipping, a 0-d tensor on the device (read with the step's sums)."""
        if not self.cfg.grad_clip:
            return torch.zeros((), device=self.env.device)
        norm = torch.nn.utils.clip_grad_norm_(self.parts.params, self.cfg.grad_clip)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    # -- logging -----------------------------------------------------------------------------------------------------
    def record(self, r: PendingStep, s: StepStats, ago: float) -> None:
        """Count a step read back, write its metrics line (rank 0) `ago` seconds (<= 0) after it ended; time the
        first steps for the ETA; re-check the free cores now and then (eyas.core.threads)."""
        g = self.progress
        if changed := self.parts.cpu.recheck():
            self.say(changed)
        g.samples_seen += s.samples
        g.tokens_seen += s.tokens
        g.epoch_samples += s.samples
        self.tokens_run += s.tokens
        self.last = s
        rec = {"step": r.step, "epoch": r.epoch, "lr": s.lr, "loss": round(s.loss, 6),
               "loss_i": [round(x, 6) for x in s.loss_i], "acc_i": [round(x, 6) for x in s.acc_i],
               "tokens_per_s": round(s.tokens / max(s.seconds, 1e-9), 1), "samples_seen_global": g.samples_seen,
               "elapsed_s": round(self.elapsed() + ago, 3), "time": round(time.time() + ago, 3),
               "grad_norm": round(s.grad_norm, 6)}
        if self.tag:
            rec["duplicate_data"] = True
        self.parts.metrics.write(rec)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{s.loss:.3f}", acc0=f"{s.acc_i[0]:.3f}", refresh=False)
        self.step_times.append(s.seconds)
        if len(self.step_times) >= 6 and not self.rate_reported:  # the first step warms up: rate from the next
            self.rate_reported = True
            self.report_rate(sum(self.step_times[1:]) / (len(self.step_times) - 1))

    def report_rate(self, seconds_per_step: float) -> None:
        rate = 1.0 / max(seconds_per_step, 1e-9)
        p, plan = self.parts, self.parts.plan
        timed = compute_plan(plan.samples, plan.world_size, plan.micro_batch, plan.grad_accum, plan.epochs,
                             plan.drop_remainder, steps_per_s=rate, tokens=plan.tokens)
        remaining = p.total_steps - self.progress.step
        left, whole = remaining / rate, p.total_steps / rate  # this run's steps: --max-steps counted
        self.say(f"plan: measured {rate:.2f} optimizer steps/s per rank -> {fmt_duration(left)} left for the "
                 f"{fmt_int(remaining)} remaining steps (global, all ranks step together)")
        cut = f" (--max-steps {self.cfg.max_steps} of {fmt_int(sum(p.steps_per_epoch))} planned)" \
            if p.total_steps < sum(p.steps_per_epoch) else ""
        self.say(f"plan: ETA {fmt_duration(whole)} for the run's {fmt_int(p.total_steps)} optimizer steps{cut} at "
                 f"{rate:.2f} optimizer steps/s per rank")
        if self.env.is_main:
            write_json(p.out / "plan.json", {**p.plan_json, **timed.to_dict(), "eta_s": whole, "remaining_eta_s": left})

    def say(self, line: str) -> None:
        """A console line (rank 0), written above the progress bar when one is showing."""
        if self.bar is not None and not self.con.quiet:
            self.bar.write(self.tag + line, file=self.con.stream)
        else:
            self.con.print(self.tag + line)

    def elapsed(self) -> float:
        return self.progress.elapsed_s + time.perf_counter() - self.t0

    def end_epoch(self, epoch: int) -> None:
        """The epoch's global processed count against the dataset, validation, the epoch-end checkpoint."""
        g, n = self.progress, len(self.parts.train_src)
        wait = self.epoch_wait_s / max(self.epoch_loop_s, 1e-9)
        self.say(f"epoch {epoch + 1}: {fmt_int(g.epoch_samples)} samples processed (global) of {fmt_int(n)} "
                 f"({fmt_int(g.epoch_samples - n) if g.epoch_samples >= n else 0} repeats); "
                 f"waiting for data {100 * wait:.1f}% of the loop's time")
        g.epoch_samples = 0
        self.val = self.validate(epoch)
        g.epoch, g.step_in_epoch = epoch + 1, 0
        self.save()

    def validate(self, epoch: int) -> dict | None:
        """The validation pass (eyas.train.heldout.validation_sums): loss and acc per TTT step, global."""
        p, k = self.parts, self.cfg.ttt_steps
        if p.val_src is None:
            return None
        red = validation_sums(p.model, self.validation_batches(), p.head_rows, p.t2d, k, self.env, p.dtype,
                              p.path)
        out = {"epoch": epoch, "samples": len(p.val_src), **per_step(red, k)}
        out["loss"] = float(sum(w * x for w, x in zip(p.weights.tolist(), out["loss_i"])))
        out["expected_tau_by_chain"] = [expected_acceptance_length(out["acc_i"], c) for c in range(1, k + 1)]
        out["expected_tau"] = out["expected_tau_by_chain"][-1]
        self.say(f"validation (epoch {epoch + 1}, {fmt_int(len(p.val_src))} samples, global): loss "
                 f"{out['loss']:.4f}, acc_i " + " ".join(f"{a:.3f}" for a in out["acc_i"]) +
                 f"; expected acceptance length {out['expected_tau']:.2f} for a chain of {k}"
                 + (f" ({out['expected_tau_by_chain'][2]:.2f} for 3)" if k > 3 else ""))
        p.metrics.write_validation({**out, "step": self.progress.step})
        return out

    def validation_batches(self):
        """This rank's validation micro-batches, prepared; the rows that only pad the last step (every rank makes
        the same calls, as FSDP needs) have their loss mask zeroed, so they are run but not counted."""
        p = self.parts
        shard = shard_epoch(p.val_src.lengths, 0, self.env.rank, p.val_spec)
        yield from masked_batches(p.val_src, shard, self.to_device)

    # -- sharding audit, checkpoints, the end ------------------------------------------------------------------------
    def audited_shard(self, epoch: int, first: bool):
        """This rank's share of the epoch, after checking every rank's actual sample ids (disjoint, covering);
        the audit line is shown for the first epoch this process runs, and for any that fails."""
        p, cfg = self.parts, self.cfg
        shard = shard_epoch(p.train_src.lengths, epoch, self.env.rank, p.spec)
        gathered = dist.all_gather_objects(shard.sample_ids(), self.env)
        a = audit(gathered, len(p.train_src), epoch, shard.dropped_samples,
                  units=shard.total_units if cfg.max_tokens else 0, allowed=cfg.allow_duplicate_data)
        if not a.ok and cfg.allow_duplicate_data:
            self.tag = "[DUPLICATE DATA] "
        if first or not a.ok:
            self.say(a.line())
        if self.env.is_main:
            self.audits[str(epoch)] = a.to_dict()
            write_json(p.out / "audit.json", {**a.to_dict(), "epochs": self.audits})
        if not a.ok and not cfg.allow_duplicate_data:
            raise EyasError(f"sharding audit failed for epoch {epoch + 1}: {a.line()}",
                            "ranks would train on the same samples (or some on none): the run would not be the "
                            "one the plan describes" + ("; --no-shard-data is set" if not cfg.shard_data else ""),
                            "drop --no-shard-data (or fix the sampler); --allow-duplicate-data trains anyway, "
                            "marking every log line")
        expect = p.steps_per_epoch[epoch]
        if len(shard.steps) != expect:
            raise RuntimeError(f"eyas internal error: {len(shard.steps)} steps in epoch {epoch + 1}, "
                               f"plan says {expect}")
        return shard

    def save(self) -> None:
        """A checkpoint at the current data position: weights, optimizer, RNG states, progress."""
        self.read_steps()  # the progress it saves counts every step's samples
        p, g = self.parts, self.progress
        optim = full_optimizer_state(p.model, p.optimizer)  # collective under FSDP
        draft = self.full_draft()
        rngs = dist.all_gather_objects(rng_state(), self.env)
        if self.env.is_main:
            state = TrainerState(progress=dataclasses.replace(g, elapsed_s=self.elapsed()),
                                 world_size=self.env.world_size, config=self.cfg.to_dict(), rng=rngs,
                                 vocab=p.vocab_info, training=self.training_summary(), data=p.data_record)
            save_checkpoint(p.out, g.step, draft, optim, state.to_dict(), self.cfg.keep_checkpoints)
        dist.barrier(self.env)

    def full_draft(self):
        """An Eagle3Draft with the full weights (FSDP: gathered into a CPU copy; else the draft itself)."""
        if not (self.env.distributed and self.cfg.parallel == "fsdp"):
            return draft_of(self.parts.model)
        state = full_model_state(self.parts.model)  # a collective: every rank takes part, rank 0 gets the tensors
        if not self.env.is_main:
            return None
        copy = Eagle3Draft(self.parts.draft_cfg)
        copy.load_state_dict(state)
        return copy

    def training_summary(self) -> dict:
        s, g = self.last, self.progress
        return {"steps": g.step, "epochs": self.cfg.epochs, "samples": g.samples_seen,
                "tokens": g.tokens_seen, "world_size": self.env.world_size, "ttt_steps": self.cfg.ttt_steps,
                "final_loss": s.loss if s else None, "final_acc_i": s.acc_i if s else None,
                "validation": self.val, "vocab_coverage": self.parts.vocab_info["coverage"], "dtype": self.parts.dtype}

    def data_summary(self) -> dict:
        """What the draft was trained on, for its folder (and the model cards exported from it)."""
        p = self.parts
        reader = getattr(p.train_src, "source", p.train_src)  # a Subset's store
        dataset = (getattr(reader, "manifest", None) or {}).get("dataset") or {}
        return {"source": self.cfg.data if self.cfg.online else self.cfg.store, "online": self.cfg.online,
                "train_samples": len(p.train_src), "train_tokens": int(sum(p.train_src.lengths)),
                "validation_samples": len(p.val_src) if p.val_src is not None else 0,
                "skipped_samples": p.data_record["skipped_samples"], "prepared": dataset.get("path", self.cfg.data),
                "fingerprint": dataset.get("fingerprint")}

    def finish(self) -> dict:
        p, g = self.parts, self.progress
        draft = self.full_draft()
        summary = self.training_summary()
        wait = self.data_wait_s / max(self.loop_s, 1e-9)
        tps = self.tokens_run / max(self.loop_s, 1e-9)
        result = {"out": str(p.out), "final": str(p.out / "final"), **summary, "tokens_per_s": tps,
                  "train_loop_s": self.loop_s, "data_wait_share": wait, "elapsed_s": self.elapsed(),
                  "audit": self.audits, "duplicate_data": bool(self.tag),
                  "skipped_samples": p.data_record["skipped_samples"]}
        if self.env.is_main:
            save_draft(draft, p.out / "final", extra={"training": summary, "data": self.data_summary()})
            write_json(p.out / SUMMARY_FILE, result)
        dist.barrier(self.env)
        acc = " ".join(f"{a:.3f}" for a in (summary["final_acc_i"] or []))
        self.con.summary(f"{self.tag}train: {fmt_int(g.step)} steps, {fmt_int(g.samples_seen)} samples "
                         f"(global), acc_i {acc}, {tps:,.0f} tokens/s, data wait {100 * wait:.1f}% -> "
                         f"{p.out / 'final'}")
        return result


def run(cfg: TrainConfig) -> dict | None:
    """Train; rank 0 returns the run's summary, other ranks None (so `--json` prints one line per run)."""
    env = dist.init(cfg.device, cfg.collective_timeout)
    finished, lock = False, None
    try:
        lock = dist.hold_output(env, Path(cfg.out), "train")
        summary = Trainer(cfg, env, console(env.rank, cfg.quiet, cfg.json)).fit()
        finished = True
        return summary if env.is_main else None
    except Exception as e:
        err = explain_failure(e, cfg, env)
        if err is None:
            raise
        raise err from None
    finally:
        if lock is not None:
            lock.close()
        dist.shutdown(finished)


def explain_failure(e: Exception, cfg: TrainConfig, env) -> EyasError | None:
    """What to tell the user when a rank lost its peers or the disk filled up (a checkpoint says which one it was
    writing; this covers metrics.jsonl, plan.json, final/); None for any other error."""

    resume = ("rerun the same command with --resume: training continues from the last complete checkpoint in "
              f"{cfg.out}/checkpoints")
    lost = dist.peer_failure(e, env, f"find the cause in the other ranks' output, then {resume}")
    if lost is not None:
        return lost
    why = disk_full(e)
    if why is None:
        return None
    return EyasError(f"cannot write to {cfg.out}: {why}", "the run folder's disk is full (or a size limit or quota "
                     "was hit)", f"free space on that disk (or lower --keep-checkpoints), then {resume}")

