"""Which floating-point type a device computes fast: what `--dtype auto` means in every stage, and the warning when
bfloat16 is asked of a CPU that only emulates it.

bfloat16 halves memory traffic, and is the faster type wherever the hardware multiplies it: CUDA GPUs from Ampere
on, and CPUs with AVX512-BF16 or AMX (torch's oneDNN says which). A CPU with AVX2 alone (an AMD EPYC whose AVX-512
is not exposed, say) converts every bf16 operand to fp32 and back in software: measured 2026-12-03 on such an
EPYC (2 cores), eyas's decoder made 25.4 bf16 tokens/s against 66.3 in fp32 (2.6x), vLLM's CPU build 64-77
against 255-300 (about 4x). So `auto` is bfloat16 where the device has it and float32 elsewhere.
"""

from __future__ import annotations

import torch

FULL = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16",
        "bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}
SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def native_bf16(device: str) -> bool:
    """Does `device` multiply bfloat16 in hardware?"""
    if str(device).startswith("cuda"):  # Ampere (compute capability 8) on; older GPUs emulate it (and
        # torch.cuda.is_bf16_supported says yes to emulation). The capability is read without making a tensor
        return torch.cuda.get_device_capability(torch.device(device))[0] >= 8
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def cpu_capability() -> str:
    """torch's name for the CPU's widest vector unit (AVX2, AVX512, ...), for messages."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "unknown"


def choose_dtype(requested: str, device: str) -> tuple[str, str | None]:
    """`requested` (auto, or a dtype by either name) on `device` -> (the dtype's full name, a line for the console:
    what auto chose and why, or why an explicit bfloat16 will be slow here; None when there is nothing to say)."""
    device = str(device)
    where = "this GPU" if device.startswith("cuda") else f"this CPU ({cpu_capability()})"
    if requested == "auto":
        if native_bf16(device):
            return "bfloat16", f"dtype: bfloat16 (--dtype auto: {where} multiplies bf16 in hardware)"
        return "float32", (f"dtype: float32 (--dtype auto: {where} has no bf16 in hardware, so bf16 would be emulated, "
                           "2.6-4x slower as measured on an AVX2-only EPYC; --dtype bf16 to force it)")
    if requested not in FULL:
        raise ValueError(f"unknown dtype {requested!r}: use auto, {', '.join(FULL)}")
    name = FULL[requested]
    if name == "bfloat16" and not device.startswith("cuda") and not native_bf16(device):
        return name, (f"dtype: bfloat16 is emulated on {where}: 2.6-4x slower than float32 as measured on an "
                      "AVX2-only EPYC (--dtype auto picks float32 on such CPUs)")
    return name, None
