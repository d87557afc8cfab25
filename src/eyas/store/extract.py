"""`eyas extract`: the target's hidden states for every prepared sample, into a checksummed, rank-sharded store.

    eyas extract --data runs/demo/prepared --store runs/demo/store
    torchrun --nproc_per_node 8 -m eyas extract --data ... --store ...      (any number of ranks and nodes)

What is captured: forward hooks on the three feature layers (HF `hidden_states` indices; index i is the output of
decoder layer i-1) and on the final norm, while the *base* model runs (`target.model.model`): no other layer's
states are kept and no full-vocabulary logits are ever computed.

How work is split: samples are sorted by length and cut into shards of about `--shard-mb` (and small data into
about `--min-shards` of them); that plan depends only on the data and the settings, never on the number of ranks.
Shard k goes to global rank k mod world (`shard_indices`), each rank writes its own shards, and a shard appears
only once complete (temp name, fsync, rename), so a restart (with any number of ranks) skips what exists and the
store's content is the same however it was run. Within a shard, samples go through the target in length-sorted
batches of <= `--batch-tokens` padded tokens, right-padded without an attention mask (causal attention never lets
a real token see a pad); a background thread copies, checksums and writes while the next batch runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Literal

import torch
from datasets import Dataset

from eyas.core import dist
from eyas.core.config import StageConfig, changed_settings, check, opt
from eyas.core.errors import EyasError, disk_full
from eyas.core.files import check_writable, read_json, write_json
from eyas.core.log import Console, console, fmt_bytes, fmt_duration, fmt_int
from eyas.core.memory import tune_allocator
from eyas.core.options import (
    Dtype,
    collective_timeout_opt,
    device_opt,
    dtype_opt,
    target_opt,
    trust_remote_code_opt,
    trusted_code_line,
)
from eyas.core.precision import FULL, SHORT, choose_dtype
from eyas.core.target import Target, load_target
from eyas.core.threads import Threads
from eyas.core.weights import load_target_shell, read_module
from eyas.data.prepared import open_prepared
from eyas.models.capture import Capture, check_layers, forward_batch
from eyas.store.layout import SHARD_DIR, bytes_per_token, shard_name
from eyas.store.shard_plan import (
    HEADER_BYTES,
    free_bytes,
    plan_batches,
    plan_engine_batches,
    plan_shards,
    plan_text,
    shard_indices,
)
from eyas.store.shards import shard_index
from eyas.store.vllm_states import engine_dtype, engine_features, open_engine
from eyas.store.writer import BackgroundWriter, ShardBuilder, check_coverage, write_manifest

SUMMARY_FILE = "summary.json"  # what the last run of extract did (rank 0 writes it when all is merged)
SETTINGS_FILE = "extract.json"  # what a store was started with; a restart must match it
NO_SPACE_FIX = ("free space on that disk (or raise the limit) and rerun the same command: it keeps the finished "
                "shards and writes only the missing ones")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExtractConfig(StageConfig):
    data: str = opt("runs/demo/prepared", "prepared dataset folder (written by eyas prepare)")
    split: str = opt("train", "which split of --data to extract")
    store: str = opt("runs/demo/store", "output store folder (resumes when it holds a partial run)")
    target: str = target_opt()
    trust_remote_code: bool = trust_remote_code_opt()
    layers: tuple[int, ...] = opt((), "HF hidden_states indices of the three features; empty = [2, L//2, L-3]")
    dtype: Dtype = dtype_opt("the target's forward pass (and the store)")
    compact: bool = opt(False, "store fp8 e4m3 with per-row power-of-two scales (half the bytes; see docs/store.md)")
    attn: Literal["auto", "sdpa", "eager"] = opt("auto", "attention kernel; auto keeps the target's (sdpa). "
                                                 "eager makes results independent of batching and padding")
    batch_tokens: int = opt(8192, "padded tokens per forward batch (batch size x longest sample) of the local "
                                  "target; an engine keeps --concurrency requests in flight instead")
    shard_mb: float = opt(256.0, "target size of a shard file in MiB (a crash loses at most the shard in progress)")
    min_shards: int = opt(64, "cut data smaller than this many --shard-mb into about this many shards, so that ranks "
                              "(which take shards round-robin) get equal shares")
    limit: int = opt(0, "extract only the first N samples of the split (0: all)")
    device: str = device_opt()
    collective_timeout: float = collective_timeout_opt()
    threads: int = opt(0, "CPU threads per rank (0: the cores other work leaves free, shared by this node's ranks, "
                          "re-checked as it runs; an explicit OMP_NUM_THREADS also wins)")
    engine: Literal["local", "vllm"] = opt("local", "local: hooks on the target loaded here; vllm: a vLLM server runs "
                                           "the target (one per rank; docs/extract.md)")
    engine_url: str = opt("", "vllm: attach to servers already running (comma-separated; rank r uses the r-th "
                              "modulo their number) instead of starting one")
    engine_python: str = opt("", "vllm: the python of vLLM's own environment, to start the server with (empty: "
                                 "$EYAS_VLLM_PYTHON, else the one scripts/setup-vllm.sh makes)")
    engine_args: str = opt("", "vllm: more server arguments, passed through (e.g. '--tensor-parallel-size 8')")
    engine_port: int = opt(8200, "vllm: the port of the server eyas starts (rank r on this node: port + r)")
    engine_startup_s: float = opt(1800.0, "vllm: how long the server may take to start")
    concurrency: int = opt(8, "vllm: samples in flight per engine (and at most this many engine files on disk)")
    dry_run: bool = opt(False, "print the plan and exit without writing anything")

    def validate(self):
        check(bool(self.data), "--data is empty", "give the prepared dataset folder (eyas prepare --out)")
        check(bool(self.store), "--store is empty", "name the output store folder")
        check(len(self.layers) in (0, 3), f"--layers {list(self.layers)}: EAGLE-3 takes exactly three feature layers",
              "give three HF hidden_states indices, e.g. --layers 2 15 27, or none for the default")
        check(list(self.layers) == sorted(set(self.layers)) and all(i >= 1 for i in self.layers),
              f"--layers {list(self.layers)} must be distinct, increasing and >= 1",
              "index 0 is the embedding output; give e.g. --layers 2 15 27")
        check(self.batch_tokens >= 1, f"--batch-tokens {self.batch_tokens} must be >= 1", "use e.g. 8192")
        check(self.shard_mb > 0, f"--shard-mb {self.shard_mb} must be positive", "use e.g. 512")
        check(self.min_shards >= 1, f"--min-shards {self.min_shards} must be at least 1", "use e.g. 64")
        check(self.limit >= 0, f"--limit {self.limit} is negative", "use 0 for all samples")
        check(self.concurrency >= 1, f"--concurrency {self.concurrency} must be >= 1", "use e.g. 8")


def fetch_rows(ds, rows: list[int], where: str) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
    """(ids, input_ids [L] int64, loss_mask [L] int8) of some dataset rows, checked against num_tokens."""
    batch = ds[rows]
    ids, toks, masks = [], [], []
    for r, sid, t, m, n in zip(rows, batch["id"], batch["input_ids"], batch["loss_mask"], batch["num_tokens"]):
        if not (len(t) == len(m) == n) or n == 0:
            raise EyasError(f"{where} row {r} (id {sid}): {len(t)} input ids, {len(m)} mask values, num_tokens {n}",
                            fix="re-run eyas prepare; the dataset is damaged")
        ids.append(sid)
        toks.append(torch.tensor(t, dtype=torch.int64))
        masks.append(torch.tensor(m, dtype=torch.int8))
    return ids, toks, masks


def run(cfg: ExtractConfig, *, target=None) -> dict:
    """Extract (or resume) the store; returns the summary.

    `target` may be passed preloaded (tests, demo); it is then used as it is (its dtype wins over --dtype).
    """
    # with an engine the target runs in the engine: this process computes nothing and must hold no GPU it needs
    env = dist.init("cpu" if cfg.engine == "vllm" else cfg.device, cfg.collective_timeout)
    con = console(env.rank, cfg.quiet, cfg.json)
    tune_allocator()
    cpu = Threads(cfg.threads, env.local_world_size, env.device, env.local_rank)
    n, why = cpu.apply()
    alone = env.device == "cpu" and cfg.engine != "vllm" and not env.distributed and len(cpu.cores) > 1
    con.print(f"threads: {n} per rank ({why})" + (f"; one rank per core keeps more speed beside other work: "
                                                  f"torchrun --nproc-per-node {len(cpu.cores)} -m eyas extract ..."
                                                  if alone else ""))
    dtype, why = choose_dtype(cfg.dtype, dist.pick_device("auto") if cfg.engine == "vllm" else env.device)
    cfg = dataclasses.replace(cfg, dtype=SHORT[dtype])  # what the store records: never "auto"
    if why:
        con.print(why)
    finished, lock = False, None
    try:
        lock = dist.hold_output(env, Path(cfg.store), "extract")
        summary = _run(cfg, env, con, target, cpu)
        finished = True
        return summary
    except OSError as e:  # the store's index, manifest or summary (a shard says which it was)
        if (why := disk_full(e)) is None:
            raise
        raise EyasError(f"cannot write to {cfg.store}: {why}", "the store's disk is full", NO_SPACE_FIX) from None
    finally:
        if lock is not None:
            lock.close()
        if env.distributed:
            dist.shutdown(finished)


@dataclasses.dataclass(frozen=True)
class Extraction:
    """One extract run as every rank sees it: the settings, this process, the target, the data and the plan."""

    cfg: ExtractConfig
    env: dist.DistEnv
    con: Console
    target: Target  # loaded here, or its shell (config, final norm) when an engine runs it
    ds: Dataset  # the prepared split
    lengths: list[int]  # tokens of each sample extracted (the first --limit rows)
    shards: list[list[int]]  # the plan: dataset rows of shard k (eyas.store.shard_plan)
    layer_ids: list[int]  # HF hidden_states indices of the three features
    cpu: Threads

    @property
    def store(self) -> Path:
        return Path(self.cfg.store)

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.target.hidden_size, self.cfg.compact)


def _run(cfg: ExtractConfig, env, con, target, cpu: Threads) -> dict:
    t0 = time.perf_counter()
    prepared = open_prepared(cfg.data, cfg.split)
    ds, fingerprint = prepared.ds, prepared.fingerprint
    n = min(cfg.limit, len(ds)) if cfg.limit else len(ds)
    if n == 0:
        raise EyasError(f"{cfg.data} [{cfg.split}] has no samples", fix="prepare some data first")
    lengths = [int(x) for x in ds.select_columns(["num_tokens"])[:n]["num_tokens"]]
    if target is None:  # an engine runs the target elsewhere: here only its config and final norm
        if cfg.trust_remote_code:
            con.print(trusted_code_line(cfg.target))
        target = (load_target_shell(cfg.target, trust_remote_code=cfg.trust_remote_code) if cfg.engine == "vllm"
                  else load_target(cfg.target, dtype=cfg.dtype, device=env.device,
                                   trust_remote_code=cfg.trust_remote_code))
    if cfg.attn != "auto" and cfg.engine == "local":
        target.model.set_attn_implementation(cfg.attn)
    layer_ids = list(cfg.layers) or target.default_feature_layers()
    check_layers(layer_ids, target.num_layers)
    shards = plan_shards(lengths, bytes_per_token(target.hidden_size, cfg.compact), int(cfg.shard_mb * 2**20),
                         cfg.min_shards)
    job = Extraction(cfg, env, con, target, ds, lengths, shards, layer_ids, cpu)
    store, header = job.store, _store_header(cfg, target, layer_ids, fingerprint, n)
    settings = {"header": header, "shard_mb": cfg.shard_mb, "min_shards": cfg.min_shards,
                "batch_tokens": cfg.batch_tokens,
                "attention": "vllm" if cfg.engine == "vllm" else target.model.config._attn_implementation}
    if cfg.engine != "local":  # a store is extracted by one engine: never states of two mixed
        settings["engine"] = cfg.engine
    plan = dist.agree(env, lambda: _prepare_store(job, settings))
    if cfg.dry_run:
        return plan
    stats = dist.on_every_rank(env, lambda: _extract_mine(job))
    tokens_run, samples_run = dist.all_reduce_sum([stats["tokens"], stats["samples"]], env)
    totals = dist.agree(env, lambda: _merge(store, header, len(shards), n, env.world_size))
    elapsed = time.perf_counter() - t0
    summary = {"store": str(store), **totals, "layer_ids": layer_ids, "compact": cfg.compact,
               "extracted_samples": int(samples_run), "extracted_tokens": int(tokens_run),
               "resumed_shards": plan["done_shards"], "world_size": env.world_size, "elapsed_s": round(elapsed, 2),
               "tokens_per_s": round(tokens_run / max(elapsed, 1e-9), 1)}
    if env.is_main:
        write_json(store / SUMMARY_FILE, summary)
    con.summary(f"extract: {fmt_int(totals['samples'])} samples, {fmt_int(totals['tokens'])} tokens -> {store} "
                f"({fmt_bytes(totals['bytes'])}, {fmt_int(totals['bytes_per_token'])} B/token, {totals['shards']} "
                f"shards; {plan['done_shards']} resumed) in {fmt_duration(elapsed)}")
    return summary


def _store_header(cfg: ExtractConfig, target, layer_ids: list[int], fingerprint, n: int) -> dict:
    """What the manifest says about the store (docs/store.md): no time, no rank count, so reruns agree."""
    return {"source": "eyas extract", "target": target.identity(), "layer_ids": layer_ids,
            "hidden_size": target.hidden_size, "dtype": "float8_e4m3fn" if cfg.compact else "bfloat16",
            "compact": cfg.compact, "forward_dtype": forward_dtype(cfg, target),
            "dataset": {"path": str(Path(cfg.data).resolve()), "split": cfg.split, "fingerprint": fingerprint,
                        "samples": n}}


def forward_dtype(cfg: ExtractConfig, target) -> str:
    """The dtype the target runs in: the loaded model's, or the one the engine is started with."""
    if cfg.engine == "vllm":
        return FULL[cfg.dtype]
    return str(target.dtype).removeprefix("torch.")


