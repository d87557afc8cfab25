"""The hidden-state store: format, zero-copy reader, compact codec, verify, info/verify CLI."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from eyas import cli
from eyas.core.errors import EyasError
from eyas.store.layout import (
    COMPACT_ABS_DIV,
    COMPACT_REL,
    SHARD_DIR,
    bytes_per_token,
    dequantize_rows,
    quantize_rows,
    shard_name,
)
from eyas.store.reader import StoreReader
from eyas.store.writer import ShardBuilder, check_coverage, write_manifest

H = 16
IDENTITY = {"name": "t", "architecture": "LlamaForCausalLM", "config_hash": "abc", "hidden_size": H,
            "num_layers": 8, "vocab_size": 1000}


def samples(n=7, seed=0):
    """(row, id, input_ids, loss_mask, aux [L,3,H] fp32, final [L,H] fp32) with varied magnitudes per row."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(n):
        L = int(torch.randint(1, 12, (1,), generator=g))
        scale = torch.exp(torch.randn(L, 4, 1, generator=g) * 3)  # rows spanning orders of magnitude
        x = torch.randn(L, 4, H, generator=g) * scale
        out.append((r, f"id-{r}", torch.randint(0, 1000, (L,), generator=g), torch.randint(0, 2, (L,), generator=g),
                    x[:, :3], x[:, 3]))
    return out


