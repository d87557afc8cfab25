"""Replay the model-free drafters (prompt lookup, suffix decoding) on greedy references: at temperature 0 a round's
accepted tokens depend only on what was proposed and on the target's greedy continuation, so the rounds that
`eyas evaluate` runs are counted here in seconds, without the target's forwards (tau only: no time).

    python bench/replay_drafters.py --bench mt_bench --per-category 3 --num-prompts 0 --refs /tmp/mt-refs.json

The references (each turn's prompt and the target's plain greedy reply, decoded once and kept in --refs) follow
evaluate's order, its untimed warm-up first (forgotten after, as evaluate forgets it), so the replay of eyas's
drafters makes the rounds of `eyas evaluate --no-adaptive` (tests/test_speculate.py checks it against the decoding
loop; evaluate's default controller sizes each round by its costs, which a replay without time cannot). A
reference ends at its stop token, so a draft token the loop would still accept past it is not seen: tau can read
a hair low (not the rounds). Where vLLM's environment has arctic-inference (`VLLM_SUFFIX=1 bash
scripts/setup-vllm.sh`), arctic's suffix cache, the implementation behind vLLM's `suffix` method, is replayed on
the same references through the calls vLLM makes (`--arctic-k` tokens, its defaults), its cache emptied after the
warm-up too (vLLM's judge keeps the reply of its own warm-up prompt, of no bench, in it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def walk(tokens: list[int], parents: list[int], ref: list[int], at: int) -> list[int]:
    """The proposal's nodes accepted at temperature 0 when the target's greedy continuation is ref[at:]: from the
    root, into the child holding the next reference token, while there is one. (eyas.speculate.decode.verify_greedy
    walks the same way over the target's argmaxes; this copy is here for the arctic worker, which runs where eyas
    cannot be imported.)"""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    node, path = -1, []
    while at + len(path) < len(ref):
        node = next((c for c in kids.get(node, []) if tokens[c] == ref[at + len(path)]), None)
        if node is None:
            break
        path.append(node)
    return path


def replay(refs: dict, drafter) -> dict:
    """Decode every reference as the decoding loop would with `drafter` (start, propose, update, finish): the
    rounds of the rows that count (not the warm-up), each a token and the draft tokens accepted before it."""
    stop = set(refs["stop"])
    accepted: list[int] = []
    drafted = proposed = 0
    for row in refs["rows"]:
        prompt, ref, max_new = row["prompt"], row["reply"], row["max_new"]
        gen = ref[:1]  # the first token comes from the prefill
        drafter.start(prompt, gen)
        while len(gen) < max_new and gen[-1] not in stop:
            tokens, parents = drafter.propose(prompt, gen)
            path = walk(tokens, parents, ref, len(gen))
            new = [tokens[i] for i in path]
            end = len(gen) + len(path)
            if end < len(ref):  # the target's own token after the accepted ones
                new.append(ref[end])
            elif ref[-1] not in stop:  # (after a stop token it would be cut off)
                raise SystemExit(f"replay: the reference of turn {row['id']} is too short for a round of "
                                 f"{len(tokens)} tokens: decode it with more tokens past --max-new-tokens")
            gen.extend(new)
            drafter.update(prompt, gen, new)
            if row["id"] != "warm-up":
                accepted.append(len(path))
                drafted += bool(tokens)
                proposed += len(tokens)
        drafter.finish()
        if row["id"] == "warm-up":  # as evaluate does after its warm-up (vLLM's judge warms up on another prompt)
            drafter.forget()
    n = len(accepted)
    return {"rounds": n, "tau": 1 + sum(accepted) / n, "drafted": drafted,
            "tau_drafted": 1 + sum(accepted) / drafted if drafted else None, "rows": 1 + proposed / n,
            "accepted": accepted}


class Arctic:
    """arctic-inference's suffix cache driven as vLLM's SuffixDecodingProposer drives it (one request at a time):
    the prompt starts a request, every new token joins its response, the last `depth` tokens are the pattern."""

    def __init__(self, k: int, depth: int = 24, factor: float = 1.0, min_prob: float = 0.1):
        self.k, self.depth, self.factor, self.min_prob = k, depth, factor, min_prob
        self.forget()

    def forget(self):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache, self.request = SuffixDecodingCache(max_tree_depth=self.depth, max_cached_requests=10000), 0

    def start(self, prompt, gen):
        self.request += 1
        self.cache.start_request(self.request, prompt)
        self.cache.add_active_response(self.request, gen)

    def propose(self, prompt, gen):
        d = self.cache.speculate(self.request, (prompt + gen)[-self.depth:], max_spec_tokens=self.k,
                                 max_spec_factor=self.factor, min_token_prob=self.min_prob)
        return list(d.token_ids), list(d.parents)

    def update(self, prompt, gen, new):
        self.cache.add_active_response(self.request, new)

    def finish(self):
        self.cache.stop_request(self.request)


if __name__ == "__main__" and sys.argv[1:2] == ["--arctic-worker"]:  # in vLLM's environment: no eyas there
    refs_path, k = sys.argv[2], int(sys.argv[3])
    result = replay(json.loads(Path(refs_path).read_text()), Arctic(k))
    print(json.dumps({"name": f"arctic suffix k={k} (vLLM's suffix)", **result}))
    sys.exit(0)

from eyas.core.config import opt, parse  # noqa: E402  (the worker above runs where eyas is not installed)
from eyas.core.options import Dtype, dtype_opt, target_opt  # noqa: E402


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """The settings of one replay."""

    target: str = target_opt()
    bench: str = opt("mt_bench", "mt_bench, gsm8k or a JSONL file of prompts (as eyas evaluate takes)")
    num_prompts: int = opt(10, "the first N prompts (0: every one the bench selects), as eyas evaluate counts them")
    per_category: int = opt(0, "MT-Bench: the first N questions of each category")
    max_new_tokens: int = opt(128, "tokens generated per turn at most, as in eyas evaluate")
    dtype: Dtype = dtype_opt("the target's, for the references", auto="fp32")
    lookup_k: int = opt(7, "prompt lookup: tokens proposed per round at most")
    suffix_k: int = opt(8, "eyas's suffix decoding: tokens verified per round at most")
    arctic_k: int = opt(7, "arctic's suffix cache: tokens per round at most (bench/vllm_judge.py runs vLLM's "
                        "suffix with its --lookup-k, 7)")
    refs: str = opt("", "keep the references in this JSON file (decoded once, read again while the settings match)")
    engine_python: str = opt("", "vLLM's python, for arctic's cache (empty: $EYAS_VLLM_PYTHON, else the one "
                             "scripts/setup-vllm.sh makes)")


class EyasDrafter:
    """One of eyas's drafters behind replay's calls, as speculative_generate calls it at temperature 0."""

    def __init__(self, drafter):
        self.d = drafter

    def start(self, prompt, gen):
        self.d.start(prompt + gen, None)

    def propose(self, prompt, gen):
        p = self.d.propose(prompt + gen, 0.0, None, None)
        return p.tokens.tolist(), p.parents.tolist()

    def update(self, prompt, gen, new):
        self.d.update(prompt + gen, None)

    def finish(self):
        pass

    def forget(self):
        self.d.forget()


def references(a: ReplayConfig, extra: int) -> dict:
    """Every turn's prompt and greedy reply (max_new_tokens + `extra`, for the last round's look past the limit),
    in evaluate's order after its warm-up; the second turn follows the first's reply cut at max_new_tokens."""
    from vllm_judge import bench_turns  # (this folder: the turns as the judge and evaluate build them)

    from eyas.core.precision import FULL
    from eyas.core.target import load_target
    from eyas.data.chat import ChatRenderer
    from eyas.speculate.decode import plain_generate
    from eyas.speculate.evaluate import stop_ids
    from eyas.speculate.target_forward import make_runner

    key = {"target": a.target, "bench": a.bench, "num_prompts": a.num_prompts, "per_category": a.per_category,
           "max_new_tokens": a.max_new_tokens, "dtype": a.dtype, "extra": extra}
    if a.refs and Path(a.refs).is_file() and (kept := json.loads(Path(a.refs).read_text())).get("key") == key:
        return kept
    target = load_target(a.target, dtype=FULL.get(a.dtype, "float32"))
    runner = make_runner(target, target.default_feature_layers())
    renderer = ChatRenderer(target.tokenizer)
    stop = stop_ids(target, renderer)
    turns = bench_turns(a, target, runner, renderer, stop, extra,
                        lambda n: print(f"references: {n} turns", end="\r", flush=True))
    warm = turns[0]["prompt"]  # evaluate warms up on the first turn's prompt
    rows = [{"id": "warm-up", "prompt": warm, "max_new": 24,
             "reply": plain_generate(runner, warm, 24 + extra, stop=stop).tokens}]
    rows += [{**t, "max_new": a.max_new_tokens} for t in turns]
    refs = {"key": key, "stop": sorted(stop), "rows": rows}
    if a.refs:
        Path(a.refs).write_text(json.dumps(refs))
    return refs


def main() -> None:
    a = parse(ReplayConfig, description=__doc__.split("\n\n")[0])
    from eyas.core.errors import EyasError
    from eyas.core.vllm_server import vllm_python
    from eyas.speculate.drafters import PromptLookupDrafter
    from eyas.speculate.suffix import SuffixDrafter

    refs = references(a, extra=max(a.lookup_k, a.suffix_k, a.arctic_k) + 1)
    results = [{"name": f"prompt-lookup k={a.lookup_k}", **replay(refs, EyasDrafter(PromptLookupDrafter(a.lookup_k)))},
               {"name": f"suffix k={a.suffix_k}", **replay(refs, EyasDrafter(SuffixDrafter(a.suffix_k)))}]
    try:
        python = vllm_python(a.engine_python)
        missing = subprocess.run([python, "-c", "import arctic_inference"], capture_output=True).returncode != 0
        why = f"arctic-inference is not importable by {python}" if missing else ""
    except EyasError as e:
        why = e.what.removeprefix("--engine vllm: ")
    if not why:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "refs.json"
            path.write_text(json.dumps(refs))
            done = subprocess.run([python, __file__, "--arctic-worker", str(path), str(a.arctic_k)],
                                  capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
        if done.returncode != 0:
            raise SystemExit("replay: arctic's cache failed:\n" + "\n".join(done.stderr.splitlines()[-20:]))
        results.append(json.loads(done.stdout.splitlines()[-1]))
    else:
        print(f"arctic's suffix cache: left out, {why} (VLLM_SUFFIX=1 bash scripts/setup-vllm.sh builds it in "
              "vLLM's environment)")
    print(f"{len(refs['rows']) - 1} turns of {a.bench}, {a.max_new_tokens} new tokens at most, temperature 0")
    print(f"{'drafter':<40} {'rounds':>7} {'tau':>6} {'drafted':>8} {'tau drafted':>12} {'rows/round':>11}")
    for r in results:
        print(f"{r['name']:<40} {r['rounds']:>7} {r['tau']:>6.3f} {r['drafted']:>8} {r['tau_drafted'] or 0:>12.3f}"
              f" {r['rows']:>11.2f}")
    print("rows/round: the rows each round's verification forward takes (the token, and every token proposed)")


if __name__ == "__main__":
    main()
