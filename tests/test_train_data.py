"""The trainer's batches from a store: read straight into the batch (read_batch) equals collating the samples."""

import dataclasses

import numpy as np
import pytest
import torch

from eyas.store.reader import StoreReader
from eyas.train.batches import Subset, collate, load_micro_batch, read_batch
from tests.test_store import build_store, samples

MICRO = ((4, 0, 7), (2,), (8, 5), (1, 3, 6))  # packed rows of different lengths: padding in every row but one


@pytest.mark.parametrize("compact", [False, True], ids=["bf16", "compact"])
def test_read_batch_equals_collating_the_samples(tmp_path, compact):
    r = StoreReader(build_store(tmp_path / "s", samples(9), compact=compact))
    got = read_batch(r, MICRO, repeats=1)
    want = collate([[r[i] for i in unit] for unit in MICRO], repeats=1)
    for name in ("input_ids", "loss_mask", "position_ids", "doc_ids", "aux", "final"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (got.samples, got.repeats, got.tokens, got.docs) == (want.samples, want.repeats, want.tokens, want.docs)
    lengths = [sum(int(r.lengths[i]) for i in unit) for unit in MICRO]
    assert got.tokens == sum(lengths) and got.input_ids.shape[1] == max(lengths)
    for row, n in enumerate(lengths):  # padding: zeros, and no document
        assert not got.aux[row, n:].any() and not got.final[row, n:].any() and (got.doc_ids[row, n:] == -1).all()
    # the doc layout: positions restart at 0 for every packed sample
    row, start, n = got.docs[-1]
    assert got.position_ids[row, start:start + n].tolist() == list(range(n))


def test_a_subset_of_a_store_reads_its_own_samples(tmp_path):
    r = StoreReader(build_store(tmp_path / "s", samples(9)))
    sub = Subset(r, np.array([8, 2, 5]))
    got = load_micro_batch(sub, ((0, 2), (1,)))  # samples 8+5 packed, then 2
    want = collate([[r[8], r[5]], [r[2]]])
    assert torch.equal(got.aux, want.aux) and torch.equal(got.input_ids, want.input_ids)


def test_a_gpu_batch_of_a_compact_store_is_decoded_where_it_goes(tmp_path, monkeypatch):
    """For a GPU (pin=True) a compact store's batch keeps its fp8 rows and exponents encoded, pinned, and
    Batch.to decodes them on the device it moves to: the same features as decoding on the host. (This CPU has no
    pinned memory: torch.empty's pin_memory is ignored here.)"""
    r = StoreReader(build_store(tmp_path / "s", samples(9), compact=True))
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **kw: empty(*a, **kw))
    encoded = read_batch(r, MICRO, repeats=1, pin=True)
    assert encoded.aux is None and encoded.encoded["aux"].dtype == torch.float8_e4m3fn
    host = read_batch(r, MICRO, repeats=1)
    moved, want = encoded.to("cpu", torch.bfloat16), host.to("cpu", torch.bfloat16)
    assert moved.encoded is None and torch.equal(moved.aux, want.aux) and torch.equal(moved.final, want.final)
    assert torch.equal(moved.input_ids, want.input_ids)


def test_the_static_path_pads_to_a_few_lengths_and_fsdp_is_not_compiled_whole(tmp_path):
    """A compiled step compiles once per shape: lengths padded to powers of two (>= 256) give a handful; FSDP2's
    per-layer hooks cannot sit inside one whole-step graph, so under FSDP2 the static path runs eagerly."""
    from eyas.train.objective import choose_path

    b = read_batch(StoreReader(build_store(tmp_path / "s", samples(9))), MICRO)
    T = b.input_ids.shape[1]
    for smallest, want in ((256, 256), (8, 1 << (T - 1).bit_length())):
        p = b.padded(smallest)
        assert p.input_ids.shape[1] == max(want, T) and torch.equal(p.input_ids[:, :T], b.input_ids)
        assert (p.loss_mask[:, T:] == 0).all() and (p.doc_ids[:, T:] == -1).all() and not p.aux[:, T:].any()
    lengths = {b.padded(256).input_ids.shape[1] for b in [dataclass_with_T(b, t) for t in range(1, 4097, 37)]}
    assert lengths == {256, 512, 1024, 2048, 4096}
    assert choose_path("cuda:0", "auto")[:2] == ("static", True)
    assert choose_path("cuda:0", "auto", sharded=True)[:2] == ("static", False)
    assert "not compiled under FSDP2" in choose_path("cuda:0", "on", sharded=True)[2]
    assert choose_path("cpu", "auto")[:2] == ("gathered", False) and choose_path("cpu", "on")[:2] == ("static", True)


def dataclass_with_T(b, T: int):
    """b cut or tiled to T positions (only its shape matters here)."""
    def fit(t):
        reps = -(-T // t.shape[1])
        return t.repeat(1, reps, *([1] * (t.dim() - 2)))[:, :T]
    return dataclasses.replace(b, input_ids=fit(b.input_ids), loss_mask=fit(b.loss_mask),
                               position_ids=fit(b.position_ids), doc_ids=fit(b.doc_ids), aux=fit(b.aux),
                               final=fit(b.final))
