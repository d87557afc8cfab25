"""Weights moved into huge pages keep their values, their ties and their module; nothing moves when turned off."""

import mmap

import pytest
import torch

from eyas.core import memory
from eyas.core.target import load_target
from eyas.models.llama import fuse_projections

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")


def test_to_hugepages_copies_values_into_one_aligned_mapping():
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(300, 7, generator=g), torch.randint(0, 9, (5,), generator=g), torch.randn(3, 4, generator=g).t(),
          torch.empty(0), torch.randn(2, dtype=torch.bfloat16, generator=g)]
    out = memory.to_hugepages(ts)
    for a, b in zip(ts, out):
        assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
    moved = out[:3] + out[4:]
    assert all(t.is_contiguous() and t.data_ptr() % memory.ALIGN == 0 for t in moved)
    base = moved[0].data_ptr()
    assert all(0 <= t.data_ptr() - base < memory.HUGE for t in moved)  # one mapping, side by side
    assert out[3] is ts[3]  # nothing to move
    moved[0].add_(1)
    assert torch.equal(moved[0], ts[0] + 1)  # a copy: the original is untouched


def test_pack_module_keeps_outputs_and_tied_weights():
    model = load_target("tiny").model
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        before = model(ids).logits
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    memory.pack_module(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert all(p.data_ptr() != ptrs[n] for n, p in model.named_parameters())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_turned_off_nothing_moves(monkeypatch, tiny_target):
    monkeypatch.setenv("EYAS_HUGEPAGES", "0")
    ts = [torch.randn(4, 4)]
    assert memory.to_hugepages(ts)[0] is ts[0]
    layers = list(tiny_target.decoder_layers())
    wqkv, _, _ = fuse_projections(layers)
    a = layers[0].self_attn
    assert torch.equal(wqkv[0], torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)))
