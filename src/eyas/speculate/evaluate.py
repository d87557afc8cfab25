"""`eyas evaluate`: run a benchmark through the speculative decoding engine and measure what the draft buys.

For every prompt (MT-Bench: both turns, the second after the target's own first answer) the same run decodes
with plain greedy decoding (eyas's loop, and transformers' `generate`, timed both; the faster is the baseline),
then with every configuration: the draft as chains of the given lengths and as one dynamic tree, and the
baselines (prompt lookup, other drafts). Methods alternate prompt by prompt, so a slow spell of the machine
hits them alike. Figures: tau, acceptance per position, tokens/s and speedup, the speedup the measured
latencies predict, and at temperature 0 whether every output equals plain greedy decoding token for token.
Definitions of the figures: `eyas.speculate.decode` (tau, rates) and `eyas.speculate.results` (speedups).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from eyas.core.config import StageConfig, check, opt
from eyas.core.dist import pick_device
from eyas.core.errors import EyasError
from eyas.core.lock import hold
from eyas.core.log import console
from eyas.core.options import Dtype, device_opt, dtype_opt, target_opt, trust_remote_code_opt, trusted_code_line
from eyas.core.precision import choose_dtype
from eyas.core.target import load_target
from eyas.core.threads import Threads
from eyas.data.builtin import builtin_file
from eyas.data.chat import ChatRenderer
from eyas.draft.checkpoint import read_draft
from eyas.draft.model import DraftConfig, Eagle3Draft
from eyas.draft.vocab import build_draft_vocab
from eyas.speculate import lossless, results
from eyas.speculate.controller import Controller
from eyas.speculate.decode import (
    first_divergence,
    plain_generate,
    speculative_generate,
)
from eyas.speculate.drafters import Eagle3Drafter, HybridDrafter, OracleDrafter, PromptLookupDrafter, TreeShape
from eyas.speculate.quantize import projected_draft, quantize_int8
from eyas.speculate.suffix import SuffixDrafter
from eyas.speculate.target_forward import (
    LeanRunner,
    effective_latency,
    make_runner,
    measure_latency,
    sync,
    verify_widths,
)

REPORT_QS = (1, 4, 8, 16, 32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig(StageConfig):
    target: str = target_opt()
    trust_remote_code: bool = trust_remote_code_opt()
    draft: str = opt("", "draft checkpoint folder (eyas train's final/); 'untrained' = freshly initialised "
                     "(timing only)")
    bench: str = opt("mt_bench", "mt_bench, gsm8k, or a JSONL file of prompts (turns|prompt|question|messages)")
    out: str = opt("runs/eval", "output folder: results.json, report.md, plots")
    chain: tuple[int, ...] = opt((3, 5, 7), "chain lengths to run (draft tokens per round; the most with --adaptive)")
    tree: bool = opt(True, "also run the EAGLE-2 dynamic tree")
    tree_topk: int = opt(4, "tree: children per expanded node and nodes expanded per depth")
    tree_depth: int = opt(5, "tree: deepest draft position")
    tree_size: int = opt(16, "tree: candidate tokens verified per round")
    adaptive: bool = opt(True, "size each round's draft from measured costs and acceptance; plain steps when "
                         "drafting does not pay")
    temperature: float = opt(0.0, "sampling temperature (0 = greedy, checked for losslessness)")
    max_new_tokens: int = opt(128, "tokens generated per turn at most")
    num_prompts: int = opt(10, "prompts to run (0 = all)")
    per_category: int = opt(0, "at most N prompts of each category, in file order (0 = no limit); MT-Bench lists its "
                            "categories one after another, so --per-category 2 samples all eight")
    baselines: tuple[str, ...] = opt(("prompt-lookup", "hybrid"),
                                     "other drafters: prompt-lookup, suffix (suffix decoding over the prompt, the "
                                     "reply and the run's earlier replies), hybrid (the draft's longest chain and "
                                     "prompt lookup, per round the one expected to yield more), hybrid-suffix (the "
                                     "same with suffix decoding), oracle, or a draft checkpoint folder")
    lookup_k: int = opt(7, "prompt lookup: tokens proposed per round")
    suffix_k: int = opt(8, "suffix decoding: tokens verified per round at most (its tree holds up to the match "
                           "length's worth, docs/evaluate.md)")
    hf_generate: bool = opt(True, "also time transformers' generate; the faster plain decoder is the baseline")
    dtype: Dtype = dtype_opt("the target and the draft")
    device: str = device_opt()
    threads: int = opt(0, "CPU threads (0: the cores other work leaves free, re-checked between prompts; an "
                          "explicit OMP_NUM_THREADS also wins)")
    draft_quant: str = opt("none", "none: the draft as trained (what export writes and engines serve); int8: "
                           "weight-only int8 draft linears on CPU (faster draft steps; proposals may shift, so tau "
                           "is then not the exported draft's; outputs stay exact)", choices=("none", "int8"))
    runner: str = opt("auto", "target forward: lean (Llama family), hf (any model), auto",
                      choices=("auto", "lean", "hf"))
    projections: str = opt("auto", "how the lean runner computes its projections: torch (F.linear), few-rows "
                           "((W @ x.T).T up to 16 rows: t(1) 1.79x faster on an AVX2 EPYC in float32), packed "
                           "(oneDNN over weights packed once: 1.5x faster products in bf16 on a Xeon with AMX), mkl "
                           "(float32: MKL over the weights packed once per row count, F.linear's to rounding; a "
                           "chain of 3 1.06-1.09x faster than with packed on a Xeon with AMX), or auto (per number of "
                           "rows the fastest here, measured; docs/evaluate.md)",
                           choices=("auto", "torch", "few-rows", "packed", "mkl"))
    compile: bool = opt(False, "run the lean runner's forwards after the prompt as torch.compile graphs (a minute "
                        "or two of compiling first on a CPU; the projections by the runner's plan, --projections; "
                        "docs/evaluate.md)")
    latency_prefix: int = opt(300, "prefix length for the latency table t(q)")
    widen: bool = opt(True, "verify q tokens in a wider forward where the measured t(q) says the wider one is "
                      "faster (fp32 on AVX2 CPUs: t(3) > t(4)); the extra rows are fillers, never committed")
    seed: int = opt(0, "seed of sampling at temperature > 0")
    repeats: int = opt(1, "decode every turn this many times per method and keep the fastest (steadier on a busy "
                       "machine)")

    def validate(self):
        check(all(k >= 1 for k in self.chain), f"chain lengths {self.chain} must be >= 1", "use e.g. --chain 3 5 7")
        check(self.chain or self.tree, "nothing to evaluate: no chain length and --no-tree", "give --chain or --tree")
        check(self.tree_topk >= 1 and self.tree_depth >= 1, f"tree top-k {self.tree_topk} and depth {self.tree_depth}"
              " must be >= 1", "use e.g. --tree-topk 4 --tree-depth 5")
        check(self.tree_size >= self.tree_depth,
              f"tree size {self.tree_size} is below the tree depth {self.tree_depth}",
              "verify at least one token per depth: --tree-size >= --tree-depth")
        check(self.temperature >= 0, f"temperature {self.temperature} is negative", "use 0 (greedy) or more")
        check(self.max_new_tokens >= 1, f"max new tokens {self.max_new_tokens} must be >= 1", "use e.g. 128")
        check(self.num_prompts >= 0, f"num prompts {self.num_prompts} is negative", "use 0 for all, or a count")
        check(self.per_category >= 0, f"per category {self.per_category} is negative", "use 0 for no limit")
        check(self.lookup_k >= 1, f"lookup k {self.lookup_k} must be >= 1", "use e.g. 7")
        check(self.threads >= 0, f"threads {self.threads} is negative", "use 0 for the free cores")
        check(self.repeats >= 1, f"repeats {self.repeats} must be >= 1", "use 1, or 3 on a busy machine")


@dataclasses.dataclass
class Item:
    id: str
    category: str
    turns: list[str]


# -- benchmarks ------------------------------------------------------------------------------------------------------
def _jsonl(path: Path):
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield line_no, json.loads(line)
                except json.JSONDecodeError as e:
                    raise EyasError(f"{path}:{line_no}: not valid JSON ({e.msg})",
                                    fix="fix or remove that line") from None


def _turns(rec: dict, where: str) -> list[str]:
    if isinstance(rec.get("turns"), list):
        turns = rec["turns"]
    elif isinstance(rec.get("messages"), list):
        turns = [m.get("content", "") for m in rec["messages"] if isinstance(m, dict) and m.get("role") == "user"]
    else:
        turns = [next((rec[k] for k in ("prompt", "question", "instruction", "text") if isinstance(rec.get(k), str)),
                      None)]
    if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise EyasError(f"{where}: no prompt found", "a line needs turns (list of str), prompt, question, instruction, "
                        "text, or messages with user turns", "fix the line or point --bench at another file")
    return turns


def load_bench(bench: str, num_prompts: int = 0, per_category: int = 0) -> list[Item]:
    """mt_bench, gsm8k (the data eyas ships: eyas.data.builtin) or a JSONL file -> the first `num_prompts` items,
    taking at most `per_category` of each category when it is set."""

    if bench in ("mt_bench", "mt-bench", "gsm8k"):
        path = builtin_file(bench)
    else:
        path = Path(bench)
        if not path.is_file():
            raise EyasError(f"benchmark {bench!r} is neither mt_bench, gsm8k nor a file", fix="give an existing .jsonl")
    items, seen = [], Counter()
    for line_no, rec in _jsonl(path):
        where = f"{path}:{line_no}"
        if not isinstance(rec, dict):
            raise EyasError(f"{where}: a line must be a JSON object", fix="fix that line")
        rid = rec.get("question_id", rec.get("id", f"{path.stem}:{line_no}"))
        cat = str(rec.get("category") or ("gsm8k" if bench == "gsm8k" else "all"))
        if per_category and seen[cat] >= per_category:
            continue
        seen[cat] += 1
        items.append(Item(str(rid), cat, _turns(rec, where)))
        if num_prompts and len(items) >= num_prompts:
            break
    if not items:
        raise EyasError(f"{path} holds no prompts", fix="give a file with at least one prompt per line")
    return items


def stop_ids(target, renderer) -> set[int]:
    """EOS, the template's end-of-turn token, and the generation config's EOS ids."""
    ids = set(renderer.stop_token_ids())
    src = getattr(target.model.generation_config, "eos_token_id", None)
    return ids | set(src if isinstance(src, (list, tuple)) else [] if src is None else [src])


# -- methods ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Method:
    name: str
    drafter: object
    controller: Controller | None
    mode: str  # chain | tree
    k: int
    source: str  # eagle3 | prompt-lookup | oracle | a checkpoint path

    @property
    def round_controller(self) -> Controller | None:
        """The controller the decoder consults each round: none for a hybrid, which consults its own."""
        return None if isinstance(self.drafter, HybridDrafter) else self.controller


def load_draft(spec: str, target, device, dtype):
    """A trained checkpoint folder, or 'untrained': initialised from the target (timing and tests only)."""

    if spec == "untrained":

        d = Eagle3Draft(DraftConfig.for_target(target, min(32000, target.vocab_size)))
        vocab = build_draft_vocab(np.zeros(target.vocab_size, dtype=np.int64), d.cfg.draft_vocab_size)
        d.init_weights(target.embed_tokens().weight.float(), target.lm_head().weight.float(), vocab.d2t)
        return d.to(device=device, dtype=dtype).eval().requires_grad_(False)
    d = read_draft(spec, device=str(device), dtype=dtype).requires_grad_(False)
    want, have = target.identity(), d.cfg.target_identity
    if have and have.get("config_hash") != want["config_hash"]:
        raise EyasError(f"draft {spec} was trained for target {have.get('name')} ({have.get('config_hash')})",
                        f"the target given is {want['name']} ({want['config_hash']})",
                        "evaluate with the draft's own target (--target), or train a draft for this one")
    return d


def build_methods(cfg: EvalConfig, draft, extra: dict, latency: dict, vocab: int) -> list[Method]:
    ctl = (lambda kmax, size=None: Controller(latency, kmax, size)) if cfg.adaptive else (lambda *a: None)
    methods = []
    longest = max(cfg.chain or (cfg.tree_depth,))  # the chain other drafters run beside the draft's
    names = short_names([cfg.draft, *extra])  # extra: the baseline draft folders, loaded
    for k in cfg.chain:
        methods.append(Method(f"eagle3 chain k={k}", Eagle3Drafter(draft, k=k), ctl(k), "chain", k, "eagle3"))
    if cfg.tree:
        shape = TreeShape(cfg.tree_topk, cfg.tree_depth, cfg.tree_size)
        name = f"eagle3 tree k={shape.topk} d={shape.depth} n={shape.size}"
        methods.append(Method(name, Eagle3Drafter(draft, tree=shape), ctl(shape.depth, shape.size), "tree",
                              shape.depth, "eagle3"))
    for b in cfg.baselines:
        if b == "prompt-lookup":
            methods.append(Method(f"prompt-lookup k={cfg.lookup_k}", PromptLookupDrafter(cfg.lookup_k),
                                  ctl(cfg.lookup_k), "chain", cfg.lookup_k, b))
        elif b == "suffix":
            methods.append(Method(f"suffix k={cfg.suffix_k}", SuffixDrafter(cfg.suffix_k), ctl(cfg.suffix_k), "tree",
                                  cfg.suffix_k, b))
        elif b in ("hybrid", "hybrid-suffix"):  # the draft's longest chain and prompt lookup (or suffix
            k, own = longest, ctl(longest)  # decoding), per round the likelier to pay
            partner = PromptLookupDrafter(cfg.lookup_k) if b == "hybrid" else SuffixDrafter(cfg.suffix_k)
            drafter = HybridDrafter(Eagle3Drafter(draft, k=k), partner, controller=own)
            methods.append(Method(f"hybrid k={k} + {partner.name} k={partner.k}", drafter, own, "chain", k, b))
        elif b == "oracle":
            k = longest
            methods.append(Method(f"oracle k={k}", OracleDrafter(k, vocab=vocab), None, "chain", k, b))
        elif b not in ("none", ""):
            k = longest
            methods.append(Method(f"{names[b]} chain k={k}", Eagle3Drafter(extra[b], k=k, name=b), ctl(k),
                                  "chain", k, b))
    return methods


def short_names(paths: list[str]) -> dict[str, str]:
    """Each draft folder by the fewest trailing parts, at least two (run/final, not just final), that tell it from
    every other folder given (runs/a/train/final and runs/a/mix/train/final: train/final, mix/train/final)."""
    parts = {p: Path(p).resolve().parts for p in paths}
    names = {}
    for p, mine in parts.items():
        n = 2
        while n < len(mine) and any(o != mine and o[-n:] == mine[-n:] for o in parts.values()):
            n += 1
        names[p] = "/".join(mine[-n:])
    return names


def hf_generate(target, prompt: list[int], max_new: int, temperature: float, stop: set[int], seed: int):
    """transformers' generate, timed from its first token to its last (the decode part). -> (tokens, decode_s)"""
    # heavy (seconds to import): loaded only where a model is
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    stamps = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            sync(scores.device)  # a GPU's step is done when its logits are, not when Python gets here
            stamps.append(time.perf_counter())
            return scores

    gc = GenerationConfig(max_new_tokens=max_new, do_sample=temperature > 0, temperature=temperature or None,
                          top_k=None, top_p=None, eos_token_id=sorted(stop), pad_token_id=sorted(stop)[0])
    torch.manual_seed(seed)
    ids = torch.tensor([prompt], device=target.device)
    out = target.model.generate(ids, generation_config=gc, logits_processor=LogitsProcessorList([Stamp()]))
    return out[0, len(prompt):].tolist(), (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0


# -- the run -----------------------------------------------------------------------------------------------------------
def run(cfg: EvalConfig) -> dict:
    """The stage, holding its output's lock (eyas.core.lock) throughout."""
    with hold(Path(cfg.out), "evaluate"):
        return _run(cfg)


def _run(cfg: EvalConfig) -> dict:
    con = console(0, cfg.quiet, cfg.json)
    device = torch.device(pick_device(cfg.device))
    cpu = Threads(cfg.threads, 1, str(device))
    con.print("threads: %d (%s)" % cpu.apply())
    if cfg.temperature > 0 and "oracle" in cfg.baselines:
        raise EyasError("the oracle drafter needs temperature 0", fix="drop 'oracle' from --baselines")
    if not cfg.draft:
        raise EyasError("no draft given", fix="pass --draft RUN/final (a trained checkpoint) or --draft untrained")
    dtype, why = choose_dtype(cfg.dtype, str(device))
    if why:
        con.print(why)
    if cfg.trust_remote_code:
        con.print(trusted_code_line(cfg.target))
    target = load_target(cfg.target, dtype=dtype, device=str(device), trust_remote_code=cfg.trust_remote_code)
    con.print(target.info())
    draft = load_draft(cfg.draft, target, device, target.dtype)
    extra = {b: load_draft(b, target, device, target.dtype) for b in cfg.baselines
             if b not in ("prompt-lookup", "suffix", "hybrid", "hybrid-suffix", "oracle", "none", "")}
    quant = cfg.draft_quant
    if quant == "int8":
        if device.type != "cpu" or not hasattr(torch, "_weight_int8pack_mm"):
            raise EyasError("--draft-quant int8 needs the CPU and torch's int8 weight-only matmul",
                            f"the run is on {device} with torch {torch.__version__}", "use --draft-quant none")
        draft, extra = quantize_int8(draft), {k: quantize_int8(v) for k, v in extra.items()}
    for path, other in extra.items():
        if other.cfg.feature_layers != draft.cfg.feature_layers:
            raise EyasError(f"baseline draft {path} reads target layers {list(other.cfg.feature_layers)}",
                            f"the main draft reads {list(draft.cfg.feature_layers)}; one run captures one set",
                            "evaluate that draft in its own run, as --draft")
    items = load_bench(cfg.bench, cfg.num_prompts, cfg.per_category)
    if cfg.compile:
        con.print("compiling the target's decoding forwards (torch.compile: 1-2 minutes for SmolLM2-135M on 2 CPU "
                  "cores, less from inductor's cache) ...")
    runner = make_runner(target, draft.cfg.feature_layers, cfg.runner, linear=cfg.projections, compiled=cfg.compile)
    if isinstance(runner, LeanRunner):
        con.print(f"target projections: {runner.linear_choice}{'; forward compiled' if runner.compiled else ''}")
        if runner.projections.plan != ((1, "torch"),) and quant == "none":  # the drafts' steps are a row or a few
            p = runner.projections
            draft, extra = projected_draft(draft, p), {k: projected_draft(v, p) for k, v in extra.items()}
    qs = sorted(set(REPORT_QS) | set(range(1, max(cfg.chain + (cfg.lookup_k,)) + 2)) | {cfg.tree_size + 1})
    con.print(f"measuring target latency t(q) for q = {qs} after {cfg.latency_prefix} tokens ...")
    latency = measure_latency(runner, qs, prefix=cfg.latency_prefix)
    runner.widths = verify_widths(latency) if cfg.widen else {}
    if runner.widths:
        con.print("verify widths: " + ", ".join(f"{q} tokens in a forward of {w} ({1e3 * latency[q]:.1f} -> "
                                                  f"{1e3 * latency[w]:.1f} ms)" for q, w in runner.widths.items())
                  + " (measured here; --no-widen verifies every q as q rows)")
    methods = build_methods(cfg, draft, extra, effective_latency(latency, runner.widths), target.vocab_size)
    renderer = ChatRenderer(target.tokenizer)
    stop = stop_ids(target, renderer)
    _warm_up(runner, renderer, methods, items[0], stop, cfg)
    records = _decode_all(con, cfg, runner, target, renderer, methods, items, stop, cpu)
    lossless.margins(runner, methods, records)
    if cfg.temperature == 0:
        lossless.rescore(target, records, runner)
    latency2 = measure_latency(runner, qs, prefix=cfg.latency_prefix, seed=1)
    latency = {q: (latency[q] + latency2[q]) / 2 for q in qs}
    res = results.aggregate(cfg, target, draft, runner, items, methods, records, latency)
    res["draft"]["quant"] = quant
    res["draft"]["precision"] = draft_precision(target.dtype, quant)
    res["files"] = results.write(res, Path(cfg.out), target.tokenizer)
    for line in results.summary_lines(res):
        con.print(line, force=not cfg.json)
    return res


def draft_precision(dtype: torch.dtype, quant: str) -> str:
    """The draft the figures were measured with, in words (every report shows it)."""
    name = str(dtype).removeprefix("torch.")
    return f"{name} as trained" if quant == "none" else f"{name}, linears int8 weight-only (not the exported draft)"


def _warm_up(runner, renderer, methods, item, stop, cfg) -> None:
    """Build the kernels of every shape once (first calls are slow on CPU), untimed."""
    prompt = renderer.prompt_ids([{"role": "user", "content": item.turns[0]}])
    ref = plain_generate(runner, prompt, 24, stop=stop)
    for m in methods:
        if isinstance(m.drafter, OracleDrafter):
            m.drafter.set_reference(ref.tokens)
        speculative_generate(runner, m.drafter, prompt, 24, cfg.temperature, stop=stop, controller=None)
        m.drafter.forget()  # the warm-up's reply is not text the run has seen: suffix decoding would draft from it
        if m.controller is not None:  # a hybrid's own controller saw the warm-up's slow first calls
            m.controller.reset()


def _fastest(n: int, decode, again=lambda: None):
    """The fastest of n decodes (interference from other processes only ever adds time); `again` before each
    repeat (a drafter's `repeat`: every decode of the turn starts from the same state)."""
    runs = []
    for i in range(n):
        if i:
            again()
        runs.append(decode())
    return min(runs, key=lambda g: g.decode_s)


def _decode_all(con, cfg, runner, target, renderer, methods, items, stop, cpu: Threads) -> list[dict]:
    """One record per (item, turn, method), methods alternating prompt by prompt (so a change of threads between
    prompts, eyas.core.threads, weighs on every method alike)."""
    records = []
    bar = con.progress(total=sum(len(i.turns) for i in items), desc="evaluate", unit="turn")
    for item in items:
        if changed := cpu.recheck():
            con.print(changed)
        messages = []
        for turn, text in enumerate(item.turns):
            messages.append({"role": "user", "content": text})
            prompt = renderer.prompt_ids(messages)
            base = _fastest(cfg.repeats, lambda: plain_generate(runner, prompt, cfg.max_new_tokens, cfg.temperature,
                                                                cfg.seed, stop))
            key = {"id": item.id, "category": item.category, "turn": turn + 1, "prompt_tokens": len(prompt),
                   "user": text}
            records.append({**key, "method": "plain", "tokens": base.tokens, "decode_s": base.decode_s,
                            "prefill_s": base.prefill_s, "rounds": [], "prompt": prompt})
            if cfg.hf_generate:
                toks, dt = min((hf_generate(target, prompt, cfg.max_new_tokens, cfg.temperature, stop, cfg.seed)
                                for _ in range(cfg.repeats)), key=lambda x: x[1])
                records.append({**key, "method": "hf_generate", "tokens": toks, "decode_s": dt, "prefill_s": None,
                                "rounds": []})
            for m in methods:
                if isinstance(m.drafter, OracleDrafter):
                    m.drafter.set_reference(base.tokens)
                g = _fastest(cfg.repeats, lambda: speculative_generate(
                    runner, m.drafter, prompt, cfg.max_new_tokens, cfg.temperature, cfg.seed, stop, m.round_controller),
                    m.drafter.repeat)
                records.append({**key, "method": m.name, "tokens": g.tokens, "decode_s": g.decode_s,
                                "prefill_s": g.prefill_s, "rounds": [dataclasses.asdict(r) for r in g.rounds],
                                "prompt": prompt, "reference": base.tokens,
                                "divergence": (first_divergence(base.tokens, g.tokens) if cfg.temperature == 0
                                               else None)})
            # the next turn follows the target's own answer (plain decoding's)
            answer = renderer.clean_reply(target.tokenizer.decode(base.tokens, skip_special_tokens=True))
            messages.append({"role": "assistant", "content": answer})
            bar.update(1)
    bar.close()
    return records
