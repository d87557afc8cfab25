"""eyas prepare: the prepared-dataset contract, checked against the tokenizer's own template and the documented
rules."""

import hashlib
import json

import numpy as np
import pytest

from eyas.cli import main
from eyas.core.errors import EyasError
from eyas.data.prepare import PrepareConfig, run
from eyas.data.prepared import open_prepared, read_summary

SYSTEM = {"role": "system", "content": "You are terse."}
CHATS = [
    {"id": "chat-a", "messages": [SYSTEM, {"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": "Hello."},
                                  {"role": "user", "content": "Name a colour"},
                                  {"role": "assistant", "content": "Blue"}]},
    {"id": "chat-b", "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    {"id": "chat-c", "messages": [{"role": "user", "content": "Capital of France?"},
                                  {"role": "assistant", "content": "Paris is the capital of France."}]},
]
MATH = [{"question": f"What is {i} times 3?", "answer": f"{i} * 3 = {3 * i}\n#### {3 * i}"} for i in range(1, 7)]


@pytest.fixture
def fast_target(tiny_target, monkeypatch):
    """prepare loads its target by name: hand it the session's tiny target instead of rebuilding it."""
    monkeypatch.setattr("eyas.data.prepare.load_target_shell", lambda spec, **kw: tiny_target)
    return tiny_target


def write_lines(path, lines):
    path.write_bytes(b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n"
                              for line in lines))
    return str(path)


def rows(out, split):
    return list(open_prepared(out, split).ds)


def expected_split(sample_id, seed, fraction):  # the rule docs/prepare.md states, computed independently
    h = int.from_bytes(hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()[:8], "big")
    return "validation" if h / 2**64 < fraction else "train"


def masked_runs(tok, ids, mask):
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs, cur = runs + [cur], []
    return [tok.decode(r) for r in runs + ([cur] if cur else [])]


@pytest.fixture
def inputs(tmp_path):
    chats = write_lines(tmp_path / "chats.jsonl", CHATS)
    math = write_lines(tmp_path / "math.jsonl", MATH + [
        b'{"question": "broken',                                                   # line 7: malformed
        {"question": "What is  1 times 3?", "answer": "1 * 3 = 3\n#### 3"},       # line 8: duplicate content
        {"question": "What is 9 times 3?"},                                        # line 9: prompt-only
    ])
    mt = write_lines(tmp_path / "question.jsonl", [{"question_id": 81, "turns": ["Write a poem.", "Shorter."]},
                                                   {"question_id": "chat-b", "turns": ["dup id"]}])
    return chats, math, mt


