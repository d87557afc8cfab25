"""A stand-in for a vLLM server running `extract_hidden_states` with its hidden-states connector, for the unit
suite (the real one is tests/integration/test_vllm_extract.py). It serves what eyas uses of vLLM's API and writes
files the way vLLM 0.32's connector does (eyas.store.vllm_states):

- GET /health, GET /v1/models;
- POST /v1/completions with `prompt` a list of token ids: the answer echoes them (`prompt_token_ids`) and names
  `kv_transfer_params.hidden_states_path` = SHARED/<request id>.safetensors, whose `FILE.lock` is held with an
  exclusive flock from before the answer until the file is written, a moment after it (as vLLM writes one engine
  step later, on a thread);
- the file: `hidden_states` [T, layers, H] (id i < L: HF hidden_states[i]; id L: the last layer's output before
  the final norm) and `token_ids` [T] int64.

    python tests/fake_vllm.py --model DIR --port P --speculative-config JSON --kv-transfer-config JSON [--dtype D]

Without --speculative-config it is a plain server for `eyas regenerate --engine vllm`: POST /v1/completions with
token ids generates greedily (transformers' generate, one request at a time) up to `max_tokens` or a
`stop_token_ids` token, and answers the new ids (`choices[0].token_ids`, the stop token included, as vLLM does),
`finish_reason` and `usage.completion_tokens`. FAKE_VLLM_REQUESTS=FILE appends every
request's body to FILE, one JSON line each.

FAKE_VLLM_DIE_AFTER=N makes it exit (code 3) when its N+1-th request arrives, as an engine crashing mid-run;
FAKE_VLLM_FAIL_LOAD=1 makes it fail at start, as vLLM does on a model it cannot load.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

LOCK = threading.Lock()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--speculative-config", default="")
    ap.add_argument("--kv-transfer-config", default="")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--served-model-name", default="")
    ap.add_argument("--max-model-len", type=int, default=2048)
    a, _ = ap.parse_known_args()
    generating = not a.speculative_config
    if not generating:
        spec, transfer = json.loads(a.speculative_config), json.loads(a.kv_transfer_config)
        assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
        ids = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
        shared = Path(transfer["kv_connector_extra_config"]["shared_storage_path"])
    torch.set_num_threads(1)
    if os.environ.get("FAKE_VLLM_FAIL_LOAD"):
        raise ValueError(f"fake vllm cannot load this model: {a.model}")
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype)).eval()
    print(f"fake vllm: serving {a.model}" + ("" if generating else f" with layer ids {ids} into {shared}"),
          flush=True)
    print("fake vllm: threads " + " ".join(f"{k}={os.environ.get(k)}"  # what eyas chose for vLLM's threads
                                           for k in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")), flush=True)
    record = os.environ.get("FAKE_VLLM_REQUESTS")
    delay = float(os.environ.get("FAKE_VLLM_DELAY_S", "0"))  # seconds per completion: a run a test can interrupt

    def generate(body: dict) -> dict:
        time.sleep(delay)
        stops = set(body.get("stop_token_ids") or [])
        with torch.inference_mode(), LOCK:
            out = model.generate(torch.tensor([body["prompt"]]), max_new_tokens=body["max_tokens"],
                                 do_sample=False, eos_token_id=sorted(stops) or None, pad_token_id=0)
        new = out[0, len(body["prompt"]):].tolist()
        end = next((k for k, t in enumerate(new) if t in stops), None)
        new = new if end is None else new[:end + 1]
        return {"id": "cmpl-gen", "choices": [{"text": "", "token_ids": new,
                                               "finish_reason": "length" if end is None else "stop"}],
                "usage": {"completion_tokens": len(new)}}
    die_after = int(os.environ.get("FAKE_VLLM_DIE_AFTER", "-1"))
    state = {"requests": 0}

    def states(tokens: list[int]) -> torch.Tensor:
        layers, kept = model.model.layers, {}

        def keep(module, args, output):
            kept["last"] = output[0] if isinstance(output, tuple) else output

        with torch.inference_mode(), LOCK:  # one forward at a time, with its own hook
            hook = layers[-1].register_forward_hook(keep)
            out = model.model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
            hook.remove()
        hs = [kept["last"][0] if i == len(layers) else out.hidden_states[i][0] for i in ids]
        return torch.stack(hs, dim=1).contiguous()  # [T, layers, H]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                return self._send(200, {})
            if self.path == "/v1/models":
                return self._send(200, {"data": [{"id": a.served_model_name or a.model,
                                                  "max_model_len": a.max_model_len}]})
            self._send(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with LOCK:
                state["requests"] += 1
                n = state["requests"]
            if 0 <= die_after < n:
                print("fake vllm: dying as asked", flush=True)
                os._exit(3)
            if record:
                with LOCK, open(record, "a") as f:
                    f.write(json.dumps(body) + "\n")
            if generating:
                return self._send(200, generate(body))
            tokens = body["prompt"]
            if not (isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)):
                return self._send(400, {"error": "prompt must be token ids here"})
            path = shared / f"cmpl-{n:06d}-0.safetensors"
            shared.mkdir(parents=True, exist_ok=True)
            fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            hs = states(tokens)

            def write():  # one engine step later, on a thread: the client must wait on the lock
                time.sleep(0.05)
                save_file({"hidden_states": hs, "token_ids": torch.tensor(tokens)}, str(path))
                os.close(fd)

            threading.Thread(target=write).start()
            self._send(200, {"id": f"cmpl-{n}", "choices": [{"text": "x", "prompt_token_ids": tokens}],
                             "kv_transfer_params": {"hidden_states_path": str(path)}})

    ThreadingHTTPServer(("127.0.0.1", a.port), Handler).serve_forever()


if __name__ == "__main__":
    sys.exit(main())