def _completed(store: Path, shards: list[list[int]], ks) -> dict[int, dict]:
    """The finished shards among ks (their own indexes), refusing any that belongs to another plan."""
    done = {}
    for k in ks:
        p = store / SHARD_DIR / shard_name(k)
        if p.is_file():
            idx = shard_index(p)
            if idx["rows"] != shards[k]:
                raise EyasError(f"{p} holds other samples than this run would put there",
                                "the store was started with other data or settings",
                                "use a new --store folder, or the data and settings of the first run")
            done[k] = idx
    return done


def _prepare_store(job: Extraction, settings: dict) -> dict:
    """Rank 0: compare with an existing run's settings, print the plan, check the disk, create the folders."""
    cfg, env, target, shards, lengths = job.cfg, job.env, job.target, job.shards, job.lengths
    store, bpt = job.store, job.bytes_per_token
    old = store / SETTINGS_FILE
    if old.is_file():
        prev = read_json(old, f"use a new --store folder, or remove {old} if the store holds nothing you need")
        prev.setdefault("min_shards", 1)  # a store begun before --min-shards existed was cut with 1
        diff = changed_settings(prev, settings)
        if diff:
            raise EyasError(f"{store} was started with other settings ({', '.join(diff)} "
                            f"differ{'s' if len(diff) == 1 else ''})",
                            "resuming would mix hidden states of two different runs in one store",
                            f"rerun with the first run's settings (see {old}; a store begun before eyas had "
                            "--min-shards needs --min-shards 1) or use a new --store folder")
    elif store.exists() and any(p.name != f"{SETTINGS_FILE}.tmp" for p in store.iterdir()):  # a kill's leftover
        raise EyasError(f"{store} exists and is not an extract in progress", fix="use a new or empty --store folder")
    if not cfg.dry_run:
        check_writable(store)  # before the disk check: a read-only place has no free space either
    done = _completed(store, shards, range(len(shards)))
    shard_bytes = [sum(lengths[r] for r in s) * bpt + HEADER_BYTES for s in shards]
    todo_bytes = sum(b for k, b in enumerate(shard_bytes) if k not in done)
    if cfg.engine == "vllm":  # the engine's files in flight: [T, 4, H] per sample, `concurrency` per rank at most
        width = engine_dtype(cfg).itemsize
        todo_bytes += env.world_size * cfg.concurrency * max(lengths) * 4 * target.hidden_size * width
    plan = {"target": target.name, "num_layers": target.num_layers, "hidden": target.hidden_size,
            "layers": settings["header"]["layer_ids"], "dtype": settings["header"]["forward_dtype"],
            "device": "a vLLM engine" if cfg.engine == "vllm" else env.device, "data": cfg.data, "split": cfg.split,
            "fingerprint": settings["header"]["dataset"]["fingerprint"], "samples": len(lengths),
            "tokens": sum(lengths), "shards": len(shards), "done_shards": len(done),
            "done_samples": sum(len(d["rows"]) for d in done.values()), "bpt": bpt,
            "storage": "compact fp8 e4m3 + per-row scales" if cfg.compact else "bf16",
            "bytes": sum(shard_bytes), "todo_bytes": todo_bytes, "world": env.world_size,
            "free": free_bytes(store), "store": str(store)}
    job.con.print(plan_text(plan))
    if plan["free"] < todo_bytes:
        raise EyasError(f"not enough disk for {store}: it needs {fmt_bytes(todo_bytes)}, {fmt_bytes(plan['free'])} "
                        f"are free, {fmt_bytes(todo_bytes - plan['free'])} missing",
                        fix="free that much space, choose a --store on a larger disk, or use --compact")
    if not cfg.dry_run:  # the settings first: a kill in between must leave a store that a rerun recognises
        write_json(old, settings)
        (store / SHARD_DIR).mkdir(parents=True, exist_ok=True)
    return plan


