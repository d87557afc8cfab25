"""eyas plan: the arithmetic of a training run before it starts.

The figures a multi-rank run needs and logs rarely label: micro-batches per rank, optimizer steps, the global
batch, the wall-clock time, and what that time would be if the data were NOT sharded (the failure mode in which
every rank iterates the whole dataset). `compute_plan` is pure; the trainer calls it to print its plan block
and writes `Plan.to_dict()` to `RUN/plan.json`; `eyas doctor` reads both back.

Definitions, with N samples, W ranks, b samples per micro-batch per rank, g micro-batches per optimizer step:

| remainder | samples per rank per epoch | micro-batches per rank per epoch | optimizer steps per epoch |
|---|---|---|---|
| padded (default) | ceil(N/W), adding W*ceil(N/W) - N repeats | ceil(ceil(N/W) / b), the last short | ceil(mb / g) |
| dropped | floor(N / (W*b*g)) * b*g | floor(N / (W*b*g)) * g | floor(N / (W*b*g)) |

An optimizer step is global: all ranks take it together, on W*b*g samples (the global batch). `steps_per_s` is
the optimizer steps per second one rank achieves (the line rate of a rank-0 log), so the ETA is
optimizer_steps_total / steps_per_s, counting steps only (no start-up, validation or checkpoints). Not
sharded, every rank reads all N samples each epoch: the same formulas with W = 1.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
from pathlib import Path

import eyas.core.target as target
from eyas.core.config import StageConfig, check, opt
from eyas.core.errors import EyasError
from eyas.core.files import read_json
from eyas.core.log import Console, fmt_bytes, fmt_duration, fmt_int
from eyas.core.options import Dtype, dtype_opt, target_opt, trust_remote_code_opt, trusted_code_line
from eyas.core.precision import FULL
from eyas.data.prepared import open_prepared, read_summary

# Bytes per element of the stored hidden states.
DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float32": 4, "fp32": 4}
STORED_LAYERS = 4  # three feature layers (low|mid|high, the draft's input) + the final hidden state (its target)


# the largest figures a plan takes: far past any run (the seed's: 35,446 samples, 4 ranks, 87.8M tokens)
LIMITS = {"samples": (0, 10**12), "tokens": (0, 10**15), "hidden_size": (0, 10**6), "num_layers": (0, 10**4),
          "world_size": (1, 10**6), "micro_batch": (1, 10**6), "grad_accum": (1, 10**6), "epochs": (1, 10**6)}

# eyas train's defaults, which eyas plan assumes too: one definition for both
MICRO_BATCH, GRAD_ACCUM, EPOCHS = 4, 1, 1


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The arithmetic of one run; every figure is per rank or global as its name says."""

    samples: int  # dataset samples (global)
    world_size: int
    micro_batch: int  # samples per micro-batch, per rank
    grad_accum: int  # micro-batches per optimizer step
    epochs: int
    drop_remainder: bool
    samples_per_rank_per_epoch: int  # including padded repeats
    padded_samples: int  # repeats added per epoch (global), so every rank has the same count; 0 when dropping
    dropped_samples: int  # samples left out per epoch (global); 0 when padding
    micro_batches_per_rank_per_epoch: int
    micro_batches_per_rank_total: int
    optimizer_steps_per_epoch: int  # global: every rank takes each step together
    optimizer_steps_total: int
    global_batch: int  # samples per optimizer step over all ranks: W * b * g
    unsharded_micro_batches_per_rank_per_epoch: int  # if every rank read all N samples
    unsharded_optimizer_steps_total: int
    steps_per_s: float | None = None  # optimizer steps per second of one rank
    eta_s: float | None = None
    eta_unsharded_s: float | None = None
    tokens: int | None = None  # dataset tokens (global)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def lines(self) -> list[str]:
        """The labelled plan block (the trainer prints it; `eyas doctor` parses it back: keep the wording)."""
        tokens = f", {fmt_int(self.tokens)} tokens (global)" if self.tokens else ""
        if self.drop_remainder:
            rest = f"remainder dropped: {fmt_int(self.dropped_samples)} dropped per epoch, global"
        else:
            rest = f"remainder padded with repeats: {fmt_int(self.padded_samples)} padded, global"
        out = [
            f"plan: dataset {fmt_int(self.samples)} samples (global), {self.epochs} epochs{tokens}",
            f"plan: {self.world_size} ranks x micro-batch {self.micro_batch} (per rank) x grad accum {self.grad_accum}"
            f" = global batch {fmt_int(self.global_batch)} samples per optimizer step",
            f"plan: samples per rank per epoch: {fmt_int(self.samples_per_rank_per_epoch)} ({rest})",
            f"plan: micro-batches per rank: {fmt_int(self.micro_batches_per_rank_per_epoch)} per epoch, "
            f"{fmt_int(self.micro_batches_per_rank_total)} in all",
            f"plan: optimizer steps (global, all ranks step together): {fmt_int(self.optimizer_steps_per_epoch)} "
            f"per epoch, {fmt_int(self.optimizer_steps_total)} in all",
        ]
        if self.eta_s is not None:
            out.append(f"plan: ETA {fmt_duration(self.eta_s)} at {self.steps_per_s:.2f} optimizer steps/s per rank")
        if self.world_size > 1:  # a hypothesis, said as one: the words SHARDED / NOT SHARDED are verdicts only
            took = f", taking {fmt_duration(self.eta_unsharded_s)}" if self.eta_unsharded_s is not None else ""
            out.append(f"plan: if the data were not sharded (every rank reading all {fmt_int(self.samples)} samples): "
                       f"{fmt_int(self.unsharded_micro_batches_per_rank_per_epoch)} micro-batches per rank per epoch, "
                       f"{fmt_int(self.unsharded_optimizer_steps_total)} optimizer steps per rank in all{took}")
        return out


