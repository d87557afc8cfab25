"""Benchmark of `eyas extract` and the store: three figures, each a ratio measured side by side in one run.

1. extraction throughput / the bare forward pass of the same target on the same batches   (goal >= 0.9)
   bare = `target.model.model(ids)` over exactly the batches extract plans, nothing kept; extract = the whole
   `eyas extract` run (hooks, copies, checksums, background writes, manifest), into a fresh store each time.
   Passes alternate (bare, extract, bare, extract, ...); the figure is the median of the paired ratios of
   wall-clock throughput. The store is cut into shards of --shard-mb (default 32 MiB: 8 shards of the default
   240 samples, as the recipe's 2 GiB store has 8 of 256 MiB), so that, as in a real run, shards are written
   while later ones are computed; with a single shard its whole write and fsync would come after the last
   forward pass, where nothing can hide it. The ratio of CPU times (user + system, all threads) is printed
   beside it: on a machine without a spare core the writer thread's work cannot hide, and that figure says what
   it costs.
2. random-sample reads / sequential reads of the same bytes from the page cache             (goal >= 0.8)
   random = `StoreReader.read_into` of every sample in a shuffled order into a batch buffer; sequential = the
   shard files read front to back with readinto, after one warming read. Both on one thread, both counting the
   bytes stored, neither checking them. Beside it, each over 5 passes: the same reads with every sample's
   checksum checked on its first read (the reader's default, the cost of a run's first epoch); the
   memory-mapped views `reader[i]` copied instead (the reader's first design); and the trainer's own packed
   micro-batches (`load_micro_batch`, checked, with its allocation, padding and position ids).
3. bytes per token of the bf16 and the compact store / the 8H reference (3 feature layers + final, bf16)
4. with --engine-python: extraction through a vLLM engine (`eyas extract --engine vllm`, attached to an engine
   started once) / local extraction and / the bare forward pass, alternated

    python bench/bench_extract.py                           # SmolLM2-135M on 240 GSM8K conversations
    python bench/bench_extract.py --samples 480 --threads 2 --out /tmp/bench
    python bench/bench_extract.py --engine-python /tmp/vllm-venv/bin/python --engine-only --repeats 3

Machines shared with other jobs vary by tens of percent between runs: read the ratios, not the absolute speeds.
"""

from __future__ import annotations

import dataclasses
import json
import random
import resource
import shutil
import statistics
import time
from pathlib import Path

import torch

from eyas.core.config import opt, parse
from eyas.core.memory import tune_allocator
from eyas.core.options import target_opt
from eyas.core.target import load_target
from eyas.data.prepared import open_prepared
from eyas.store.extract import ExtractConfig
from eyas.store.extract import run as extract
from eyas.store.layout import SHARD_DIR, bytes_per_token
from eyas.store.reader import StoreReader
from eyas.store.shard_plan import plan_batches, plan_shards
from eyas.train.batches import load_micro_batch
from eyas.train.sharding import ShardSpec, shard_epoch


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExtractBenchConfig:
    target: str = target_opt()
    data: str = opt("", "a prepared dataset; default: the first --samples of GSM8K train")
    samples: int = opt(240, "the first N GSM8K train conversations (without --data)")
    shard_mb: float = opt(32.0, "eyas extract --shard-mb")
    repeats: int = opt(5, "paired extraction runs (the median is reported)")
    threads: int = opt(0, "torch intra-op threads (0: torch's default)")
    read_passes: int = opt(5, "passes over the store per read measurement")
    max_tokens: int = opt(1024, "the trainer's packed row length (the recipe's)")
    out: str = opt("/tmp/eyas-bench-extract", "the bench's folder: prepared data, stores, bench_extract.json")
    engine_python: str = opt("", "also extract through vLLM (the python of its environment)")
    engine_args: str = opt("--max-model-len 2048 --enforce-eager --max-num-seqs 8", "the vLLM engine's more arguments")
    concurrency: int = opt(8, "eyas extract --concurrency, for the engine")
    engine_only: bool = opt(False, "only figure 4 (the engine) and its references")


def prepared_dataset(args, out: Path) -> Path:
    if args.data:
        return Path(args.data)
    from eyas.data.prepare import PrepareConfig
    from eyas.data.prepare import run as prepare

    folder = out / f"prepared-{args.target}-{args.samples}"
    if not (folder / "summary.json").is_file():
        prepare(PrepareConfig(target=args.target, data=("gsm8k-train",), out=str(folder), max_samples=args.samples,
                              validation=0.0, quiet=True))
    return folder