def _extract_mine(job: Extraction) -> dict:
    """Write this rank's unfinished shards, then the index of all its shards (STORE/index/rank-R-of-W.json)."""
    env, shards, lengths, store = job.env, job.shards, job.lengths, job.store
    mine = shard_indices(len(shards), env.rank, env.world_size)
    done = _completed(store, shards, mine)
    for k in mine:  # temp files of a killed run: never visible, safe to drop (only this rank owns shard k)
        for tmp in (store / SHARD_DIR).glob(f".{shard_name(k)}.tmp-*"):
            tmp.unlink(missing_ok=True)
    todo = [k for k in mine if k not in done]
    total = sum(len(shards[k]) for k in todo)
    desc = "extract" + (f" (rank 0 of {env.world_size})" if env.distributed else "")
    # progress in tokens: samples are in length order, so a sample-based ETA would be far too optimistic
    bar = job.con.progress(total=sum(lengths[r] for k in todo for r in shards[k]), desc=desc, unit="tok",
                           unit_scale=True)
    writer, indexes = BackgroundWriter(), dict(done)
    try:
        longest = max((lengths[r] for k in todo for r in shards[k]), default=0)
        with feature_source(job, longest) as features:
            tokens = _run_shards(job, todo, features, writer, indexes, bar)
    except BaseException:
        with contextlib.suppress(BaseException):  # the first error is the one to report
            writer.close()  # finishes what is queued (a shard is only committed once all of it was queued)
        raise
    finally:
        bar.close()
    writer.close()
    write_json(store / "index" / f"rank-{env.rank:05d}-of-{env.world_size:05d}.json", [indexes[k] for k in mine])
    return {"tokens": tokens, "samples": total}


