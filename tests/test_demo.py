"""`eyas demo --quick` end to end (the tiny target, two training ranks under torchrun), and `eyas run` from TOML.

The report of the real run must have every section, and every number on it must equal its source file.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eyas.core.errors import EyasError
from eyas.core.log import Console
from eyas.pipeline.demo import RunConfig, stages_from_toml
from eyas.pipeline.stages import Stage, run_stage
from tests.test_report import SECTIONS, Page, check_numbers


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[Path, str]:
    runs = tmp_path_factory.mktemp("runs")
    proc = subprocess.run([sys.executable, "-m", "eyas", "demo", "--quick", "--runs-dir", str(runs)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return runs / "demo-quick", proc.stderr



def test_quick_demo_runs_every_stage_and_reports_the_figures(quick_run):
    run_dir, err = quick_run
    for stage in ("regenerate-gsm8k", "regenerate-chitchat", "prepare", "extract", "train", "evaluate",
                  "evaluate-gsm8k", "export-eagle3", "export-speculators", "report"):
        assert (run_dir / "stages" / f"{stage}.json").exists(), stage
    assert "disjoint: yes" in err  # the sharding audit of the two-rank training is visible
    assert "plan: optimizer steps (global, all ranks step together)" in err  # and its plan, labelled
    assert "acceptance length tau" in err and "lossless: yes" in err
    assert "  GSM8K test (4 prompts): draft tau" in err and "  MT-Bench (4 prompts, writing): draft tau" in err
    audit = json.loads((run_dir / "train" / "audit.json").read_text())
    assert audit["disjoint"] is True and audit["covers"] is True and audit["world_size"] == 2
    page = Page((run_dir / "report.html").read_text(encoding="utf-8"))
    assert {k: v["status"] for k, v in page.sections.items()} == {s: "ok" for s in SECTIONS[1:]}  # [0]: the card
    assert len(page.kpis) >= 3  # the summary card
    # highlighted: exactly the draft tokens evaluate recorded as accepted in the three generations shown. How many
    # there are depends on the adaptive controller, which drafts only where the measured timings say it pays: on a
    # busy machine it may draft nothing at all in these few tokens, so "some are highlighted" cannot be asserted.
    results = json.loads((run_dir / "evaluate" / "results.json").read_text())
    assert results["samples"] and all(s["accepted"] for s in results["samples"])
    want = []
    for s in results["samples"][:3]:
        pos = 1  # pieces[0] comes from the prompt's forward; then each round: its accepted tokens, the target's own
        for a in s["accepted"]:
            want += s["pieces"][pos:pos + a]
            pos += a + 1
    assert page.drafted == [p for p in want if p]
    assert check_numbers(page, run_dir) > 20


@pytest.mark.parametrize("target, parallel", [("tiny-qwen3-moe", "ddp"), ("tiny-deepseek-v3", "fsdp")])
def test_every_stage_runs_on_moe_and_latent_attention_targets(tmp_path, target, parallel):
    """The pipeline on the tiny Qwen3-MoE and DeepSeek-V3 targets (the tiny Llama is the quick run above):
    regenerate (transformers' generate), extract, two-rank training, a lossless evaluation, the engines' export."""
    proc = subprocess.run([sys.executable, "-m", "eyas", "demo", "--quick", "--target", target, "--samples", "16",
                           "--eval-prompts", "2", "--parallel", parallel, "--runs-dir", str(tmp_path), "--name", "r"],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "r"
    assert json.loads((run / "store" / "manifest.json").read_text())["layer_ids"] == [2, 4, 5]
    audit = json.loads((run / "train" / "audit.json").read_text())
    assert audit["disjoint"] and audit["covers"] and audit["world_size"] == 2
    results = json.loads((run / "evaluate" / "results.json").read_text())
    checked = [c["lossless"] for c in results["configs"] if c["lossless"]["checked"]]
    assert checked and all(x["lossless"] for x in checked)  # every output the target's own greedy one
    exported = json.loads((run / "export" / "eagle3" / "config.json").read_text())
    arch = {"tiny-qwen3-moe": "Qwen3MoeForCausalLM", "tiny-deepseek-v3": "DeepseekV3ForCausalLM"}[target]
    assert exported["eyas"]["draft"]["target"]["architecture"] == arch
    assert (exported["hidden_size"], exported["target_hidden_size"], exported["vocab_size"]) == (64, 64, 49152)
    assert exported["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM: the input of layer i
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang: layer i's output
    heads, kv, dim = (exported[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    assert heads * dim == 64 and (target != "tiny-deepseek-v3" or dim == 16)  # MLA: v_head_dim heads


def test_second_run_skips_cached_stages(quick_run):
    run_dir, _ = quick_run
    proc = subprocess.run([sys.executable, "-m", "eyas", "demo", "--quick", "--runs-dir", str(run_dir.parent)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("cached:") == 10  # every stage, both evaluations included


def test_toml_stages_and_their_errors(tmp_path):
    doc = {"run": {"name": "x"}, "prepare": {"data": ["{run}/a.jsonl"], "out": "{run}/p"},
           "second": {"command": "train", "nproc": 2, "store": "{run}/s"}}
    stages = stages_from_toml(doc, tmp_path / "x", "t.toml")
    assert [(s.name, s.command, s.nproc) for s in stages] == [("prepare", "prepare", 1), ("second", "train", 2)]
    assert stages[0].settings["data"] == (f"{tmp_path}/x/a.jsonl",)
    with pytest.raises(EyasError, match="names no eyas command"):
        stages_from_toml({"frobnicate": {"a": 1}}, tmp_path, "t.toml")
    with pytest.raises(EyasError, match="lists no stages"):
        stages_from_toml({"run": {}}, tmp_path, "t.toml")
    assert RunConfig(config="x.toml").config == "x.toml"


@pytest.mark.parametrize("table, said", [
    ({"command": "train", "max_steps": "four"}, r"run.toml \[t\]: max_steps = 'four': a value of type str, not a "
                                                "whole number"),
    ({"command": "prepare", "max_length": 256.7}, r"max_length = 256.7.*type float, not a whole number"),
    ({"command": "train", "resume": 1}, r"resume = 1.*type int, not true or false"),
    ({"command": "train", "lr": "1e-4"}, r"lr = '1e-4'.*type str, not a number"),
    ({"command": "train", "parallel": "zero"}, r"parallel = 'zero'.*not one of ddp, fsdp"),
    ({"command": "prepare", "data": "chats.jsonl"}, r"data = 'chats.jsonl'.*a list is expected"),
    ({"command": "train", "nproc": 0}, r"\[t\] nproc = 0 is not a process count"),
    ({"command": "train", "nproc": "two"}, r"\[t\] nproc = 'two' is not a process count"),
])
def test_a_toml_value_of_the_wrong_type_is_refused_naming_its_table_and_key(tmp_path, table, said):
    """Issue 45: every value is checked against its field's type (and a stage's process count against its range),
    with the table and the key named and an example of the fix; none reaches the stage to fail there."""
    with pytest.raises(EyasError, match=said) as e:
        stages_from_toml({"t": table}, tmp_path, "run.toml")
    assert "fix: write" in str(e.value)
    assert stages_from_toml({"t": {"command": "train", "lr": 1, "max_steps": 4}}, tmp_path, "run.toml")[0].settings[
        "lr"] == 1  # an int is a float's value: lr = 1 is 1.0


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", "/abs", " "])
def test_a_run_name_cannot_leave_the_runs_folder(tmp_path, name):
    from eyas.pipeline.demo import run_config

    toml = tmp_path / "r.toml"
    toml.write_text(f'[run]\nname = "{name}"\n[prepare]\ndata = ["x.jsonl"]\n')
    runs = tmp_path / "deep" / "runs"
    with pytest.raises(EyasError, match="is not a folder name"):
        run_config(RunConfig(config=str(toml), runs_dir=str(runs)))
    assert not (tmp_path / "deep").exists() and not (tmp_path / "x").exists()


EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.toml"))


@pytest.mark.parametrize("config", EXAMPLES, ids=lambda p: p.name)
def test_example_configs_build(config, tmp_path):
    """Every stage of every example builds its command's settings (a misspelt key fails here, not an hour into a
    run), and a training stage's validation store is one an extract stage of the same file writes."""
    import tomllib

    from eyas.core.config import from_mapping
    from eyas.pipeline.registry import load_stage

    stages = stages_from_toml(tomllib.loads(config.read_text()), tmp_path / "run", config.name)
    cfgs = {s.name: from_mapping(load_stage(s.command)[0], s.settings, s.name) for s in stages}
    stores = {cfgs[s.name].store for s in stages if s.command == "extract"}
    for s in stages:
        if s.command == "train" and cfgs[s.name].val_store:
            assert cfgs[s.name].val_store in stores, (s.name, cfgs[s.name].val_store)


