"""`eyas prompts` (eyas.data.prompts): the open user turn of a real chat template, the real sampler's batches, and
the file's rules (filters, resume exactly where it stopped, settings kept) with a scripted sampler."""

import json
import os

import pytest

from eyas.core.errors import EyasError
from eyas.data import prompts
from eyas.data.chat import ChatRenderer
from eyas.data.prompts import PromptsConfig, open_user_turn, run


def test_the_open_user_turn_is_the_templates_text_before_a_user_message(tiny_target):
    renderer = ChatRenderer(tiny_target.tokenizer)  # SmolLM2's ChatML template, with its default system prompt
    plain = open_user_turn(renderer, "")
    assert plain.endswith("<|im_end|>\n<|im_start|>user\n") and "You are a helpful AI assistant" in plain
    steered = open_user_turn(renderer, "You write Python.")
    assert steered == "<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\n"


def test_the_real_sampler_is_seeded_by_batch(tiny_target, monkeypatch):
    monkeypatch.setattr(prompts, "load_target", lambda *a, **k: tiny_target)
    cfg = PromptsConfig(target="tiny", out="unused", batch_size=3, max_new_tokens=6, threads=1, quiet=True)
    from eyas.core.log import console

    sampler = prompts.Sampler(cfg, "float32", console(0, True))
    assert sampler.lean is not None  # Llama family: eyas's batched decoder
    first, again, other = sampler.batch(0), sampler.batch(0), sampler.batch(1)
    assert first == again != other and len(first) == 3
    assert all(isinstance(t, str) and 1 <= n <= 6 and isinstance(stopped, bool) for t, n, stopped in first)
    assert len({t for t, _, _ in first}) == 3  # sampled rows differ from each other


class Scripted:
    """A sampler whose batch b row r says f"request {b}.{r}", except: row 1 is cut (not ended), row 2 too short,
    row 3 repeats row 0 of batch 0. `stop_at`: raise KeyboardInterrupt when asked for that batch (a killed run)."""

    stop_at = None
    calls: list = []

    def __init__(self, cfg, dtype, con):
        self.target = None

    def batch(self, b):
        Scripted.calls.append(b)
        if b == Scripted.stop_at:
            raise KeyboardInterrupt
        rows = []
        for r in range(5):
            text = {1: f"cut {b}.{r}", 2: "hm", 3: "request 0.0"}.get(r, f"request {b}.{r}")
            rows.append((text, 7, r != 1))
        return rows


def _cfg(out, **kw):
    return PromptsConfig(**{"out": str(out), "num_prompts": 5, "batch_size": 5, "min_chars": 4, "quiet": True,
                            "dtype": "float32", **kw})


def test_filters_and_a_killed_run_resumes_to_the_uninterrupted_file(tmp_path, monkeypatch):
    monkeypatch.setattr(prompts, "Sampler", Scripted)
    whole = tmp_path / "whole.jsonl"
    s = run(_cfg(whole))
    got = [json.loads(line) for line in whole.read_text().splitlines()]
    # rows 0 and 4 of each batch are kept (1 cut, 2 too short, 3 a repeat of the first prompt)
    assert [g["messages"][0]["content"] for g in got] == ["request 0.0", "request 0.4", "request 1.0",
                                                          "request 1.4", "request 2.0"]
    assert got[0] == {"id": "magpie:0:0:0", "messages": [{"role": "user", "content": "request 0.0"}],
                      "source": "magpie:smollm2-135m", "batch": 0, "row": 0}
    assert s["dropped"] == {"cut at --max-new-tokens": 2, "shorter than --min-chars": 2, "duplicate": 2}
    assert s["tokens"] == 7 * 11  # every row looked at, up to the last one kept

    part = tmp_path / "part.jsonl"
    Scripted.stop_at = 2
    with pytest.raises(KeyboardInterrupt):
        run(_cfg(part))
    assert len(part.read_text().splitlines()) == 4  # batches 0 and 1 were written whole
    Scripted.stop_at = None
    run(_cfg(part, num_prompts=3))  # asking for fewer than written adds nothing
    assert len(part.read_text().splitlines()) == 4
    Scripted.calls = []
    s = run(_cfg(part))
    assert part.read_text() == whole.read_text() and s["written"] == 1 and s["already_there"] == 4
    assert Scripted.calls == [1, 2]  # the last batch written is sampled again and continued after its last row
    s = run(_cfg(part, num_prompts=8))  # more: on from batch 2's row 0, never writing a row twice
    texts = [json.loads(line)["messages"][0]["content"] for line in part.read_text().splitlines()]
    assert texts[5:] == ["request 2.4", "request 3.0", "request 3.4"] and len(set(texts)) == 8