def _run_shards(job: Extraction, todo: list[int], features, writer: BackgroundWriter, indexes: dict, bar) -> int:
    """The forward loop: batches of each unfinished shard through `features` (the target here, or an engine),
    their states to the writer; the free cores re-checked now and then (eyas.core.threads)."""
    cfg, shards, lengths, hidden, bpt = job.cfg, job.shards, job.lengths, job.target.hidden_size, job.bytes_per_token
    where = f"{cfg.data} [{cfg.split}]"
    store, total, samples, tokens = job.store, sum(len(shards[k]) for k in todo), 0, 0
    for k in todo:
        rows = shards[k]
        builder = ShardBuilder(shard_name(k), sum(lengths[r] for r in rows), hidden, cfg.compact)
        sizes = [lengths[r] for r in rows]
        batches = (plan_engine_batches(sizes, cfg.concurrency, 4 * hidden * engine_dtype(cfg).itemsize)
                   if cfg.engine == "vllm" else plan_batches(sizes, cfg.batch_tokens))  # engine states: [T, 4, H]
        for batch in batches:
            brows = [rows[p] for p in batch]
            ids, toks, masks = fetch_rows(job.ds, brows, where)
            feats = features(toks)
            writer.put(_add_job(builder, brows, ids, toks, masks, feats))
            n_tok = sum(len(t) for t in toks)
            samples, tokens = samples + len(toks), tokens + n_tok
            bar.set_postfix_str(f"{fmt_int(samples)}/{fmt_int(total)} samples, {fmt_bytes(tokens * bpt)} "
                                f"written ({fmt_bytes(writer.bytes)} in finished shards)", refresh=False)
            bar.update(n_tok)
            if changed := job.cpu.recheck():
                bar.write(changed)
        writer.put(_commit_job(builder, store / SHARD_DIR, indexes, k, writer))
    return tokens