def kept(run: Path, name: str, why: str, file: str = "metrics.jsonl") -> list[str | None]:
    """The content of `file` (None: not there) in every folder `eyas run` set aside for `name` because of `why`."""
    return [(d / file).read_text() if (d / file).is_file() else None for d in sorted(run.glob(f"{name}.kept-*-{why}*"))]


def test_force_clears_a_resuming_stage_only_inside_the_run(tmp_path):
    run = tmp_path / "run"
    (run / "train").mkdir(parents=True)
    (run / "train" / "metrics.jsonl").write_text("{}\n")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    stage = Stage("train", "train", {"out": str(outside)}, fresh=(str(outside),))
    with pytest.raises(EyasError, match="not inside the run folder"):
        run_stage(stage, run, Console(quiet=True), force=True)
    assert outside.is_dir()
    stage = Stage("plan", "plan", {"samples": 10, "world_size": 2, "quiet": True}, fresh=(str(run / "train"),))
    run_stage(stage, run, Console(quiet=True), force=True)
    assert not (run / "train").exists() and (run / "stages" / "plan.json").is_file()
    assert kept(run, "train", "force") == ["{}\n"]  # set aside, not deleted
    (run / "train").mkdir()  # its output again; same settings: cached, kept
    run_stage(stage, run, Console(quiet=True))
    assert (run / "train").is_dir()
    changed = Stage("plan", "plan", {"samples": 12, "world_size": 2, "quiet": True}, fresh=(str(run / "train"),))
    run_stage(changed, run, Console(quiet=True))  # other settings: the old output cannot be resumed: set aside
    assert not (run / "train").exists() and kept(run, "train", "settings-changed") == [None]  # the empty folder


