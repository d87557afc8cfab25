"""Every input format parses into the same normalised conversation; bad records are counted, never fatal."""

import json

import pytest

from eyas.core.errors import EyasError
from eyas.data.formats import Conversation, Issues, Message, parse_record
from eyas.data.sources import read_conversations, resolve_data

Q, A = "What is 2 + 2?", "2 + 2 = 4."
SINGLE = [Message("user", Q), Message("assistant", A)]
MULTI = [Message("system", "Be brief."), Message("user", "Hi"), Message("assistant", "Hello!"),
         Message("user", Q), Message("assistant", A)]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def parse_file(path):
    issues = Issues()
    convs = list(read_conversations([str(path)], issues))
    return convs, issues


@pytest.mark.parametrize("record", [
    {"conversations": [{"from": "human", "value": Q}, {"from": "gpt", "value": A}]},
    {"messages": [{"role": "user", "content": Q}, {"role": "assistant", "content": A}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is "},
                                               {"type": "text", "text": "2 + 2?"}]},
                  {"role": "assistant", "content": A}]},
    {"question": Q, "answer": A},
    {"prompt": Q, "response": A},
    {"prompt": Q, "completion": A},
    {"instruction": Q, "input": "", "output": A},
    {"messages": [[{"text": Q, "sender": "s1"}],
                  [{"text": "2 + 2", "sender": "s2"}, {"text": "= 4.", "sender": "s2"}]]},
], ids=["sharegpt", "openai", "openai-parts", "gsm8k", "prompt-response", "prompt-completion", "alpaca", "chitchat"])
def test_single_turn_formats_agree(tmp_path, record):
    convs, issues = parse_file(write_jsonl(tmp_path / "d.jsonl", [record]))
    assert not issues.counts
    expected = (SINGLE if "sender" not in json.dumps(record)
                else [Message("user", Q), Message("assistant", "2 + 2\n= 4.")])
    assert convs[0].messages == expected
    assert convs[0].id == "d:1"  # no own id: <file stem>:<line>


@pytest.mark.parametrize("record", [
    {"id": "c7", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                   {"from": "gpt", "value": "Hello!"}, {"from": "user", "value": Q},
                                   {"from": "assistant", "value": A}]},
    {"id": "c7", "messages": [{"role": m.role, "content": m.content} for m in MULTI]},
], ids=["sharegpt", "openai"])
def test_multi_turn_formats_agree(tmp_path, record):
    convs, issues = parse_file(write_jsonl(tmp_path / "m.jsonl", [record]))
    assert not issues.counts
    assert convs[0] == Conversation(id="c7", messages=MULTI, source=convs[0].source)


def test_prompt_only_formats(tmp_path):
    records = [{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
               {"prompt": "Write a poem."}, {"instruction": "Translate.", "input": "Bonjour"},
               {"question": "Write a poem."}]
    convs, issues = parse_file(write_jsonl(tmp_path / "q.jsonl", records))
    assert not issues.counts
    assert convs[0].id == "81" and convs[0].messages == [Message("user", "Write a poem."),
                                                         Message("user", "Now shorter.")]
    assert convs[1].messages == [Message("user", "Write a poem.")] == convs[3].messages
    assert convs[2].messages == [Message("user", "Translate.\n\nBonjour")]
    assert not any(c.has_assistant for c in convs)


def test_alpaca_with_system_and_input(tmp_path):
    rec = {"system": "Be brief.", "instruction": "Add.", "input": "2 and 2", "output": "4"}
    convs, _ = parse_file(write_jsonl(tmp_path / "a.jsonl", [rec]))
    assert convs[0].messages == [Message("system", "Be brief."), Message("user", "Add.\n\n2 and 2"),
                                 Message("assistant", "4")]


def test_json_array_and_mapping_files(tmp_path):
    rec = {"messages": [{"role": "user", "content": Q}, {"role": "assistant", "content": A}]}
    arr = tmp_path / "arr.json"
    arr.write_text("[\n" + json.dumps(rec) + ",\n\n" + json.dumps(dict(rec, id="x")) + "\n]\n", encoding="utf-8")
    convs, _ = parse_file(arr)
    assert [c.id for c in convs] == ["arr:2", "x"] and all(c.messages == SINGLE for c in convs)
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"k1": rec, "k2": {"question": Q, "answer": A}}), encoding="utf-8")
    convs, _ = parse_file(mapping)
    assert [c.id for c in convs] == ["k1", "k2"] and all(c.messages == SINGLE for c in convs)
    single = tmp_path / "one.json"
    single.write_text(json.dumps(rec, indent=2), encoding="utf-8")
    assert parse_file(single)[0][0].messages == SINGLE