@contextlib.contextmanager
def feature_source(job: Extraction, longest: int):
    """features(toks) -> [aux0, aux1, aux2, final], each indexable by sample ([B, T, H] or a list of [T, H]):
    hooks on the local target, or this rank's vLLM engine (started only when there is work: `longest` tokens in
    this rank's longest sample still to extract, 0 when none)."""
    cfg, target = job.cfg, job.target
    if cfg.engine == "local":
        with Capture(target, job.layer_ids) as cap:
            yield lambda toks: forward_batch(target, cap, toks)
        return
    if not longest:
        yield None
        return
    norm = read_module(target, target.final_norm()).to(engine_dtype(cfg))
    engine = open_engine(cfg, job.env, job.con, target, job.layer_ids, longest)
    try:
        if engine.max_model_len and longest + 1 > engine.max_model_len:  # the prompt and the one token asked for
            raise EyasError(f"the engine's max_model_len {engine.max_model_len} is shorter than this rank's longest "
                            f"sample ({longest} tokens + 1)", "vLLM refuses a prompt that long",
                            f"start the engine with --max-model-len {longest + 1} or more")
        yield lambda toks: engine_features(engine, norm, toks, cfg.concurrency, target.hidden_size)
    finally:
        engine.close()


def _add_job(builder, rows, ids, toks, masks, feats):
    def add():
        if hasattr(feats, "wait"):  # copies still in flight from the GPU (eyas.models.capture.HostCopies)
            feats.wait()
        for b, (r, sid, t, m) in enumerate(zip(rows, ids, toks, masks)):
            builder.add(r, sid, t, m, [f[b] for f in feats[:3]], feats[3][b])
    return add


