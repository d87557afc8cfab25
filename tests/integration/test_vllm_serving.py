"""vLLM serves eyas's EAGLE-3 export (issue 6): lossless outputs and an acceptance length that agrees with eyas's.

The draft: $EYAS_TEST_DRAFT (an eyas checkpoint, e.g. RUN/final, or an eagle3/speculators folder, which is
imported first), else one built once by `build_draft` below and cached outside the repo under
$EYAS_CACHE/integration/ (regenerate 200 GSM8K-train prompts through the plain vLLM server, prepare, extract,
train; about an hour on a shared 2-core CPU, then seconds).

For each export format (eagle3: `--speculative-config {"method": "eagle3", "model": DIR,
"num_speculative_tokens": 3}`; speculators: `--model DIR`, vLLM reads the verifier and the 3 tokens from its
config) a server starts with the draft and receives the first turns of the first PROMPTS MT-Bench questions
($EYAS_IT_BENCH=gsm8k: GSM8K test questions instead, where the cached GSM8K-trained draft is in its own domain),
rendered to token ids by eyas's chat template and sent to /v1/completions at temperature 0, MAX_NEW tokens.
- (a) every output equals, token for token, vLLM's output for the same prompt without a draft;
- (b) vLLM's acceptance length, 1 + spec_decode_num_accepted_tokens_total / spec_decode_num_drafts_total from
  /metrics, is within 10% of the tau of `eyas evaluate --chain 3 --no-tree --no-adaptive --dtype float32` on
  the same prompts (first turns, so both sides decode exactly the same prompt ids).
The figures are printed with the prefix [integration]; docs/integration.md records them.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

PROMPTS = int(os.environ.get("EYAS_IT_PROMPTS", "20"))  # first turns of the benchmark
BENCH = os.environ.get("EYAS_IT_BENCH", "mt_bench")  # mt_bench or gsm8k (its test split), as `eyas evaluate --bench`
MAX_NEW = 128
K = 3  # num_speculative_tokens, and eyas evaluate's chain length
TOLERANCE = 0.10
# How the cached draft is built; the hashes name its cache folders, so changing a value builds anew.
DATA_RECIPE = {"data": "gsm8k-train", "samples": 200, "max_new_tokens": 256, "temperature": 0}
# Chosen for a CPU: a 8k draft vocabulary and 3 TTT steps (the chain is 3 long) cut the cost of a training token
# ~9x against the defaults (32k, 7), whose output head dominates it.
TRAIN_RECIPE = {"epochs": 10, "lr": 3e-4, "draft_vocab": 8192, "ttt_steps": 3, "micro_batch": 4,
                "max_tokens": 0, "seed": 0}
STAGE_TIMEOUT_S = 4 * 3600


def run_eyas(eyas, *args: str) -> dict:
    """`eyas ARGS --json` -> its summary; the command's stderr on failure."""
    r = subprocess.run(eyas.cmd(*args, "--json"), env=eyas.env, capture_output=True, text=True,
                       timeout=STAGE_TIMEOUT_S)
    assert r.returncode == 0, f"eyas {' '.join(args)} failed:\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- the draft ---------------------------------------------------------------------------------------------------------
def _key(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]


def recipe_dirs() -> tuple[Path, Path]:
    """(data folder: regenerated, prepared, store; training run folder inside it)."""
    from eyas.core.paths import cache_dir

    data = cache_dir() / "integration" / f"smollm2-gsm8k-{_key(DATA_RECIPE)}"
    return data, data / f"run-{_key(TRAIN_RECIPE)}"


