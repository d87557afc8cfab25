"""vLLM as the judge: an exported draft served by vLLM's speculative decoding (`eagle3`), beside vLLM's own `ngram`
and (where arctic-inference is installed) `suffix` methods and its plain decoding, on the prompts `eyas evaluate`
decodes: one request at a time, temperature 0, each method's tau and speedup over vLLM's plain decoding in the
same run, every output compared with plain's token for token.

    python bench/vllm_judge.py --draft runs/demo/export/eagle3 --bench mt_bench --per-category 3 --num-prompts 0

Runs in eyas's environment and starts vLLM's (scripts/setup-vllm.sh; EYAS_VLLM_PYTHON) once per method
(bench/vllm_worker.py). The prompts are rendered as `eyas evaluate` renders them, and a second turn follows eyas's
own plain greedy answer to the first, so the same settings in `eyas evaluate` decode the same prompts. Time is
counted as eyas counts it: decoding after the first token (a one-token request on the same prompt times the
prefill, which is subtracted). tau is vLLM's: 1 + accepted tokens / drafting rounds (rounds in which ngram or
suffix found nothing to propose are not counted, where `eyas evaluate` counts them with a = 0); `tau all` counts
every round as eyas does: tokens after the first / (those tokens - accepted ones), a round being one token and its
accepted ones (a round cut short by the token limit makes it a little high).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from eyas.core.config import opt, parse
from eyas.core.options import Dtype, dtype_opt, target_opt

WORKER = Path(__file__).with_name("vllm_worker.py")
METHODS = ("plain", "eagle3", "ngram", "suffix")


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeConfig:
    """The settings of one judging run."""

    target: str = target_opt()
    draft: str = opt("", "the exported draft folder (eyas export --format eagle3)")
    bench: str = opt("mt_bench", "mt_bench, gsm8k or a JSONL file of prompts (as eyas evaluate takes)")
    num_prompts: int = opt(10, "the first N prompts (0: every one the bench selects), as eyas evaluate counts them")
    per_category: int = opt(0, "MT-Bench: the first N questions of each category")
    max_new_tokens: int = opt(128, "tokens generated per turn at most")
    k: int = opt(3, "eagle3: draft tokens per round")
    lookup_k: int = opt(7, "ngram and suffix: tokens proposed per round at most")
    methods: tuple[str, ...] = opt(METHODS, "vLLM's methods to run (suffix needs arctic-inference in vLLM's "
                                   "environment; it is left out, said so, where that is missing)", choices=METHODS)
    dtype: Dtype = dtype_opt("vLLM and eyas's prompt pass", auto="fp32, the export's dtype")
    engine_python: str = opt("", "the python of vLLM's environment (empty: $EYAS_VLLM_PYTHON, else the one "
                             "scripts/setup-vllm.sh makes)")
    out: str = opt("", "write the figures as JSON here")


WARM_UP = "Name the days of the week, one per line."  # the untimed first request: a prompt of no bench


def bench_turns(a, target, runner, renderer, stop: set[int], extra: int | None = None, said=None) -> list[dict]:
    """Every turn of the bench `a` selects (its bench, num_prompts, per_category, max_new_tokens), as `eyas evaluate`
    decodes it: {"id", "prompt", "reply"}, a later turn following the target's plain greedy answer to the one
    before, cut at max_new_tokens. "reply": the greedy reply of max_new_tokens + `extra` tokens on every turn when
    `extra` is given, else only where a later turn needs it (None on an item's last turn). `said(n)` after each
    item, n turns done. Also bench/replay_drafters.py's references."""
    from eyas.speculate.decode import plain_generate
    from eyas.speculate.evaluate import load_bench

    rows = []
    for item in load_bench(a.bench, a.num_prompts, a.per_category):
        messages = []
        for turn, text in enumerate(item.turns):
            messages.append({"role": "user", "content": text})
            prompt = renderer.prompt_ids(messages)
            later = turn + 1 < len(item.turns)
            reply = (plain_generate(runner, prompt, a.max_new_tokens + (extra or 0), stop=stop).tokens
                     if later or extra is not None else None)
            rows.append({"id": f"{item.id}/{turn + 1}", "prompt": prompt, "reply": reply})
            if later:  # the next turn follows the target's own answer, as in evaluate
                messages.append({"role": "assistant", "content": renderer.clean_reply(
                    target.tokenizer.decode(reply[:a.max_new_tokens], skip_special_tokens=True))})
        if said:
            said(len(rows))
    return rows


def prompts_of(a: JudgeConfig, dtype: str) -> tuple[list[list[int]], list[int], str, list[int]]:
    """Every turn's prompt ids as `eyas evaluate` builds them, the stop ids, the target's folder for vLLM, and the
    warm-up prompt's ids."""
    from eyas.core.target import load_target
    from eyas.core.vllm_server import engine_model
    from eyas.data.chat import ChatRenderer
    from eyas.speculate.evaluate import stop_ids
    from eyas.speculate.target_forward import make_runner

    target = load_target(a.target, dtype=dtype)
    runner = make_runner(target, target.default_feature_layers())
    renderer = ChatRenderer(target.tokenizer)
    stop = stop_ids(target, renderer)
    prompts = [t["prompt"] for t in bench_turns(a, target, runner, renderer, stop)]
    warmup = renderer.prompt_ids([{"role": "user", "content": WARM_UP}])
    return prompts, sorted(stop), engine_model(a.target)[0], warmup


def spec_config(a: JudgeConfig, method: str) -> dict | None:
    if method == "plain":
        return None
    if method == "eagle3":
        return {"method": "eagle3", "model": str(Path(a.draft).resolve()), "num_speculative_tokens": a.k}
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": a.lookup_k, "prompt_lookup_min": 1,
                "prompt_lookup_max": 3}  # eyas's prompt lookup: the last 3, 2, then 1 tokens
    return {"method": "suffix", "num_speculative_tokens": a.lookup_k}


