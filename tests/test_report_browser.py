"""The report in a real browser: headless Chromium (Debian's `chromium`) opens it, and the test checks that the page
logs no console error, that every plot is drawn (an SVG on screen with non-empty paths), that nothing overflows
the page, and takes a full-page screenshot (kept at $EYAS_REPORT_SCREENSHOT when set, for a human to look at).

Chromium is driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: requests on fd 3, replies on
fd 4, each a JSON text ended by NUL), which reports console messages, exceptions and failed loads as events.
When Chromium is missing the test installs it with apt-get (root only); it skips only when that is impossible.
"""

from __future__ import annotations

import base64
import io
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from eyas.report.build import ReportConfig, run
from tests.test_report import make_run

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")


def chromium() -> str | None:
    """The browser's path, installing Debian's chromium when none is found and this process may."""
    found = next((p for p in map(shutil.which, NAMES) if p), None)
    if found or not shutil.which("apt-get") or os.geteuid() != 0:
        return found
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"]):
        try:
            subprocess.run(cmd, env=env, capture_output=True, timeout=900, check=True)
        except (subprocess.SubprocessError, OSError):
            return None
    return next((p for p in map(shutil.which, NAMES) if p), None)


class DevTools:
    """One headless Chromium and a DevTools session on one page."""

    def __init__(self, binary: str, profile: Path):
        to_browser, self.w = os.pipe()
        self.r, from_browser = os.pipe()

        def fds():  # in the child: the protocol's fixed descriptors 3 (requests) and 4 (replies)
            a, b = os.dup(to_browser), os.dup(from_browser)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe",
                                      "about:blank"], preexec_fn=fds, close_fds=False,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser)
        os.close(from_browser)
        self.buf, self.next_id, self.events, self.session = b"", 0, [], None
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for method in ("Page.enable", "Runtime.enable", "Log.enable"):
            self.call(method)

    def _recv(self, deadline: float) -> dict:
        while b"\0" not in self.buf:
            ready, _, _ = select.select([self.r], [], [], max(0.0, deadline - time.time()))
            chunk = os.read(self.r, 1 << 20) if ready else b""
            if not chunk:
                raise TimeoutError("Chromium stopped answering")
            self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, params: dict | None = None, timeout: float = 60) -> dict:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if self.session and not method.startswith(("Target.", "Browser.")):
            msg["sessionId"] = self.session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        while True:
            reply = self._recv(deadline)
            if reply.get("id") == self.next_id:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply.get("result", {})
            self.events.append(reply)

    def open(self, url: str, width: int = 1280, height: int = 4000) -> None:
        self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": False})
        self.call("Page.navigate", {"url": url})
        deadline = time.time() + 60
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            self.events.append(self._recv(deadline))

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and failed loads, as text."""
        out = []
        for e in self.events:
            p, m = e.get("params", {}), e.get("method")
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
            elif m == "Runtime.exceptionThrown":
                out.append(str(p.get("exceptionDetails", {}).get("text")))
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(str(p["entry"].get("text")))
        return out

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})["result"]["value"]

    def screenshot(self) -> bytes:
        shot = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        return base64.b64decode(shot["data"])

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
            self.proc.wait(timeout=10)
        except (TimeoutError, AssertionError, OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            os.close(self.w)
            os.close(self.r)


PROBE = """JSON.stringify((() => {
  const plots = [...document.querySelectorAll('svg.plot')];
  const drawn = plots.filter(s => {
    const r = s.getBoundingClientRect();
    return r.width > 200 && r.height > 100 && [...s.querySelectorAll('path')].some(p => p.getTotalLength() > 0);
  });
  return {plots: plots.length, drawn: drawn.length, broken_images: [...document.images].filter(
            i => !i.complete || i.naturalWidth === 0).length,
          sections: Object.fromEntries([...document.querySelectorAll('section')].map(s => [s.id, s.dataset.status])),
          scroll_width: document.documentElement.scrollWidth, height: document.documentElement.scrollHeight,
          overflowing: [...document.querySelectorAll('.tablewrap, pre, figure')].filter(
            e => e.scrollWidth > e.clientWidth + 1).length,
          title: document.title};
})())"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    binary = chromium()
    if binary is None:
        pytest.skip("Chromium is not installed and cannot be installed here (needs apt-get as root)")
    tools = DevTools(binary, tmp_path_factory.mktemp("chromium-profile"))
    yield tools
    tools.close()


