"""Throughput beside other work: each stage's kernel quiet, beside one busy process and beside two, with eyas's
thread choice (eyas.core.threads: the cores other work leaves free) against torch's default of every core.

Busy processes are `python -c "while True: pass"`, as a user's other work would be. Each cell runs its kernel
for --seconds after a warm-up and reports work per second; the ratio is against the same mode's quiet figure.
The kernels are what each stage spends its time in, on SmolLM2-135M in bf16:

- regenerate: the lean batched decoder, 16 prompts x 24 new tokens (new tokens/s);
- extract: the target's forward with hidden states, 8 x 256 tokens (tokens/s);
- train: the EAGLE-3 draft's training-time-test forward and backward as the recipe trains it (TTT 5, a packed
  sequence of 1,024 tokens, draft vocabulary 8,192), tokens/s;
- evaluate: one-row greedy decoding, as plain and speculative decoding run it (new tokens/s).

With ranks, regenerate's ranks decode their own prompts as `eyas regenerate`'s worker processes do, and
extract's ranks run the same forward on their own batches (the rate is their sum), and train's ranks
run the TTT objective wrapped in DistributedDataParallel as the trainer wraps it, so every step all-reduces the
gradients; the rate is the ranks' tokens together.

    python bench/bench_threads.py                 # ~5 min on 2 cores
    python bench/bench_threads.py --kernels regenerate --seconds 10
    python bench/bench_threads.py --kernels extract train --hogs 0 2 --repeats 3    # medians of 3 rounds
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import sys
import time

import torch

from eyas.core.config import check, opt, parse
from eyas.core.options import target_opt

HOG = "while True: pass"
KERNELS = ("regenerate", "extract", "train", "evaluate")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ThreadsBenchConfig:
    target: str = target_opt()
    kernels: tuple[str, ...] = opt(KERNELS, "the stages' kernels measured", choices=KERNELS)
    seconds: float = opt(8.0, "each cell's kernel runs this long after a warm-up")
    hogs: tuple[int, ...] = opt((0, 1, 2), "busy processes beside the kernels, each number in turn")
    repeats: int = opt(1, "rounds of every condition, alternated (medians shown)")
    ranks: int = opt(0, "ranks of the ranked mode for regenerate, extract and train (default: one per core; 1: none)")

    def __post_init__(self):
        check(bool(self.kernels) and bool(self.hogs), "--kernels or --hogs given no value",
              "give each one value or more, or leave it out")


def kernels(target, names: list[str], env=None) -> dict:
    from eyas.draft.model import DraftConfig, Eagle3Draft
    from eyas.draft.ttt import target_log_probs, ttt_forward
    from eyas.models.generation import BatchGenerator

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
        cfg = DraftConfig.for_target(target, 8192, None, 1)
        draft = Eagle3Draft(cfg).to(target.dtype)
        H, T = target.hidden_size, 1024
        x = torch.randint(0, vocab, (1, T), generator=g)
        aux = torch.randn(1, T, 3 * H, generator=g, dtype=torch.float32).to(target.dtype)
        logp = target_log_probs(torch.randn(1, T, H, generator=g), torch.randn(8192, H, generator=g))
        mask = torch.ones(1, T, dtype=torch.long)

        if env is None:
            def step():
                r = ttt_forward(draft, x, aux, logp.to(target.dtype), mask, steps=5)
                r.loss_sum.sum().backward()
                draft.zero_grad(set_to_none=True)
        else:  # as the trainer runs it on several ranks: the objective in DDP, gradients all-reduced every step
            from eyas.train.objective import TTTObjective
            from eyas.train.parallelize import wrap
            model = wrap(TTTObjective(draft, 5), "ddp", env)
            logp = logp.to(target.dtype)

            def step():
                loss_sum, _, _ = model(x, aux, logp, None, mask, None, None)
                loss_sum.sum().backward()
                draft.zero_grad(set_to_none=True)
        out["train"] = (step, T, "tokens/s")
    if "evaluate" in names:
        out["evaluate"] = (lambda: lean.generate(one, 32, stops=set()), 32, "new tokens/s")
    return out


def rate(fn, work: float, seconds: float, synced: bool = False) -> float:
    """Work per second over `seconds` after a warm-up call. synced: ranks in lockstep (DDP) stop together, as
    rank 0 decides (a rank that ran one step more would wait forever for the others' all-reduce)."""
    import torch.distributed as tdist

    fn()  # warm-up
    done, t0 = 0.0, time.perf_counter()
    while True:
        go = torch.tensor([time.perf_counter() - t0 < seconds])
        if synced:
            tdist.broadcast(go, 0)
        if not go.item():
            break
        fn()
        done += work
    return done / (time.perf_counter() - t0)


def rank_main(rank: int, world: int, port: int, target_name: str, name: str, seconds: float, results) -> None:
    """One rank of the ranked mode: its own process, its threads from its share of the cores (eyas.core.threads
    with ranks_on_node = world), the kernel timed in step with the other ranks."""
    import torch.distributed as tdist

    from eyas.core.dist import DistEnv
    from eyas.core.target import load_target
    from eyas.core.threads import Threads

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        n, _ = Threads(ranks_on_node=world, slot=rank).apply()  # as extract and train: one rank per core, pinned
        env = DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world, backend="gloo")
        target = load_target(target_name, dtype="bfloat16")
        fn, work, _ = kernels(target, [name], env)[name]
        tdist.barrier()
        results.put((rank, n, rate(fn, work, seconds, synced=name == "train")))
    finally:
        tdist.destroy_process_group()