def main() -> None:
    a = parse(JudgeConfig, description=__doc__.split("\n\n")[0])
    from eyas.core.precision import FULL
    from eyas.core.vllm_server import cpu_env, vllm_python
    from eyas.speculate.decode import first_divergence

    dtype = FULL.get(a.dtype, "float32")
    python = vllm_python(a.engine_python)
    methods = list(a.methods)
    if "eagle3" in methods and not a.draft:
        raise SystemExit("vllm_judge: eagle3 needs --draft, the exported draft's folder")
    if "suffix" in methods and subprocess.run([python, "-c", "import arctic_inference"],
                                              capture_output=True).returncode != 0:
        print("suffix: left out, arctic-inference is not installed in vLLM's environment "
              "(VLLM_SUFFIX=1 bash scripts/setup-vllm.sh builds it there)")
        methods.remove("suffix")
    print(f"load {os.getloadavg()[0]:.2f} before; {time.strftime('%Y-%m-%d %H:%M')}")
    prompts, stop, model, warmup = prompts_of(a, dtype)
    env, threads = cpu_env(1, python)
    print(f"{len(prompts)} prompts, {a.max_new_tokens} new tokens at most; vLLM at {python}; {threads}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in methods:
            job, out = Path(tmp) / f"{method}.json", Path(tmp) / f"{method}.out.json"
            job.write_text(json.dumps({"target": model, "dtype": dtype, "max_model_len": 4096, "stop": stop,
                                       "max_new_tokens": a.max_new_tokens, "spec": spec_config(a, method),
                                       "prompts": prompts, "warmup": warmup}))
            t0 = time.perf_counter()
            done = subprocess.run([python, str(WORKER), str(job), str(out)], env={**os.environ, **env},
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"vllm_judge: {method} failed:\n" + "\n".join(done.stderr.splitlines()[-20:]))
            results[method] = json.loads(out.read_text())
            print(f"{method}: {time.perf_counter() - t0:.0f} s with vLLM's start-up", flush=True)
    plain = results["plain"]["rows"]
    rate = {}
    table = []
    for method, r in results.items():
        rows = r["rows"]
        tokens = sum(len(x["tokens"]) - 1 for x in rows)
        seconds = sum(x["seconds"] - x["first_s"] for x in rows)
        rate[method] = tokens / seconds
        spec = r["spec"]
        drafts = spec.get("vllm:spec_decode_num_drafts", 0)
        accepted = spec.get("vllm:spec_decode_num_accepted_tokens", 0)
        per_pos = spec.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])
        same = sum(first_divergence(p["tokens"], x["tokens"]) is None for p, x in zip(plain, rows))
        table.append({"method": method, "tau": 1 + accepted / drafts if drafts else None, "drafts": drafts,
                      "tau_all": tokens / (tokens - accepted) if drafts else None,
                      "accepted_by_position": per_pos, "tokens_per_s": rate[method],
                      "speedup": rate[method] / rate["plain"], "same_as_plain": same, "prompts": len(rows)})
    print(f"{'method':<8} {'tau':>5} {'tau all':>7} {'tok/s':>7} {'speedup':>7}  same as plain  accepted by position")
    for t in table:
        tau, every = (f"{t['tau']:.3f}", f"{t['tau_all']:.3f}") if t["tau"] else ("-", "-")
        print(f"{t['method']:<8} {tau:>5} {every:>7} {t['tokens_per_s']:>7.1f} {t['speedup']:>6.2f}x  "
              f"{t['same_as_plain']}/{t['prompts']:<12} {t['accepted_by_position']}")
    print(f"load {os.getloadavg()[0]:.2f} after; {time.strftime('%Y-%m-%d %H:%M')}")
    if a.out:
        Path(a.out).write_text(json.dumps({"settings": dataclasses.asdict(a), "dtype": dtype, "threads": threads,
                                           "methods": table, "when": time.strftime("%Y-%m-%d %H:%M")}, indent=1))


if __name__ == "__main__":
    main()