def test_malformed_lines_counted_not_fatal(tmp_path):
    good = json.dumps({"question": Q, "answer": A}).encode()
    lines = [
        good,                                                   # 1 ok
        b'{"question": "unterminated',                          # 2 malformed-json
        b'{"question": "caf\xe9", "answer": "x"}',              # 3 invalid-utf8 (latin-1 byte)
        b'{"foo": 1}',                                          # 4 unknown-format
        b'{"messages": []}',                                    # 5 empty-conversation
        b'{"messages": [{"role": "user", "content": "  "}]}',   # 6 empty-message
        b'{"messages": [{"role": "tool", "content": "x"}]}',    # 7 unknown-role
        b'',                                                    # 8 blank: skipped silently
        b'[1, 2]',                                              # 9 unknown-format (not an object)
        b'{"messages": [{"role": "assistant", "content": "x"}]}',  # 10 no-user-message
        b'{"question": "\\udc80", "answer": "x"}',              # 11 invalid-utf8 (escaped lone surrogate)
        b'{"prompt": "Only a prompt"}',                         # 12 ok, prompt-only
        good,                                                   # 13 ok
    ]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    convs, issues = parse_file(path)
    assert [c.id for c in convs] == ["bad:1", "bad:12", "bad:13"]
    expected = {"malformed-json": 2, "invalid-utf8": 3, "unknown-format": 4, "empty-conversation": 5,
                "empty-message": 6, "unknown-role": 7, "no-user-message": 10}
    for reason, line in expected.items():
        assert any(p["where"] == f"{path}:{line}" for p in issues.places[reason]), reason
    assert issues.counts == {**{r: 1 for r in expected}, "invalid-utf8": 2, "unknown-format": 2}
    assert len(issues.lines()) == len(issues.counts)


def test_malformed_json_array_element_reports_its_line(tmp_path):
    path = tmp_path / "arr.json"
    path.write_text('[\n {"question": "a", "answer": "b"},\n {"question": oops},\n {"question": "c"}\n]',
                    encoding="utf-8")
    convs, issues = parse_file(path)
    assert len(convs) == 1 and issues.counts == {"malformed-json": 1}
    assert issues.places["malformed-json"][0]["where"] == f"{path}:3 (record 1)"


def test_missing_file_is_one_clear_error(tmp_path):
    with pytest.raises(EyasError, match="not found"):
        resolve_data(str(tmp_path / "nope.jsonl"))


def test_parse_record_direct(tmp_path):
    conv = parse_record({"id": 5, "question": Q, "answer": A, "source": "mine"}, stem="f", name="f.jsonl",
                        where="f.jsonl:9")
    assert conv.id == "5" and conv.source == "mine" and conv.messages == SINGLE
    assert conv.to_record() == {"id": "5", "messages": [{"role": "user", "content": Q},
                                                        {"role": "assistant", "content": A}], "source": "mine"}


def test_content_key_ignores_spacing_only():
    a = Conversation("1", [Message("user", "Hi  there\n"), Message("assistant", "Yo")], "s")
    b = Conversation("2", [Message("user", "Hi there"), Message("assistant", "Yo")], "t")
    c = Conversation("3", [Message("user", "Hi there"), Message("assistant", "yo")], "t")
    assert a.content_key() == b.content_key() != c.content_key()


# sha256 of the upstream files (FastChat's question.jsonl, grade-school-math's train and test.jsonl)
UPSTREAM = {"mt-bench": "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
            "gsm8k-train": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
            "gsm8k_test": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14"}


def test_shorthands_resolve_to_the_data_eyas_ships(tmp_path, monkeypatch):
    """Issue 44: the built-in names need nothing beside eyas: the shipped files, unpacked into the cache, are the
    upstream files byte for byte, and parse into their record counts."""
    import hashlib

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EYAS_SHARED_DATA", raising=False)
    for name, n in (("mt-bench", 80), ("gsm8k-train", 7473), ("gsm8k_test", 1319)):
        (path,) = resolve_data(name)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == UPSTREAM[name], name
        convs, issues = parse_file(path)
        assert len(convs) == n and not issues.counts
    assert convs[0].messages[0].role == "user" and convs[0].has_assistant


def test_chitchat_package():
    pytest.importorskip("chitchat_dataset")
    (path,) = resolve_data("chitchat")
    raw = json.loads(path.read_text(encoding="utf-8"))
    convs, issues = parse_file(path)
    assert len(convs) + issues.total() == len(raw) == 7168
    key, rec = next(iter(raw.items()))
    first = next(c for c in convs if c.id == key)
    senders = [g[0]["sender"] for g in rec["messages"]]
    expected = [Message("user" if s == senders[0] else "assistant", "\n".join(u["text"].strip() for u in g))
                for s, g in zip(senders, rec["messages"])]
    assert first.messages == expected


def test_bom_and_bad_bytes_in_a_json_array(tmp_path):
    path = tmp_path / "b.json"
    path.write_bytes(b"\xef\xbb\xbf[\n" + json.dumps({"question": Q, "answer": A}).encode() + b",\n"
                     + b'{"question": "caf\xe9", "answer": "x"}\n]')
    convs, issues = parse_file(path)
    assert [c.messages for c in convs] == [SINGLE] and issues.counts == {"invalid-utf8": 1}
    assert issues.places["invalid-utf8"][0]["where"] == f"{path}:3 (record 1)"


def test_writingbench_queries_are_prompts(tmp_path):
    rec = {"index": 7, "domain1": "Academic & Engineering", "domain2": "Paper Outline", "query": "Outline a review.",
           "checklist": [{"name": "x"}]}
    convs, issues = parse_file(write_jsonl(tmp_path / "wb.jsonl", [rec]))
    assert not issues.counts
    assert convs[0].messages == [Message("user", "Outline a review.")] and not convs[0].has_assistant


def test_writingbench_package():
    pytest.importorskip("inspect_evals")
    (path,) = resolve_data("writingbench")
    assert path.name == "benchmark_all.jsonl"
    convs, issues = parse_file(path)
    raw = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(convs) == len(raw) == 1000 and not issues.counts
    assert [c.messages[0].content for c in convs[:5]] == [r["query"] for r in raw[:5]]