def bare_forward(target, data: Path, cfg: ExtractConfig) -> tuple[float, int]:
    """(seconds, tokens) of the base model over the batches extract would run, outputs dropped."""
    ds = open_prepared(str(data), cfg.split).ds
    lengths = [int(x) for x in ds["num_tokens"]]
    bpt = bytes_per_token(target.hidden_size, cfg.compact)
    t0, tokens = time.perf_counter(), 0
    for shard in plan_shards(lengths, bpt, int(cfg.shard_mb * 2**20)):
        for batch in plan_batches([lengths[r] for r in shard], cfg.batch_tokens):
            rows = [shard[p] for p in batch]
            toks = ds[rows]["input_ids"]
            ids = torch.zeros(len(rows), max(len(t) for t in toks), dtype=torch.int64)
            for b, t in enumerate(toks):
                ids[b, : len(t)] = torch.tensor(t)
            with torch.inference_mode():
                target.model.model(input_ids=ids.to(target.device), use_cache=False)
            tokens += sum(len(t) for t in toks)
    return time.perf_counter() - t0, tokens


def timed_extract(target, cfg: ExtractConfig) -> float:
    shutil.rmtree(cfg.store, ignore_errors=True)
    t0 = time.perf_counter()
    extract(cfg, target=target)
    return time.perf_counter() - t0


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads (the writer thread's work included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def read_sequential(files: list[Path], passes: int, chunk: int = 8 << 20) -> tuple[float, int]:
    """(seconds, bytes) of reading the shard files front to back `passes` times into one buffer (readinto)."""
    buf = memoryview(bytearray(chunk))
    t0, total = time.perf_counter(), 0
    for _ in range(passes):
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while n := fh.readinto(buf):
                    total += n
    return time.perf_counter() - t0, total


def read_random(store: Path, passes: int, seed: int, shuffle: bool = True, check: bool = False,
                mapped: bool = False) -> tuple[float, int]:
    """(seconds, bytes) of `passes` shuffled passes over the samples, each read into a batch buffer.

    The default reads as the trainer does (`StoreReader.read_into`: the kernel's copy) and, like the sequential
    reads, checks nothing; check=True also checks each sample's checksum on its first read (the reader's
    default); mapped=True copies the memory-mapped views `reader[i]` returns instead. shuffle=False reads the
    samples in store order: the same code path, minus the randomness."""
    t0 = time.perf_counter()
    reader = StoreReader(store, check_reads=check)  # opening (manifest, headers) is part of the cost
    L, H = int(reader.lengths.max()), reader.hidden_size
    bufs = {n: torch.empty(L, *shape, dtype=dt) for n, (dt, shape) in reader.row_specs.items()}
    views = {n: t.view(torch.uint8).numpy().reshape(-1) for n, t in bufs.items()}
    rng, total = random.Random(seed), 0
    for _ in range(passes):
        order = list(range(len(reader)))
        if shuffle:
            rng.shuffle(order)
        for i in order:
            if mapped:
                s = reader[i]
                n = len(s.input_ids)
                for name in ("input_ids", "loss_mask", "aux", "final"):
                    bufs[name][:n].copy_(getattr(s, name))
            else:
                n = reader.read_into(i, views)
            total += n * bytes_per_token(H, compact=False)  # the bytes stored
    return time.perf_counter() - t0, total


def read_batches(store: Path, passes: int, max_tokens: int) -> tuple[float, int]:
    """(seconds, bytes) of the trainer's own micro-batches (`load_micro_batch`) over `passes` epochs of one rank,
    samples packed into rows of `max_tokens` as `eyas train --max-tokens` packs them: the reads, plus the
    batch's allocation, padding, widened ids, positions and document ids."""
    t0 = time.perf_counter()
    reader = StoreReader(store)
    spec = ShardSpec(world_size=1, max_tokens=max_tokens)
    total = 0
    for epoch in range(passes):
        for micro in shard_epoch(reader.lengths, epoch, 0, spec).micro_batches:
            total += load_micro_batch(reader, micro).tokens * bytes_per_token(reader.hidden_size, compact=False)
    return time.perf_counter() - t0, total


def engine_figures(args, target, data: Path, cfg: ExtractConfig, out: Path) -> None:
    """4. extraction through a vLLM engine (started once, attached to: its start-up is timed apart) against local
    extraction and the bare forward pass, alternated in one run, each over the same samples."""
    from eyas.core.target import resolve_source
    from eyas.core.vllm_server import cpu_env
    from eyas.store.vllm_states import VllmEngine, vllm_layer_ids

    t0 = time.perf_counter()
    ids = vllm_layer_ids(target.default_feature_layers(), target.num_layers)
    env, threads = cpu_env(python=args.engine_python)
    print(threads)
    engine = VllmEngine.start(args.engine_python, str(resolve_source(args.target)[1]), ids, out / "engine-tmp",
                              out / "engine.log", 8299, f"--dtype bfloat16 {args.engine_args}", env=env)
    startup = time.perf_counter() - t0
    ecfg = dataclasses.replace(cfg, store=str(out / "store-engine"), engine="vllm", engine_url=engine.url,
                             concurrency=args.concurrency)
    rows = []
    try:
        timed_extract(target, ecfg)  # warm-up of the engine
        for _ in range(args.repeats):
            t_bare, tokens = bare_forward(target, data, cfg)
            t_local, t_engine = timed_extract(target, cfg), timed_extract(target, ecfg)
            rows.append((tokens / t_bare, tokens / t_local, tokens / t_engine))
            print(f"  bare {rows[-1][0]:8.0f} tok/s   local extract {rows[-1][1]:8.0f} tok/s   vLLM extract "
                  f"{rows[-1][2]:8.0f} tok/s   vLLM / local {rows[-1][2] / rows[-1][1]:.3f}", flush=True)
    finally:
        engine.close()
    med = [statistics.median(r[i] for r in rows) for i in range(3)]
    print(f"4. vLLM extraction (concurrency {args.concurrency}) / local extraction {med[2] / med[1]:.3f}, / bare "
          f"forward {med[2] / med[0]:.3f}  (medians {med[2]:.0f}, {med[1]:.0f}, {med[0]:.0f} tok/s; the engine "
          f"started in {startup:.0f} s, not counted)")


def main() -> None:
    args = parse(ExtractBenchConfig, description=__doc__.split("\n")[0])
    if args.threads:
        torch.set_num_threads(args.threads)
    tune_allocator()  # what extract does first; applied before both, so the ratio compares like with like
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = prepared_dataset(args, out)
    target = load_target(args.target, dtype="bf16")
    cfg = ExtractConfig(data=str(data), store=str(out / "store"), target=args.target, shard_mb=args.shard_mb,
                        quiet=True)
    bare_forward(target, data, cfg)  # warm-up: allocator, kernels, page cache of the dataset
    if args.engine_python:
        engine_figures(args, target, data, cfg, out)
        if args.engine_only:
            return
    ratios, cpu_ratios, rates = [], [], []
    for _ in range(args.repeats):
        c0 = cpu_seconds()
        t_bare, tokens = bare_forward(target, data, cfg)
        c1 = cpu_seconds()
        t_ext = timed_extract(target, cfg)
        c2 = cpu_seconds()
        ratios.append(t_bare / t_ext)
        cpu_ratios.append((c1 - c0) / (c2 - c1))
        rates.append((tokens / t_bare, tokens / t_ext))
        print(f"  bare {tokens / t_bare:8.0f} tok/s   extract {tokens / t_ext:8.0f} tok/s"
              f"   wall ratio {t_bare / t_ext:.3f}   cpu-time ratio {cpu_ratios[-1]:.3f}", flush=True)
    problems = StoreReader(cfg.store).verify()  # what `eyas store verify` runs: every checksum recomputed
    print(f"  store verify {cfg.store}: " + ("passed" if not problems else f"{len(problems)} problems: {problems[:3]}"))
    compact = dataclasses.replace(cfg, store=str(out / "store-compact"), compact=True)
    t_bare, tokens = bare_forward(target, data, cfg)
    t_cmp = timed_extract(target, compact)
    print(f"  compact: bare {tokens / t_bare:.0f} tok/s, extract {tokens / t_cmp:.0f} tok/s,"
          f" ratio {t_bare / t_cmp:.3f}")

    # Reads run on one thread, as a data-loading thread does (and as readinto does): a multi-threaded copy_ of
    # a few MiB only adds OpenMP barriers, which on a busy machine cost more than the copy itself.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    files = sorted((Path(cfg.store) / SHARD_DIR).glob("*.safetensors"))
    read_sequential(files, 1)  # into the page cache
    figures = {k: [] for k in ("random", "in_order", "checked", "mapped", "trainer")}
    for k in range(2 * args.repeats + 1):
        ts, bs = read_sequential(files, args.read_passes)
        store, passes = Path(cfg.store), args.read_passes
        runs = {"random": read_random(store, passes, seed=k), "in_order": read_random(store, passes, k, shuffle=False),
                "checked": read_random(store, passes, seed=k, check=True),
                "mapped": read_random(store, passes, seed=k, check=True, mapped=True),
                "trainer": read_batches(store, passes, args.max_tokens)}
        for name, (t, b) in runs.items():
            figures[name].append((b / t) / (bs / ts))
        f = {name: v[-1] for name, v in figures.items()}
        print(f"  sequential files {bs / ts / 2**30:5.2f} GiB/s   random samples {f['random'] * bs / ts / 2**30:5.2f} "
              f"GiB/s   random/sequential {f['random']:.3f}   (in store order {f['in_order']:.3f}; first reads "
              f"checked {f['checked']:.3f}, copied from the map {f['mapped']:.3f}; trainer's batches "
              f"{f['trainer']:.3f})", flush=True)
    torch.set_num_threads(threads)

    H = target.hidden_size
    m_bf16 = StoreReader(cfg.store).manifest["totals"]
    m_cmp = StoreReader(compact.store).manifest["totals"]
    result = {
        "target": args.target, "samples": m_bf16["samples"], "tokens": m_bf16["tokens"],
        "store_verify_problems": problems,
        "threads": threads,
        "extract_over_bare_forward": round(statistics.median(ratios), 3),
        "extract_ratios": [round(r, 3) for r in ratios],
        "extract_over_bare_forward_cpu_time": round(statistics.median(cpu_ratios), 3),
        "extract_cpu_ratios": [round(r, 3) for r in cpu_ratios],
        "bare_tok_s": [round(a) for a, _ in rates], "extract_tok_s": [round(b) for _, b in rates],
        "compact_extract_over_bare_forward": round(t_bare / t_cmp, 3),
        "random_over_sequential_read": round(statistics.median(figures["random"]), 3),
        "read_ratios": [round(r, 3) for r in figures["random"]],
        "random_over_in_order_samples": round(statistics.median(figures["random"]) / statistics.median(
            figures["in_order"]), 3),
        "checked_random_over_sequential_read": round(statistics.median(figures["checked"]), 3),
        "mapped_checked_random_over_sequential_read": round(statistics.median(figures["mapped"]), 3),
        "trainer_batches_over_sequential_read": round(statistics.median(figures["trainer"]), 3),
        "reference_bytes_per_token": 8 * H,
        "bf16_bytes_per_token": m_bf16["bytes_per_token"],
        "bf16_over_reference": round(m_bf16["bytes_per_token"] / (8 * H), 4),
        "compact_bytes_per_token": m_cmp["bytes_per_token"],
        "compact_over_reference": round(m_cmp["bytes_per_token"] / (8 * H), 4),
    }
    print("\n".join([
        (f"\nbench_extract: {args.target}, {result['samples']} samples, {result['tokens']:,} tokens, "
         f"{result['threads']} threads, {args.repeats} repeats"),
        (f"1. extraction / bare forward (same batches)      {result['extract_over_bare_forward']:.3f}  (goal >= 0.9; "
         f"by CPU time, writer included: {result['extract_over_bare_forward_cpu_time']:.3f})"),
        (f"2. random sample reads / sequential page cache   {result['random_over_sequential_read']:.3f}  (goal >= 0.8; "
         f"random / the same samples in store order: {result['random_over_in_order_samples']:.3f})"),
        (f"   with each sample's checksum checked on its first read ({args.read_passes} passes): "
         f"{result['checked_random_over_sequential_read']:.3f}; copied from the memory map instead, checked: "
         f"{result['mapped_checked_random_over_sequential_read']:.3f}; the trainer's packed micro-batches, "
         f"checked: {result['trainer_batches_over_sequential_read']:.3f}"),
        (f"3. bytes per token vs 8H = {8 * H}: bf16 {result['bf16_bytes_per_token']} "
         f"({result['bf16_over_reference']:.4f}x), compact {result['compact_bytes_per_token']} "
         f"({result['compact_over_reference']:.4f}x)"),
    ]))
    (out / "bench_extract.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
