"""Local regeneration throughput on real prompts: eyas's continuous batching against its batch-by-batch decoder and
transformers' `generate`, alternated in one run.

Each method answers the same conversations through `eyas regenerate`'s own local backend (the chat template, the
stop at end of turn, up to --max-new-tokens): `slots` refills a finished row's slot at once (the default path),
`batches` decodes --batch-size conversations together and waits for the longest reply, `hf` is transformers'
`generate` batch by batch. tokens/s counts the replies' tokens over the wall time, prefill included. The lean
paths' replies are checked to be the same as each other's (bf16 near-ties aside).

`server` sends the same conversations through `eyas regenerate --server URL` to an OpenAI-compatible server
started beforehand (vLLM's CPU build, for one: docs/regenerate.md), at each --concurrency. `engine` is
`eyas regenerate --engine vllm`: eyas starts vLLM itself (--engine-python, else $EYAS_VLLM_PYTHON or the
environment scripts/setup-vllm.sh makes; its start-up is timed apart, not counted) and sends token ids, at each
--concurrency.

At the end the bench prints issue 24's targets beside what this run measured: eyas's own decoder (`slots`) at
600 tokens/s, at 5x transformers' `generate`, at efficiency 0.6 and at 2x the engine a user would pick instead
(vLLM, `engine` or `server`), and how much more data the faster path buys in the same time.

The run also measures the machine's GEMM rate in the target's dtype on the decoder's own largest weight (the
fused [gate|up] projection, 512 rows at a time) and prints each method's efficiency = tokens/s x FLOPs per token
/ GEMM rate, with FLOPs per token = 2 x the weights every token multiplies (decoder layers and output head;
attention over the context, a few per cent more at these lengths, is left out, so the figure is a lower bound).

    python bench/bench_regenerate.py                                   # GSM8K train, 256 prompts, 256 new tokens
    python bench/bench_regenerate.py --data chitchat --samples 64 --max-turns 3 --max-new-tokens 96   # the recipe's
    python bench/bench_regenerate.py --methods slots server --server http://127.0.0.1:8000 --concurrency 16 64
    python bench/bench_regenerate.py --methods slots hf engine --concurrency 64 128 256   # the issue's targets
    python bench/bench_regenerate.py --methods engine --concurrency 128 --hogs 0 1 2 --engine-bind eyas vllm
                                                      # beside busy processes: eyas's thread choice and vLLM's own
    python bench/bench_regenerate.py --methods slots --workers 1 2 --hogs 0 2   # worker processes, quiet and loaded
    python bench/bench_regenerate.py --attention      # the single-query attention alone: cost per call and per column

`--attention` times eyas.models.llama.decode_attention on SmolLM2-135M's shapes over a cache slice, against
bmm over the strided slice without the copy and against scaled_dot_product_attention, at several row counts and
widths; one row's time (the cost of a call) over the cost of a row-column at 32-128 rows is what
eyas.models.generation.GROUP estimates.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eyas.core.config import check, opt, parse
from eyas.core.options import Dtype, dtype_opt, target_opt
from eyas.core.precision import FULL

NO_ENGINE = ("", "eyas")  # the (thread binding, preload) of runs that start no engine
METHODS = ("slots", "batches", "hf", "server", "engine")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RegenerateBenchConfig:
    target: str = target_opt()
    data: str = opt("gsm8k-train", "the conversations (eyas regenerate --data)")
    samples: int = opt(256, "the first N conversations")
    max_new_tokens: int = opt(256, "new tokens per reply at most")
    max_turns: int = opt(0, "answer only the first N user turns (0: all)")
    dtype: Dtype = dtype_opt("the target", auto="bf16 here, the bench's reference")
    batch: tuple[int, ...] = opt((32, 64), "the local methods' batch sizes (slots per worker), each in turn")
    server: str = opt("", "the server method's URL")
    concurrency: tuple[int, ...] = opt((16, 64), "the server and engine methods'")
    engine_python: str = opt("", "the engine method's vLLM python (eyas.core.vllm_server)")
    engine_args: str = opt("", "the engine method's more server arguments")
    methods: tuple[str, ...] = opt(("slots", "batches", "hf"), "the methods, alternated", choices=METHODS)
    repeats: int = opt(1, "rounds of every method (medians shown)")
    hogs: tuple[int, ...] = opt((0,), "run everything beside this many busy processes (python -c 'while True: "
                                      "pass'), each in turn")
    engine_bind: tuple[str, ...] = opt(
        ("eyas",), "the engine's threads: eyas's choice from the free cores (eyas.core.vllm_server.cpu_env) or "
                   "vLLM's own binding, one thread to each core (VLLM_CPU_OMP_THREADS_BIND=auto); with several "
                   "--hogs the engine starts anew beside each number of busy processes", choices=("eyas", "vllm"))
    engine_preload: tuple[str, ...] = opt(
        ("eyas",), "the engine's LD_PRELOAD: eyas's choice (tcmalloc and Intel's OpenMP where found, "
                   "eyas.core.vllm_server.preload), 'none', or libraries as LD_PRELOAD takes them; one engine each")
    workers: tuple[int, ...] = opt((1,), "the local methods (slots, hf) on this many worker processes "
                                         "(eyas.data.workers), each in turn; each worker has --batch slots")
    attention: bool = opt(False, "time the single-query attention alone")

    def __post_init__(self):
        empty = [f"--{n.replace('_', '-')}" for n in ("batch", "concurrency", "methods", "hogs", "engine_bind",
                                                      "engine_preload", "workers") if not getattr(self, n)]
        check(not empty, f"{' '.join(empty)} given no value", "give each one value or more, or leave it out")

    @property
    def torch_dtype(self) -> str:
        """The dtype's full name; auto is bfloat16 (this bench's figures so far)."""
        return FULL.get(self.dtype, "bfloat16")


class Tally:
    """A Sink stand-in: counts finished conversations and their reply tokens, keeps the replies."""

    def __init__(self):
        self.tokens, self.replies, self.failed_in_a_row = 0, {}, 0

    def finished(self, d) -> None:
        conv = d.result()
        self.replies[conv.id] = [m.content for m in conv.messages if m.role == "assistant"]
        self.tokens += d.tokens  # the replies' tokens as generated (a stop token counted)

    def failed(self, conv, e) -> None:
        self.replies[conv.id] = None

    def step(self, tokens: int) -> None:
        pass


def main() -> None:
    a = parse(RegenerateBenchConfig, description=__doc__)
    if a.attention:
        return attention_bench(a.torch_dtype)


    from eyas.core.log import Console
    from eyas.data.formats import Issues
    from eyas.data.local import run_batches, run_slots
    from eyas.data.regenerate import pending, run_local
    from eyas.data.server import run_server
    from eyas.data.vllm_backend import EngineBackend
    from eyas.data.workers import Workers

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown CPU")
    print(f"bench_regenerate: {cpu}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; {a.target} "
          f"{a.torch_dtype}, {a.samples} {a.data} conversations, up to {a.max_new_tokens} new tokens")
    con = Console(quiet=True)
    backends = {}
    results: dict[tuple[str, str], list[float]] = {}
    replies: dict[tuple[str, str], dict] = {}
    runs = [(m, f"batch {b}" + (f" x{w} workers" if w > 1 else ""), b, NO_ENGINE, w) for w in a.workers for b in a.batch
            for m in a.methods if m not in ("server", "engine") and (w == 1 or m != "batches")]
    runs += [("server", f"concurrency {c}", c, NO_ENGINE, 1) for c in a.concurrency if "server" in a.methods]
    runs += [("engine", f"concurrency {c}" + (f", {bind}" if len(a.engine_bind) > 1 else "")
              + (f", preload {Path(pre.split(':')[-1]).name}" if len(a.engine_preload) > 1 else ""), c, (bind, pre), 1)
             for bind in a.engine_bind for pre in a.engine_preload for c in a.concurrency
             if "engine" in a.methods]  # one engine at a time
    engine_out = Path(tempfile.mkdtemp(prefix="bench-regenerate-")) / "engine.jsonl"  # the engine's log beside it
    loaded: dict[tuple[str, str, int], list[float]] = {}
    try:
        for hogs in a.hogs:
            procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
            try:
                for _ in range(a.repeats):
                    for m, setting, n, engine, w in runs:  # alternated: a slow spell of the machine hits every method
                        backend = backend_for(a, m, n, backends, con, engine_out, engine, w)
                        cfg = backend.cfg
                        todo, _ = pending(cfg, set(), Issues())
                        sink = Tally()
                        t0 = time.perf_counter()
                        runner = {"slots": run_slots, "server": run_server, "engine": run_server}.get(m, run_batches)
                        if isinstance(backend, Workers):  # each worker runs the method's own loop (answer_here)
                            runner = run_local
                        runner(backend, todo, sink)
                        seconds = time.perf_counter() - t0
                        if hogs == a.hogs[0]:
                            results.setdefault((m, setting), []).append(sink.tokens / seconds)
                            replies[m, setting] = sink.replies
                        loaded.setdefault((m, setting, hogs), []).append(sink.tokens / seconds)
                        print(f"  {m:8s} {setting:15s} {hogs} busy: {sink.tokens:6d} reply tokens in "
                              f"{seconds:6.1f} s = {sink.tokens / seconds:6.1f} tokens/s", flush=True)
            finally:
                if len(a.hogs) > 1:  # the engine chooses its threads at start-up: a new one beside the next load
                    for key in [k for k in backends if k[0] == "engine"]:
                        backends.pop(key).close()
                for proc in procs:
                    proc.kill()
                    proc.wait()
    finally:
        for b in backends.values():
            if isinstance(b, (EngineBackend, Workers)):
                b.close()
    report(a, backends, results, replies)
    if len(a.hogs) > 1:
        print(f"beside busy processes (each against the first column; medians of {a.repeats}):")
        loaded = {k: statistics.median(v) for k, v in loaded.items()}
        print(f"{'method':8s} {'setting':16s} " + " ".join(f"{f'{h} busy':>17s}" for h in a.hogs))
        for m, setting, *_ in runs:
            q = loaded[m, setting, a.hogs[0]]
            print(f"{m:8s} {setting:16s} " + " ".join(
                f"{loaded[m, setting, h]:8.1f} ({loaded[m, setting, h] / q:4.2f}x)" for h in a.hogs))


def backend_for(a, m: str, n: int, backends: dict, con, engine_out: Path, engine: tuple[str, str] = NO_ENGINE,
                workers: int = 1):
    """The backend of method `m` at batch size / concurrency `n`: one loaded target per generator and number of
    worker processes, one engine for every concurrency of a thread binding and preload (one engine at a time;
    its start-up and threads are printed, not counted)."""
    from eyas.core.vllm_server import cpu_env, vllm_python
    from eyas.data.local import LocalBackend
    from eyas.data.regenerate import RegenerateConfig
    from eyas.data.server import ServerBackend
    from eyas.data.vllm_backend import EngineBackend
    from eyas.data.workers import Workers

    gen = "hf" if m == "hf" else "lean"
    cfg = RegenerateConfig(target=a.target, data=(a.data,), max_samples=a.samples, batch_size=n, concurrency=n,
                           server=a.server if m == "server" else "", engine="vllm" if m == "engine" else "local",
                           engine_python=a.engine_python, engine_args=a.engine_args, max_new_tokens=a.max_new_tokens,
                           max_turns=a.max_turns,
                           dtype=a.torch_dtype, generator=gen, quiet=True, out=str(engine_out))
    key = (m, engine) if m in ("server", "engine") else (gen, workers)
    if key not in backends:
        if m == "engine":  # one engine at a time: an idle one beside would be other work
            for other in [k for k in backends if k[0] == "engine"]:
                backends.pop(other).close()
        bind, pre = engine
        own = {"VLLM_CPU_OMP_THREADS_BIND": "auto"} if bind == "vllm" else {}
        if pre != "eyas":
            own["LD_PRELOAD"] = "" if pre == "none" else pre
        saved = {k: os.environ.get(k) for k in own}
        os.environ.update(own)
        try:
            if m == "engine":
                env, threads = cpu_env(python=vllm_python(a.engine_python))
                print(f"  {threads}; LD_PRELOAD={env.get('LD_PRELOAD', own.get('LD_PRELOAD', ''))!r}", flush=True)
            t0 = time.perf_counter()
            if workers > 1:
                backends[key] = Workers(dataclasses.replace(cfg, workers=workers), con, workers, "--workers")
            else:
                backends[key] = {"server": ServerBackend, "engine": EngineBackend}.get(m, LocalBackend)(cfg, con)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
        if m == "engine":
            print(f"  engine: vLLM started in {time.perf_counter() - t0:.0f} s (not counted)", flush=True)
    backend = backends[key]
    if m in ("server", "engine"):
        backend.concurrency = n  # the bench's sweep: one server, several numbers of conversations in flight
    backend.cfg = cfg
    return backend


def report(a, backends: dict, results: dict, replies: dict) -> None:
    """The medians, the GEMM ceiling, the issue's targets against this run, the replies' agreement."""
    import torch

    from eyas.core.target import load_target
    from eyas.data.local import LocalBackend

    loaded = next((b.target for b in backends.values() if isinstance(b, LocalBackend)), None)
    rate, per_token = gemm_rate(loaded or load_target(a.target, dtype=a.torch_dtype, device=torch.device("cpu")))
    print(f"GEMM rate ({a.torch_dtype}, the fused [gate|up] weight x 512 rows): {rate / 1e9:.0f} GFLOP/s; "
          f"{per_token / 1e6:.0f} MFLOP per token in the weights")
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"{'method':8s} {'setting':16s} {'tokens/s':>9s} {'efficiency':>10s}   (median of {a.repeats})")
    for (m, setting), r in med.items():
        print(f"{m:8s} {setting:16s} {r:9.1f} {r * per_token / rate:10.2f}")
    best = {m: max(r for (mm, _), r in med.items() if mm == m) for m in a.methods if any(k[0] == m for k in med)}
    if "slots" in best and len(best) > 1:
        print("slots (best setting) / " + ", ".join(f"{m} {best['slots'] / r:.2f}x" for m, r in best.items()
                                                    if m != "slots"))
    targets(best, per_token / rate)
    for b in a.batch:
        x, y = replies.get(("slots", f"batch {b}")), replies.get(("batches", f"batch {b}"))
        if x and y:
            print(f"batch {b}: conversations with the same replies in slots and batches: "
                  f"{sum(x[k] == y[k] for k in x)}/{len(x)} (bf16 near-ties; fp32 is identical in the tests)")
    print(f"bench_regenerate: load {os.getloadavg()[0]:.2f} after")


def targets(best: dict[str, float], flop_per_token_s: float) -> None:
    """Issue 24's targets for eyas's own decoder, each against this run's figures."""
    if "slots" not in best:
        return
    own = best["slots"]
    rows = [("eyas's decoder, tokens/s", own, 600.0), ("efficiency (GEMM ceiling)", own * flop_per_token_s, 0.6)]
    if "hf" in best:
        rows.append(("over transformers' generate", own / best["hf"], 5.0))
    engines = {m: r for m, r in best.items() if m in ("engine", "server")}
    if engines:
        rows.append(("over vLLM", own / max(engines.values()), 2.0))
    print("issue 24's targets for eyas's own decoder (slots, its best setting):")
    for what, got, goal in rows:
        print(f"  {what:30s} {got:8.2f}   target {goal:6.2f}   {'met' if got >= goal else f'{got / goal:.2f} of it'}")
    if engines:
        m, r = max(engines.items(), key=lambda kv: kv[1])
        print(f"the faster path is {'slots' if own >= r else m}: {max(own, r) / min(own, r):.2f}x the other's "
              "tokens, so that much more data in the same regeneration time")