def test_a_stage_that_failed_is_cleared_when_rerun_with_other_settings(tmp_path):
    run = tmp_path / "run"
    (run / "train").mkdir(parents=True)
    bad = Stage("plan", "plan", {"samples": 10, "world_size": -1, "quiet": True}, fresh=(str(run / "train"),))
    with pytest.raises(EyasError):
        run_stage(bad, run, Console(quiet=True))  # began, failed: no finished marker
    (run / "train" / "checkpoint").write_text("partial")
    again = Stage("plan", "plan", {"samples": 10, "world_size": -1, "quiet": True}, fresh=(str(run / "train"),))
    with pytest.raises(EyasError):
        run_stage(again, run, Console(quiet=True))  # same settings: its partial output is kept for resuming
    assert (run / "train" / "checkpoint").is_file()
    fixed = Stage("plan", "plan", {"samples": 10, "world_size": 2, "quiet": True}, fresh=(str(run / "train"),))
    run_stage(fixed, run, Console(quiet=True))  # other settings: the partial output cannot be resumed: set aside
    assert not (run / "train").exists() and (run / "stages" / "plan.json").is_file()
    assert kept(run, "train", "settings-changed", "checkpoint") == ["partial"]  # hours of work never deleted
    assert not (run / "stages" / "plan.started").exists()


