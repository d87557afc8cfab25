"""`--dtype auto` (eyas.core.precision): bfloat16 where the device multiplies it in hardware, float32 elsewhere, and
a warning when bfloat16 is asked of a CPU that only emulates it."""

import pytest
import torch

from eyas.core import precision
from eyas.core.precision import choose_dtype


@pytest.mark.parametrize("native,want", [(True, "bfloat16"), (False, "float32")])
def test_auto_is_bf16_only_where_the_hardware_has_it(monkeypatch, native, want):
    monkeypatch.setattr(precision, "native_bf16", lambda device: native)
    dtype, why = choose_dtype("auto", "cpu")
    assert dtype == want and why.startswith(f"dtype: {want} (--dtype auto")
    assert ("emulated" in why) is (not native)


def test_an_explicit_dtype_is_kept_and_emulated_bf16_is_named(monkeypatch):
    monkeypatch.setattr(precision, "native_bf16", lambda device: False)
    assert choose_dtype("fp32", "cpu") == ("float32", None)
    assert choose_dtype("float16", "cpu") == ("float16", None)
    dtype, why = choose_dtype("bf16", "cpu")
    assert dtype == "bfloat16" and "emulated" in why and "--dtype auto" in why
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    assert choose_dtype("bfloat16", "cpu") == ("bfloat16", None)
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        choose_dtype("int8", "cpu")


def test_this_cpu_is_read_as_torch_reads_it():
    """auto agrees with oneDNN's own answer on the machine the suite runs on (AVX2 alone: float32)."""
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert precision.native_bf16("cpu") is native
    assert choose_dtype("auto", "cpu")[0] == ("bfloat16" if native else "float32")


@pytest.mark.parametrize("capability,native", [((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_a_gpu_has_bf16_from_ampere_on_not_where_torch_would_emulate_it(monkeypatch, capability, native):
    """torch.cuda.is_bf16_supported() says yes on a T4 or V100 (it counts emulation): auto must not pick it there."""
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: asked.append(d) or capability)
    assert precision.native_bf16("cuda:1") is native and asked == [torch.device("cuda:1")]  # the device asked
