"""A server misbehaving during `eyas regenerate --server`: retried with backoff within a bounded time, then reported.

The fake server is a real OpenAI-compatible HTTP server on 127.0.0.1 (a thread of this process) that misbehaves
in one way, either for a while or forever for some conversations: refused connections, HTTP 500, a hang, a
trickling answer, malformed JSON (cut, 200,000 levels deep, wrong types), an answer cut short, bytes that are not
HTTP, a reset connection. Every test checks against the reference answers the healthy server gives: what was
completed is kept in the output file, the failed conversations are named with their reason, and a rerun against a
healthy server asks only for what is missing.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eyas.core.errors import EyasError
from eyas.data.regenerate import RegenerateConfig, run
from tests.test_regenerate import run_incomplete

TIMEOUT = 0.4  # --timeout: seconds one request may take
RETRY_TIME = 1.6  # --retry-time: seconds one request may spend in retries
RETRIES = 4


def answer(messages: list[dict]) -> str:
    """The healthy server's reply: deterministic, so the expected output is known in advance."""
    return f"answer to {messages[-1]['content']}"


class FakeServer:
    """OpenAI-compatible `/v1/chat/completions` on 127.0.0.1; `decide(n, body)` picks request n's behaviour.

    Records every request: (n, the first user message, the action taken, the Authorization header).
    """

    def __init__(self, decide=lambda n, body: "ok", port: int = 0):
        self.decide, self.requests, self.models_asked, self.echoed = decide, [], 0, ""
        self.lock, self.release = threading.Lock(), threading.Event()  # release: hanging handlers give up
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def first_users(self, action: str | None = None) -> list[str]:
        return [r[1] for r in self.requests if action is None or r[2] == action]

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self):
        srv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                srv.models_asked += 1
                if srv.decide(-1, None) == "hang":
                    return srv.release.wait(30)
                self.send(200, json.dumps({"object": "list", "data": [{"id": "fake-model"}]}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                first = next(m["content"] for m in body["messages"] if m["role"] == "user")
                with srv.lock:
                    n = len(srv.requests)
                    action = srv.decide(n, body)
                    srv.requests.append((n, first, action, self.headers.get("Authorization")))
                getattr(self, "act_" + action.replace("-", "_"))(body)

            def send(self, code: int, payload: bytes, length: int | None = None):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload) if length is None else length))
                self.end_headers()
                self.wfile.write(payload)
                self.wfile.flush()

            def act_ok(self, body):
                reply = answer(body["messages"])
                self.send(200, json.dumps({
                    "id": "x", "object": "chat.completion", "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": len(reply.split())}}).encode())

            def act_http_500(self, body):
                self.send(500, b'{"error": "internal error"}')

            def act_hang(self, body):
                srv.release.wait(30)
                self.close_connection = True

            def act_trickle(self, body):  # headers, then one byte at a time, each well within --timeout
                self.send_response(200)
                self.send_header("Content-Length", "100000")
                self.end_headers()
                end = time.monotonic() + 10  # a run that waits for the whole answer takes 10 s (the bound is ~3)
                while not srv.release.wait(TIMEOUT / 4) and time.monotonic() < end:
                    try:
                        self.wfile.write(b" ")
                        self.wfile.flush()
                    except OSError:
                        break
                self.close_connection = True

            def act_malformed(self, body):
                self.send(200, b'{"choices": [{"message": {"content": "cut')

            def act_deep_json(self, body):
                self.send(200, b"[" * 200_000 + b"]" * 200_000)

            def act_wrong_types(self, body):  # a number where the reply's text belongs
                self.send(200, json.dumps({"choices": [{"message": {"content": 42}}], "usage": []}).encode())

            def act_odd_usage(self, body):  # a good reply with a token count that is no count
                odd = ["many", -3, [1], None, True, 1e400][len(srv.requests) % 6]
                reply = answer(body["messages"])
                self.send(200, json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}],
                                           "usage": {"completion_tokens": odd}}).encode())

            def act_truncated_body(self, body):
                self.send(200, b'{"choices": [', length=4000)
                self.close_connection = True

            def act_not_http(self, body):
                self.wfile.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
                self.wfile.flush()
                self.close_connection = True

            def act_echo_auth(self, body):  # 401 quoting the key it was given, as some proxies do
                key = str(self.headers.get("Authorization")).removeprefix("Bearer ")
                srv.echoed += key
                self.send(401, json.dumps({"error": f"Invalid token. Received API Key = {key}"}).encode())

            def act_reset(self, body):
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

        return Handler


