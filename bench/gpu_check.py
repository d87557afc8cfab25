"""The prepared GPU check: eyas's hot paths on one CUDA device, in one run of a few minutes, with nothing fetched and
no checkpoint copied in. Targets are built from their configs with seeded random weights (speed does not depend on
the weights; tau is measured on the CPU, docs/evaluate.md).

  1. extraction on a target of SmolLM2-135M's shape: eyas's feature capture (hooks on three layers and the final
     norm, the features copied to the host) against a bare forward of the same batches;
  2. training a draft for that target on the extracted features (the trainer's TTT objective, --compile auto);
  3. speculative decoding on the device with that draft: token for token the greedy output (fp32, so that no
     near-tie of bf16 rounding can part them);
  4. training a draft for a target shaped like an 8B model's layer (hidden 4,096, 32 heads, 8 kv heads, vocabulary
     128,256, draft vocabulary 32,000, 2 layers) at T = 8,192 packed.

For each it prints tokens/s, MFU against the device's dense bf16 peak (the model FLOPs of the work done, masked rows
included), peak device memory and the host synchronisations of one optimizer step (torch.cuda.set_sync_debug_mode).

    python bench/gpu_check.py                          # on a CUDA GPU: a few minutes
    python bench/gpu_check.py --device cpu --tiny      # toy sizes on a CPU (CI: tests/test_gpu_check.py)
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eyas.core.config import check, opt, parse  # noqa: E402

NEEDS = {"torch": (2, 6), "transformers": (4, 56)}  # flex_attention with GQA and block masks; the Llama we build
PEAK_BF16_TFLOPS = {"H100 SXM": 989.0, "H100 80GB HBM3": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0,
                    "H200": 989.0, "GH200": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "B200": 2250.0}
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0,
               max_position_embeddings=8192, tie_word_embeddings=True)
TINY_TARGET = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                   max_position_embeddings=1024, tie_word_embeddings=True)
LLAMA_8B_LAYER = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, vocab_size=128256)
TINY_8B_LAYER = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, vocab_size=1024)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuCheckConfig:
    device: str = opt("cuda", "the device: cuda (one GPU) or cpu (the same code, to keep it working)")
    tiny: bool = opt(False, "toy sizes (CI on a CPU); the figures then say nothing about speed")
    ttt_steps: int = opt(7, "TTT steps of both trainings")
    steps: int = opt(5, "timed optimizer steps of each training (after the warm-up steps that compile)")
    compile: str = opt("auto", "torch.compile of the TTT step: auto (on with CUDA), on, off",
                       choices=("auto", "on", "off"))

    def __post_init__(self):
        check(self.device in ("cuda", "cpu"), f"--device {self.device}: cuda or cpu", "use --device cuda or cpu")
        check(self.device == "cpu" or torch.cuda.is_available(), "--device cuda: no CUDA device is visible here",
              "run on a machine with a GPU, or --device cpu --tiny to check the script")


def versions(cfg: GpuCheckConfig) -> list[str]:
    """What this machine has, checked against NEEDS (the script stops if too old)."""
    import transformers

    lines = []
    for name, mod in (("torch", torch), ("transformers", transformers)):
        have = tuple(int(x) for x in mod.__version__.split("+")[0].split(".")[:2])
        check(have >= NEEDS[name], f"{name} {mod.__version__} is older than {'.'.join(map(str, NEEDS[name]))}",
              f"pip install '{name}>={'.'.join(map(str, NEEDS[name]))}'")
        lines.append(f"{name} {mod.__version__}")
    if cfg.device == "cuda":
        with contextlib.suppress(ImportError):
            import triton

            lines.append(f"triton {triton.__version__}")
        lines.append(f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
    return lines


def peak_flops(device: str) -> float | None:
    """The device's dense bf16 peak in FLOP/s, from its name; None when unknown (no MFU printed)."""
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    for key, tflops in sorted(PEAK_BF16_TFLOPS.items(), key=lambda kv: -len(kv[0])):
        if all(part in name for part in key.split()):
            return tflops * 1e12
    return None


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def counting_syncs(device: str):
    """Count the host synchronisations inside the block (CUDA's sync debug mode warns at each); [count] or [None]."""
    box = [None]
    if device != "cuda":
        yield box
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield box
        finally:
            torch.cuda.set_sync_debug_mode("default")
    box[0] = sum("synchroniz" in str(w.message) for w in caught)