def build_store(root: Path, data, compact=False, per_shard=3) -> Path:
    (root / SHARD_DIR).mkdir(parents=True)
    shards = []
    for k in range(0, len(data), per_shard):
        part = data[k: k + per_shard]
        b = ShardBuilder(shard_name(k // per_shard), sum(len(d[2]) for d in part), H, compact)
        for r, sid, ids, mask, aux, final in part:
            b.add(r, sid, ids, mask, list(aux.unbind(1)), final)
        shards.append(b.commit(root / SHARD_DIR))
    header = {"source": "test", "target": IDENTITY, "layer_ids": [2, 4, 5], "hidden_size": H,
              "dtype": "float8_e4m3fn" if compact else "bfloat16", "compact": compact, "dataset": None}
    write_manifest(root, header, shards)
    return root


def test_roundtrip_bf16_is_exact_and_zero_copy(tmp_path):
    data = samples()
    r = StoreReader(build_store(tmp_path / "s", data))
    assert len(r) == len(data) and r.lengths.tolist() == [len(d[2]) for d in data]
    assert r.identity == IDENTITY and r.layer_ids == [2, 4, 5]
    for i, (row, sid, ids, mask, aux, final) in enumerate(data):
        s = r[i]
        assert s.id == sid and s.input_ids.dtype == torch.int64 and torch.equal(s.input_ids, ids)
        assert s.loss_mask.tolist() == mask.tolist()
        assert torch.equal(s.aux, aux.to(torch.bfloat16).reshape(len(ids), 3 * H))
        assert torch.equal(s.final, final.to(torch.bfloat16))
    a, b = r[0], r[1]  # same shard: views of one memory-mapped buffer, no copy
    assert a.aux.untyped_storage().data_ptr() == b.aux.untyped_storage().data_ptr()
    assert a.aux.data_ptr() != b.aux.data_ptr()


def test_shards_are_plain_safetensors_files(tmp_path):
    data = samples()
    build_store(tmp_path / "s", data)
    with safe_open(str(tmp_path / "s" / SHARD_DIR / shard_name(0)), "pt") as f:
        assert set(f.keys()) == {"input_ids", "loss_mask", "aux", "final"}
        ids = f.get_tensor("input_ids")
        meta = json.loads(f.metadata()["eyas"])
    assert meta["rows"] == [0, 1, 2] and ids.tolist() == torch.cat([d[2] for d in data[:3]]).tolist()


def test_compact_roundtrip_is_within_the_stated_bound(tmp_path):
    data = samples()
    r = StoreReader(build_store(tmp_path / "s", data, compact=True))
    for i, (_, _, ids, _, aux, final) in enumerate(data):
        s = r[i]
        for x, y in ((aux, s.aux.view(len(ids), 3, H)), (final, s.final)):
            bound = x.abs() * COMPACT_REL + x.abs().amax(-1, keepdim=True) / COMPACT_ABS_DIV
            assert ((x - y.float()).abs() <= bound).all()
    assert bytes_per_token(576, True) == 4 * 576 + 9 and bytes_per_token(576, False) == 8 * 576 + 5


@settings(max_examples=60, deadline=None)
@given(st.integers(-40, 40), st.integers(0, 2**31 - 1))
def test_fp8_codec_bound_holds_at_any_magnitude(log2_scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 32, generator=g) * 2.0 ** log2_scale
    x[0] = 0.0  # an all-zero row
    x[1, :16] *= 1e-6  # tiny values next to large ones (subnormal range)
    q, e = quantize_rows(x)
    y = dequantize_rows(q, e).float()
    bound = x.abs() * COMPACT_REL + x.abs().amax(-1, keepdim=True) / COMPACT_ABS_DIV
    assert torch.isfinite(y).all() and ((x - y).abs() <= bound).all()
    assert torch.equal(y[0], torch.zeros(32))


def test_check_target_refuses_another_target(tmp_path):
    r = StoreReader(build_store(tmp_path / "s", samples()))
    r.check_target(dict(IDENTITY))
    with pytest.raises(EyasError, match="config_hash"):
        r.check_target({**IDENTITY, "config_hash": "other"})


def test_coverage_names_duplicates_and_missing_rows():
    a = {"name": "a", "rows": [0, 1], "ids": ["x", "y"]}
    b = {"name": "b", "rows": [1, 3], "ids": ["y", "w"]}
    problems = check_coverage([a, b], 4)
    assert any("in both a and b" in p for p in problems) and any("missing" in p and "[2]" in p for p in problems)
    assert check_coverage([a], 2) == []


def flip_byte(path: Path, where: int) -> None:
    data = bytearray(path.read_bytes())
    data[where] ^= 0x40
    path.write_bytes(bytes(data))


def test_verify_names_a_flipped_byte_a_truncated_and_a_missing_shard(tmp_path):
    data = samples(9)
    store = build_store(tmp_path / "s", data)
    assert StoreReader(store).verify() == []
    shards = sorted((store / SHARD_DIR).iterdir())
    flip_byte(shards[0], shards[0].stat().st_size - 3)  # inside the last tensor of the last sample
    problems = StoreReader(store).verify()
    assert len(problems) == 1 and shards[0].name in problems[0] and "id-2" in problems[0]
    with open(shards[1], "r+b") as f:
        f.truncate(shards[1].stat().st_size - 10)
    shards[2].unlink()
    with pytest.raises(EyasError, match=shards[1].name):  # the reader refuses by default...
        StoreReader(store)
    skipping = StoreReader(store, skip_bad=True)  # ...or skips and counts when asked
    assert len(skipping) == 3 and skipping.skipped == 6
    problems = skipping.verify()
    assert any(shards[1].name in p and "truncated" in p for p in problems)
    assert any(shards[2].name in p and "missing" in p for p in problems)


def test_checksums_are_xxh3_and_stores_with_blake2b_checksums_still_check(tmp_path):
    """New stores carry "xxh3:<hex>"; a store written before (bare blake2b-128 hex) reads and verifies as before."""
    import hashlib

    import xxhash

    store = build_store(tmp_path / "s", samples(4), per_shard=4)
    manifest = json.loads((store / "manifest.json").read_text())
    reader = StoreReader(store)
    for s in manifest["samples"]:
        x = reader[manifest["samples"].index(s)]
        raw = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in (x.input_ids.int(), x.loss_mask,
                                                                                        x.aux, x.final))
        assert s["checksum"] == "xxh3:" + xxhash.xxh3_128(raw).hexdigest()
        s["checksum"] = hashlib.blake2b(raw, digest_size=16).hexdigest()  # what the first eyas stores hold
    (store / "manifest.json").write_text(json.dumps(manifest))
    legacy = StoreReader(store)
    assert legacy.verify() == [] and torch.equal(legacy[1].aux, reader[1].aux)
    flip_byte(store / SHARD_DIR / shard_name(0), (store / SHARD_DIR / shard_name(0)).stat().st_size - 1)
    assert len(StoreReader(store).verify()) == 1
    with pytest.raises(EyasError, match="id-3.*checksum differs"):
        StoreReader(store)[3]
    manifest["samples"][0]["checksum"] = None  # a damaged manifest: a problem named, not a TypeError
    manifest["samples"][1]["checksum"] = "sha256:" + "0" * 64  # a newer eyas's algorithm: refused, never "corrupted"
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EyasError, match="id-0.*checksum differs"):
        StoreReader(store)[0]
    with pytest.raises(EyasError, match="(?s)algorithm .sha256.*upgrade eyas"):
        StoreReader(store)[1]


