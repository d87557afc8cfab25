"""Throughput beside other work: each stage's kernel quiet, beside one busy process and beside two, with eyas's
thread choice (eyas.core.threads: the cores other work leaves free) against torch's default of every core.

Busy processes are `python -c "while True: pass"`, as a user's other work would be. Each cell runs its kernel
for --seconds after a warm-up and reports work per second; the ratio is against the same mode's quiet figure.
The kernels are what each stage spends its time in, on SmolLM2-135M in bf16:

- regenerate: the lean batched decoder, 16 prompts x 24 new tokens (new tokens/s);
- extract: the target's forward with hidden states, 8 x 256 tokens (tokens/s);
- train: the EAGLE-3 draft's training-time-test forward and backward, 3 steps over 512 tokens (steps/s);
- evaluate: one-row greedy decoding, as plain and speculative decoding run it (new tokens/s).

    python bench/bench_threads.py                 # ~5 min on 2 cores
    python bench/bench_threads.py --kernels regenerate --seconds 10
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

HOG = "while True: pass"


def kernels(target, names: list[str]) -> dict:
    from eyas.core.generate import BatchGenerator
    from eyas.draft.model import DraftConfig, Eagle3Draft
    from eyas.draft.ttt import target_log_probs, ttt_forward

    g = torch.Generator().manual_seed(0)
    vocab = target.vocab_size
    lean = BatchGenerator(target)
    prompts = [torch.randint(100, vocab - 100, (int(n),), generator=g).tolist()
               for n in torch.randint(60, 160, (16,), generator=g)]
    one = prompts[:1]
    out = {}
    if "regenerate" in names:
        out["regenerate"] = (lambda: lean.generate(prompts, 24, stops=set()), 16 * 24, "new tokens/s")
    if "extract" in names:
        ids = torch.randint(100, vocab - 100, (8, 256), generator=g)

        def forward():
            with torch.inference_mode():
                target.model(input_ids=ids, output_hidden_states=True)
        out["extract"] = (forward, 8 * 256, "tokens/s")
    if "train" in names:
        cfg = DraftConfig.for_target(target, 4096, None, 1)
        draft = Eagle3Draft(cfg).to(target.dtype)
        H, T = target.hidden_size, 512
        x = torch.randint(0, vocab, (1, T), generator=g)
        aux = torch.randn(1, T, 3 * H, generator=g, dtype=torch.float32).to(target.dtype)
        logp = target_log_probs(torch.randn(1, T, H, generator=g), torch.randn(4096, H, generator=g))
        mask = torch.ones(1, T, dtype=torch.long)

        def step():
            r = ttt_forward(draft, x, aux, logp.to(target.dtype), mask, steps=3)
            r.loss_sum.sum().backward()
            draft.zero_grad(set_to_none=True)
        out["train"] = (step, 1, "steps/s")
    if "evaluate" in names:
        out["evaluate"] = (lambda: lean.generate(one, 32, stops=set()), 32, "new tokens/s")
    return out


def rate(fn, work: float, seconds: float) -> float:
    fn()  # warm-up
    done, t0 = 0.0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        done += work
    return done / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--kernels", nargs="+", default=["regenerate", "extract", "train", "evaluate"])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--hogs", nargs="+", type=int, default=[0, 1, 2])
    a = ap.parse_args()

    from eyas.core.target import load_target
    from eyas.core.threads import Threads

    os.environ.pop("OMP_NUM_THREADS", None)
    cores = len(os.sched_getaffinity(0))
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "unknown CPU")
    print(f"bench_threads: {model}, {cores} cores, load {os.getloadavg()[0]:.2f}, {a.seconds:g} s per cell")
    target = load_target(a.target, dtype="bfloat16")
    work = kernels(target, a.kernels)
    table: dict[tuple[str, str, int], float] = {}
    whys: dict[int, str] = {}
    for hogs in a.hogs:
        procs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)]
        try:
            time.sleep(1.0)
            n, whys[hogs] = Threads().apply()
            for name, (fn, amount, _) in work.items():
                for mode, threads in (("eyas", n), ("all cores", cores)):  # alternated within each condition
                    torch.set_num_threads(threads)
                    table[name, mode, hogs] = rate(fn, amount, a.seconds)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        print(f"  {hogs} busy process(es): eyas chose {n} thread(s) ({whys[hogs]})")
    print(f"{'kernel':11s} {'mode':10s} " + " ".join(f"{f'{h} busy':>18s}" for h in a.hogs))
    for name, (_, _, unit) in work.items():
        for mode in ("eyas", "all cores"):
            q = table[name, mode, a.hogs[0]]
            cells = [f"{table[name, mode, h]:9.1f} ({table[name, mode, h] / q:4.2f}x)" for h in a.hogs]
            print(f"{name:11s} {mode:10s} " + " ".join(f"{c:>18s}" for c in cells) + f"  {unit}")
    print(f"bench_threads: load {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
