"""eyas regenerate: turn-by-turn answers, against a small OpenAI-compatible server of the test's own and the tiny
target."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from eyas.core.errors import EyasError, Incomplete
from eyas.data.regenerate import RegenerateConfig, read_done, run

REPO = Path(__file__).resolve().parents[1]


def canned_answer(messages):
    """The server's deterministic reply: which turn it is and what the user just said."""
    turn = sum(m["role"] == "assistant" for m in messages) + 1
    return f"answer {turn} to {messages[-1]['content']}"


class Canned:
    """A deterministic OpenAI-compatible chat server on 127.0.0.1 with scripted faults."""

    def __init__(self, faults=(), ok_then_fail=None, delay=0.0, key=None):
        self.faults = list(faults)  # actions of the first requests: 500, garbage, nochoices, close
        self.ok_then_fail = ok_then_fail  # after this many good answers, answer 500 forever
        self.delay, self.key = delay, key
        self.lock = threading.Lock()
        self.answered, self.failed, self.models_asked = [], 0, 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def _action(self):
        with self.lock:
            if self.faults:
                self.failed += 1
                return self.faults.pop(0)
            if self.ok_then_fail is not None and len(self.answered) >= self.ok_then_fail:
                self.failed += 1
                return "500"
            return "ok"

    def _handler(self):
        canned = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, payload: bytes):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                canned.models_asked += 1
                self._send(200, json.dumps({"object": "list", "data": [{"id": "canned-model"}]}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if canned.key and self.headers.get("Authorization") != f"Bearer {canned.key}":
                    return self._send(401, b'{"error": "bad key"}')
                action = canned._action()
                if action == "close":
                    self.close_connection = True
                    return self.connection.shutdown(socket.SHUT_RDWR)
                if action in ("500", "garbage", "nochoices"):
                    code, payload = {"500": (500, b'{"error": "boom"}'), "garbage": (200, b"{not json"),
                                     "nochoices": (200, b'{"object": "error"}')}[action]
                    return self._send(code, payload)
                time.sleep(canned.delay)
                reply = canned_answer(body["messages"])
                with canned.lock:
                    canned.answered.append(body)
                self._send(200, json.dumps({
                    "id": "x", "object": "chat.completion", "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": len(reply.split())}}).encode())

        return Handler

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    made = []

    def make(**kw):
        made.append(Canned(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture
def quick_retries(monkeypatch):
    monkeypatch.setattr("eyas.data.server.BACKOFF_S", 0.01)


def make_data(tmp_path, n=12):
    """n conversations mixing MT-Bench turns, OpenAI messages with a system prompt and GSM8K."""
    recs = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            recs.append({"question_id": f"q{i}", "turns": [f"first {i}", f"second {i}"]})
        elif kind == 1:
            recs.append({"id": f"m{i}", "messages": [{"role": "system", "content": "Be kind."},
                                                     {"role": "user", "content": f"hello {i}"},
                                                     {"role": "assistant", "content": "an old answer"},
                                                     {"role": "user", "content": f"again {i}"}]})
        else:
            recs.append({"question": f"math {i}", "answer": "old"})
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return path


def expected_records(path):
    """The regenerated conversations, replayed independently from the raw records."""
    out = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        r = json.loads(line)
        if "turns" in r:
            rid, script = str(r["question_id"]), [{"role": "user", "content": t} for t in r["turns"]]
        elif "messages" in r:
            rid, script = r["id"], [m for m in r["messages"] if m["role"] != "assistant"]
        else:
            rid, script = f"{path.stem}:{n}", [{"role": "user", "content": r["question"]}]
        msgs = []
        for m in script:
            msgs.append(m)
            if m["role"] == "user":
                msgs.append({"role": "assistant", "content": canned_answer(msgs)})
        out[rid] = msgs
    return out


def read_out(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def run_incomplete(c: RegenerateConfig) -> dict:
    """A run that leaves conversations to do ends Incomplete (the CLI exits 3), carrying what it did."""
    with pytest.raises(Incomplete, match="left to do") as e:
        run(c)
    return e.value.summary


def cfg(data, out, url, **kw):
    base = dict(data=(str(data),), out=str(out), server=url, concurrency=3, retries=3, retry_time=5, timeout=5,
                quiet=True)
    return RegenerateConfig(**{**base, **kw})


def test_server_regenerates_turn_by_turn(servers, tmp_path):
    srv = servers()
    data, out = make_data(tmp_path), tmp_path / "out.jsonl"
    summary = run(cfg(data, out, srv.url))
    got = read_out(out)
    want = expected_records(data)
    assert sorted(r["id"] for r in got) == sorted(want)
    for r in got:
        assert r["messages"] == want[r["id"]] and isinstance(r["source"], str)
    # the second turn was asked after the model's own first answer, not the data's old one
    second = [b for b in srv.answered if b["messages"][-1]["content"] == "again 1"]
    assert second[0]["messages"][2] == {"role": "assistant", "content": "answer 1 to hello 1"}
    assert {b["model"] for b in srv.answered} == {"canned-model"} and srv.models_asked == 1
    assert summary["done"] == 12 and summary["failed"] == 0 and summary["skipped"] == 0
    assert summary["tokens"] == sum(len(m["content"].split()) for r in got for m in r["messages"][1:]
                                    if m["role"] == "assistant")
    again = run(cfg(data, out, srv.url))  # everything is done: nothing is asked again
    assert again["skipped"] == 12 and again["done"] == 0 and len(read_out(out)) == 12


def test_max_turns_answers_only_the_first_user_turns(servers, tmp_path):
    srv = servers()
    data, out = make_data(tmp_path), tmp_path / "out.jsonl"
    run(cfg(data, out, srv.url, max_turns=1))
    want = expected_records(data)
    for r in read_out(out):  # each conversation cut before its second user message, then answered
        full = want[r["id"]]
        second = [i for i, m in enumerate(full) if m["role"] == "user"][1:]
        assert r["messages"] == (full[:second[0]] if second else full)
        assert sum(m["role"] == "user" for m in r["messages"]) == 1
    assert not any(b["messages"][-1]["content"].startswith(("again", "second")) for b in srv.answered)


def test_faults_are_retried(servers, tmp_path, quick_retries):
    srv = servers(faults=["500", "garbage", "close", "nochoices", "500"])
    data, out = make_data(tmp_path, 6), tmp_path / "out.jsonl"
    summary = run(cfg(data, out, srv.url, concurrency=1, retries=5, model="m"))
    assert summary["failed"] == 0 and summary["done"] == 6 and srv.failed == 5
    want = expected_records(data)
    assert {r["id"]: r["messages"] for r in read_out(out)} == want


def test_failing_server_is_reported_and_done_work_kept(servers, tmp_path, quick_retries, monkeypatch):
    monkeypatch.setattr("eyas.data.server.GIVE_UP_AFTER", 4)
    srv = servers(ok_then_fail=5)
    data, out = make_data(tmp_path, 30), tmp_path / "out.jsonl"
    summary = run_incomplete(cfg(data, out, srv.url, concurrency=1, retries=2, model="m"))
    kept = read_out(out)
    assert len(kept) == summary["done"] >= 2 and summary["failed"] == 4
    assert summary["failures"]["http-500"]["count"] == 4
    assert summary["failures"]["http-500"]["examples"][0]["where"].startswith(f"{data}:")
    assert "after 3 attempts" in summary["failures"]["http-500"]["examples"][0]["detail"]
    assert summary["stopped_early"] and summary["not_started"] == 30 - summary["done"] - 4
    healthy = servers()  # the same model, served again elsewhere: the rerun resumes
    summary = run(cfg(data, out, healthy.url, model="m"))
    got = read_out(out)
    assert summary["skipped"] == len(kept) and summary["done"] == 30 - len(kept)
    assert sorted(r["id"] for r in got) == sorted(expected_records(data)) and got[: len(kept)] == kept


def test_refused_connection_is_retried_then_reported(tmp_path, quick_retries):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    data, out = make_data(tmp_path, 3), tmp_path / "out.jsonl"
    url = f"http://127.0.0.1:{port}"
    summary = run_incomplete(cfg(data, out, url, retries=2, model="m"))
    assert summary["failed"] == 3 and summary["failures"]["connection-error"]["count"] == 3
    assert read_out(out) == []
    with pytest.raises(EyasError, match="cannot list the models"):
        run(cfg(data, out, url, retries=0))


def test_api_key_is_sent_and_never_shown(servers, tmp_path, monkeypatch, capsys):
    secret = "sk-eyas-test-4c1d"
    srv = servers(key=secret)
    data, out = make_data(tmp_path, 3), tmp_path / "out.jsonl"
    monkeypatch.setenv("EYAS_API_KEY", secret)
    summary = run(cfg(data, out, srv.url, quiet=False))
    assert summary["done"] == 3
    monkeypatch.delenv("EYAS_API_KEY")
    keyfile = tmp_path / "key"
    keyfile.write_text(secret + "\n")
    assert run(cfg(data, tmp_path / "o2.jsonl", srv.url, api_key_file=str(keyfile)))["done"] == 3
    wrong = run_incomplete(cfg(data, tmp_path / "o3.jsonl", srv.url, retries=3))  # no key: 401 is not retried
    assert wrong["failures"]["http-401"]["count"] == 3 and "after" not in json.dumps(wrong["failures"])
    seen = capsys.readouterr()
    for text in (seen.out, seen.err, json.dumps(summary), out.read_text()):
        assert secret not in text


def test_torn_last_line_is_dropped_and_corrupt_middle_refused(tmp_path):
    out = tmp_path / "o.jsonl"
    good = [json.dumps({"id": str(i), "messages": [], "source": "s"}) + "\n" for i in range(3)]
    out.write_text("".join(good) + '{"id": "3", "mess')
    assert read_done(out) == {"0", "1", "2"}
    assert out.read_text() == "".join(good)
    out.write_text(good[0] + "garbage\n" + good[1])
    with pytest.raises(EyasError, match="o.jsonl:2"):
        read_done(out)
    assert out.read_text() == good[0] + "garbage\n" + good[1]  # nothing destroyed
    other = tmp_path / "data.json"  # a whole file without a newline (json.dump) is not a torn line of eyas's
    other.write_text('[{"messages": []}]')
    with pytest.raises(EyasError, match="data.json:1 is not a line eyas wrote"):
        read_done(other)
    assert other.read_text() == '[{"messages": []}]'


def test_sigkill_then_rerun_resumes_without_duplicates_or_gaps(servers, tmp_path):
    srv = servers(delay=0.15)  # 30 prompts, 2 at a time: 2.2 s, a wide window for the kill to land mid-run
    data, out = make_data(tmp_path, 30), tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "eyas", "regenerate", "--server", srv.url, "--data", str(data), "--out", str(out),
           "--concurrency", "2", "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not out.exists() or out.read_text().count("\n") < 4):
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    lines_before = out.read_text().count("\n")
    assert 4 <= lines_before < 30
    with open(out, "ab") as f:  # as if the kill had landed mid-write
        f.write(b'{"id": "q0", "messages": [{"role": "us')
    summary = run(cfg(data, out, srv.url))
    got = read_out(out)
    ids = [r["id"] for r in got]
    want = expected_records(data)
    assert len(ids) == len(set(ids)) == 30 and set(ids) == set(want)
    assert all(r["messages"] == want[r["id"]] for r in got)
    assert summary["skipped"] == lines_before and summary["done"] == 30 - lines_before


@pytest.fixture
def local_tiny(tiny_target, monkeypatch):
    monkeypatch.setattr("eyas.data.local.load_target", lambda spec, **kw: tiny_target)
    monkeypatch.setattr("eyas.data.regenerate.plan_workers", lambda cfg, n: (1, "this process"))  # patched here
    # one thread: on a shared 2-core machine OpenMP's second thread makes these tiny forwards ~10x slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_target
    torch.set_num_threads(threads)


def greedy_reference(target, messages, max_new_tokens):
    """Greedy decoding by hand: argmax of the full forward, one token at a time."""
    tok = target.tokenizer
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"])
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            t = int(target.model(torch.tensor([ids + new])).logits[0, -1].argmax())
            if t == tok.convert_tokens_to_ids("<|im_end|>"):
                break
            new.append(t)
    return tok.decode(new, skip_special_tokens=True)


@pytest.mark.parametrize("generator,batch", [("hf", 1), ("lean", 3)])
def test_local_backend_matches_greedy_reference(local_tiny, tmp_path, generator, batch):
    data, out = make_data(tmp_path, 4), tmp_path / "out.jsonl"
    summary = run(RegenerateConfig(data=(str(data),), out=str(out), target="tiny", max_new_tokens=6,
                                   batch_size=batch, generator=generator, quiet=True))
    got = {r["id"]: r["messages"] for r in read_out(out)}
    compared = 0
    for rid, script in expected_records(data).items():
        msgs = []
        for m in script:
            if m["role"] == "assistant":
                reply = greedy_reference(local_tiny, msgs, 6)
                msgs.append({"role": "assistant", "content": reply})
            else:
                msgs.append(m)
        if all(m["content"].strip() for m in msgs):  # an empty reply fails its conversation instead
            assert got[rid] == msgs
            compared += 1
    assert compared >= 2
    assert summary["done"] + summary["failed"] == 4 and summary["tokens"] > 0


def test_local_backend_batches_and_resumes(local_tiny, tmp_path):
    data, out = make_data(tmp_path, 7), tmp_path / "out.jsonl"
    first = run(RegenerateConfig(data=(str(data),), out=str(out), target="tiny", max_new_tokens=4, batch_size=3,
                                 max_samples=4, quiet=True))
    second = run(RegenerateConfig(data=(str(data),), out=str(out), target="tiny", max_new_tokens=4, batch_size=3,
                                  quiet=True))
    got = read_out(out)
    assert first["done"] + first["failed"] == 4 and second["skipped"] == first["done"]
    assert len({r["id"] for r in got}) == len(got) == first["done"] + second["done"]
    for r in got:
        roles = [m["role"] for m in r["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2)


def test_second_writer_is_refused(servers, tmp_path):
    from eyas.core.lock import hold

    srv = servers()
    data, out = make_data(tmp_path, 2), tmp_path / "out.jsonl"
    held = hold(out, "regenerate")
    with pytest.raises(EyasError, match="another eyas run is writing"):
        run(cfg(data, out, srv.url))
    held.close()
    assert run(cfg(data, out, srv.url))["done"] == 2


def test_max_prompt_tokens_leaves_out_long_prompts_and_counts_them(local_tiny, tmp_path):
    from eyas.data.chat import ChatRenderer

    short, long_ = "Hi.", "Tell me " + "more and more " * 40
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in (("s", short), ("l", long_))))
    renderer = ChatRenderer(local_tiny.tokenizer)
    n_short = len(renderer.prompt_ids([{"role": "user", "content": short}]))
    n_long = len(renderer.prompt_ids([{"role": "user", "content": long_}]))
    assert n_short < 40 < n_long
    out = tmp_path / "out.jsonl"
    summary = run(RegenerateConfig(data=(str(data),), out=str(out), target="tiny", max_new_tokens=3,
                                   max_prompt_tokens=40, quiet=True))
    assert [r["id"] for r in read_out(out)] == ["s"]
    assert summary["failed"] == 0 and summary["failures"] == {}  # a choice, not a failure a rerun would retry
    assert summary["left_out"] == 1 and summary["not_started"] == 0
    assert f"{n_long} tokens exceed --max-prompt-tokens 40" in json.dumps(summary["left_out_reasons"])


def test_resume_under_other_generation_settings_is_refused_and_overwrite_starts_anew(servers, tmp_path):
    """Replies made under one --max-new-tokens (or temperature) are never silently mixed with others: the resume is
    refused, naming what changed, and leaves the file as it was; --overwrite generates every reply again."""
    srv = servers()
    data, out = make_data(tmp_path, 6), tmp_path / "out.jsonl"
    assert run(cfg(data, out, srv.url, max_new_tokens=16))["done"] == 6
    before = out.read_text()
    for changed, said in ((dict(max_new_tokens=8), "max_new_tokens 16 then, 8 now"),  # issue 45: with nothing left
                          (dict(max_new_tokens=16, temperature=0.7), "temperature 0.0 then, 0.7 now")):  # to do too
        with pytest.raises(EyasError, match=said):
            run(cfg(data, out, srv.url, **changed))
        assert out.read_text() == before
    assert run(cfg(data, out, srv.url, max_new_tokens=16))["skipped"] == 6  # the same settings: nothing to do
    data.write_text(data.read_text() + json.dumps({"question": "one more"}) + "\n")  # ids: file stem + line
    for changed, said in ((dict(max_new_tokens=8), "max_new_tokens 16 then, 8 now"),
                          (dict(max_new_tokens=16, temperature=0.7), "temperature 0.0 then, 0.7 now")):
        with pytest.raises(EyasError, match=said):
            run(cfg(data, out, srv.url, **changed))
        assert out.read_text() == before
    again = run(cfg(data, out, srv.url, max_new_tokens=16))  # the same settings: resumes
    assert again["done"] == 1 and again["skipped"] == 6
    fresh = run(cfg(data, out, srv.url, max_new_tokens=8, overwrite=True))
    assert fresh["done"] == 7 and fresh["skipped"] == 0 and len(read_out(out)) == 7
    with pytest.raises(EyasError, match="not a regenerated conversation"):  # --overwrite replaces only its own
        other = tmp_path / "notes.jsonl"
        other.write_text('{"my": "notes"}\n')
        run(cfg(data, other, srv.url, overwrite=True))
    assert (tmp_path / "notes.jsonl").read_text() == '{"my": "notes"}\n'


def test_a_run_stopped_early_exits_3_with_what_is_left_and_how_to_resume(servers, tmp_path, quick_retries,
                                                                          monkeypatch, capsys):
    from eyas.cli import main

    monkeypatch.setattr("eyas.data.server.GIVE_UP_AFTER", 3)
    srv = servers(ok_then_fail=2)
    data, out = make_data(tmp_path, 12), tmp_path / "out.jsonl"
    code = main(["regenerate", "--data", str(data), "--out", str(out), "--server", srv.url, "--concurrency", "1",
                 "--retries", "1", "--model", "m", "--quiet"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "left to do" in err and "rerun the same command" in err
    done = len(read_out(out))
    assert "of 12 conversations left to do" in err and f"{done} were written" in err


def test_auto_dtype_is_recorded_as_the_dtype_it_chose(local_tiny, tmp_path, monkeypatch):
    """--dtype auto writes the dtype it resolved to beside the answers: a resume in the other dtype (a machine whose
    CPU has bf16 in hardware, say) is refused instead of mixing answers made two ways."""
    monkeypatch.setattr("eyas.core.precision.native_bf16", lambda device: False)
    data, out = make_data(tmp_path, 3), tmp_path / "out.jsonl"
    cfg = dict(data=(str(data),), out=str(out), target="tiny", max_new_tokens=3, quiet=True)
    run(RegenerateConfig(**cfg, max_samples=2, dtype="auto"))
    assert json.loads((tmp_path / "out.jsonl.settings.json").read_text())["dtype"] == "float32"
    assert run(RegenerateConfig(**cfg, max_samples=2, dtype="float32"))["skipped"] == 2  # the same answers
    monkeypatch.setattr("eyas.core.precision.native_bf16", lambda device: True)
    with pytest.raises(EyasError, match="dtype"):
        run(RegenerateConfig(**cfg, dtype="auto"))
    with pytest.raises(EyasError, match="max_new_tokens 3 then, 5 now"):  # every one written: refused all the same
        run(RegenerateConfig(**{**cfg, "max_new_tokens": 5}, max_samples=2, dtype="float32"))
