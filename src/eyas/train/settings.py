"""`TrainConfig`: the settings of `eyas train`, every flag of the command line and every key of a [train] table one
field here, each checked together in `validate`.
"""

from __future__ import annotations

import dataclasses

from eyas.core.config import StageConfig, check, opt
from eyas.core.options import Dtype, collective_timeout_opt, device_opt, dtype_opt, target_opt, trust_remote_code_opt
from eyas.draft.losses import LOSSES
from eyas.train.plan import EPOCHS, GRAD_ACCUM, MICRO_BATCH
from eyas.train.trackers import TRACKERS, missing_package


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(StageConfig):
    """Settings of `eyas train` (every flag of the command line is one field here)."""

    store: str = opt("runs/demo/store", "hidden-state store to train on (written by eyas extract)")
    target: str = target_opt(role="the store was extracted from it: embeddings, output head, identity")
    trust_remote_code: bool = trust_remote_code_opt()
    out: str = opt("runs/demo/draft", "run folder: metrics.jsonl, plan.json, audit.json, checkpoints/, final/")
    online: bool = opt(False, "run the target in the loop to compute the features (no store; needs --data)")
    data: str = opt("", "prepared dataset folder: the samples for --online; with --store, the dataset the store "
                        "must have been extracted from (checked)")
    skip_bad_shards: bool = opt(False, "leave out (and count) the samples of store shards that are missing or "
                                       "truncated, instead of stopping")
    val_store: str = opt("", "hidden-state store for the validation pass; empty: hold out --val-fraction")
    val_fraction: float = opt(0.0, "share of the training samples held out for validation (without --val-store)")
    data_fraction: float = opt(1.0, "train on this seeded share of the training samples (after any hold-out); "
                                    "a smaller share's samples are within a larger one's (data-scaling curves)")
    epochs: int = opt(EPOCHS, "passes over the training data")
    max_steps: int = opt(0, "stop after this many optimizer steps (0 = all epochs); the LR schedule spans them")
    micro_batch: int = opt(MICRO_BATCH, "samples (or packed sequences) per micro-batch, per rank")
    grad_accum: int = opt(GRAD_ACCUM, "micro-batches per optimizer step, per rank")
    max_tokens: int = opt(0, "pack samples into sequences of at most this many tokens (0 = one sample per row)")
    drop_remainder: bool = opt(False, "drop what does not fill a whole global batch (default: pad with repeats)")
    group_window: int = opt(32, "sort the samples of this many optimizer steps by length, so a micro-batch holds "
                                "similar lengths; the steps' order stays shuffled (0 = off)")
    lr: float = opt(1e-4, "peak learning rate (AdamW)")
    warmup_ratio: float = opt(0.02, "share of the optimizer steps spent warming the learning rate up")
    min_lr_ratio: float = opt(0.1, "the cosine ends at this share of the peak learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(0.5, "clip the gradient's global norm to this (0 = off)")
    ttt_steps: int = opt(7, "training-time test: draft steps unrolled on its own outputs")
    loss: str = opt("ce", "the output head's loss against the target's distribution: ce (soft cross-entropy, "
                    "EAGLE-3's), tv (total variation: 1 - the acceptance rate), nla (-log of the acceptance rate), "
                    "lk-hybrid (KL moving to TV as acceptance grows; the LK losses, docs/train.md)", choices=LOSSES)
    step_decay: float = opt(0.8, "weight of TTT step i's loss: decay**i")
    draft_vocab: int = opt(32000, "draft vocabulary size (capped at the target's vocabulary)")
    num_layers: int = opt(1, "draft decoder layers")
    freeze_head: bool = opt(False, "keep the draft's lm_head at the target's rows (fewer trainable parameters)")
    init_from_target: bool = opt(False, "start the draft layer from the target's last decoder layer instead of "
                                        "random weights (its q/k/v on the hidden half of the input)")
    fc_norm: bool = opt(False, "RMS-normalise each of the three target features before the draft's fc layer "
                               "(EAGLE-3.1; exported as vLLM's fc_norm)")
    norm_before_fc: bool = opt(False, "one RMSNorm over the three target features together before fc (speculators' "
                                      "EAGLE-3.1 default; excludes --fc-norm; exported as vLLM's input_norm)")
    norm_before_residual: bool = opt(False, "the first layer's residual is the normalised fused features, not the raw "
                                            "ones (speculators' default; exported as norm_before_residual)")
    norm_output: bool = opt(False, "each TTT step (and each decoding step) reads the previous step's output after "
                                   "the final norm (EAGLE-3.1; exported as vLLM's norm_output)")
    feature_noise: float = opt(0.0, "add Gaussian noise of this standard deviation to the target's features the "
                                    "draft reads, in training only (speculators uses 0.05; 0 = off)")
    dtype: Dtype = dtype_opt("training's compute (bf16: autocast over fp32 weights; fp16 is refused)")
    parallel: str = opt("ddp", "data parallelism over ranks: ddp, or fsdp (FSDP2 fully_shard)", choices=("ddp", "fsdp"))
    device: str = device_opt()
    collective_timeout: float = collective_timeout_opt()
    compile: str = opt("auto", "compile the TTT step with torch.compile (one graph, no host synchronisation, the "
                       "static path): auto = on with CUDA, off on a CPU", choices=("auto", "on", "off"))
    threads: int = opt(0, "CPU threads per rank (0 = the cores divided among the ranks of this node)")
    seed: int = opt(0, "seed of the weights' initialisation and of the data order")
    shuffle: bool = opt(True, "reshuffle the data every epoch")
    shard_data: bool = opt(True, "give every rank its own share of each epoch (off: every rank reads everything, "
                                 "which the audit refuses)")
    allow_duplicate_data: bool = opt(False, "train even if the sharding audit fails (experiments; every log line "
                                            "then says so)")
    checkpoint_every: int = opt(0, "write a checkpoint every N optimizer steps (0 = only at the end of each epoch)")
    keep_checkpoints: int = opt(3, "keep the newest K checkpoints")
    resume: bool = opt(False, "continue from the newest checkpoint in OUT/checkpoints (same settings and ranks)")
    tracker: tuple[str, ...] = opt((), "also send rank 0's metrics to: tensorboard (OUT/tensorboard), wandb "
                                       "(Weights & Biases; WANDB_MODE=offline works without a network), mlflow "
                                       "(MLFLOW_TRACKING_URI); docs/train.md")
    metrics_every: int = opt(0, "read the step figures (loss, accuracy, gradient norm) back from the device every N "
                                "optimizer steps, in one transfer; every step is still written to metrics.jsonl "
                                "(0 = auto: every step on a CPU, where reading costs nothing; every 10 with CUDA)")
    prefetch: int = opt(4, "micro-batches prepared ahead on a background thread")

    def validate(self):
        for name in ("epochs", "micro_batch", "grad_accum", "ttt_steps", "draft_vocab", "num_layers", "prefetch"):
            v = getattr(self, name)
            check(v >= 1, f"train: --{name.replace('_', '-')} {v} must be >= 1", "give a whole number >= 1")
        for name in ("max_steps", "max_tokens", "group_window", "checkpoint_every", "keep_checkpoints", "threads",
                     "metrics_every"):
            v = getattr(self, name)
            check(v >= 0, f"train: --{name.replace('_', '-')} {v} must be >= 0", "give 0 or a positive number")
        check(self.dtype not in ("fp16", "float16"), "train: --dtype fp16 is not a training dtype here",
              "use --dtype bf16 (the same memory, no loss scaling needed) or fp32; auto picks one")
        check(self.lr > 0, f"train: --lr {self.lr} must be positive", "give e.g. --lr 1e-4")
        check(0 <= self.warmup_ratio < 1, f"train: --warmup-ratio {self.warmup_ratio} outside [0, 1)", "e.g. 0.02")
        check(0 <= self.min_lr_ratio <= 1, f"train: --min-lr-ratio {self.min_lr_ratio} outside [0, 1]", "e.g. 0.1")
        check(0 <= self.val_fraction < 1, f"train: --val-fraction {self.val_fraction} outside [0, 1)", "e.g. 0.05")
        check(0 < self.data_fraction <= 1, f"train: --data-fraction {self.data_fraction} outside (0, 1]",
              "e.g. 0.25 for a quarter of the samples")
        check(0 < self.step_decay <= 1, f"train: --step-decay {self.step_decay} outside (0, 1]", "EAGLE-3 uses 0.8")
        check(self.feature_noise >= 0, f"train: --feature-noise {self.feature_noise} is negative",
              "give 0 (off) or a standard deviation such as 0.05")
        check(not (self.fc_norm and self.norm_before_fc), "train: --fc-norm and --norm-before-fc exclude each other",
              "pick one: --fc-norm normalises each feature (the EAGLE-3.1 paper), --norm-before-fc all three together "
              "(speculators' default)")
        check(self.grad_clip >= 0, f"train: --grad-clip {self.grad_clip} is negative", "give 0 (off) or e.g. 0.5")
        check(not self.online or bool(self.data), "train: --online needs the prepared dataset (--data DIR)",
              "pass --data DIR, the folder eyas prepare wrote")
        check(not (self.online and self.val_store), "train: --val-store does not go with --online",
              "online training validates on DIR/validation of --data")
        for name in self.tracker:
            check(name in TRACKERS, f"train: --tracker {name} is not a tracker eyas knows",
                  f"use one or more of {', '.join(TRACKERS)}")
            install = missing_package(name)
            check(install is None, f"train: --tracker {name} needs a package that is not installed",
                  f"`{install}`, or drop {name} from --tracker (metrics.jsonl has the same figures)")