def test_a_stage_reruns_when_a_stage_it_reads_ran_again(tmp_path, monkeypatch):
    """train's settings change -> train reruns, and so do evaluate and report (they read its output, their own
    settings are the same); a stage that reads nothing train wrote stays cached. The markers, not the settings,
    say which output is newer."""
    import dataclasses

    from eyas.pipeline.stages import reads, run_pipeline

    ran = []

    @dataclasses.dataclass(frozen=True)
    class Fake:
        out: str = ""
        data: str = ""
        lr: float = 0.0

    def run(cfg):
        ran.append(cfg.out)
        return {}

    monkeypatch.setattr("eyas.pipeline.stages.load_stage", lambda command: (Fake, run))
    monkeypatch.setattr("eyas.pipeline.stages.to_argv", lambda cfg: [])
    r = tmp_path / "run"

    def stages(lr):
        return [Stage("prepare", "prepare", {"out": f"{r}/prepared"}),
                Stage("train", "train", {"data": f"{r}/prepared", "out": f"{r}/train", "lr": lr}),
                Stage("evaluate", "evaluate", {"data": f"{r}/train/final", "out": f"{r}/eval"}),
                Stage("other", "evaluate", {"data": f"{r}/prepared", "out": f"{r}/other"}),
                Stage("report", "report", {"data": str(r), "out": f"{r}/report"})]

    assert [u.name for u in stages(1)[:2] if reads(stages(1)[2], u)] == ["train"]
    run_pipeline(stages(1.0), r, Console(quiet=True))
    assert len(ran) == 5
    ran.clear()
    run_pipeline(stages(1.0), r, Console(quiet=True))
    assert ran == []  # all cached
    run_pipeline(stages(2.0), r, Console(quiet=True))
    assert ran == [f"{r}/train", f"{r}/eval", f"{r}/report"]
    ran.clear()
    run_pipeline(stages(2.0), r, Console(quiet=True))
    assert ran == []


def test_a_failed_torchrun_stage_names_the_rank_that_died_first(tmp_path, monkeypatch):
    """Under NCCL the surviving ranks are aborted by the watchdog, with no Python exception of eyas's: the stage's
    error reads the log as `eyas doctor` does and names the rank that died first and its error."""
    import types

    from eyas.pipeline import stages as runner
    from tests.seedlogs import SeedRun
    from tests.seedlogs import lines as seed_lines

    log_lines = [line + "\n" for line in seed_lines(SeedRun(fmt="torchrun", samples=400, stop_at=40, crash_rank=1))]

    class FakeTorchrun:
        def __init__(self, cmd, **kwargs):
            self.stdout, self.returncode = iter(log_lines), 1

        def wait(self):
            return self.returncode

    monkeypatch.setattr(runner.subprocess, "Popen", FakeTorchrun)
    monkeypatch.setattr(runner, "to_argv", lambda cfg: [])
    cfg = types.SimpleNamespace(out=str(tmp_path / "train"))
    with pytest.raises(EyasError) as e:
        runner._launch_torchrun(Stage("train", "train", {}, nproc=4), cfg, tmp_path / "train.log", Console(quiet=True))
    text = str(e.value)
    assert "failed under torchrun (exit 1)" in text
    assert "rank 1 died first: torch.OutOfMemoryError: CUDA out of memory" in text
    assert "then ranks 0, 2, 3 were stopped (NCCL watchdog timeouts" in text
    assert (tmp_path / "train.log").read_text() == "".join(log_lines)  # the whole log kept
    # a crash before any step (extract's ranks write progress bars, not steps; a target too large to load)
    from tests.seedlogs import _crash

    run = SeedRun(fmt="torchrun", samples=400, crash_rank=0)
    log_lines = ["[rank0]: extract (rank 0 of 4):  12%|#  | 9.1k/75k [00:31<03:46, 291tok/s]\n",
                 *(line + "\n" for line in _crash(run, run.start))]
    with pytest.raises(EyasError, match=r"rank 0 died first: torch.OutOfMemoryError") as e:
        runner._launch_torchrun(Stage("extract", "extract", {}, nproc=4), types.SimpleNamespace(store=str(tmp_path)),
                                tmp_path / "extract.log", Console(quiet=True))
    assert "before the first step" not in str(e.value) and "ranks 1, 2, 3 were stopped" in str(e.value)
    log_lines = ["[rank0]: RuntimeError: something else\n"]  # no traceback: the log is pointed to, as before
    with pytest.raises(EyasError, match="see the log") as e:
        runner._launch_torchrun(Stage("extract", "extract", {}, nproc=2), types.SimpleNamespace(store=str(tmp_path)),
                                tmp_path / "extract.log", Console(quiet=True))


