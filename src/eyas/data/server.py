"""The `--server` backend of `eyas regenerate`: any OpenAI-compatible `/v1/chat/completions`.

Each conversation runs on a worker thread, turn by turn; at most `--concurrency` are in flight and the main
thread alone writes results. A request that is refused, times out, answers 408/429/5xx, is cut short, is not HTTP,
or sends a body that is not a chat completion (bad JSON, too deep, wrong types) is retried after 0.5 s, 1 s, 2 s,
... (with jitter) up to `--retries` times and within `--retry-time` seconds; then its conversation is reported
failed and the others go on. `--timeout` bounds each wait for the server and also the whole answer's body, so a
server trickling bytes cannot hold a request open for longer. After `GIVE_UP_AFTER` conversations fail in a row the
server is taken to be down and the run stops early, keeping everything already written. The API key comes from
`--api-key-file` or $EYAS_API_KEY and is only ever put in the Authorization header; a server's own words that are
reported (error bodies) have it blanked out, since some servers quote it back.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Protocol

from eyas.core.errors import EyasError
from eyas.data.replies import Dialogue, Failed, Reply, Sink

BACKOFF_S = 0.5  # first retry delay; doubles each retry
BACKOFF_MAX_S = 30.0
SERVER_CONCURRENCY = 8  # conversations in flight by default: a server others may share
GIVE_UP_AFTER = 16  # conversations failing in a row: the server is down
RETRY_HTTP = {408, 409, 425, 429, 500, 502, 503, 504}
MAX_ANSWER = 64 << 20  # bytes: a chat completion is far smaller; more is a misbehaving server


class ServerSettings(Protocol):
    """What the backend reads of the stage's settings (eyas.data.regenerate.RegenerateConfig has them all)."""

    server: str
    model: str
    concurrency: int
    timeout: float
    retries: int
    retry_time: float
    api_key_file: str
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int