def _commit_job(builder, folder: Path, indexes: dict, k: int, writer: BackgroundWriter):
    def job():
        try:
            indexes[k] = builder.commit(folder)
        except OSError as e:
            if (why := disk_full(e)) is None:
                raise
            raise EyasError(f"cannot write shard {folder / shard_name(k)}: {why}",
                            f"the store's disk is full (or a size limit or quota was hit); the partial shard was "
                            f"removed, the {len(indexes)} shards finished so far are complete and kept",
                            NO_SPACE_FIX) from None
        writer.bytes += indexes[k]["bytes"]
    return job


def _merge(store: Path, header: dict, n_shards: int, n_samples: int, world: int) -> dict:
    """Rank 0, after every rank finished: per-rank indexes -> manifest.json, with the coverage check."""

    shards = []
    for r in range(world):
        p = store / "index" / f"rank-{r:05d}-of-{world:05d}.json"
        shards += read_json(p, "rerun the same extract command: it rewrites the index of any unfinished rank",
                            expect=list)
    problems = check_coverage(shards, n_samples)
    if len(shards) != n_shards:
        problems.append(f"{len(shards)} shards indexed, the plan has {n_shards}")
    if problems:
        raise EyasError(f"coverage check failed for {store}: " + "; ".join(problems[:5]),
                        "every prepared sample must be in the store exactly once",
                        "rerun the same command; it rewrites what is missing")
    return write_manifest(store, header, shards)