def test_prepared_dataset_contract(fast_target, inputs, tmp_path):
    tok = fast_target.tokenizer
    out = tmp_path / "prep"
    summary = run(PrepareConfig(target="tiny", data=inputs, out=str(out), validation=0.4, seed=3, quiet=True))
    got = {s: rows(out, s) for s in ("train", "validation")}
    ds = open_prepared(out, "train").ds
    assert {k: str(v) for k, v in ds.features.items()} == {
        "id": "Value('string')", "input_ids": "List(Value('int32'))", "loss_mask": "List(Value('int8'))",
        "num_tokens": "Value('int32')"}
    conversations = {c["id"]: c["messages"] for c in CHATS}
    conversations.update({f"math:{i + 1}": [{"role": "user", "content": m["question"]},
                                             {"role": "assistant", "content": m["answer"]}]
                          for i, m in enumerate(MATH)})
    conversations["math:9"] = [{"role": "user", "content": "What is 9 times 3?"}]
    conversations["81"] = [{"role": "user", "content": "Write a poem."}, {"role": "user", "content": "Shorter."}]
    seen = {}
    for split, samples in got.items():
        for r in samples:
            seen[r["id"]] = split
            msgs = conversations[r["id"]]
            assert r["input_ids"] == list(tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"])
            assert r["num_tokens"] == len(r["input_ids"]) == len(r["loss_mask"])
            want = [m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant"]
            assert masked_runs(tok, r["input_ids"], r["loss_mask"]) == want
    assert seen == {i: expected_split(i, 3, 0.4) for i in conversations}
    assert set(seen.values()) == {"train", "validation"}

    assert summary == read_summary(out)
    assert summary["samples_in"] == 3 + 9 + 2 and summary["kept"] == len(conversations)
    dropped = summary["dropped_by_reason"]
    assert {r: d["count"] for r, d in dropped.items()} == {"malformed-json": 1, "duplicate-content": 1,
                                                           "duplicate-id": 1}
    assert dropped["malformed-json"]["examples"][0]["where"] == f"{inputs[1]}:7"
    assert dropped["duplicate-content"]["examples"][0]["where"] == f"{inputs[1]}:8"
    assert summary["prompt_only"] == 2
    all_rows = got["train"] + got["validation"]
    assert summary["tokens"] == sum(r["num_tokens"] for r in all_rows)
    assert summary["loss_tokens"] == sum(sum(r["loss_mask"]) for r in all_rows)
    assert summary["target"] == fast_target.identity()
    fps = {}
    for split, samples in got.items():
        h = hashlib.sha256()
        for r in samples:
            h.update(r["id"].encode() + b"\0" + np.array(r["input_ids"], "<i4").tobytes()
                     + np.array(r["loss_mask"], "i1").tobytes())
        fps[split] = h.hexdigest()
    assert summary["fingerprints"] == fps
    assert summary["fingerprint"] == hashlib.sha256(
        f"train:{fps['train']}validation:{fps['validation']}".encode()).hexdigest()


def test_split_is_stable_when_data_is_added(fast_target, inputs, tmp_path):
    chats, math, _ = inputs
    run(PrepareConfig(target="tiny", data=(math,), out=str(tmp_path / "a"), validation=0.5, quiet=True))
    run(PrepareConfig(target="tiny", data=(chats, math), out=str(tmp_path / "b"), validation=0.5, quiet=True))
    split = {s: {r["id"] for r in rows(tmp_path / "a", s)} for s in ("train", "validation")}
    more = {s: {r["id"] for r in rows(tmp_path / "b", s)} for s in ("train", "validation")}
    assert split["train"] <= more["train"] and split["validation"] <= more["validation"]


def test_max_length_truncate_and_drop(fast_target, inputs, tmp_path):
    chats = inputs[0]
    full = {r["id"]: r for r in rows(run_out(chats, tmp_path / "full"), "train")}
    limit = 40
    long_ids = {i for i, r in full.items() if r["num_tokens"] > limit}
    assert long_ids and len(long_ids) < len(full)
    s = run(PrepareConfig(target="tiny", data=(chats,), out=str(tmp_path / "t"), max_length=limit, validation=0,
                          quiet=True))
    cut = {r["id"]: r for r in rows(tmp_path / "t", "train")}
    for i in long_ids:
        if i in cut:
            assert cut[i]["input_ids"] == full[i]["input_ids"][:limit] and cut[i]["num_tokens"] == limit
    assert s["truncated"] >= 1 and s["truncated"] + s["dropped_by_reason"].get("too-long", {}).get("count", 0) == len(
        long_ids)
    s = run(PrepareConfig(target="tiny", data=(chats,), out=str(tmp_path / "d"), max_length=limit, validation=0,
                          overlong="drop", quiet=True))
    assert {r["id"] for r in rows(tmp_path / "d", "train")} == set(full) - long_ids
    assert s["dropped_by_reason"]["too-long"]["count"] == len(long_ids)


def run_out(data, out):
    run(PrepareConfig(target="tiny", data=(data,), out=str(out), validation=0, quiet=True))
    return out


def test_existing_output_is_kept_unless_overwrite(fast_target, inputs, tmp_path):
    out = run_out(inputs[0], tmp_path / "p")
    before = read_summary(out)
    with pytest.raises(EyasError, match="already exists"):
        run_out(inputs[0], out)
    assert read_summary(out) == before
    run(PrepareConfig(target="tiny", data=(inputs[1],), out=str(out), validation=0, overwrite=True, quiet=True))
    assert read_summary(out)["data"] == [inputs[1]]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "precious.txt").write_text("keep me")
    with pytest.raises(EyasError, match="not a folder `eyas prepare` wrote"):
        run(PrepareConfig(target="tiny", data=(inputs[0],), out=str(tmp_path / "other"), overwrite=True, quiet=True))
    assert (tmp_path / "other" / "precious.txt").read_text() == "keep me"
    (out / "train" / "my-notes.txt").write_text("mine")  # issue 45: inside prepare's own output, nested
    with pytest.raises(EyasError, match=r"did not write, such as .*train/my-notes\.txt"):
        run(PrepareConfig(target="tiny", data=(inputs[0],), out=str(out), overwrite=True, quiet=True))
    assert (out / "train" / "my-notes.txt").read_text() == "mine" and read_summary(out)["data"] == [inputs[1]]


def test_max_samples_and_no_dedup(fast_target, inputs, tmp_path):
    s = run(PrepareConfig(target="tiny", data=(inputs[1],), out=str(tmp_path / "m"), max_samples=3, quiet=True))
    assert s["kept"] == 3
    s = run(PrepareConfig(target="tiny", data=(inputs[1],), out=str(tmp_path / "n"), dedup=False, quiet=True))
    assert "duplicate-content" not in s["dropped_by_reason"] and s["kept"] == 8


def test_cli_and_validation(fast_target, inputs, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["prepare", "--target", "tiny", "--data", inputs[2], "--out", str(out), "--overlong", "drop",
                 "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["prompt_only"] == 2 and printed["loss_tokens"] == 0
    assert all(sum(r["loss_mask"]) == 0 for s in ("train", "validation") for r in rows(out, s))
    with pytest.raises(EyasError):
        PrepareConfig(data=(), out="x")
    with pytest.raises(EyasError):
        PrepareConfig(data=("a",), validation=1.0)
    with pytest.raises(EyasError, match="not a prepared dataset"):
        open_prepared(tmp_path / "nowhere", "train")


def test_an_input_without_records_is_an_error_naming_the_file(fast_target, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(EyasError, match=f"no usable conversation in {empty}"):
        run(PrepareConfig(target="tiny", data=(str(empty),), out=str(tmp_path / "p"), quiet=True))
    assert not (tmp_path / "p").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nope": 1}\n')
    with pytest.raises(EyasError, match="(?s)1 records read, all dropped: .*unknown-format"):
        run(PrepareConfig(target="tiny", data=(str(bad),), out=str(tmp_path / "p"), quiet=True))


def test_records_of_a_one_line_json_array_are_placed_by_index_and_all_kept(fast_target, tmp_path):
    """A JSON array written on one line: every bad record is named by its index (it was 'array.json:1' for all),
    and the good ones keep distinct default ids (they all were 'array:1', so all but the first were dropped as
    duplicates)."""
    arr = tmp_path / "array.json"
    arr.write_text(json.dumps([{"question": "a?"}, {"nope": 1}, {"question": "b?"}, {"question": "c?"}]))
    s = run(PrepareConfig(target="tiny", data=(str(arr),), out=str(tmp_path / "p"), validation=0, quiet=True))
    assert s["samples"]["train"] == 3
    (example,) = s["dropped_by_reason"]["unknown-format"]["examples"]
    assert example["where"] == f"{arr}:1.1 (record 1)"
    assert sorted(r["id"] for r in open_prepared(tmp_path / "p", "train").ds) == ["array:1", "array:1.2", "array:1.3"]


def test_a_huge_record_is_bounded_before_it_is_tokenized(fast_target, tmp_path, monkeypatch):
    """Issue 45: a record of megabytes costs prepare no more than --max-length allows. With --overlong drop it is
    dropped untokenized (it cannot fit: no token covers more than the vocabulary's longest entry); with truncate
    only its head is tokenized, and the sample equals the whole record's, tokenized and truncated."""
    from eyas.data.chat import ChatRenderer
    from eyas.data.prepare import longest_token

    per_token = longest_token(fast_target.tokenizer)
    words = " ".join(f"w{i % 997}" for i in range(400_000))  # 2.4 MB of text in one reply
    huge = {"id": "huge", "messages": [{"role": "user", "content": "Say it all."},
                                       {"role": "assistant", "content": words}]}
    data = write_lines(tmp_path / "huge.jsonl", [huge, CHATS[1]])
    seen = []
    encode = ChatRenderer.encode

    def spy(self, messages, *a, **kw):
        seen.append(sum(len(m.content) for m in messages))
        return encode(self, messages, *a, **kw)

    monkeypatch.setattr(ChatRenderer, "encode", spy)
    s = run(PrepareConfig(target="tiny", data=(data,), out=str(tmp_path / "d"), max_length=64, overlong="drop",
                          validation=0, quiet=True))
    assert s["kept"] == 1 and s["dropped_by_reason"]["too-long"]["count"] == 1
    assert max(seen) < 100  # only the small chat was tokenized
    seen.clear()
    run(PrepareConfig(target="tiny", data=(data,), out=str(tmp_path / "t"), max_length=64, validation=0, quiet=True))
    assert max(seen) == 2 * 64 * per_token  # the head of the huge one, not its 2.4 MB
    got = {r["id"]: r for r in rows(tmp_path / "t", "train")}["huge"]
    monkeypatch.setattr(ChatRenderer, "encode", encode)
    from eyas.data.formats import Conversation, Message

    whole = ChatRenderer(fast_target.tokenizer).encode(
        Conversation("huge", [Message("user", "Say it all."), Message("assistant", words)], "s").messages)
    assert got["input_ids"] == whole.input_ids[:64] and got["loss_mask"] == whole.loss_mask[:64]