def _per_epoch(samples: int, world_size: int, b: int, g: int, drop: bool) -> tuple[int, int, int, int, int]:
    """(samples per rank, padded, dropped, micro-batches per rank, optimizer steps) for one epoch."""
    if drop:
        steps = samples // (world_size * b * g)
        per_rank = steps * b * g
        return per_rank, 0, samples - per_rank * world_size, steps * g, steps
    per_rank = _ceil_div(samples, world_size)
    micro = _ceil_div(per_rank, b)
    return per_rank, per_rank * world_size - samples, 0, micro, _ceil_div(micro, g)


def compute_plan(samples: int, world_size: int, micro_batch: int = 1, grad_accum: int = 1, epochs: int = 1,
                 drop_remainder: bool = False, steps_per_s: float | None = None, tokens: int | None = None) -> Plan:
    """The plan of a run (see the module docstring for the formulas). Raises EyasError on impossible input."""
    for name, v in (("samples", samples), ("world_size", world_size), ("micro_batch", micro_batch),
                    ("grad_accum", grad_accum), ("epochs", epochs)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise EyasError(f"plan: {name} = {v!r} is not a positive whole number", fix=f"give {name} >= 1")
    if steps_per_s is not None and not (math.isfinite(steps_per_s) and steps_per_s > 0):
        raise EyasError(f"plan: steps_per_s = {steps_per_s!r} must be a positive number", fix="omit it or measure it")
    per_rank, padded, dropped, micro, steps = _per_epoch(samples, world_size, micro_batch, grad_accum, drop_remainder)
    if steps == 0:
        raise EyasError(f"plan: {samples} samples do not fill one global batch of "
                        f"{world_size * micro_batch * grad_accum}",
                        "with the remainder dropped, no optimizer step would run",
                        "use fewer ranks, a smaller micro-batch or grad accum, or pad the remainder")
    _, _, _, u_micro, u_steps = _per_epoch(samples, 1, micro_batch, grad_accum, drop_remainder)
    eta = eta_u = None
    if steps_per_s:
        eta, eta_u = steps * epochs / steps_per_s, u_steps * epochs / steps_per_s
    return Plan(samples=samples, world_size=world_size, micro_batch=micro_batch, grad_accum=grad_accum, epochs=epochs,
                drop_remainder=drop_remainder, samples_per_rank_per_epoch=per_rank, padded_samples=padded,
                dropped_samples=dropped, micro_batches_per_rank_per_epoch=micro,
                micro_batches_per_rank_total=micro * epochs, optimizer_steps_per_epoch=steps,
                optimizer_steps_total=steps * epochs, global_batch=world_size * micro_batch * grad_accum,
                unsharded_micro_batches_per_rank_per_epoch=u_micro, unsharded_optimizer_steps_total=u_steps * epochs,
                steps_per_s=steps_per_s, eta_s=eta, eta_unsharded_s=eta_u, tokens=tokens)


def storage_bytes(tokens: int, hidden_size: int, dtype: str = "bfloat16") -> tuple[int, int]:
    """(bytes per token, total bytes) of the hidden states an extraction stores: (3 + 1) x H x dtype bytes.

    Token ids and loss masks add a few bytes per token on top; they are left out here.
    """
    if dtype not in DTYPE_BYTES:
        raise EyasError(f"unknown storage dtype {dtype!r}", fix=f"use one of {', '.join(DTYPE_BYTES)}")
    per_token = STORED_LAYERS * hidden_size * DTYPE_BYTES[dtype]
    return per_token, per_token * tokens


def target_dims(spec: str, trust_remote_code: bool = False) -> tuple[int, int]:
    """(hidden size, layers) of a target name, HF folder, Hub id or .gguf, without loading its weights."""

    info = getattr(target, "target_spec_info", None)  # the target module's own table, when it offers one
    if info is not None:
        r = info(spec)
        get = r.get if isinstance(r, dict) else (lambda k: getattr(r, k, None))
        if get("hidden_size"):
            return int(get("hidden_size")), int(get("num_layers") or 0)
    if spec in target.TINY:
        fields = target.TINY[spec][1]
        return fields["hidden_size"], fields["num_hidden_layers"]
    path = Path(spec).expanduser()
    if target.hub_id(spec) is not None:  # its config and tokenizer files, from the Hugging Face cache
        path = Path(target.resolve_source(spec, weights=False)[1])
    if path.is_dir() and (path / "config.json").is_file():
        return _config_dims(path, trust_remote_code)
    if spec in target.BUILTINS or (path.suffix == ".gguf" and path.is_file()):
        return _gguf_dims(target.builtin_gguf(spec) if spec in target.BUILTINS else path)
    raise EyasError(f"unknown target {spec!r}", "it is neither a built-in name, a model folder nor a .gguf file",
                    "give --hidden-size H (and --num-layers L) instead")


def _config_dims(folder: Path, trust_remote_code: bool) -> tuple[int, int]:
    """From config.json as written; a config that states them only through its own class (its fields named
    otherwise) is read by transformers, running the folder's code when --trust-remote-code allows it."""
    cfg = read_json(folder / "config.json", "give a model folder whose config.json is intact")
    cfg = cfg.get("text_config", cfg)
    if "hidden_size" in cfg:
        return int(cfg["hidden_size"]), int(cfg.get("num_hidden_layers", 0))
    from transformers import AutoConfig  # heavy (seconds to import): only for a config that needs it

    with target.refusing_code(folder):
        text = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code).get_text_config()
    return int(text.hidden_size), int(getattr(text, "num_hidden_layers", 0) or 0)


