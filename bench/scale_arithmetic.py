"""The arithmetic of docs/scale.md: per-rank memory, store size and read bandwidth of a draft's training run for a
target too large for this machine, computed from eyas's own code where it can be (the draft's shape and parameter
count come from `DraftConfig.for_target` on the target's config, the draft built on the meta device) and from
stated formulas where it cannot (activations, throughput).

    python bench/scale_arithmetic.py                  # the seed's run (Kimi-K2, 4 GPUs) and a 70B Llama on 8 GPUs

Formulas (bytes; B = 1 packed row per micro-batch, T the packing length, k the TTT steps):
- parameters fp32 (all, the frozen embeddings included), gradients and two Adam moments fp32 (trainable ones);
  DDP keeps all of it on every rank. FSDP2 as eyas.train.parallelize applies it: a 1/W share of the trainable
  parameters, gradients and moments; the frozen embeddings whole on every rank (left out of sharding, so never
  gathered); and, under bf16, every trainable parameter gathered in bf16 from its first use in a micro-batch to
  its backward (the layers are called k times a micro-batch and kept, reshard_after_forward=False);
- the frozen output-head rows of the draft vocabulary [Vd, H] in bf16 on every rank;
- activations saved for backward per token and TTT step, bf16: the layer input [2H], q, k, v, the attention
  output, its projection, two norms and the residual (4H), the MLP's gate, up, activation and product (4I):
  (8H + 4I + 2 nh d + 2 nkv d) x 2;
- attention, before (a [nh, T, T] fp32 probability tensor kept per TTT step >= 1) and now (linear in T);
- the soft cross-entropy, before (logits [k T, Vd] bf16 kept for backward, the target's [T, Vd] fp32 table) and
  now (row chunks: flat in T and Vd);
- throughput at an assumed model-FLOPs utilisation: 6 x (matmul parameters) x k FLOPs per token plus attention.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import torch

from eyas.core.config import opt, parse
from eyas.core.weights import load_target_shell
from eyas.draft.model import DraftConfig, Eagle3Draft

# Public configs (the fields the draft's shape reads). Kimi-K2: 61 layers, hidden 7168, 163,840-token vocabulary.
KIMI_K2 = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168,
               intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64,
               num_key_value_heads=64, n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8,
               first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=512, q_lora_rank=1536,
               qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=163840,
               max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=50000.0, tie_word_embeddings=False,
               routed_scaling_factor=2.827, num_nextn_predict_layers=0)
LLAMA_70B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192, intermediate_size=28672,
                 num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                 vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                 tie_word_embeddings=False)

RUNS = {  # name: (target config, GPUs, tokens of the run, samples)
    "seed: Kimi-K2 on 4 GPUs": (KIMI_K2, 4, 87.8e6, 37312),
    "Llama-3.1-70B on 8 GPUs": (LLAMA_70B, 8, 87.8e6, 37312),
}
GiB = 2**30


def draft_of(config: dict, draft_vocab: int) -> tuple[DraftConfig, int, int, int]:
    """(draft config, target parameters, draft parameters, trainable draft parameters), from eyas's own code."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(config))
        shell = load_target_shell(d)
        target_params = sum(p.numel() for p in shell.model.parameters())
        dc = DraftConfig.for_target(shell, draft_vocab)
    with torch.device("meta"):
        draft = Eagle3Draft(dc)
    total = sum(p.numel() for p in draft.parameters())
    return dc, target_params, total, total - draft.embed_tokens.weight.numel()  # the embeddings stay frozen