def build_target(shape: dict, device: str, dtype: torch.dtype):
    """A Llama target with seeded random weights, as eyas's Target (no tokenizer: ids are random)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyas.core.target import Target

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(device, dtype).eval()
    return Target(name="random-" + ("tiny" if shape is TINY_TARGET else "smollm2-shape"), model=model,
                  tokenizer=None, source="(built from its config)")


def extraction(target, layer_ids, batches: list[torch.Tensor], device: str):
    """Bare forwards, then eyas's capture (features to the host) over the same batches -> (features, line)."""
    from eyas.models.capture import Capture, forward_batch

    tokens = sum(b.numel() for b in batches)
    with torch.inference_mode():
        target.model.model(input_ids=batches[0].to(device), use_cache=False)  # warm-up
        sync(device)
        t0 = time.perf_counter()
        for b in batches:
            target.model.model(input_ids=b.to(device), use_cache=False)
        sync(device)
        bare = tokens / (time.perf_counter() - t0)
    feats = []
    with Capture(target, layer_ids) as cap:
        t0 = time.perf_counter()
        for b in batches:
            feats.append(forward_batch(target, cap, list(b)))  # on a GPU: copies in flight, overlapping the next
        feats = [f.wait() if hasattr(f, "wait") else f for f in feats]  # every feature on the host
        captured = tokens / (time.perf_counter() - t0)
    return feats, (f"extraction: {captured:,.0f} tokens/s with capture and host copies, bare forward "
                   f"{bare:,.0f} tokens/s: {captured / bare:.2f} of it")


def train(draft, head_rows, batches, cfg: GpuCheckConfig, flops_per_token: float, name: str) -> list[str]:
    """The trainer's TTT objective (eyas.train.objective) over `batches` of (ids, aux, final, mask, pos, docs): warm-up
    steps (compilation), then cfg.steps timed ones -> the report lines."""
    from eyas.draft.ttt import step_weights
    from eyas.train.batches import valid_masks
    from eyas.train.objective import TTTObjective, autocast, choose_path, resolve_dtype, targets

    dev = cfg.device
    path, compiled, how = choose_path(dev, cfg.compile)
    objective = TTTObjective(draft, cfg.ttt_steps, path, compiled)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=dev == "cuda")
    scale = (step_weights(cfg.ttt_steps, 0.8) / 1000).to(dev)
    dtype = resolve_dtype("auto", dev)[0]  # bf16 where the device has bf16 matmuls, as the trainer decides

    def step(batch):
        ids, aux, final, mask, pos, docs = batch
        with autocast(dev, dtype):
            with torch.no_grad():
                valid = valid_masks(ids, mask, docs, draft.t2d, cfg.ttt_steps) if path == "gathered" else None
                target, index = targets(path, final, head_rows, valid)
            loss_sum, _, _ = objective(ids, aux, target, index, mask, pos, docs, scale)
            loss = (loss_sum.float() * scale).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for b in batches[:2]:
        step(b)
    sync(dev)
    warm = time.perf_counter() - t0
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with counting_syncs(dev) as syncs:
        step(batches[0])
    times = []
    for i in range(cfg.steps):
        b = batches[i % len(batches)]
        sync(dev)
        t0 = time.perf_counter()
        step(b)
        sync(dev)
        times.append(time.perf_counter() - t0)
    per_step = statistics.median(times)
    tokens = batches[0][0].numel()
    rate = tokens / per_step
    peak = peak_flops(dev)
    mfu = f"MFU {rate * flops_per_token / peak:.1%}" if peak else "MFU n/a (device peak unknown)"
    memory = (f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if dev == "cuda"
              else "peak memory n/a on a CPU")
    syncs_line = (f"{syncs[0]} host syncs in one optimizer step" if syncs[0] is not None
                  else "host syncs not counted on a CPU")
    return [f"{name}: {how}, {tokens:,} tokens per step, warm-up {warm:.1f} s",
            f"{name}: {rate:,.0f} tokens/s, {mfu}, {memory}, {syncs_line}"]