def test_other_settings_are_refused_and_overwrite_starts_anew(tmp_path, monkeypatch):
    monkeypatch.setattr(prompts, "Sampler", Scripted)
    out = tmp_path / "p.jsonl"
    run(_cfg(out, num_prompts=2))
    with pytest.raises(EyasError, match=r"holds prompts made under other settings: temperature 1.0 then, 0.7 now"):
        run(_cfg(out, num_prompts=4, temperature=0.7))
    assert len(out.read_text().splitlines()) == 2  # nothing written, nothing lost
    with pytest.raises(EyasError, match="temperature 1.0 then, 0.7 now"):  # issue 45: nothing left to do, and yet
        run(_cfg(out, num_prompts=2, temperature=0.7))  # those 2 are not "done" under these settings
    run(_cfg(out, num_prompts=1, temperature=0.7, overwrite=True))
    assert len(out.read_text().splitlines()) == 1
    assert json.loads(out.with_name("p.jsonl.settings.json").read_text())["temperature"] == 0.7
    # --overwrite never deletes a file eyas prompts did not write: another stage's output, a data set, a JSON file
    for name, text in [("replies.jsonl", '{"id": "q0", "messages": []}\n'), ("notes.jsonl", '{"text": "mine"}\n'),
                       ("one.json", '{"id": "x", "messages": []}')]:
        other = tmp_path / name
        other.write_text(text)
        for kw in ({"overwrite": True}, {}):
            with pytest.raises(EyasError, match="is not a prompt `eyas prompts` wrote"):
                run(_cfg(other, **kw))
            assert other.read_text() == text


def test_a_target_that_never_ends_a_user_turn_is_stopped_with_the_counts(tmp_path, monkeypatch):
    class Endless(Scripted):
        def batch(self, b):
            return [(f"on and on {b}.{r}", 6, False) for r in range(5)]

    monkeypatch.setattr(prompts, "Sampler", Endless)
    with pytest.raises(EyasError, match=r"0 of 260 samples kept \(260 cut at --max-new-tokens") as e:
        run(_cfg(tmp_path / "p.jsonl"))
    assert "raise --max-new-tokens" in str(e.value)


def test_greedy_prompts_are_refused():
    with pytest.raises(EyasError, match="--temperature 0"):
        PromptsConfig(temperature=0.0)


def test_a_torn_last_record_is_dropped_and_the_run_resumes(tmp_path, monkeypatch):
    monkeypatch.setattr(prompts, "Sampler", Scripted)
    whole, torn = tmp_path / "whole.jsonl", tmp_path / "torn.jsonl"
    run(_cfg(whole))
    lines = whole.read_text().splitlines(keepends=True)
    torn.write_text("".join(lines[:3]) + lines[3][:20])  # killed while writing the fourth record
    torn.with_name("torn.jsonl.settings.json").write_text(whole.with_name("whole.jsonl.settings.json").read_text())
    run(_cfg(torn))
    assert torn.read_text() == whole.read_text()


def test_a_second_writer_is_refused(tmp_path, monkeypatch):
    from eyas.core.lock import hold

    monkeypatch.setattr(prompts, "Sampler", Scripted)
    out = tmp_path / "p.jsonl"
    held = hold(out, "prompts")
    with pytest.raises(EyasError, match=rf"another eyas run is writing {out} \(pid {os.getpid()} on "):
        run(_cfg(out))
    assert not out.exists()
    held.close()
    assert run(_cfg(out))["written"] == 5