def test_store_cli_info_and_verify(tmp_path, capsys):
    store = build_store(tmp_path / "s", samples(9))
    assert cli.main(["store", "info", str(store), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    tokens = sum(len(d[2]) for d in samples(9))
    assert info["samples"] == 9 and info["tokens"] == tokens and info["reference_bytes_per_token"] == 8 * H
    assert cli.main(["store", "verify", str(store), "--quiet"]) == 0
    shard = store / SHARD_DIR / shard_name(1)
    flip_byte(shard, shard.stat().st_size - 1)
    assert cli.main(["store", "verify", str(store), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert shard.name in err and "id-5" in err and "checksum" in err


def test_not_a_store_and_a_damaged_manifest_are_clear_errors(tmp_path):
    with pytest.raises(EyasError, match="not a hidden-state store"):
        StoreReader(tmp_path)
    store = build_store(tmp_path / "s", samples(3))
    (store / "manifest.json").write_text("{ cut")
    with pytest.raises(EyasError, match="corrupted"):
        StoreReader(store)


def test_lengths_is_a_numpy_array(tmp_path):
    r = StoreReader(build_store(tmp_path / "s", samples(4)))
    assert isinstance(r.lengths, np.ndarray) and r.lengths.dtype == np.int64


def test_verify_against_the_prepared_data_names_a_sample_with_other_tokens(tmp_path, capsys):
    from datasets import Dataset

    data = samples(4)
    store = build_store(tmp_path / "s", data)
    rows = {"id": [d[1] for d in data], "input_ids": [d[2].tolist() for d in data],
            "loss_mask": [d[3].tolist() for d in data], "num_tokens": [len(d[2]) for d in data]}
    Dataset.from_dict(rows).save_to_disk(str(tmp_path / "prep" / "train"))
    assert cli.main(["store", "verify", str(store), "--data", str(tmp_path / "prep"), "--quiet"]) == 0
    rows["input_ids"][2][0] += 1
    Dataset.from_dict(rows).save_to_disk(str(tmp_path / "prep2" / "train"))
    assert cli.main(["store", "verify", str(store), "--data", str(tmp_path / "prep2"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "1 problem" in err and "sample id-2 (row 2) has other token ids" in err and shard_name(0) in err


def byte_buffers(reader, tokens: int) -> dict:
    """Flat uint8 views of fresh buffers, one per stored tensor, for `tokens` tokens (what read_into fills)."""
    bufs = {n: torch.full((tokens, math.prod(shape) * dt.itemsize), 7, dtype=torch.uint8).view(dt).view(tokens, *shape)
            for n, (dt, shape) in reader.row_specs.items()}  # every byte 7
    return bufs, {n: t.view(torch.uint8).numpy().reshape(-1) for n, t in bufs.items()}


@pytest.mark.parametrize("compact", [False, True], ids=["bf16", "compact"])
def test_read_into_copies_exactly_the_samples_rows(tmp_path, compact):
    """Every sample read into a buffer at an offset equals the sample the mapped reader returns, decoded the same
    way, and the bytes before and after it stay untouched."""
    from eyas.store.layout import features

    data = samples(9)
    r = StoreReader(build_store(tmp_path / "s", data, compact=compact))
    for i, d in enumerate(data):
        L, at = len(d[2]), 3
        bufs, out = byte_buffers(r, at + L + 2)
        assert r.read_into(i, out, at) == L
        sl = slice(at, at + L)
        aux, final = features({n: t[sl] for n, t in bufs.items()})
        s = r[i]
        assert torch.equal(bufs["input_ids"][sl].long(), d[2]) and bufs["loss_mask"][sl].tolist() == d[3].tolist()
        assert torch.equal(aux, s.aux) and torch.equal(final, s.final)
        untouched = [t for t in bufs.values() for t in (t[:at], t[at + L:])]
        assert all((t.view(torch.uint8) == 7).all() for t in untouched)


def test_read_into_names_a_damaged_sample_and_a_shard_cut_short_while_open(tmp_path):
    data = samples(9)
    store = build_store(tmp_path / "s", data)
    shards = sorted((store / SHARD_DIR).iterdir())
    flip_byte(shards[0], shards[0].stat().st_size - 3)  # the last tensor of shard 0's last sample, id-2
    r = StoreReader(store)
    _, out = byte_buffers(r, 20)
    assert r.read_into(0, out) == len(data[0][2])  # the undamaged samples of the shard still read
    with pytest.raises(EyasError, match="shard-000000.*id-2.*checksum differs") as e:
        r.read_into(2, out)
    assert "store verify" in e.value.fix
    r.read_into(3, out)  # opens shard 1; now it is cut short under the open reader
    with open(shards[1], "r+b") as f:
        f.truncate(shards[1].stat().st_size - 10)
    with pytest.raises(EyasError, match="shard-000001.*ends inside sample id-5"):
        r.read_into(5, out)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files in /proc/self/fd (Linux)")
def test_read_into_keeps_a_bounded_number_of_shard_files_open(tmp_path, monkeypatch):
    """A terabyte store has thousands of shards, more than a process may open: the reader keeps at most
    OPEN_FILES of them open, whichever way it reads."""
    import os

    import eyas.store.reader

    def open_shards() -> int:  # this process's descriptors on the store's shards (a map holds one too)
        fds = Path("/proc/self/fd")
        return sum(1 for fd in fds.iterdir() if os.path.realpath(fd).startswith(str(store / SHARD_DIR)))

    monkeypatch.setattr(eyas.store.reader, "OPEN_FILES", 2)
    data = samples(12)
    store = build_store(tmp_path / "s", data)  # 4 shards of 3 samples
    r = StoreReader(store)
    _, out = byte_buffers(r, 20)
    for i in [0, 3, 6, 9, 1, 4, 7, 10, 2]:
        r.read_into(i, out)
        assert open_shards() <= 4  # 2 shards, each a file and a map at most
        assert r[i].id == data[i][1]  # the mapped reader too
        assert open_shards() <= 4
    assert StoreReader(store).verify() == []  # and verify, which reads every shard
    bufs, out = byte_buffers(r, 20)
    r.read_into(11, out)
    assert torch.equal(bufs["input_ids"][: len(data[11][2])].long(), data[11][2])
    r.close()  # every file given back
    assert open_shards() == 0
    with StoreReader(store) as again:
        again.read_into(0, out), again[1]
    assert open_shards() == 0


def test_a_shard_replaced_or_removed_under_an_open_reader_is_named(tmp_path, monkeypatch):
    """A closed (least recently used) shard is reopened only if it is still the file whose header was read: a
    shard rewritten meanwhile, even to the same size, would put other bytes where the reader looks."""
    import eyas.store.reader

    monkeypatch.setattr(eyas.store.reader, "OPEN_FILES", 1)
    store = build_store(tmp_path / "s", samples(9))
    other = build_store(tmp_path / "o", samples(9, seed=1))
    r = StoreReader(store)
    _, out = byte_buffers(r, 20)
    r.read_into(0, out), r.read_into(3, out)  # shard 0 read, then closed to open shard 1
    shard0 = store / SHARD_DIR / shard_name(0)
    shard0.write_bytes((other / SHARD_DIR / shard_name(0)).read_bytes()[: shard0.stat().st_size].ljust(
        shard0.stat().st_size, b" "))
    with pytest.raises(EyasError, match="shard-000000.*replaced or changed") as e:
        r.read_into(0, out)  # checked on its first read: only the reopening check can tell
    assert "open the store again" in e.value.fix
    r.read_into(6, out), r.read_into(3, out)  # shard 2 read, then closed
    (store / SHARD_DIR / shard_name(2)).unlink()
    with pytest.raises(EyasError, match="shard-000002.* was removed"):
        r[7]


@pytest.mark.parametrize("damage", ["float dims", "huge offset", "aux of another dtype"])
def test_a_header_that_does_not_describe_the_stores_tensors_is_named(tmp_path, damage):
    import struct

    store = build_store(tmp_path / "s", samples(3))
    path = store / SHARD_DIR / shard_name(0)
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    T = header["input_ids"]["shape"][0]
    if damage == "float dims":
        header["loss_mask"]["shape"] = [T + 0.0]
    elif damage == "huge offset":
        header["final"]["data_offsets"][0] = 10**400
    else:  # same bytes: [T, 3H] bf16 read as [T, 6H] int8
        header["aux"].update(dtype="I8", shape=[T, 3 * H * 2])
    text = json.dumps(header, separators=(",", ":")).encode().replace(b"1e+400", b"1" + b"0" * 400)
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + blob[8 + n:])  # the data as it was
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["shards"][0]["bytes"] = path.stat().st_size  # only the header is damaged
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EyasError, match="shard-000000.*corrupted") as e:
        StoreReader(store)[0]
    assert "delete the shard" in e.value.fix


def test_read_into_refuses_a_small_buffer_and_a_sample_outside_its_shard(tmp_path):
    data = samples(3)
    store = build_store(tmp_path / "s", data)
    r = StoreReader(store)
    _, out = byte_buffers(r, len(data[0][2]) - 1)
    with pytest.raises(ValueError, match="input_ids buffer holds"):
        r.read_into(0, out)
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["samples"][2]["offset"] += 1  # past the shard's last row
    (store / "manifest.json").write_text(json.dumps(manifest))
    _, out = byte_buffers(r, 20)
    with pytest.raises(EyasError, match="id-2 lies at rows .* which has"):
        StoreReader(store).read_into(2, out)


def test_threads_sharing_a_reader_read_every_sample_right(tmp_path, monkeypatch):
    """Two threads reading one store while shards are closed and reopened under them (OPEN_FILES = 1)."""
    import threading

    import eyas.store.reader

    monkeypatch.setattr(eyas.store.reader, "OPEN_FILES", 1)
    data = samples(12)
    r = StoreReader(build_store(tmp_path / "s", data))
    errors = []

    def work(order):
        bufs, out = byte_buffers(r, 20)
        try:
            for _ in range(30):
                for i in order:
                    n = r.read_into(i, out)
                    assert torch.equal(bufs["input_ids"][:n].long(), data[i][2])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(o,)) for o in (range(12), range(11, -1, -1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_shard_copied_back_unchanged_under_an_open_reader_still_reads(tmp_path, monkeypatch):
    """A new inode and time with the same size and header bytes (a copy, a re-extraction that wrote the same
    bytes, a file system without stable inodes) is the same shard: no false alarm."""
    import shutil

    import eyas.store.reader

    monkeypatch.setattr(eyas.store.reader, "OPEN_FILES", 1)
    data = samples(6)
    store = build_store(tmp_path / "s", data)
    r = StoreReader(store)
    bufs, out = byte_buffers(r, 20)
    r.read_into(0, out), r.read_into(3, out)  # shard 0 opened, then closed
    shard0 = store / SHARD_DIR / shard_name(0)
    shutil.copy(shard0, tmp_path / "copy")
    (tmp_path / "copy").replace(shard0)
    n = r.read_into(1, out)
    assert torch.equal(bufs["input_ids"][:n].long(), data[1][2])


@pytest.mark.parametrize("damage", ["a list", "binary", "a sample without length", "an offset as text",
                                    "a shard without size", "no target"])
def test_a_damaged_manifest_is_named_never_a_raw_error(tmp_path, damage):
    store = build_store(tmp_path / "s", samples(3))
    path = store / "manifest.json"
    m = json.loads(path.read_text())
    if damage == "a list":
        m = [m]
    elif damage == "a sample without length":
        del m["samples"][1]["length"]
    elif damage == "an offset as text":
        m["samples"][2]["offset"] = "0"
    elif damage == "a shard without size":
        del m["shards"][0]["bytes"]
    elif damage == "no target":
        del m["target"]
    path.write_bytes(b"\xff\xfe\x00garbage" if damage == "binary" else json.dumps(m).encode())
    with pytest.raises(EyasError, match="manifest.json is (damaged|corrupted)") as e:
        StoreReader(store)
    assert "re-run the command that wrote the store" in e.value.fix
