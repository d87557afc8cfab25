"""One method of bench/vllm_judge.py, run in vLLM's own environment (it imports vLLM and the standard library only).

    VLLM_PYTHON bench/vllm_worker.py JOB.json OUT.json

JOB: {"target", "dtype", "max_model_len", "max_new_tokens", "stop", "spec" (vLLM's speculative_config, or null for
plain decoding), "prompts" (token id lists), "warmup" (a prompt of none of the bench's)}. One request at a time,
temperature 0, after one warm-up request on the warm-up prompt (its reply stays in vLLM's suffix cache: on a
prompt of the bench, `suffix` would draft that prompt's reply from it, as it did until 2026-12-06). For
each prompt: its tokens, the seconds of the whole request and of a one-token request on the same prompt (its
prefill and first token, so that decoding alone can be timed as `eyas evaluate` times it). OUT also holds vLLM's
speculative-decoding counters over the timed requests (drafts, draft tokens, accepted tokens, accepted per
position).
"""

import json
import sys
import time

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[m.name] = out.get(m.name, 0) + m.value
        elif m.name == PER_POS:
            old = out.get(m.name, [0] * len(m.values))
            out[m.name] = [a + b for a, b in zip(old, m.values)]
    return out


def main() -> None:
    job = json.load(open(sys.argv[1]))
    llm = LLM(model=job["target"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0,
              speculative_config=job["spec"], disable_log_stats=False, enable_prefix_caching=False)
    full = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], stop_token_ids=job["stop"])
    first = SamplingParams(temperature=0.0, max_tokens=1, stop_token_ids=job["stop"])

    def run(prompt, params):
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids), time.perf_counter() - t0

    run(job["warmup"], full)  # warm-up: compilation, caches
    before = counters(llm)
    rows = []
    for prompt in job["prompts"]:
        tokens, seconds = run(prompt, full)
        _, first_s = run(prompt, first)
        rows.append({"tokens": tokens, "seconds": seconds, "first_s": first_s})
    after = counters(llm)
    spec = {k: (after[k] - before.get(k, 0) if k in COUNTERS else
                [a - b for a, b in zip(after[k], before.get(k, [0] * len(after[k])))]) for k in after}
    json.dump({"rows": rows, "spec": spec}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