def train_flops_per_token(dc, k: int, mean_context: float) -> float:
    """Model FLOPs of one trained token: k TTT steps of the layers (forward 2, backward 4 per weight), the output
    head per step (logits, dh, dW: 6 Vd H), the target head once (2 Vd H), fc once (6 x 3Ht H), attention (12 per
    query-key pair and head dimension, over the mean context)."""
    H, Vd = dc.hidden_size, dc.draft_vocab_size
    q, kv = dc.num_attention_heads * dc.head_dim, dc.num_key_value_heads * dc.head_dim
    layer = lambda inp: inp * (q + 2 * kv) + q * H + 3 * H * dc.intermediate_size  # noqa: E731
    layers = layer(2 * H) + (dc.num_layers - 1) * layer(H)
    attention = 12 * dc.num_layers * q * mean_context
    return k * (6 * layers + 6 * Vd * H + attention) + 2 * Vd * H + 6 * 3 * dc.target_hidden_size * H


def draft_for(shape: dict, vocab: int, draft_vocab: int, layers: int, device: str, feature_layers=(2, 15, 27)):
    """An Eagle3Draft of the shape, its embeddings and output head random (seeded), its draft vocabulary the most
    frequent ids of a seeded count; and the target's head rows."""
    from eyas.draft.model import DraftConfig, Eagle3Draft
    from eyas.draft.vocab import build_draft_vocab

    H = shape["hidden_size"]
    g = torch.Generator().manual_seed(0)
    dc = DraftConfig(hidden_size=H, intermediate_size=shape["intermediate_size"],
                     num_attention_heads=shape["num_attention_heads"],
                     num_key_value_heads=shape["num_key_value_heads"],
                     head_dim=shape.get("head_dim") or H // shape["num_attention_heads"], vocab_size=vocab,
                     draft_vocab_size=draft_vocab, target_hidden_size=H, feature_layers=tuple(feature_layers),
                     num_layers=layers)
    draft = Eagle3Draft(dc)
    embed, head = torch.randn(vocab, H, generator=g) * 0.02, torch.randn(vocab, H, generator=g) * 0.02
    voc = build_draft_vocab(torch.randint(0, 1000, (vocab,), generator=g).numpy(), draft_vocab)
    draft.init_weights(embed, head, voc.d2t)
    draft = draft.to(device)
    return draft, head[draft.target_ids().cpu()].to(device), dc