def test_the_demos_last_lines_judge_the_draft_where_it_should_pay_and_where_it_cannot(tmp_path):
    """Issue 44: a newcomer reads the draft on MT-Bench writing and on GSM8K test (like its training data), each
    beside the hybrid and prompt lookup, and a conclusion drawn from those figures alone."""
    from eyas.pipeline.demo import _final_lines

    ok = {"checked": True, "identical": True}

    def results(bench, cats, draft, hybrid, lookup):
        configs = [{"name": f"eagle3 chain k={k}", "drafter": "eagle3", "k": k, "tau": t, "speedup": s,
                    "lossless": ok} for k, (t, s) in zip((3, 5), draft)]
        configs += [{"name": "hybrid", "drafter": "hybrid", "k": 5, "tau": hybrid[0], "speedup": hybrid[1],
                     "lossless": ok},
                    {"name": "prompt-lookup k=7", "drafter": "prompt-lookup", "k": 7, "tau": lookup[0],
                     "speedup": lookup[1], "lossless": ok}]
        return {"bench": {"name": bench, "prompts": 4, "categories": cats}, "configs": configs}

    mt = results("mt_bench", ["writing"], [(1.02, 1.01), (1.03, 0.99)], (1.43, 1.32), (1.39, 1.27))
    gsm = results("gsm8k", ["gsm8k"], [(1.36, 1.14), (1.3, 1.05)], (2.25, 1.79), (1.94, 1.64))
    summaries = {"prepare": {"samples": {"train": 310, "validation": 10},
                             "data": ["runs/demo/regenerated/gsm8k.jsonl", "runs/demo/regenerated/chitchat.jsonl"]},
                 "evaluate": mt, "evaluate-gsm8k": gsm, "report": {"path": "r.html"}}
    lines = _final_lines(summaries, tmp_path)
    assert lines[1] == ("acceptance length tau and speedup over plain greedy decoding of the draft trained on 310 "
                        "conversations (gsm8k, chitchat), beside prompt lookup and the hybrid of both (lossless: yes):")
    assert lines[2] == ("  MT-Bench (4 prompts, writing): draft tau 1.02, 1.01x (chain 3); hybrid tau 1.43, 1.32x; "
                        "prompt lookup tau 1.39, 1.27x")
    assert lines[3] == ("  GSM8K test (4 prompts): draft tau 1.36, 1.14x (chain 3); hybrid tau 2.25, 1.79x; "
                        "prompt lookup tau 1.94, 1.64x")
    assert lines[4] == ("The draft alone pays on GSM8K test (1.14x) and not on MT-Bench writing (1.01x). Prompt "
                        "lookup, which needs no training, does better on MT-Bench writing and GSM8K test. The hybrid, "
                        "taking each round from the draft or prompt lookup, is fastest on MT-Bench writing and GSM8K "
                        "test, where the draft's tokens add to prompt lookup's. 310 conversations and minutes of "
                        "training buy that much; docs/recipe.md trains a draft on broad data (eyas run "
                        "examples/smollm2-recipe.toml).")
    assert lines[5] == "report: r.html"
    # the conclusion follows the figures: a draft that pays nowhere is not said to pay, a strong one is not
    # said to lose to prompt lookup, and a hybrid that adds nothing is not praised
    weak = results("gsm8k", ["gsm8k"], [(1.1, 1.02), (1.1, 1.0)], (1.3, 1.2), (1.3, 1.25))
    said = _final_lines({**summaries, "evaluate-gsm8k": weak}, tmp_path)[4]
    assert said.startswith("The draft alone does not pay yet (MT-Bench writing 1.01x, GSM8K test 1.02x).")
    assert "is fastest on MT-Bench writing," in said and "GSM8K test," not in said  # 1.2x: no faster than lookup
    same_tau = results("gsm8k", ["gsm8k"], [(1.0, 0.95), (1.0, 0.9)], (2.0, 1.7), (2.0, 1.55))  # the tiny target's
    said = _final_lines({**summaries, "evaluate-gsm8k": same_tau}, tmp_path)[4]  # random draft: priced, not drafted
    assert "is fastest on MT-Bench writing," in said and "GSM8K test," not in said
    strong = results("gsm8k", ["gsm8k"], [(2.5, 1.9), (2.6, 2.0)], (2.6, 2.1), (1.5, 1.3))
    twice = _final_lines({**summaries, "evaluate": strong, "evaluate-gsm8k": strong,
                          "prepare": {"samples": {"train": 50_000}}}, tmp_path)
    said = twice[4]  # two evaluations of one benchmark: each named by its stage, lines and conclusion alike
    assert twice[2].startswith("  evaluate, GSM8K test (4 prompts): draft tau 2.60, 2.00x (chain 5)")
    assert twice[3].startswith("  evaluate-gsm8k, GSM8K test (4 prompts): draft tau 2.60, 2.00x (chain 5)")
    assert said.startswith("The draft alone pays on GSM8K test in evaluate (2.00x) and GSM8K test in "
                           "evaluate-gsm8k (2.00x).")
    assert "Prompt lookup" not in said and "conversations and minutes" not in said
    no_draft = {"bench": {"name": "gsm8k"}, "configs": gsm["configs"][2:]}
    assert _final_lines({"evaluate": no_draft}, tmp_path) == [f"run folder: {tmp_path}"]