def report(name: str, config: dict, gpus: int, tokens: float, samples: int, T: int, k: int, vd: int, mfu: float,
           peak_tflops: float) -> None:
    dc, n_target, n_draft, n_train = draft_of(config, vd)
    H, inter, nh, nkv, d = (dc.hidden_size, dc.intermediate_size, dc.num_attention_heads, dc.num_key_value_heads,
                            dc.head_dim)
    states = {"parameters fp32": 4 * n_draft, "gradients fp32": 4 * n_train, "Adam moments fp32": 8 * n_train}
    fixed = states["parameters fp32"] + states["gradients fp32"] + states["Adam moments fp32"]
    head_rows = vd * H * 2
    act = (8 * H + 4 * inter + 2 * nh * d + 2 * nkv * d) * 2 * T * k
    attn_before = nh * T * T * 4 * (k - 1)
    attn_now = (nh * d * 2 + nh * 4) * T * k  # out + lse per row, the chunk's scores are transient
    ce_before = k * T * vd * 2 + T * vd * 4
    store_per_token = 8 * H + 5  # aux [3H] + final [H] bf16, input_ids int32, loss_mask int8
    flops_per_token = 6 * (n_train) * k + 3 * 2 * T * nh * d * k  # matmuls fwd+bwd, causal attention
    per_gpu = mfu * peak_tflops * 1e12 / flops_per_token
    print(f"\n## {name}\n")
    print(f"target {n_target / 1e9:,.0f}B parameters ({n_target * 4 / 1e12:.2f} TB in fp32: what every rank loaded "
          f"before, {gpus * n_target * 4 / 1e12:.1f} TB on {gpus} ranks of a node); now read of it: embeddings and "
          f"head, {2 * config['vocab_size'] * H * 2 / GiB:.1f} GiB in bf16")
    print(f"draft: hidden {H}, {nh} heads x {d} ({nkv} kv), intermediate {inter}, draft vocabulary {vd:,}: "
          f"{n_draft / 1e9:.2f}B parameters, {n_train / 1e9:.2f}B trainable")
    frozen = 4 * (n_draft - n_train)
    sharded = {"parameters fp32": 4 * n_train / gpus + frozen, "gradients fp32": 4 * n_train / gpus,
               "Adam moments fp32": 8 * n_train / gpus}
    gathered = 2 * n_train  # bf16 copies of the trainable parameters, held through the micro-batch
    print("\n| per rank | DDP | FSDP2 |\n|---|---|---|")
    for what, b in states.items():
        print(f"| {what} | {b / GiB:.1f} GiB | {sharded[what] / GiB:.1f} GiB |")
    print(f"| of which frozen embeddings (never gathered) | {frozen / GiB:.1f} GiB | {frozen / GiB:.1f} GiB |")
    print(f"| trainable parameters gathered in bf16 | - | {gathered / GiB:.1f} GiB |")
    print(f"| output-head rows [Vd, H] bf16 | {head_rows / GiB:.2f} GiB | {head_rows / GiB:.2f} GiB |")
    print(f"| activations, T = {T:,}, k = {k} | {act / GiB:.1f} GiB | {act / GiB:.1f} GiB |")
    print(f"| attention: before (T^2) / now | {attn_before / GiB:,.0f} / {attn_now / GiB:.2f} GiB | same |")
    print(f"| cross-entropy: before / now | {ce_before / GiB:.1f} GiB / flat (row chunks) | same |")
    print(f"| total now | {(fixed + head_rows + act + attn_now) / GiB:.0f} GiB | "
          f"{(sum(sharded.values()) + gathered + head_rows + act + attn_now) / GiB:.0f} GiB |")
    store = store_per_token * tokens
    print(f"\nstore: {store_per_token:,} B/token x {tokens / 1e6:.1f}M tokens = {store / 2**40:.2f} TiB "
          f"({samples:,} samples)")
    print(f"throughput at {mfu:.0%} of {peak_tflops:.0f} TFLOP/s: {flops_per_token / 1e9:.1f} GFLOP/token -> "
          f"{per_gpu:,.0f} tokens/s per GPU; reads {per_gpu * store_per_token / 1e9:.2f} GB/s per GPU, "
          f"{gpus * per_gpu * store_per_token / 1e9:.2f} GB/s for {gpus}; an epoch in "
          f"{tokens / (gpus * per_gpu) / 60:.0f} min")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaleConfig:
    max_tokens: int = opt(8192, "packing length T (speculators packs to 8,192)")
    ttt_steps: int = opt(7, "training-time-test steps k")
    draft_vocab: int = opt(32000, "the draft's vocabulary")
    mfu: float = opt(0.4, "assumed model-FLOPs utilisation")
    peak_tflops: float = opt(989.0, "dense bf16 peak per GPU (H100 SXM: 989)")


def main() -> None:
    a = parse(ScaleConfig, description=__doc__)
    for name, (config, gpus, tokens, samples) in RUNS.items():
        report(name, config, gpus, tokens, samples, a.max_tokens, a.ttt_steps, a.draft_vocab, a.mfu, a.peak_tflops)


if __name__ == "__main__":
    main()
