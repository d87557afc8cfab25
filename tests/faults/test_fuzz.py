"""Fuzzing the parsers of outside data: chat files (eyas.data.formats) and training logs (eyas.doctor.logformats,
eyas doctor).

Whatever the bytes (random, cut, nested 10,000 deep, lines of tens of MB, values of the wrong type), a parser
answers (conversations and counted issues; a doctor report) or raises EyasError, and never hangs: every example
runs under a wall-clock limit. What it answers must be usable: a conversation the regenerate output can hold
(UTF-8, a user turn, no empty message), a doctor report that serialises to JSON.
(tests/test_doctor.py already fuzzes raw log bytes; here the run-folder files and the chat formats.)
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from eyas.core.errors import EyasError
from eyas.data.formats import ROLES, Conversation, Issues
from eyas.data.sources import read_conversations

LIMIT_S = 20.0  # wall-clock limit of one example: far above what any takes, far below a hang


class Hang(BaseException):  # a BaseException, so no `except Exception` in eyas can swallow it
    pass


@contextlib.contextmanager
def time_limit(seconds: float = LIMIT_S):
    def fire(signum, frame):
        raise Hang(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def examples(full: bool) -> int:
    return 3000 if full else 120


def fuzz_settings(full: bool):
    return settings(max_examples=examples(full), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


# ---------------------------------------------------------------- chat data

FORMAT_KEYS = ["conversations", "messages", "from", "value", "role", "content", "turns", "question", "answer",
               "instruction", "input", "output", "system", "prompt", "response", "completion", "id", "question_id",
               "conversation_id", "source", "text", "sender", "type"]
ROLE_WORDS = ["human", "user", "gpt", "assistant", "system", "model", "bard", "tool", "", "USER "]
ODD_TEXT = ["", " ", "\ud800", "x\udfff", "\x00", "\ufeff", "é", "\u2028", "[", "{"]  # lone surrogates: JSON "\ud800"

texts = st.one_of(st.text(max_size=12), st.sampled_from(ODD_TEXT))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), texts)
keys = st.one_of(st.sampled_from(FORMAT_KEYS), texts)
values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(keys, kids,
                                                                                                   max_size=4)),
                      max_leaves=16)
maybe_text = st.one_of(texts, texts, values)  # mostly text, sometimes any value
role = st.one_of(st.sampled_from(ROLE_WORDS), values)


def _record():
    """Records of every format, with fields of the wrong type now and then, or anything at all."""
    turn = st.fixed_dictionaries({}, optional={"from": role, "value": maybe_text, "role": role, "content": maybe_text})
    parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]), "text": maybe_text}),
                     max_size=3)
    openai_msg = st.fixed_dictionaries({"role": role, "content": st.one_of(maybe_text, parts)})
    chit = st.lists(st.lists(st.fixed_dictionaries({"text": maybe_text, "sender": st.sampled_from(["a", "b", "c"])}),
                             max_size=3), max_size=4)
    own = {"id": st.one_of(texts, values), "source": maybe_text}
    return st.one_of(
        st.fixed_dictionaries({"conversations": st.one_of(st.lists(turn, max_size=5), values)}, optional=own),
        st.fixed_dictionaries({"messages": st.one_of(st.lists(openai_msg, max_size=5), chit, values)}, optional=own),
        st.fixed_dictionaries({"turns": st.one_of(st.lists(maybe_text, max_size=3), values)},
                              optional={"question_id": st.one_of(st.integers(), texts, values)}),
        st.fixed_dictionaries({"prompt": maybe_text}, optional={"response": maybe_text, "completion": maybe_text,
                                                                "system": maybe_text, **own}),
        st.fixed_dictionaries({"question": maybe_text}, optional={"answer": maybe_text}),
        st.fixed_dictionaries({"instruction": maybe_text}, optional={"input": maybe_text, "output": maybe_text}),
        values,
    )


def _layout(records: list, how: str) -> bytes:
    if how == "jsonl":
        return "".join(json.dumps(r) + "\n" for r in records).encode()
    if how == "array":
        return json.dumps(records, indent=1).encode()
    return json.dumps({f"k{i}": r for i, r in enumerate(records)}).encode()  # the id -> record mapping


@st.composite
def chat_files(draw) -> tuple[str, bytes]:
    """(suffix, content): records laid out as JSONL, a JSON array or a mapping, then maybe damaged."""
    how = draw(st.sampled_from(["jsonl", "array", "mapping"]))
    data = _layout(draw(st.lists(_record(), max_size=6)), how)
    damage = draw(st.sampled_from(["none", "none", "cut", "flip", "insert", "bytes"]))
    at = draw(st.integers(0, max(0, len(data) - 1)))
    if damage == "cut":
        data = data[:at]
    elif damage == "flip" and data:
        data = data[:at] + bytes([data[at] ^ (1 << draw(st.integers(0, 7)))]) + data[at + 1:]
    elif damage == "insert":
        data = data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]
    elif damage == "bytes":
        data = draw(st.binary(max_size=300))
    return draw(st.sampled_from([".jsonl", ".json", ".ndjson"])), data


def check_conversations(path: Path) -> tuple[list[Conversation], Issues]:
    """Parse a file; every conversation returned must be one that regenerate and prepare can use."""
    issues = Issues()
    with time_limit():
        try:
            convs = list(read_conversations([str(path)], issues))
        except EyasError:
            return [], issues
    for c in convs:
        assert isinstance(c.id, str) and c.id and isinstance(c.source, str)
        assert any(m.role == "user" for m in c.messages)
        assert all(m.role in ROLES and isinstance(m.content, str) and m.content.strip() for m in c.messages)
        json.dumps(c.to_record(), ensure_ascii=False).encode("utf-8")  # what regenerate appends to its output
    return convs, issues


def test_fuzz_chat_files(tmp_path, faults_full, tally):
    @fuzz_settings(faults_full)
    @given(chat_files())
    @example((".jsonl", b'{"prompt": "hi", "id": "\\ud800"}\n'))  # an id that cannot be written as UTF-8
    @example((".jsonl", b'{"prompt": "hi", "source": "x\\udfff"}\n'))
    @example((".json", b'{"k\xff": {"prompt": "hi"}}'))  # a mapping key with a byte that is not UTF-8
    def prop(file):
        suffix, data = file
        path = tmp_path / f"fuzz{suffix}"
        path.write_bytes(data)
        check_conversations(path)
        tally("fuzz cases run: chat parsers")

    prop()


def nested(depth: int, kind: str) -> str:
    return {"list": "[" * depth + "]" * depth, "dict": '{"a":' * depth + "1" + "}" * depth,
            "open": "[" * depth}[kind]


def test_fuzz_chat_deep_nesting(tmp_path, faults_full, tally):
    """JSON nested up to 20,000 deep (Python's json gives up near 1,000: RecursionError), everywhere it can be."""
    places = ["line", "array", "file", "messages", "content", "role", "turns", "id", "mapping"]

    @fuzz_settings(faults_full)
    @given(depth=st.one_of(st.integers(1, 20_000), st.integers(900, 1100), st.just(10_000)),
           kind=st.sampled_from(["list", "dict", "open"]), where=st.sampled_from(places))
    def prop(depth, kind, where):
        deep = nested(depth, kind)
        good = json.dumps({"id": "good", "prompt": "hello"})
        body = {"line": f"{good}\n{deep}\n{good.replace('good', 'good2')}\n",
                "array": f"[{good}, {deep}]", "file": deep,
                "messages": f'{{"messages": {deep}}}\n{good}\n',
                "content": f'{{"messages": [{{"role": "user", "content": {deep}}}]}}\n{good}\n',
                "role": f'{{"conversations": [{{"from": {deep}, "value": "x"}}]}}\n{good}\n',
                "turns": f'{{"turns": [{deep}]}}\n{good}\n', "id": f'{{"id": {deep}, "prompt": "x"}}\n{good}\n',
                "mapping": f'{{"a": {{"prompt": "x"}}, "b": {deep}}}'}[where]
        path = tmp_path / ("deep.json" if where in ("array", "file", "mapping") else "deep.jsonl")
        path.write_text(body)
        convs, _ = check_conversations(path)
        if where in ("line", "messages", "content", "role", "turns"):  # the good records next to it survive
            assert "good" in {c.id for c in convs}
        tally("fuzz cases run: chat parsers")

    prop()


HUGE = 24 << 20  # 24 MiB


@pytest.mark.parametrize("shape", ["record", "garbage", "spaces-in-array", "many-small"])
def test_chat_huge_lines(tmp_path, shape, faults_full, tally):
    """Lines of tens of MB: parsed in linear time, the records around them intact."""
    if not faults_full and shape == "many-small":
        pytest.skip("full strength only (--faults-full)")
    good = json.dumps({"id": "good", "prompt": "hello"})
    path = tmp_path / ("h.json" if shape == "spaces-in-array" else "h.jsonl")
    with open(path, "w") as f:
        if shape == "record":  # one valid conversation whose text is 24 MiB
            f.write(json.dumps({"id": "big", "prompt": "x" * HUGE}) + "\n" + good + "\n")
        elif shape == "garbage":
            f.write("{" + "\x01[" * (HUGE // 2) + "\n" + good + "\n")
        elif shape == "spaces-in-array":
            f.write("[" + good + "," + " " * HUGE + good.replace("good", "good2") + "]")
        else:
            f.write("".join(json.dumps({"id": f"s{i}", "prompt": "y"}) + "\n" for i in range(400_000)))
    t0 = time.perf_counter()
    convs, issues = check_conversations(path)
    elapsed = time.perf_counter() - t0
    ids = [c.id for c in convs]
    if shape == "record":
        assert ids == ["big", "good"] and len(convs[0].messages[0].content) == HUGE
    elif shape == "garbage":
        assert ids == ["good"] and issues.counts["malformed-json"] == 1
    elif shape == "spaces-in-array":
        assert ids == ["good", "good2"]
    else:
        assert len(ids) == 400_000
    assert elapsed < 15, f"{shape}: {elapsed:.1f} s"
    tally("fuzz cases run: chat parsers")


# ---------------------------------------------------------------- training logs (eyas doctor)

numbers = st.one_of(st.integers(-(2**70), 2**70), st.floats(), st.sampled_from([0, -1, 1e308, 1e-320]))
odd = st.one_of(numbers, values, st.just(math.inf))
METRIC_KEYS = ["step", "epoch", "lr", "loss", "loss_i", "acc_i", "tokens_per_s", "samples_seen_global", "elapsed_s",
               "duplicate_data", "grad_norm"]
PLAN_KEYS = ["samples", "epochs", "world_size", "micro_batch", "grad_accum", "optimizer_steps_per_epoch",
             "optimizer_steps_total", "optimizer_steps_run"]
AUDIT_KEYS = ["samples", "world_size", "per_rank", "per_rank_max", "padded", "dropped", "disjoint", "units", "epochs",
              "ok", "allowed", "missing"]


def _metric_line(step: int):
    """A metrics.jsonl record of step `step` whose fields are right, missing or of the wrong type."""
    right = {"step": st.just(step), "epoch": st.just(0), "lr": st.just(1e-4), "loss": st.just(2.0),
             "samples_seen_global": st.just(4 * step), "elapsed_s": st.just(0.5 * step)}
    return st.fixed_dictionaries({k: st.one_of(v, odd) for k, v in right.items()},
                                 optional={k: odd for k in METRIC_KEYS if k not in right})


def _json_file(keys: list[str]):
    good = st.fixed_dictionaries({k: st.integers(1, 50) for k in keys[:6]}, optional={k: odd for k in keys[6:]})
    return st.one_of(good, st.dictionaries(st.sampled_from(keys), odd, max_size=8), values)


def _dumps(obj) -> str:
    return json.dumps(obj, allow_nan=True)


@st.composite
def run_folders(draw) -> dict[str, str | None]:
    steps = draw(st.lists(st.integers(0, 20).flatmap(_metric_line), max_size=25))
    metrics = "\n".join(_dumps(s) for s in steps)
    extra = draw(st.sampled_from(["", "deep", "huge-number", "cut"]))
    if extra == "deep":
        metrics += "\n" + '{"step": 3, "x": ' + nested(draw(st.integers(500, 20_000)), "list") + "}"
    elif extra == "huge-number":
        metrics += '\n{"step": ' + "9" * 5000 + ', "lr": 1e999, "epoch": -1e999}'
    elif extra == "cut" and metrics:
        metrics = metrics[: draw(st.integers(0, len(metrics)))]
    return {"metrics.jsonl": metrics + "\n", "plan.json": _side_file(draw, PLAN_KEYS),
            "audit.json": _side_file(draw, AUDIT_KEYS)}


def _side_file(draw, keys: list[str]) -> str | None:
    """plan.json / audit.json: absent, JSON with fields right or wrong, nested too deep, or bytes."""
    choice = draw(st.sampled_from(["absent", "json", "json", "deep", "bytes"]))
    if choice == "json":
        return _dumps(draw(_json_file(keys)))
    if choice == "deep":
        return nested(draw(st.integers(900, 20_000)), draw(st.sampled_from(["list", "dict"])))
    return draw(st.binary(max_size=64)).decode("latin-1") if choice == "bytes" else None


def doctor_report(folder: Path, **hints) -> dict | None:
    from eyas.doctor.diagnose import DoctorConfig, run

    with time_limit():
        try:
            rep = run(DoctorConfig(logs=(str(folder),), quiet=True, **hints))
        except EyasError:
            return None
    json.dumps(rep)  # the --json output must serialise
    return rep


def test_fuzz_doctor_run_folders(tmp_path, faults_full, tally):
    """An eyas run folder whose metrics.jsonl, plan.json and audit.json hold anything at all."""

    plan = {"samples": 1e999, "epochs": 1, "world_size": 1, "micro_batch": 1, "grad_accum": 1,
            "optimizer_steps_per_epoch": 1, "optimizer_steps_total": 1}  # 1e999 reads as inf: int(inf) overflows

    @fuzz_settings(faults_full)
    @given(files=run_folders(), samples=st.integers(0, 40), world=st.integers(0, 4))
    @example(files={"metrics.jsonl": '{"step": 1, "lr": 0.1}\n', "plan.json": _dumps(plan), "audit.json": None},
             samples=0, world=0)
    @example(files={"metrics.jsonl": '{"step": 1}\n', "plan.json": nested(5000, "list"), "audit.json": None},
             samples=0, world=0)
    def prop(files, samples, world):
        for name, text in files.items():
            p = tmp_path / name
            p.unlink(missing_ok=True)
            if text is not None:
                p.write_text(text, encoding="utf-8", errors="surrogatepass")
        rep = doctor_report(tmp_path, samples=samples, world_size=world)
        if rep is not None:
            assert rep["logs"][0]["verdict"] in ("sharded", "not sharded", "undecidable")
        tally("fuzz cases run: log parsers")

    prop()


def test_fuzz_log_parser_lines(faults_full, tally):
    """LogParser.feed on any text: every format's fragments, mixed with random text and control characters."""
    from eyas.doctor.logformats import LogParser

    fragments = ["step 3: {'lr': 1e-4, 'loss': 2}", "[rank1]: ", "global_step=", "epoch=0, lr=", "\r", "\x1b[2K",
                 '{"step": 2, "lr": [1], "epoch": {"a": 1}, "elapsed_s": "x", "samples_seen_global": true}',
                 '{"step": 1e400}', '{"step": ' + "9" * 400 + "}", "[23:59:59] INFO     train/loss=0.1",
                 " " * 20 + "global_step=7 train/x=1", "2025-02-30 25:61:61 ", "E1399 99:99:99.9 ",
                 "data: 9 samples over 2 ranks -> 5 per rank per epoch (1 padded), disjoint: yes", "99%|█| 1/0 [",
                 "plan: dataset 1,000,000,000,000,000 samples (global), 1 epochs", "lr " + "9" * 30, "epoch 1/0"]

    @fuzz_settings(faults_full)
    @given(st.lists(st.lists(st.one_of(st.sampled_from(fragments), st.text(max_size=20)), max_size=12)
                    .map("".join), max_size=40))
    def prop(lines):
        parser = LogParser()
        with time_limit():
            for i, line in enumerate(lines, 1):
                parser.feed(i, line)
            parser.finish()
        for s in parser.steps:
            assert s.step is None or isinstance(s.step, int)
            assert all(v is None or math.isfinite(v) for v in (s.lr, s.loss, s.epoch, s.time))
        tally("fuzz cases run: log parsers")

    prop()


def test_doctor_huge_lines(tmp_path, tally):
    """A metrics.jsonl with a 24 MiB line among good ones: cut at the parsers' line limit, the steps around it read."""
    lines = [json.dumps({"step": i, "epoch": 0, "lr": 1e-4, "loss": 2.0, "elapsed_s": float(i)}) for i in range(1, 6)]
    lines.insert(2, '{"step": 99, "pad": "' + "x" * HUGE + '"}')
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    t0 = time.perf_counter()
    rep = doctor_report(tmp_path)
    assert rep is not None and time.perf_counter() - t0 < 15
    log = rep["logs"][0]
    assert log["steps_found"] == 5 and log["truncated_lines"] == 1
    tally("fuzz cases run: log parsers")