def test_a_speedup_the_latencies_cannot_explain_is_flagged_not_believed(tmp_path):
    """A demo run beside other work timed plain decoding slow: the draft at tau 1.05 showed 1.45x, more than its
    tau and the measured forwards allow (1.00x). The figures are printed with a caution naming the configuration;
    efficiency within noise of 1 is not flagged."""
    from eyas.pipeline.demo import _final_lines
    from eyas.speculate.results import EFFICIENCY_CEILING, disturbed

    ok = {"checked": True, "identical": True}

    def config(name, drafter, tau, speedup, predicted):
        return {"name": name, "drafter": drafter, "k": 5, "tau": tau, "speedup": speedup, "lossless": ok,
                "predicted_speedup": predicted, "efficiency": speedup / predicted}

    mt = {"bench": {"name": "mt_bench", "prompts": 4, "categories": ["writing"]},
          "configs": [config("eagle3 chain k=5", "eagle3", 1.05, 1.45, 1.00),
                      config("prompt-lookup k=7", "prompt-lookup", 1.39, 1.92, 1.35)]}
    gsm = {"bench": {"name": "gsm8k", "prompts": 4, "categories": ["gsm8k"]},
           "configs": [config("eagle3 chain k=5", "eagle3", 1.04, 1.04, 0.98)]}  # 1.06: noise, not flagged
    assert [c["name"] for c in disturbed(mt)] == ["eagle3 chain k=5", "prompt-lookup k=7"] and disturbed(gsm) == []
    assert disturbed({"configs": [{"efficiency": EFFICIENCY_CEILING}]}) == []
    lines = _final_lines({"evaluate": mt, "evaluate-gsm8k": gsm}, tmp_path)
    caution = [x for x in lines if "caution" in x]
    assert len(caution) == 1 and caution[0].startswith("MT-Bench: caution: 2 configuration(s) ran faster than")
    assert "eagle3 chain k=5: 1.45x measured, 1.00x the most its tau and t(q) allow" in caution[0]
    assert lines.index(caution[0]) == 4  # after both benchmarks' figures, before the conclusion drawn from them