def _gguf_dims(path: Path) -> tuple[int, int]:
    import gguf  # only for a .gguf target

    fields = gguf.GGUFReader(path).fields

    def value(key: str):
        f = fields.get(key)
        return None if f is None or not f.data else f.parts[f.data[0]]

    arch = bytes(value("general.architecture")).decode()
    return int(value(f"{arch}.embedding_length")[0]), int(value(f"{arch}.block_count")[0])


def read_prepared(folder: str) -> tuple[int, int]:
    """(samples, tokens) of a prepared dataset's train split, from DIR/summary.json (else the DIR/train split)."""
    d = Path(folder)
    summary = d / "summary.json"
    if not summary.is_file() and not (d / "train").is_dir():
        raise EyasError(f"{d} is not a prepared dataset (no summary.json, no train/)",
                        fix="give the folder `eyas prepare` wrote, or --samples N --tokens T")
    if summary.is_file():
        s = read_summary(d)
        samples, tokens = s.get("samples"), s.get("tokens_by_split", {})
        if isinstance(samples, dict) and isinstance(samples.get("train"), int):  # the prepare contract
            return samples["train"], int(tokens.get("train", 0)) if isinstance(tokens, dict) else 0
    ds = open_prepared(d, "train").ds
    return len(ds), int(sum(ds["num_tokens"]))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanConfig(StageConfig):
    """Settings of `eyas plan`."""

    samples: int = opt(0, "dataset samples (global); 0 = read them from --data")
    data: str = opt("", "a prepared dataset folder: samples and tokens come from DIR/summary.json")
    tokens: int = opt(0, "dataset tokens (global) for the storage estimate; 0 = from --data, or no estimate")
    world_size: int = opt(1, "ranks (processes, usually one per GPU)")
    micro_batch: int = opt(MICRO_BATCH, "samples per micro-batch, per rank (eyas train's default)")
    grad_accum: int = opt(GRAD_ACCUM, "micro-batches per optimizer step (gradient accumulation)")
    epochs: int = opt(EPOCHS, "epochs")
    drop_remainder: bool = opt(False, "drop what does not fill a whole global batch (default: pad with repeats)")
    steps_per_s: float = opt(0.0, "measured optimizer steps per second of one rank, for the ETA; 0 = no ETA")
    target: str = target_opt("", role="for its hidden size (or give --hidden-size)")
    trust_remote_code: bool = trust_remote_code_opt()
    hidden_size: int = opt(0, "the target's hidden size H, for the storage estimate")
    num_layers: int = opt(0, "the target's decoder layers, to show the default feature layers")
    dtype: Dtype = dtype_opt("the extraction, which the hidden states are stored in", auto="bf16, what a GPU's auto "
                             "extracts in")
    store: str = opt(".", "where the hidden-state store would go (its disk's free space is reported)")

    def validate(self):
        for name, (lo, top) in LIMITS.items():  # first: a negative count is not a missing one
            v = getattr(self, name)
            check(lo <= v <= top, f"plan: --{name.replace('_', '-')} {v:,} is outside {lo:,}..{top:,}",
                  f"give a whole number from {lo:,} to {top:,}")
        check(self.samples > 0 or bool(self.data), "plan: no dataset size given",
              "give --samples N or --data PREPARED_DIR")
        check(self.steps_per_s == 0 or (math.isfinite(self.steps_per_s) and 1e-6 <= self.steps_per_s <= 1e6),
              f"plan: --steps-per-s {self.steps_per_s:g} is outside 1e-06..1e+06 (or 0 for no ETA)",
              "give the measured optimizer steps per second of one rank, or 0 for no ETA")


