"""Is the speculative output the target's own greedy output? The checks behind `eyas evaluate`'s lossless column.

At temperature 0 a speculative decoder must emit, at every position, the target's top-1 token. In fp32 that is a
token-for-token comparison with plain greedy decoding. In bf16 it is not: verifying k+1 tokens in one forward and
decoding one at a time run different kernels, which round differently, so at a near-tie the two may pick different
tokens, each the target's greedy choice up to rounding. So an output that differs from plain greedy is checked
in three steps, each settling what the one before could not:

1. margins: the target's top-2 gap where the method first left plain greedy (a gap near 0 is a numerical tie);
2. rescore: the whole output re-scored by the target in fp32, in one forward pass without a cache: every emitted
   token must be the fp32 top-1 up to the rounding of the run's dtype (tie_tolerance);
3. replay, for a token further below the fp32 top-1 than that: the turn's own forwards are run again, the prompt
   then round by round the same tokens in the same shapes, the same cache entries kept:
   - in fp32, its logits must equal the cache-free fp32 forward's (so the cache, positions and rollback the run
     used are right: a fault there shows as a gap of whole units, not of rounding);
   - in the run's dtype, every emitted token must be the argmax of the replayed logits (so the decoder emitted
     exactly what the target computed in that verify shape);
   - and those logits may stand no further from the fp32 ones than DTYPE_SPREAD times as far as plain one-token
     decoding of the same tokens in the same dtype stands (so what moved the token is that dtype's rounding, not
     a fault of the verify path that only shows in bf16, such as a mask value that overflows).
   All hold: the token is the bf16 target's own choice, and its distance from the fp32 top-1 is rounding (kept
   as a tie, marked `replayed`). Any fails: a real mismatch, the loud NO.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch

from eyas.speculate.target_forward import LeanRunner, make_runner

FP32_TIE = 1e-3  # relative: fp32 logits closer than this are a tie, either token the target's greedy choice
ULPS = 4  # a bf16 (fp16) run's tolerance: logits within this many units in the last place of its dtype
MANTISSA = {torch.bfloat16: 7, torch.float16: 10}  # explicit mantissa bits
DTYPE_SPREAD = 4.0  # how much further from fp32 the verify shapes' logits may be than one-token decoding's
ONE_TOKEN = {"size": 0, "depth": 0, "accepted": 0}  # a round that drafts nothing: plain decoding's shape
FILLER = 0  # the token replayed in place of a rejected draft token (causal attention keeps it from the kept rows)


def tie_tolerance(dtype: torch.dtype, top: float) -> float:
    """How far below the fp32 top-1 logit a token may be and still be the greedy choice of a run in `dtype`:
    ULPS units in the last place of `top` in that dtype (in bf16 at a logit of 15, 4 x 2**-4 = 0.25), or
    FP32_TIE relative in fp32."""
    scale = max(1.0, abs(top))
    if dtype not in MANTISSA:
        return FP32_TIE * scale
    return ULPS * 2.0 ** (math.floor(math.log2(scale)) - MANTISSA[dtype])


@torch.inference_mode()
def margins(runner, methods, records) -> None:
    """At each method's first divergence from plain greedy, the target's top-2 logit gap after the common prefix
    (recomputed in one forward): a gap near 0 is a numerical tie, where any change of kernel may flip the argmax."""
    for m in methods:
        bad = next((r for r in records if r["method"] == m.name and r.get("divergence") is not None), None)
        if bad is None or bad["divergence"] >= len(bad["reference"]):
            continue
        runner.reset()
        ids = bad["prompt"] + bad["reference"][: bad["divergence"]]
        logits, _ = runner.prefill(torch.tensor(ids, device=runner.device))
        top = logits[-1].float().topk(2).values
        bad["margin"] = float(top[0] - top[1])


@torch.inference_mode()
def rescore(target, records, runner=None) -> None:
    """Steps 2 and 3 of the module docstring for every output that differs from plain greedy decoding. `runner`
    is the run's own (its dtype and kernels); without one, nothing is replayed.
    Sets record["rescore"] = {"ties": [...], "mismatch": ...}; a tie settled by the replay has "replayed": True.
    Memory: the fp32 copy of the target (on the CPU when the GPU has no room for it), the fp32 logits of the
    output's rows only, and, for the replay, the runner's own copies of its weights in fp32 (a replay that fails,
    out of memory say, is reported, not raised)."""
    bad = [r for r in records if r.get("divergence") is not None]
    if not bad:
        return
    replays = runner is not None and target.dtype != torch.float32
    # a replay's lean runner adds its fused copies of the weights (eyas.speculate.target_forward: about 60% of them)
    fused = 0.6 if replays and isinstance(runner, LeanRunner) else 0.0
    model = target.model if target.dtype == torch.float32 else fp32_copy(target.model, fused)
    runner32 = None
    try:
        for r in bad:
            chose = _fp32_rows(model, r)
            ties, beyond = _off_top(chose, r, target.dtype)
            if beyond and replays:
                try:
                    if runner32 is None:
                        lean = isinstance(runner, LeanRunner)  # the run's kind, and its products' calls
                        runner32 = make_runner(dataclasses.replace(target, model=model), runner.feature_layers,
                                               "lean" if lean else "hf",
                                               linear=runner.projections.plan if lean else "auto")
                        runner32.widths = dict(runner.widths)  # and the run's forward shapes
                    r["replay"] = confirm_by_replay(runner32, runner, r, chose)
                except (RuntimeError, MemoryError) as e:  # the decoding's results stand; the check says it could not
                    r["replay"] = {"confirmed": False, "why": f"the replay failed ({type(e).__name__}: "
                                   f"{str(e)[:200]}); rerun evaluate with --dtype float32 to compare exactly"}
                if r["replay"]["confirmed"]:
                    ties = sorted(ties + [{**e, "replayed": True} for e in beyond], key=lambda e: e["index"])
                    beyond = []
            r["rescore"] = {"ties": ties, "mismatch": beyond[0] if beyond else None}
    finally:
        if close := getattr(runner32, "close", None):  # the HF runner's forward hooks on the fp32 copy
            close()


def fp32_copy(model: torch.nn.Module, more: float = 0.0) -> torch.nn.Module:
    """`model` in float32, made tensor by tensor (never a second copy in the run's dtype first, and tied weights
    stay tied), on the model's device where it fits with `more` of its size beside it (a replay runner's fused
    weights), else on the CPU (`fp32_device`)."""
    tensors = [*model.parameters(), *model.buffers()]
    need = sum(t.numel() for t in tensors if t.is_floating_point()) * 4
    dev = fp32_device(tensors[0].device, int(need * (1 + more)))

    def fp32(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(dev, torch.float32 if t.is_floating_point() else t.dtype, copy=True)

    memo = {id(p): torch.nn.Parameter(fp32(p), requires_grad=False) for p in model.parameters()}
    memo |= {id(b): fp32(b) for b in model.buffers()}
    twin = copy.deepcopy(model, memo)
    for m in twin.modules():  # a runner's feature hooks on the model (HFRunner) would write into that runner
        m._forward_hooks.clear()
    return twin


def fp32_device(device: torch.device, need: int) -> torch.device:
    """Where the fp32 copy (`need` bytes) goes: the model's own device, unless that is a GPU whose free memory
    holds it with less than a quarter to spare for the rescore's activations (an 8B target in bf16 needs 32 GB
    more): then the CPU, slower but sure."""
    if device.type == "cuda" and torch.cuda.mem_get_info(device)[0] < 1.25 * need:
        return torch.device("cpu")
    return device


def _fp32_rows(model, record: dict) -> torch.Tensor:
    """[T, V] fp32: the cache-free logits whose row j chose tokens[j] (only those rows: a long prompt's are never
    held)."""
    t = len(record["tokens"])
    ids = torch.tensor([record["prompt"] + record["tokens"]], device=next(model.parameters()).device)
    return model(ids, logits_to_keep=t + 1).logits[0, :t].float()


def _off_top(chose: torch.Tensor, record: dict, dtype: torch.dtype) -> tuple[list[dict], list[dict]]:
    """The tokens from the divergence on that are not the fp32 top-1: (within the dtype's rounding, beyond it)."""
    ties, beyond = [], []
    for j in range(record["divergence"], len(record["tokens"])):
        row, tok = chose[j], record["tokens"][j]
        top = int(row.argmax())
        if tok == top:
            continue
        entry = {"index": j, "token": tok, "top1": top, "fp32_gap": float(row[top] - row[tok])}
        (ties if entry["fp32_gap"] <= tie_tolerance(dtype, float(row[top])) else beyond).append(entry)
    return ties, beyond


def confirm_by_replay(runner32, runner, record: dict, fp32_rows: torch.Tensor) -> dict:
    """Step 3 of the module docstring for one turn. fp32_rows [T, V]: the cache-free fp32 logits that chose each
    emitted token. -> {"confirmed", "fp32_cache_error" (max |replayed - cache-free| over the rows, relative to
    the row's largest logit; at most "tolerance"), "reproduced" (every token the argmax of the run dtype's
    replayed logits), "first_not_reproduced", "dtype_error" and "plain_dtype_error" (the same distance for the
    run dtype's replay and for one-token decoding of the same tokens in that dtype; at most "spread" apart)}.
    Never confirmed when a round verified a tree (its shape is not in the round's figures)."""
    tokens = record["tokens"]
    rows32 = replay(runner32, record["prompt"], tokens, record["rounds"])
    rows = replay(runner, record["prompt"], tokens, record["rounds"])
    if rows32 is None or rows is None:
        return {"confirmed": False, "why": "a round verified a tree, which its figures cannot replay; evaluate "
                                           "with --dtype float32 to compare exactly"}
    if rows.shape[0] != len(tokens):
        return {"confirmed": False, "why": f"the rounds cover {rows.shape[0]} of the {len(tokens)} tokens (a "
                                           "record from another eyas version?); rerun evaluate to record them"}
    plain = replay(runner, record["prompt"], tokens, [ONE_TOKEN] * len(tokens))
    scale = fp32_rows.abs().amax(-1).clamp_min(1.0)  # [T]

    def distance(x: torch.Tensor, skip: int = 0) -> float:  # the largest |x - fp32| over rows, relative to scale
        return max([0.0] + ((x.to(fp32_rows.device) - fp32_rows).abs().amax(-1) / scale)[skip:].tolist())

    # row 0 comes from the prompt's forward, which plain decoding runs too: the rows after it tell the two apart
    error, dtype_error, plain_error = distance(rows32), distance(rows, 1), distance(plain, 1)
    got = rows.argmax(-1).tolist()
    off = next((j for j, (a, b) in enumerate(zip(got, tokens)) if a != b), None)
    rounding = dtype_error <= DTYPE_SPREAD * plain_error
    return {"confirmed": error <= FP32_TIE and off is None and rounding, "fp32_cache_error": error,
            "tolerance": FP32_TIE, "reproduced": off is None, "first_not_reproduced": off,
            "dtype_error": dtype_error, "plain_dtype_error": plain_error, "spread": DTYPE_SPREAD}


@torch.inference_mode()
def replay(runner, prompt: list[int], tokens: list[int], rounds: list[dict]) -> torch.Tensor | None:
    """The logits that chose each emitted token, recomputed with the run's own forwards: the prompt, then each
    round's last token and `size` proposed ones (the accepted drafts, FILLER for the rejected), its accepted rows
    and bonus committed, as eyas.speculate.decode._round does. -> [len(tokens), V] float32, row j the logits that
    chose tokens[j]; None when a round verified a tree (size != depth)."""
    dev = runner.device
    runner.reset()
    logits, _ = runner.prefill(torch.tensor(prompt, device=dev))
    rows = [logits[-1:].float()]
    pos = 1  # tokens[:pos] are emitted; tokens[pos - 1] is the next round's root
    for rd in rounds:
        if rd["size"] != rd["depth"]:
            return None
        if pos >= len(tokens):  # the output was cut at a stop token or --max-new-tokens
            break
        a = rd["accepted"]
        kept = tokens[pos: pos + a]
        ids = [tokens[pos - 1]] + kept + [FILLER] * (rd["size"] - len(kept))
        logits, _ = runner.forward(torch.tensor(ids, device=dev))
        rows.append(logits[: a + 1].float())
        runner.commit(list(range(a + 1)))
        pos += a + 1
    return torch.cat(rows)[: len(tokens)]