@pytest.fixture
def servers():
    made = []

    def make(decide=lambda n, body: "ok", port=0):
        made.append(FakeServer(decide, port))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr("eyas.data.server.BACKOFF_S", 0.05)


def write_data(folder: Path, n: int = 8) -> Path:
    """n conversations: single-turn prompts, and every third one two user turns."""
    recs = []
    for i in range(n):
        if i % 3 == 2:
            recs.append({"id": f"c{i}", "turns": [f"question {i}", f"follow-up {i}"]})
        else:
            recs.append({"id": f"c{i}", "prompt": f"question {i}"})
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return path


def expected(data: Path) -> dict[str, list[dict]]:
    """Each conversation as the healthy server completes it, replayed from the raw records."""
    out = {}
    for line in data.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        msgs = []
        for turn in r.get("turns") or [r["prompt"]]:
            msgs.append({"role": "user", "content": turn})
            msgs.append({"role": "assistant", "content": answer(msgs)})
        out[r["id"]] = msgs
    return out


def read_out(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []


def cfg(data: Path, out: Path, url: str, **kw) -> RegenerateConfig:
    base = {"data": (str(data),), "out": str(out), "server": url, "model": "fake-model", "concurrency": 2,
            "retries": RETRIES, "retry_time": RETRY_TIME, "timeout": TIMEOUT, "quiet": True}
    return RegenerateConfig(**{**base, **kw})


DOOMED = {"question 1", "question 5"}  # their conversations meet the fault on every request

FOREVER = {  # fault -> the reason a failed conversation is reported with
    "http-500": "http-500", "hang": "timeout", "trickle": "timeout", "malformed": "malformed-response",
    "deep-json": "malformed-response", "wrong-types": "malformed-response", "truncated-body": "connection-error",
    "not-http": "malformed-response", "reset": "connection-error",
}
FAST_SUBSET = ("http-500", "hang", "trickle", "deep-json", "wrong-types", "not-http")


@pytest.mark.parametrize("fault", list(FOREVER))
def test_fault_forever_fails_its_conversations_only(servers, tmp_path, fault, faults_full, tally, capsys):
    if not faults_full and fault not in FAST_SUBSET:
        pytest.skip("full strength only (--faults-full)")
    srv = servers(lambda n, body: fault if body["messages"][0]["content"] in DOOMED else "ok")
    data, out = write_data(tmp_path), tmp_path / "out.jsonl"
    t0 = time.monotonic()
    summary = run_incomplete(cfg(data, out, srv.url, quiet=False))
    elapsed = time.monotonic() - t0
    want = expected(data)
    doomed_ids = {"c1", "c5"}

    # the others' completed results are kept, exactly
    got = read_out(out)
    assert {r["id"]: r["messages"] for r in got} == {k: v for k, v in want.items() if k not in doomed_ids}
    # the doomed ones are reported failed with a clear reason, each with its file and line
    reason = FOREVER[fault]
    assert summary["failed"] == 2 and summary["failures"][reason]["count"] == 2, summary["failures"]
    places = sorted(e["where"] for e in summary["failures"][reason]["examples"])
    assert places == [f"{data}:2", f"{data}:6"]
    assert all("attempts)" in e["detail"] for e in summary["failures"][reason]["examples"])
    err = capsys.readouterr().err
    assert f"{reason}: first at {data}:" in err and "rerun retries them" in err
    # retried with backoff: several attempts each, never more than --retries + 1
    for q in DOOMED:
        attempts = srv.first_users(fault).count(q)
        assert 2 <= attempts <= RETRIES + 1, (q, attempts)
    # within a bounded time: per conversation --retry-time plus one last --timeout, two of them in parallel
    assert elapsed < RETRY_TIME + 2 * TIMEOUT + 2.5, elapsed

    healthy = servers()
    again = run(cfg(data, out, healthy.url))
    assert again["skipped"] == len(want) - 2 and again["done"] == 2 and again["failed"] == 0
    assert set(healthy.first_users()) == DOOMED  # only the missing conversations were asked for
    final = read_out(out)
    assert final[: len(got)] == got and {r["id"]: r["messages"] for r in final} == want
    tally(f"server faults survived: {fault}")


@pytest.mark.parametrize("fault", ["http-500", "hang", "malformed", "reset", "not-http"])
def test_fault_for_a_while_is_retried_to_completion(servers, tmp_path, fault, faults_full, tally):
    if not faults_full and fault not in ("http-500", "hang"):
        pytest.skip("full strength only (--faults-full)")
    bad = 3  # the first requests meet the fault, then the server recovers
    srv = servers(lambda n, body: fault if n < bad else "ok")
    data, out = write_data(tmp_path, 5), tmp_path / "out.jsonl"
    summary = run(cfg(data, out, srv.url, retry_time=10))
    want = expected(data)
    assert summary["failed"] == 0 and summary["done"] == 5
    assert {r["id"]: r["messages"] for r in read_out(out)} == want
    turns = sum(len(v) // 2 for v in want.values())
    assert len(srv.requests) == bad + turns  # every fault retried once more, nothing asked twice after success
    tally(f"server faults survived: {fault} (a while)")


def test_odd_usage_counts_do_not_fail_good_answers(servers, tmp_path, tally):
    srv = servers(lambda n, body: "odd-usage")
    data, out = write_data(tmp_path, 6), tmp_path / "out.jsonl"
    summary = run(cfg(data, out, srv.url))
    assert summary["failed"] == 0 and summary["tokens"] == 0  # the counts are unknown, the replies are good
    assert {r["id"]: r["messages"] for r in read_out(out)} == expected(data)
    tally("server faults survived: odd usage counts")


def test_refused_connections_for_a_while(servers, tmp_path, tally):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there yet
    late: list[FakeServer] = []
    timer = threading.Timer(0.6, lambda: late.append(servers(port=port)))
    timer.start()
    data, out = write_data(tmp_path, 3), tmp_path / "out.jsonl"
    t0 = time.monotonic()
    summary = run(cfg(data, out, f"http://127.0.0.1:{port}", retries=8, retry_time=10))
    timer.join()
    assert time.monotonic() - t0 >= 0.6 and late  # it waited for the server, then was answered
    assert summary["failed"] == 0 and {r["id"]: r["messages"] for r in read_out(out)} == expected(data)
    tally("server faults survived: refused connections (a while)")


def test_a_server_down_stops_the_run_in_bounded_time(servers, tmp_path, monkeypatch, tally):
    monkeypatch.setattr("eyas.data.server.GIVE_UP_AFTER", 3)
    # answers the first two conversations (decided by their question, not by the request count: an answer slowed
    # past --timeout by a busy machine is asked again and still answered), then hangs forever
    srv = servers(lambda n, body: "ok" if body["messages"][0]["content"] in ("question 0", "question 1") else "hang")
    data, out = write_data(tmp_path, 40), tmp_path / "out.jsonl"
    t0 = time.monotonic()
    summary = run_incomplete(cfg(data, out, srv.url, concurrency=1, timeout=0.3, retry_time=0.6))
    elapsed = time.monotonic() - t0
    assert summary["stopped_early"] and summary["failures"]["timeout"]["count"] == 3
    assert summary["done"] == 2 and summary["not_started"] == 40 - 2 - 3
    assert elapsed < 3 * (0.6 + 0.3) + 5, elapsed  # three conversations' retries, then it stops (not forever)
    assert [r["id"] for r in read_out(out)] == ["c0", "c1"]
    tally("server faults survived: server down (stopped early)")


def test_model_list_hanging_is_a_clear_error_in_bounded_time(servers, tmp_path, tally):
    srv = servers(lambda n, body: "hang")
    data, out = write_data(tmp_path, 2), tmp_path / "out.jsonl"
    t0 = time.monotonic()
    with pytest.raises(EyasError, match=r"cannot list the models .*timeout") as e:
        run(cfg(data, out, srv.url, model=""))
    assert time.monotonic() - t0 < RETRY_TIME + TIMEOUT + 1.5
    assert "--model" in e.value.fix and read_out(out) == []
    tally("server faults survived: model list hangs")
