"""Peak memory and time of one TTT forward + backward against the sequence length T: the implementation with the
[T,T] attention and the [N,Vd] cross-entropy (tests/ttt_reference.py, as of commit 2ae6a09) beside the chunked one
(eyas.draft.attention, eyas.draft.cross_entropy), side by side in one run.

The step is the trainer's: one row of T tokens (one document), compact targets from the target's final hidden
states (sparse_target_logp), k = 7 TTT steps, loss = sum_i scale_i loss_sum_i, backward; bf16 autocast (the
recipe's dtype on a CPU with bf16 matmuls) or --dtype fp32. The draft has one layer of SmolLM2-135M's shape
(hidden 576, 9 heads, 3 kv heads, head_dim 64, MLP 1536), target vocabulary 49,152, draft vocabulary 32,000.

How memory is measured: every (implementation, T) runs in a fresh process. It builds the model and the inputs,
warms up at T = 64, then resets its peak resident set size (writes 5 to /proc/self/clear_refs, Linux) and reads
VmRSS; after the step it reads VmHWM. The figure is VmHWM - VmRSS: every byte the step made resident at its
peak, allocator slack included, as the OS (and its OOM killer) counts it; no tensor is tracked by hand.
Time: that step's wall time ("first"), and the wall time of a second step right after it ("again": its memory
already resident, as for every step of a training run after its first). The old implementation is skipped above
--old-max-t (its [T,T] float32 scores and the [N,Vd] logits need tens of GB at T = 8192) and killed after
--timeout seconds.

    python bench/bench_ttt_memory.py                       # ~8 min at 1 thread
    python bench/bench_ttt_memory.py --lengths 512 1024 --dtype fp32
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas.core.config import check, opt, parse  # noqa: E402
from eyas.core.options import Dtype, dtype_opt  # noqa: E402

STEPS, VOCAB, DRAFT_VOCAB = 7, 49152, 32000
CHILD = "--child"  # `bench_ttt_memory.py --child IMPL T DTYPE THREADS ANNOUNCE`: one measured step (measure())


@dataclasses.dataclass(frozen=True, kw_only=True)
class TTTMemoryConfig:
    lengths: tuple[int, ...] = opt((512, 1024, 2048, 4096, 8192), "the sequence lengths T measured")
    dtype: Dtype = dtype_opt("the TTT step", auto="bf16 here: autocast, the recipe's dtype on a CPU with bf16 "
                                                  "matmuls")
    threads: int = opt(1, "torch threads of each measured process")
    old_max_t: int = opt(4096, "skip the old implementation above this T")
    timeout: float = opt(300.0, "seconds per measured step before it is killed")
    unannounced: bool = opt(False, "the new path without the step weights (ttt_forward's step_scale): the head's "
                                   "weight gradient is then computed in backward")

    def __post_init__(self):
        check(bool(self.lengths), "--lengths given no value", "give one length or more, e.g. --lengths 512 1024")
        check(self.dtype != "fp16", "--dtype fp16: the TTT step here runs in bf16 autocast or fp32",
              "use --dtype bf16 (auto) or fp32")

    @property
    def compute(self) -> str:
        """bf16 or fp32: auto is bf16."""
        return "fp32" if self.dtype == "fp32" else "bf16"


def status(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(impl: str, T: int, dtype: str, threads: int, announce: bool) -> dict:
    """One measured TTT step in this (fresh) process."""
    import torch
    from tests import ttt_reference as ref

    from eyas.draft import ttt
    from eyas.draft.model import DraftConfig, Eagle3Draft
    from eyas.train import batches as data

    torch.set_num_threads(threads)
    cfg = DraftConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=576)
    g = torch.Generator().manual_seed(0)
    model = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 if p.dim() == 2 else torch.ones(p.shape))
    model.d2t.zero_()  # draft ids 0..Vd-1 are target ids 0..Vd-1
    model.t2d[:DRAFT_VOCAB] = True
    compute = torch.bfloat16 if dtype == "bf16" else torch.float32
    head_rows = (torch.randn(DRAFT_VOCAB, 576, generator=g) * 0.05).to(compute)  # [Vd,H]
    scale = 0.8 ** torch.arange(STEPS, dtype=torch.float32) / T  # [k] the trainer's step weights / counts

    def step(T: int) -> float:
        ids = torch.randint(0, DRAFT_VOCAB, (1, T), generator=g)
        aux = torch.randn(1, T, 3 * 576, generator=g).to(compute)
        final = torch.randn(1, T, 576, generator=g).to(compute)
        mask = torch.ones(1, T, dtype=torch.long)
        pos, doc = torch.arange(T)[None], torch.zeros(1, T, dtype=torch.long)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            need = data.needed_rows(data.valid_masks(ids, mask, doc, model.t2d, STEPS))
            with torch.no_grad():
                target, index = (ref if impl == "old" else data).sparse_target_logp(final, head_rows, need)
            if impl == "old":
                r = ref.ttt_forward(model, ids, aux, target, mask, STEPS, pos, doc, index)
            else:
                r = ttt.ttt_forward(model, ids, aux, target, mask, STEPS, pos, doc, index, scale if announce else None)
            loss = (r.loss_sum.float() * scale).sum()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss.detach())

    step(64)  # warm-up: one-time initialisation outside the figures
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    t0 = time.perf_counter()
    loss = step(T)
    seconds = time.perf_counter() - t0
    peak = status("VmHWM") - before
    t0 = time.perf_counter()
    step(T)  # again, in memory the first step already made resident (as every step of a training run after its first)
    return {"peak_mb": peak / 2**20, "seconds": seconds, "warm_seconds": time.perf_counter() - t0, "loss": loss}


def measure(impl: str, T: int, a) -> dict | str:
    """child() in a fresh process; its figures, or why there are none."""
    cmd = [sys.executable, __file__, CHILD, impl, str(T), a.compute, str(a.threads), str(int(not a.unannounced))]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return f"timeout {a.timeout:g} s"
    if p.returncode != 0:
        return f"failed ({p.returncode}): {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ''}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                "unknown CPU")


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def cell(r, key: str, fmt: str) -> str:
    return format(r[key], fmt) if isinstance(r, dict) else "skipped" if r is None else "-"


def main() -> None:
    if sys.argv[1:2] == [CHILD]:
        impl, T, dtype, threads, announce = sys.argv[2:]
        print(json.dumps(child(impl, int(T), dtype, int(threads), announce == "1")))
        return
    a = parse(TTTMemoryConfig, description=__doc__.splitlines()[0])
    print(f"bench_ttt_memory: {cpu()}, {os.cpu_count()} cores, {load()}")
    print(f"one TTT forward+backward, k={STEPS}, 1-layer SmolLM2-135M-shaped draft, draft vocabulary {DRAFT_VOCAB:,}, "
          f"B=1, {a.compute}, {a.threads} thread(s); peak = VmHWM - VmRSS of a fresh process"
          + ("; new without step_scale" if a.unannounced else ""))
    rows = []
    for T in a.lengths:
        old = measure("old", T, a) if T <= a.old_max_t else None
        new = measure("new", T, a)
        rows.append((T, old, new))
        for name, r in (("old", old), ("new", new)):
            if isinstance(r, str):
                print(f"  T={T} {name}: {r}")
        if isinstance(old, dict) and isinstance(new, dict) and abs(old["loss"] - new["loss"]) > 1e-2 * abs(old["loss"]):
            print(f"  T={T}: the losses differ: old {old['loss']:.5f}, new {new['loss']:.5f}")
    print(f"{'':>6} | {'peak MB':^27} | {'first step s':^23} | {'step again s':^23} |")
    print(f"{'T':>6} | {'old':>9} {'new':>9} {'old/new':>7} | {'old':>7} {'new':>7} {'old/new':>7} | "
          f"{'old':>7} {'new':>7} {'old/new':>7} | new peak / previous T's")
    last = None
    for T, old, new in rows:
        line = f"{T:>6} |"
        for key, width, fmt in (("peak_mb", 9, ".0f"), ("seconds", 7, ".2f"), ("warm_seconds", 7, ".2f")):
            both = isinstance(old, dict) and isinstance(new, dict)
            ratio = f"{old[key] / new[key]:7.2f}" if both else f"{'-':>7}"
            line += f" {cell(old, key, fmt):>{width}} {cell(new, key, fmt):>{width}} {ratio} |"
        if isinstance(new, dict) and isinstance(last, dict):
            line += f" {new['peak_mb'] / last['peak_mb']:.2f}x"
        print(line)
        last = new
    print(f"bench_ttt_memory: {load()} after")


if __name__ == "__main__":
    main()