def ranked(target_name: str, name: str, seconds: float, world: int) -> tuple[float, int]:
    """The kernel on `world` ranks at once: (work per second of them all, threads per rank)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(rank_main, (world, port, target_name, name, seconds, results), nprocs=world,
                       start_method="spawn")
    got = [results.get() for _ in range(world)]
    return sum(r for _, _, r in got), got[0][1]


def main() -> None:
    a = parse(ThreadsBenchConfig, description=__doc__)

    from eyas.core.target import load_target
    from eyas.core.threads import Threads

    os.environ.pop("OMP_NUM_THREADS", None)
    cores = len(os.sched_getaffinity(0))
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "unknown CPU")
    print(f"bench_threads: {model}, {cores} cores, load {os.getloadavg()[0]:.2f}, {a.seconds:g} s per cell")
    target = load_target(a.target, dtype="bfloat16")
    work = kernels(target, a.kernels)
    world = a.ranks or cores
    ranked_mode = f"{world} ranks"
    modes = {name: ["eyas", "all cores"] + ([ranked_mode] if world > 1 and name != "evaluate" else [])
             for name in work}
    table: dict[tuple[str, str, int], list[float]] = {}
    whys: dict[int, str] = {}
    for rep in range(a.repeats):  # the conditions alternate; each cell's figure is the median of its repeats
        for hogs in a.hogs:
            procs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)]
            try:
                time.sleep(1.0)
                n, whys[hogs] = Threads().apply()
                for name, (fn, amount, _) in work.items():
                    for mode in modes[name]:  # alternated within each condition
                        if mode == ranked_mode:
                            got, per_rank = ranked(a.target, name, a.seconds, world)
                            if f"{world} ranks" not in whys[hogs]:
                                whys[hogs] += f"; {world} ranks: {per_rank} thread(s) each"
                        else:
                            torch.set_num_threads(n if mode == "eyas" else cores)
                            got = rate(fn, amount, a.seconds)
                        table.setdefault((name, mode, hogs), []).append(got)
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
            print(f"  repeat {rep + 1}, {hogs} busy process(es): eyas chose {n} thread(s) ({whys[hogs]})", flush=True)
    med = {k: statistics.median(v) for k, v in table.items()}
    print(f"{'kernel':11s} {'mode':10s} " + " ".join(f"{f'{h} busy':>18s}" for h in a.hogs)
          + ("" if a.repeats == 1 else f"  (medians of {a.repeats}; each repeat's ratio in brackets)"))
    for name, (_, _, unit) in work.items():
        for mode in modes[name]:
            q = med[name, mode, a.hogs[0]]
            cells = [f"{med[name, mode, h]:9.1f} ({med[name, mode, h] / q:4.2f}x)" for h in a.hogs]
            each = "" if a.repeats == 1 else "  [" + "; ".join(
                " ".join(f"{v / table[name, mode, a.hogs[0]][r]:.2f}" for r, v in enumerate(table[name, mode, h]))
                for h in a.hogs[1:]) + "]"
            print(f"{name:11s} {mode:10s} " + " ".join(f"{c:>18s}" for c in cells) + f"  {unit}{each}")
    print(f"bench_threads: load {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