def build_draft(eyas, server_url: str, root: Path, run: Path) -> Path:
    """regenerate -> prepare -> extract (into `root`) -> train (into `run`); each stage resumes or is skipped when
    its output is complete. -> the checkpoint folder."""
    d, t = DATA_RECIPE, TRAIN_RECIPE
    final = run / "final"
    if (final / "model.safetensors").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    (root / "recipe.json").write_text(json.dumps(d, indent=2))
    regen = root / "regenerated.jsonl"
    run_eyas(eyas, "regenerate", "--server", server_url, "--data", d["data"], "--max-samples", str(d["samples"]),
             "--max-new-tokens", str(d["max_new_tokens"]), "--temperature", str(d["temperature"]),
             "--concurrency", "16", "--out", str(regen))
    if not (root / "prepared" / "summary.json").is_file():
        run_eyas(eyas, "prepare", "--target", "smollm2-135m", "--data", str(regen), "--out", str(root / "prepared"),
                 "--overwrite")
    run_eyas(eyas, "extract", "--data", str(root / "prepared"), "--store", str(root / "store"),
             "--target", "smollm2-135m")
    resume = ["--resume"] if (run / "checkpoints").is_dir() else []
    run_eyas(eyas, "train", "--store", str(root / "store"), "--target", "smollm2-135m", "--out", str(run),
             "--epochs", str(t["epochs"]), "--lr", str(t["lr"]), "--draft-vocab", str(t["draft_vocab"]),
             "--ttt-steps", str(t["ttt_steps"]), "--micro-batch", str(t["micro_batch"]),
             "--max-tokens", str(t["max_tokens"]), "--seed", str(t["seed"]),
             *resume)
    assert (final / "model.safetensors").is_file(), f"eyas train wrote no {final}"
    return final


@pytest.fixture(scope="module")
def draft(eyas, plain_server, tmp_path_factory) -> Path:
    """An eyas draft checkpoint for SmolLM2-135M: $EYAS_TEST_DRAFT, or the cached recipe's."""
    given = os.environ.get("EYAS_TEST_DRAFT")
    if not given:
        return build_draft(eyas, plain_server.url, *recipe_dirs())
    path = Path(given)
    meta = json.loads((path / "config.json").read_text())
    if "eyas_draft" in meta:
        return path
    out = tmp_path_factory.mktemp("imported") / "draft"  # an eagle3/speculators folder: evaluate needs eyas's
    run_eyas(eyas, "import", str(path), "--out", str(out))
    return out