def _free_disk(where: str) -> tuple[str, int]:
    """(existing folder, free bytes) for the place a store would go (its nearest existing parent)."""
    p = Path(where).expanduser().resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return str(p), shutil.disk_usage(p).free


def _storage_lines(cfg: PlanConfig, tokens: int) -> tuple[list[str], dict | None]:
    hidden, layers = cfg.hidden_size, cfg.num_layers
    if cfg.target and not hidden:
        hidden, layers = target_dims(cfg.target, cfg.trust_remote_code)
    folder, free = _free_disk(cfg.store)
    disk = {"path": folder, "free_bytes": free}
    if not (hidden and tokens):
        missing = "--tokens (or --data)" if not tokens else "--hidden-size or --target"
        return [f"storage: no estimate without {missing}", f"disk: {fmt_bytes(free)} free at {folder}"], {"disk": disk}
    dtype = "bfloat16" if cfg.dtype == "auto" else FULL[cfg.dtype]  # what a GPU's extract --dtype auto stores
    per_token, total = storage_bytes(tokens, hidden, dtype)
    feats = ""
    if layers >= 6:
        feats = f" (feature layers [2, {layers // 2}, {layers - 3}] of {layers})"
    fits = "enough" if free >= total else f"NOT enough: {fmt_bytes(total - free)} short"
    size = f"{total / 1e12:.2f} TB ({fmt_bytes(total)})" if total >= 1e10 else fmt_bytes(total)
    lines = [f"storage: {fmt_int(per_token)} B per token = (3 feature layers + final state) x H {fmt_int(hidden)} x "
             f"{DTYPE_BYTES[dtype]} B {dtype}{feats}",
             f"storage: {fmt_int(tokens)} tokens -> {size} of hidden states",
             f"disk: {fmt_bytes(free)} free at {folder} ({fits})"]
    info = {"hidden_size": hidden, "num_layers": layers, "dtype": dtype, "bytes_per_token": per_token,
            "total_bytes": total, "disk": disk, "fits": free >= total}
    return lines, info


def run(cfg: PlanConfig) -> dict:
    samples, tokens = cfg.samples, cfg.tokens
    if cfg.data:
        n, t = read_prepared(cfg.data)
        samples, tokens = samples or n, tokens or t
    plan = compute_plan(samples, cfg.world_size, cfg.micro_batch, cfg.grad_accum, cfg.epochs, cfg.drop_remainder,
                        cfg.steps_per_s or None, tokens or None)
    con = Console(quiet=cfg.quiet or cfg.json, stream=sys.stdout)
    if cfg.trust_remote_code and cfg.target and not cfg.hidden_size:
        con.print(trusted_code_line(cfg.target))
    storage_lines, storage = _storage_lines(cfg, tokens)
    for line in plan.lines() + storage_lines:
        con.print(line)
    eta = ""
    if plan.eta_s:
        eta = f", ETA {fmt_duration(plan.eta_s)} ({fmt_duration(plan.eta_unsharded_s)} if not sharded)"
    if not cfg.json:
        con.summary(f"plan: {fmt_int(plan.micro_batches_per_rank_per_epoch)} micro-batches per rank per epoch, "
                    f"{fmt_int(plan.optimizer_steps_total)} optimizer steps in all{eta}")
    return {"plan": plan.to_dict(), "storage": storage}