def test_report_renders_in_chromium_without_errors_and_with_drawn_plots(browser, tmp_path):
    from PIL import Image

    run_dir = make_run(tmp_path / "demo")
    path = Path(run(ReportConfig(run=str(run_dir), quiet=True))["path"])
    browser.events.clear()
    browser.open(path.resolve().as_uri())
    info = json.loads(browser.evaluate(PROBE))
    assert browser.errors() == []
    assert info["plots"] == 12 and info["drawn"] == 12 and info["broken_images"] == 0  # 12: expected tau per pass
    assert info["sections"] == {s: "ok" for s in ("pipeline", "data", "plan", "training", "evaluation", "samples",
                                                  "export")}
    assert info["scroll_width"] <= 1280 and info["overflowing"] == 0  # nothing wider than the window, no side-scroll
    assert info["title"] == "demo · eyas run report"
    png = browser.screenshot()
    if os.environ.get("EYAS_REPORT_SCREENSHOT"):
        Path(os.environ["EYAS_REPORT_SCREENSHOT"]).write_bytes(png)
    image = Image.open(io.BytesIO(png)).convert("L")
    assert image.size[1] == info["height"] > 3000
    lo, hi = image.getextrema()
    assert hi - lo > 200  # ink on paper, not a blank page


def test_not_run_report_renders_without_errors(browser, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    path = Path(run(ReportConfig(run=str(empty), quiet=True))["path"])
    browser.events.clear()
    browser.open(path.resolve().as_uri())
    info = json.loads(browser.evaluate(PROBE))
    assert browser.errors() == [] and info["plots"] == 0
    assert set(info["sections"].values()) == {"not run"}


CLIPPED = """JSON.stringify([...document.querySelectorAll('svg.plot')].map(s => {
  const box = s.getBoundingClientRect();
  return [...s.querySelectorAll('text')].filter(t => { const r = t.getBoundingClientRect();
      return r.width > 0 && (r.left < box.left - 1 || r.right > box.right + 1 || r.bottom > box.bottom + 1); })
    .map(t => t.textContent);
}).flat())"""


def test_report_fits_1280_px_with_unbroken_text_and_long_legend_labels(browser, tmp_path):
    """What a real run's report holds: a sample whose text has no space to break at (a tiny model's 'CanadianCanadian
    ...' made the page 2,722 px wide) and five configurations with long names (two legends ran off their plots)."""
    run_dir = make_run(tmp_path / "demo")
    path = run_dir / "evaluate" / "results.json"
    res = json.loads(path.read_text())
    res["configs"] += [{**res["configs"][1], "name": "eagle3 tree k=4 d=5 n=16", "mode": "tree"},
                       {**res["configs"][0], "name": "runs/other/train/final chain k=7"}]
    res["samples"][0]["pieces"].append(" " + "Canadian" * 300)
    res["samples"][0]["prompt"] = "y" * 3000
    path.write_text(json.dumps(res))
    page = Path(run(ReportConfig(run=str(run_dir), quiet=True))["path"])
    browser.events.clear()
    browser.open(page.resolve().as_uri())
    info = json.loads(browser.evaluate(PROBE))
    assert browser.errors() == []
    assert info["scroll_width"] <= 1280 and info["overflowing"] == 0
    assert json.loads(browser.evaluate(CLIPPED)) == []  # every legend and label inside its plot