def packed(B: int, T: int, doc: int, vocab: int, device: str, feats=None, H: int = 0):
    """A packed micro-batch: ids, features (given, or random [B,T,3H] and [B,T,H]), 80% loss mask, documents."""
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    if feats is None:
        aux, final = torch.randn(B, T, 3 * H, generator=g), torch.randn(B, T, H, generator=g)
    else:
        aux, final = torch.cat(feats[:3], -1).float(), feats[3].float()
    mask = (torch.rand(B, T, generator=g) < 0.8).long()
    pos, docs = (torch.arange(T) % doc).expand(B, T), (torch.arange(T) // doc).expand(B, T)
    feat = torch.bfloat16 if device == "cuda" else torch.float32
    return tuple(t.to(device) for t in (ids, aux.to(feat), final.to(feat), mask, pos.contiguous(), docs.contiguous()))


def decoding(target, draft, layer_ids, device: str, new: int) -> str:
    """Speculative decoding with the draft on the device, in fp32, against greedy: equal token for token."""
    import copy

    from eyas.speculate.decode import plain_generate, speculative_generate
    from eyas.speculate.drafters import Eagle3Drafter
    from eyas.speculate.target_forward import LeanRunner

    t32 = dataclasses.replace(target, model=copy.deepcopy(target.model).float())
    runner = LeanRunner(t32, layer_ids)
    drafter = Eagle3Drafter(copy.deepcopy(draft).float().eval(), k=5)
    g = torch.Generator().manual_seed(1)
    same, total, accepted, rounds = 0, 0, 0, 0
    for _ in range(3):
        prompt = torch.randint(0, target.vocab_size, (32,), generator=g).tolist()
        ref = plain_generate(runner, prompt, new).tokens
        got = speculative_generate(runner, drafter, prompt, new)
        same += int(got.tokens == ref)
        total += 1
        accepted += sum(r.accepted for r in got.rounds)
        rounds += len(got.rounds)
    verdict = "yes" if same == total else f"NO ({total - same} of {total} prompts differ)"
    return (f"speculative decoding = greedy, token for token: {verdict} ({total} prompts x {new} tokens, "
            f"{accepted / max(rounds, 1):.2f} draft tokens accepted per round; random weights)")


def main(argv=None) -> int:
    cfg = parse(GpuCheckConfig, argv, description=__doc__.splitlines()[0])
    dev, t_start = cfg.device, time.perf_counter()
    print("gpu_check: " + ", ".join(versions(cfg)))
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 decoding stays fp32
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shape = TINY_TARGET if cfg.tiny else SMOLLM2
    target = build_target(shape, dev, dtype)
    layer_ids = target.default_feature_layers()
    B, T, n = (2, 128, 3) if cfg.tiny else (8, 2048, 12)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, target.vocab_size, (B, T), generator=g) for _ in range(n)]
    print(f"[1] target {target.name}: {target.num_layers} layers, hidden {target.hidden_size}, "
          f"{sum(p.numel() for p in target.model.parameters()) / 1e6:.0f}M parameters, {str(dtype)[6:]}, "
          f"batches of {B} x {T}")
    feats, line = extraction(target, layer_ids, batches, dev)
    print("[1] " + line)

    draft, head_rows, dc = draft_for(shape, target.vocab_size, min(32000, target.vocab_size // 2), 1, dev, layer_ids)
    train_batches = [packed(B, T, T // 4, target.vocab_size, dev, f) for f in feats]
    train_batches = [(batches[i].to(dev), *b[1:]) for i, b in enumerate(train_batches)]
    for line in train(draft, head_rows, train_batches, cfg, train_flops_per_token(dc, cfg.ttt_steps, T / 8),
                      "[2] train (SmolLM2 shape)"):
        print(line)
    print("[3] " + decoding(target, draft, layer_ids, dev, 16 if cfg.tiny else 64))
    del target, feats, train_batches, draft
    if dev == "cuda":
        torch.cuda.empty_cache()

    big = TINY_8B_LAYER if cfg.tiny else LLAMA_8B_LAYER
    T8, doc = (256, 64) if cfg.tiny else (8192, 1024)
    draft, head_rows, dc = draft_for(big, big["vocab_size"], min(32000, big["vocab_size"] // 2), 2, dev)
    print(f"[4] draft for an 8B-shaped target: hidden {dc.hidden_size}, {dc.num_attention_heads} heads, "
          f"{dc.num_key_value_heads} kv heads, vocabulary {dc.vocab_size:,} -> {dc.draft_vocab_size:,}, "
          f"{dc.num_layers} layers, T = {T8:,} packed in documents of {doc:,}")
    train_batches = [packed(1, T8, doc, dc.vocab_size, dev, H=dc.hidden_size) for _ in range(2)]
    for line in train(draft, head_rows, train_batches, cfg, train_flops_per_token(dc, cfg.ttt_steps, doc / 2),
                      "[4] train (8B shape)"):
        print(line)
    print(f"gpu_check: done in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