@pytest.fixture(scope="module")
def exports(eyas, draft, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("exports")
    out = {}
    for fmt in ("eagle3", "speculators"):
        out[fmt] = d / fmt
        run_eyas(eyas, "export", str(draft), "--format", fmt, "--out", str(out[fmt]),
                 "--speculative-tokens", str(K))
    return out


# -- the prompts and the plain engine -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """(JSONL of the first turns for eyas evaluate, their prompt ids through the chat template)."""
    from eyas.core.target import load_tokenizer
    from eyas.data.chat import ChatRenderer
    from eyas.speculate.evaluate import load_bench

    items = load_bench(BENCH, PROMPTS)
    path = tmp_path_factory.mktemp("bench") / f"{BENCH}_first_turns.jsonl"
    path.write_text("".join(json.dumps({"id": it.id, "category": it.category, "prompt": it.turns[0]}) + "\n"
                            for it in items))
    renderer = ChatRenderer(load_tokenizer("smollm2-135m"))
    return path, [renderer.prompt_ids([{"role": "user", "content": it.turns[0]}]) for it in items]


def complete_all(server, http_json, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy completions of token-id prompts (8 in flight) -> the generated token ids of each."""
    model = http_json(server.url + "/v1/models")["data"][0]["id"]

    def one(ids):
        body = {"model": model, "prompt": ids, "max_tokens": MAX_NEW, "temperature": 0, "return_token_ids": True}
        return http_json(server.url + "/v1/completions", body)["choices"][0]["token_ids"]

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, prompts))


@pytest.fixture(scope="module")
def plain_outputs(plain_server, http_json, bench) -> list[list[int]]:
    return complete_all(plain_server, http_json, bench[1])


# -- eyas's own measurement -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eyas_eval(eyas, draft, bench, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("eval")
    run_eyas(eyas, "evaluate", "--target", "smollm2-135m", "--draft", str(draft), "--bench", str(bench[0]),
             "--num-prompts", "0", "--chain", str(K), "--no-tree", "--no-adaptive", "--baselines", "none",
             "--no-hf-generate", "--dtype", "float32", "--max-new-tokens", str(MAX_NEW), "--out", str(out))
    results = json.loads((out / "results.json").read_text())
    (cfg,) = results["configs"]
    print(f"\n[integration] eyas evaluate chain {K}: tau {cfg['tau']:.3f} over {cfg['rounds']} rounds, "
          f"reach {[round(x, 3) for x in cfg['reach_by_position']]}, lossless {cfg['lossless']['identical']}")
    return cfg


# -- vLLM with the draft ----------------------------------------------------------------------------------------------
def spec_figures(before: dict, after: dict) -> dict:
    """Acceptance figures from two /metrics snapshots (counters summed over engines)."""
    def delta(name: str, **labels) -> float:
        keys = [k for k in after if k.split("{")[0] == name and all(f'{a}="{b}"' in k for a, b in labels.items())]
        return sum(after[k] - before.get(k, 0.0) for k in keys)

    drafts = delta("vllm:spec_decode_num_drafts_total")
    accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0, "vLLM reported no speculative drafts: the draft was not used"
    return {"drafts": drafts, "draft_tokens": delta("vllm:spec_decode_num_draft_tokens_total"),
            "accepted": accepted, "tau": 1 + accepted / drafts,
            "reach": [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) / drafts
                      for i in range(K)]}


@pytest.fixture(scope="module", params=["eagle3", "speculators"])
def served(request, exports, start_vllm, http_json, bench, tmp_path_factory) -> dict:
    """Serve one export format, decode the prompts, read the acceptance counters; the server is then stopped."""
    fmt, folder = request.param, exports[request.param]
    log = tmp_path_factory.mktemp(f"vllm-{fmt}") / "server.log"
    if fmt == "eagle3":
        spec = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": K}
        ctx = start_vllm(log, ["--speculative-config", json.dumps(spec)])
    else:  # `vllm serve DIR`: the verifier and the speculative settings come from the folder's config
        ctx = start_vllm(log, [], model=folder)
    with ctx as server:
        before = server.metrics()
        outputs = complete_all(server, http_json, bench[1])
        figures = spec_figures(before, server.metrics())
    print(f"\n[integration] vLLM {fmt}: tau {figures['tau']:.3f} over {figures['drafts']:.0f} drafts, "
          f"reach {[round(x, 3) for x in figures['reach']]}")
    return {"format": fmt, "outputs": outputs, **figures}


def test_served_outputs_equal_vllm_without_draft(served, plain_outputs):
    differ = [i for i, (a, b) in enumerate(zip(served["outputs"], plain_outputs)) if a != b]
    assert len(served["outputs"]) == len(plain_outputs) == PROMPTS
    assert not differ, f"{served['format']}: prompts {differ} decode differently with the draft"


def test_acceptance_length_agrees_with_eyas_evaluate(served, eyas_eval):
    ours, theirs = eyas_eval["tau"], served["tau"]
    gap = abs(theirs - ours) / ours
    print(f"\n[integration] {served['format']}: vLLM tau {theirs:.3f} / eyas tau {ours:.3f} = {theirs / ours:.3f} "
          f"({served['drafts']:.0f} vLLM drafts, {eyas_eval['rounds']} eyas rounds)")
    assert eyas_eval["lossless"]["identical"], eyas_eval["lossless"]
    assert ours > 1.2, f"eyas's tau {ours:.3f}: the draft barely works, the comparison would prove little"
    assert gap <= TOLERANCE, (f"{served['format']}: vLLM's acceptance length {theirs:.3f} vs eyas's tau {ours:.3f} "
                              f"({gap:.1%} apart); vLLM reach {served['reach']}, eyas reach "
                              f"{eyas_eval['reach_by_position']}")