def attention_bench(dtype: str) -> None:
    """decode_attention per layer over a cache slice, against bmm on the strided slice and SDPA (alternated)."""
    import torch
    import torch.nn.functional as F

    from eyas.core.memory import tune_allocator
    from eyas.models.generation import GROUP
    from eyas.models.llama import decode_attention, mask_bias

    tune_allocator()
    dt = getattr(torch, dtype)
    nh, nkv, hd, cap = 9, 3, 64, 1024  # SmolLM2-135M's heads
    scale = hd ** -0.5

    def strided(q, k, v, bias):  # the same math without the copy of the slice
        B, W = q.shape[0], k.shape[2]
        s = torch.baddbmm(bias.expand(B, nkv, nh // nkv, W).reshape(B * nkv, nh // nkv, W),
                          q.reshape(B * nkv, nh // nkv, hd), k.reshape(B * nkv, W, hd).transpose(1, 2), alpha=scale)
        return torch.bmm(torch.softmax(s, -1, dtype=torch.float32).to(v.dtype), v.reshape(B * nkv, W, hd))

    def sdpa(q, k, v, bias):
        return F.scaled_dot_product_attention(q.view(q.shape[0], nkv, nh // nkv, hd), k, v, attn_mask=bias)

    fns = {"decode_attention": decode_attention, "bmm on the strided slice": strided, "sdpa": sdpa}
    print(f"{'rows':>5s} {'columns':>8s} " + " ".join(f"{n:>26s}" for n in fns) + "   (us per layer, median of 20)")
    points = []
    for rows, width in [(1, 64), (1, 256), (8, 128), (32, 128), (32, 256), (64, 256), (128, 256)]:
        k = torch.randn(rows, nkv, cap, hd, dtype=dt)
        v = torch.randn_like(k)
        q = torch.randn(rows, nh, 1, hd, dtype=dt)
        bias = mask_bias(torch.ones(rows, 1, 1, width, dtype=torch.bool), dt)
        times = {n: [] for n in fns}
        for _ in range(20):
            for n, f in fns.items():
                t0 = time.perf_counter()
                f(q, k[:, :, :width], v[:, :, :width], bias)
                times[n].append(time.perf_counter() - t0)
        med = {n: 1e6 * statistics.median(t) for n, t in times.items()}
        points.append((rows * width, med["decode_attention"]))
        print(f"{rows:5d} {width:8d} " + " ".join(f"{med[n]:26.0f}" for n in fns))
    alone = points[0][1]  # one row of 64 columns: what one more call costs, nearly all overhead
    (x0, y0), (x1, y1) = points[-3], points[-1]  # 32 and 128 rows of 256 columns
    per = (y1 - y0) / (x1 - x0)
    print(f"decode_attention: a call over one row costs {alone:.0f} us; a row-column {1000 * per:.0f} ns at 32-128 "
          f"rows: one more call costs ~{alone / per:.0f} row-columns (GROUP = {GROUP})")


def gemm_rate(t) -> tuple[float, float]:
    """(FLOP/s of F.linear on the loaded target's fused [gate|up] weight at 512 rows, the best of 7 timings of 20
    calls: a ceiling, so a slow spell of the machine, such as an engine's processes still stopping, does not lower
    it; FLOPs per token in its weights)."""
    import torch
    import torch.nn.functional as F

    from eyas.models.generation import BatchGenerator

    lean = BatchGenerator(t)
    weights = [*lean.wqkv, *lean.wgu] + [m.weight for layer in lean.layers
                                         for m in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    per_token = 2 * (sum(w.numel() for w in weights) + t.model.lm_head.weight.numel())
    w = lean.wgu[0]
    x = torch.randn(512, w.shape[1], dtype=w.dtype)
    threads = torch.get_num_threads()  # the machine's rate: every core (a loaded run may have left this process one)
    torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    with torch.inference_mode():
        for _ in range(5):
            F.linear(x, w)
        seconds = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(20):
                F.linear(x, w)
            seconds.append((time.perf_counter() - t0) / 20)
    torch.set_num_threads(threads)
    return 2 * x.shape[0] * w.numel() / min(seconds), per_token


if __name__ == "__main__":
    main()