class Retryable(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def endpoint(url: str) -> str:
    """The chat-completions URL of a server given as host, .../v1 or the full endpoint."""
    u = url.strip().rstrip("/")
    if "://" not in u:
        u = "http://" + u
    if u.endswith("/chat/completions"):
        return u
    return u + ("/chat/completions" if u.endswith("/v1") else "/v1/chat/completions")


def api_key(cfg: ServerSettings) -> str:
    if cfg.api_key_file:
        p = Path(cfg.api_key_file).expanduser()
        if not p.is_file():
            raise EyasError(f"--api-key-file {p} not found", fix="give the file holding the key, or set EYAS_API_KEY")
        return p.read_text(encoding="utf-8").strip()
    return os.environ.get("EYAS_API_KEY", "").strip()


class ServerBackend:
    """Chat completions of `--server` (or `url`, the endpoint itself, and `model`: a server eyas started)."""

    def __init__(self, cfg: ServerSettings, con, url: str = "", model: str = "", concurrency: int = 0):
        self.cfg = cfg
        self.url = url or endpoint(cfg.server)
        self._key = api_key(cfg)
        self.timeout = cfg.timeout  # seconds one request may take (an engine eyas started allows more)
        self.name = model or cfg.model or self._first_model()
        self.concurrency = concurrency or cfg.concurrency or SERVER_CONCURRENCY
        con.print(f"server {self.url}, model {self.name!r}, {self.concurrency} conversations in flight")

    def _request(self, url: str, body: dict | None) -> dict:
        """One HTTP exchange; Retryable for what a retry may fix, Failed for what it will not."""
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = self._body(resp)
        except urllib.error.HTTPError as e:
            text = self._redact(_error_text(e))[:200]
            if e.code in RETRY_HTTP:
                raise Retryable(f"http-{e.code}", text) from None
            raise Failed(f"http-{e.code}", text) from None
        except TimeoutError:  # socket.timeout is an alias
            raise Retryable("timeout", f"no answer within {self.timeout:g} s (--timeout)") from None
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            raise Retryable("connection-error", str(getattr(e, "reason", e))) from None
        except http.client.IncompleteRead as e:
            raise Retryable("connection-error", f"the answer was cut short ({len(e.partial)} bytes)") from None
        except http.client.HTTPException as e:  # BadStatusLine, LineTooLong, ...: not an HTTP answer
            raise Retryable("malformed-response", f"not an HTTP answer ({type(e).__name__}: {str(e)[:80]})") from None
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than Python's stack
            raise Retryable("malformed-response", self._redact(raw[:4096].decode("utf-8", "replace"))[:120]) from None
        if not isinstance(obj, dict):
            raise Retryable("malformed-response", "the answer is not a JSON object")
        return obj

    def _redact(self, text: str) -> str:
        """A server's own words (reported, so written to logs) without the key, which some servers quote back."""
        return text.replace(self._key, "[the API key]") if self._key else text

    def _body(self, resp) -> bytes:
        """The whole body, within --timeout in all and at most MAX_ANSWER bytes."""
        deadline, chunks, size = time.monotonic() + self.timeout, [], 0
        while chunk := resp.read1(1 << 16):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_ANSWER:
                raise Retryable("malformed-response", f"an answer of more than {MAX_ANSWER >> 20} MiB")
            if time.monotonic() > deadline:
                raise Retryable("timeout", f"the answer took longer than {self.timeout:g} s (--timeout)")
        if resp.length:  # bytes its Content-Length promised that never came
            raise Retryable("connection-error", f"the answer was cut short ({size} bytes, {resp.length} missing)")
        return b"".join(chunks)

    def _with_retries(self, url: str, body: dict | None, parse):
        """parse(answer) of the first good answer; Retryable errors (also from parse) are retried."""
        deadline = time.monotonic() + self.cfg.retry_time
        for attempt in range(self.cfg.retries + 1):
            try:
                return parse(self._request(url, body))
            except Retryable as e:
                last = e
            delay = min(BACKOFF_MAX_S, BACKOFF_S * 2**attempt) * random.uniform(0.5, 1.0)
            if attempt == self.cfg.retries or time.monotonic() + delay > deadline:
                break
            time.sleep(delay)
        raise Failed(last.reason, f"{last.detail} (after {attempt + 1} attempts)")

    def _first_model(self) -> str:
        url = self.url.rsplit("/chat/completions", 1)[0] + "/models"
        try:
            return self._with_retries(url, None, _model_name)
        except Failed as e:
            raise EyasError(f"cannot list the models of {url}: {e}",
                            "eyas asks the server which model to name in its requests",
                            "check that the server is up and the URL right, or pass --model NAME") from None

    def ask(self, messages: list[dict]) -> Reply:
        cfg = self.cfg
        body = {"model": self.name, "messages": messages, "max_tokens": cfg.max_new_tokens,
                "temperature": cfg.temperature, "stream": False}
        if cfg.temperature > 0:
            body.update(top_p=cfg.top_p, seed=cfg.seed)
        return self._with_retries(self.url, body, _completion)


def _model_name(obj: dict) -> str:
    try:
        return str(obj["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        raise Retryable("malformed-response", "no data[0].id in the model list") from None


def _completion(obj: dict) -> Reply:
    """The reply of a chat completion; a 200 whose body is not one is retried like any other bad answer."""
    try:
        choice = obj["choices"][0]
        text = choice["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise Retryable("malformed-response", "no choices[0].message.content in the answer") from None
    if not isinstance(text, str):
        raise Retryable("malformed-response", "choices[0].message.content is not a string")
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
    tokens = usage.get("completion_tokens")
    tokens = tokens if type(tokens) is int and tokens >= 0 else 0  # a count is optional: a bad one is no count
    return Reply(text, tokens, cut=choice.get("finish_reason") == "length")


def _error_text(e: urllib.error.HTTPError) -> str:
    """The start of an error answer's body (which may itself be cut short or never come)."""
    try:
        return e.read(4096).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException):
        return ""


def converse(backend: ServerBackend, d: Dialogue) -> Dialogue:
    """Answer every user turn of one conversation in order (a worker thread); raises Failed."""
    while (prompt := d.next_prompt()) is not None:
        d.answer(backend.ask(prompt))
    return d


def run_server(backend: ServerBackend, todo: list, sink: Sink) -> str:
    """Regenerate `todo` with bounded concurrency; returns why it stopped early, or ""."""
    queue = iter(todo)
    inflight: dict = {}
    pool = ThreadPoolExecutor(max_workers=backend.concurrency, thread_name_prefix="eyas-regen")
    stopped = ""
    try:
        while True:
            while not stopped and len(inflight) < backend.concurrency and (c := next(queue, None)) is not None:
                d = Dialogue(c)
                inflight[pool.submit(converse, backend, d)] = d
            if not inflight:
                return stopped
            finished, _ = wait(inflight, return_when=FIRST_COMPLETED)
            for f in finished:
                d = inflight.pop(f)
                try:
                    sink.finished(f.result())
                except Failed as e:
                    sink.failed(d.conv, e)
            if not stopped and sink.failed_in_a_row >= GIVE_UP_AFTER:
                stopped = f"{sink.failed_in_a_row} conversations failed in a row; the server seems down"
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
