"""`eyas regenerate --engine vllm` against a stand-in engine (tests/fake_vllm.py without --speculative-config: greedy
generation with transformers): the replies equal the local backend's, the prompts and stops sent are the local
ones, the engine is always stopped and its log kept, and every refusal is a clear error. The real vLLM:
tests/integration/test_vllm_regenerate.py."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyas.core.errors import EyasError
from eyas.core.target import load_target
from eyas.core.vllm_server import GROUP_FILE, cpu_env
from eyas.data.chat import ChatRenderer
from eyas.data.regenerate import RegenerateConfig, run
from eyas.data.vllm_backend import engine_paths
from tests.ports import free_port
from tests.test_extract_engine import engine_python, folder  # noqa: F401 (folder: a fixture)
from tests.test_regenerate import REPO, make_data, read_out

pytestmark = pytest.mark.usefixtures("one_thread")


def config(data, out, target, **kw) -> RegenerateConfig:
    return RegenerateConfig(**{"data": (str(data),), "out": str(out), "target": str(target), "max_new_tokens": 5,
                               "quiet": True, "dtype": "fp32", **kw})  # fp32: the local and engine replies agree


def engine(tmp_path, name="env", **kw) -> dict:
    return dict(engine="vllm", engine_python=engine_python(tmp_path / name, **kw), engine_port=free_port(),
                concurrency=3)


def alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_the_engine_answers_as_the_local_backend_and_is_stopped(folder, tmp_path, monkeypatch):  # noqa: F811
    data = make_data(tmp_path, 6)
    requests = tmp_path / "requests.jsonl"
    monkeypatch.setenv("FAKE_VLLM_REQUESTS", str(requests))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's count: the engine gets it too
    local = run(config(data, tmp_path / "local.jsonl", folder, generator="lean", batch_size=3))
    out = tmp_path / "engine.jsonl"
    summary = run(config(data, out, folder, **engine(tmp_path)))
    assert summary["backend"] == "engine" and summary["done"] == local["done"] >= 3
    assert summary["failures"] == local["failures"]  # the same empty replies, if any
    key = {r["id"]: r["messages"] for r in read_out(tmp_path / "local.jsonl")}
    assert {r["id"]: r["messages"] for r in read_out(out)} == key  # fp32 greedy: the same replies, turn by turn
    assert summary["tokens"] == local["tokens"]  # counted alike, the stop token included
    renderer = ChatRenderer(load_target(str(folder)).tokenizer)
    sent = [json.loads(line) for line in requests.read_text().splitlines()]
    first = next(r for r in read_out(out) if r["id"] == "q0")["messages"][:1]
    assert any(b["prompt"] == renderer.prompt_ids(first) for b in sent)  # the local prompt, as token ids
    assert all(b["stop_token_ids"] == renderer.stop_token_ids() and b["max_tokens"] == 5 for b in sent)
    home, log = engine_paths(out)
    assert "fake vllm: serving" in log.read_text()  # the engine's log is kept beside the output
    env, _ = cpu_env()  # its threads: the user's 1 of 2 cores, unbound (on a 1-core machine, vLLM's own binding)
    assert (f"fake vllm: threads VLLM_CPU_OMP_THREADS_BIND={env.get('VLLM_CPU_OMP_THREADS_BIND')} "
            f"OMP_NUM_THREADS={env.get('OMP_NUM_THREADS', '1')}") in log.read_text()
    assert not alive(int((home / GROUP_FILE).read_text()))  # stopped, with its whole process group
    assert json.loads(out.with_name(out.name + ".settings.json").read_text())["engine"] == "vllm"


def test_local_and_engine_replies_are_never_mixed(folder, tmp_path):  # noqa: F811
    data, out = make_data(tmp_path, 3), tmp_path / "out.jsonl"
    run(config(data, out, folder, max_samples=1))
    with pytest.raises(EyasError, match="engine None then, 'vllm' now"):
        run(config(data, out, folder, **engine(tmp_path)))
    assert len(read_out(out)) <= 1  # what the local run wrote is kept


def test_max_prompt_tokens_and_the_engines_context_leave_prompts_out(folder, tmp_path):  # noqa: F811
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                            for i, p in (("s", "Hi."), ("l", "Tell me " + "more and more " * 40))))
    out = tmp_path / "out.jsonl"
    summary = run(config(data, out, folder, max_prompt_tokens=40, **engine(tmp_path)))
    assert summary["left_out"] == 1 and summary["failed"] == 0
    assert "exceed --max-prompt-tokens 40" in json.dumps(summary["left_out_reasons"])
    summary = run(config(data, tmp_path / "o2.jsonl", folder, max_new_tokens=2040, **engine(tmp_path, "b")))
    assert summary["failures"]["prompt-too-long"]["count"] == 2  # the fake serves 2,048 tokens
    assert "exceed the engine's max_model_len 2048" in json.dumps(summary["failures"])


def test_each_refusal_is_a_clear_error(folder, tmp_path):  # noqa: F811
    data, out = make_data(tmp_path, 2), tmp_path / "out.jsonl"
    with pytest.raises(EyasError, match="--server and --engine vllm both given"):
        config(data, out, folder, server="http://127.0.0.1:1", engine="vllm")
    with pytest.raises(EyasError, match="built in code"):
        run(config(data, out, "tiny", **engine(tmp_path)))
    with pytest.raises(EyasError, match="cannot import vllm"):
        run(config(data, out, folder, **engine(tmp_path, "a", probe_fails=True)))
    py = engine_python(tmp_path / "dies")
    Path(py).write_text(Path(py).read_text().replace("exec ", "FAKE_VLLM_FAIL_LOAD=1 exec "))
    with pytest.raises(EyasError, match="exited with code") as e:
        run(config(data, out, folder, engine="vllm", engine_python=py, engine_port=free_port()))
    assert "cannot load this model" in e.value.why
    assert not out.exists() or not read_out(out)  # nothing written


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_an_interrupted_run_stops_its_engine_and_a_rerun_finishes(folder, tmp_path, sig):  # noqa: F811
    """Ctrl-C stops the engine (eyas's finally); SIGKILL too (the kernel kills it with eyas: PR_SET_PDEATHSIG).
    What was written is kept, and the rerun does the rest."""
    data, out = make_data(tmp_path, 24), tmp_path / "out.jsonl"
    opts = engine(tmp_path)
    cmd = [sys.executable, "-m", "eyas", "regenerate", "--data", str(data), "--out", str(out), "--target",
           str(folder), "--max-new-tokens", "12", "--engine", "vllm", "--engine-python", opts["engine_python"],
           "--engine-port", str(opts["engine_port"]), "--concurrency", "1", "--dtype", "fp32", "--quiet"]
    # 0.1 s a reply: 24 take 2.4 s or more, so the run is still going when the signal comes. SIGINT's default
    # restored in the child: a test run started in the background of a non-interactive shell ignores SIGINT, the
    # child would inherit that, and Python keeps an ignored SIGINT ignored (the run then finished all 24)
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(REPO / "src"), "FAKE_VLLM_DELAY_S": "0.1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not out.exists() or out.read_text().count("\n") < 2):
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.05)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    proc.stderr.close()
    group = int((engine_paths(out)[0] / GROUP_FILE).read_text())
    deadline = time.monotonic() + 30
    while alive(group) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(group), "the engine outlived the eyas that started it"
    kept = out.read_text().count("\n")
    assert 2 <= kept < 24
    summary = run(config(data, out, folder, max_new_tokens=12, **engine(tmp_path, "again")))
    assert summary["skipped"] == kept and len({r["id"] for r in read_out(out)}) == kept + summary["done"]


def test_the_start_up_line_shows_what_vllm_is_doing_without_its_prefix(tmp_path):
    from eyas.core.vllm_server import last_line

    log = tmp_path / "engine.log"
    log.write_text("(APIServer pid=2846) INFO 12-02 12:23:38 [api_utils.py:347] version 0.32.0\n"
                   "(EngineCore pid=2952) WARNING 12-02 12:24:13 [cpu.py:224] Triton is not installed.\n\n")
    assert last_line(log) == "Triton is not installed."
    log.write_text("INFO 12-02 12:23:30 [__init__.py:216] Automatically detected platform cpu.\n")
    assert last_line(log) == "Automatically detected platform cpu."
    log.write_text("(VllmWorker TP0 pid=7) INFO 12-02 12:24:13 [cpu_worker.py:1] Warming up\n")
    assert last_line(log) == "Warming up"
    log.write_text("Traceback (most recent call last):\n")
    assert last_line(log) == "Traceback (most recent call last):"
    assert last_line(tmp_path / "none.log") == ""


def test_a_request_to_the_engine_may_take_its_share_of_a_slow_engine():
    """128 conversations in flight on an engine making 68 tokens/s in all (vLLM, float32, an AVX2-only CPU) wait
    ~600 s for 320 tokens each: past the 300 s --timeout, so the recipe's WritingBench stage failed 67 of them."""
    from eyas.data.vllm_backend import ENGINE_FLOOR_TPS, engine_timeout

    assert 320 * 128 / 68 > 300 and engine_timeout(300, 320, 128) == 320 * 128 / ENGINE_FLOOR_TPS > 320 * 128 / 68
    assert engine_timeout(300, 5, 3) == 300  # a short reply keeps --timeout
    assert engine_timeout(3000, 320, 128) == 3000  # a longer --timeout stands


def test_a_runs_consecutive_engine_stages_share_one_engine(folder, tmp_path, monkeypatch):  # noqa: F811
    """`eyas run`: two regenerate stages that would start the same vLLM server get one (started by the first, no
    start-up for the second), each stage's replies equal its own run's, and the engine is stopped before a stage
    of another kind runs; a third stage with another engine setting starts its own."""
    from eyas.core.log import Console
    from eyas.pipeline.stages import Stage, run_pipeline

    data, r = make_data(tmp_path, 4), tmp_path / "run"
    opts = {**engine(tmp_path), "data": [str(data)], "target": str(folder), "quiet": True, "dtype": "fp32"}
    group = {}

    def prepare_stage(cfg):  # a stage of another kind: the shared engine must be stopped by now
        group["alive_at_prepare"] = alive(int((engine_paths(Path(opts_a["out"]))[0] / GROUP_FILE).read_text()))
        return {}

    opts_a = {**opts, "out": f"{r}/a.jsonl", "max_new_tokens": 5}
    stages = [Stage("regenerate-a", "regenerate", opts_a),
              Stage("regenerate-b", "regenerate", {**opts, "out": f"{r}/b.jsonl", "max_new_tokens": 7}),
              Stage("regenerate-c", "regenerate", {**opts, "out": f"{r}/c.jsonl", "max_new_tokens": 7, "seed": 1}),
              Stage("prepare", "prepare", {"out": f"{r}/prepared"})]

    @dataclasses.dataclass(frozen=True)
    class Other:
        out: str = ""

    monkeypatch.setattr("eyas.pipeline.stages.load_stage",
                        lambda c: (RegenerateConfig, run) if c == "regenerate" else (Other, prepare_stage))
    out = run_pipeline(stages, r, Console(quiet=True))
    assert [out[s]["done"] for s in ("regenerate-a", "regenerate-b", "regenerate-c")] == [4, 4, 4]
    log_a, log_b, log_c = (engine_paths(Path(f"{r}/{n}.jsonl"))[1] for n in "abc")
    assert log_a.read_text().count("fake vllm: serving") == 1 and not log_b.exists()  # one start for a and b
    assert log_c.read_text().count("fake vllm: serving") == 1  # another seed: its own engine
    home_a, home_b = (engine_paths(Path(f"{r}/{n}.jsonl"))[0] for n in "ab")  # b records the engine it used, so a
    assert (home_b / GROUP_FILE).read_text() == (home_a / GROUP_FILE).read_text()  # rerun from b stops leftovers
    assert group["alive_at_prepare"] is False
    for name, new in (("b", 7), ("a", 5)):  # each stage's own settings, through the one engine
        alone = run(config(data, tmp_path / f"{name}-alone.jsonl", folder, max_new_tokens=new,
                           **engine(tmp_path, f"env-{name}")))
        assert alone["done"] == 4
        assert ({c["id"]: c["messages"] for c in read_out(Path(f"{r}/{name}.jsonl"))}
                == {c["id"]: c["messages"] for c in read_out(tmp_path / f"{name}-alone.jsonl")})
