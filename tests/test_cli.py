"""The CLI is generated from the stage dataclasses: parsing, round trip to argv, clear errors."""

import argparse
import dataclasses

import pytest

from eyas import cli
from eyas.core.config import StageConfig, add_arguments, check, from_mapping, from_namespace, opt, to_argv
from eyas.core.errors import EyasError


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoCfg(StageConfig):
    logs: tuple[str, ...] = opt((), "logs", positional=True)
    n: int = opt(3, "n")
    layers: tuple[int, ...] = opt((), "layers")
    x: float | None = opt(None, "x")
    flag: bool = opt(False, "f")

    def __post_init__(self):
        check(self.n > 0, f"n must be positive, got {self.n}", "pass --n 1 or more")


def parse(argv):
    p = argparse.ArgumentParser()
    add_arguments(p, DemoCfg)
    return from_namespace(DemoCfg, p.parse_args(argv))


def test_parse_and_roundtrip():
    c = parse(["a.log", "b.log", "--n", "5", "--layers", "2", "4", "--flag", "--x", "0.5"])
    assert c == DemoCfg(logs=("a.log", "b.log"), n=5, layers=(2, 4), x=0.5, flag=True)
    assert parse(to_argv(c)) == c


def test_defaults_come_from_the_dataclass_only():
    c = parse(["a.log"])
    assert c.n == 3 and c.layers == () and c.x is None and c.flag is False


def test_validation_and_unknown_keys_are_clear():
    with pytest.raises(EyasError, match="n must be positive"):
        parse(["a", "--n", "0"])
    with pytest.raises(EyasError, match="unknown setting"):
        from_mapping(DemoCfg, {"nn": 3}, "test.toml [x]")


def test_cli_help_and_unknown_command(capsys):
    assert cli.main(["--help"]) == 0
    assert "extract" in capsys.readouterr().out
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_interrupted_run_names_the_command_that_resumes_it():
    """Ctrl-C: the line printed resumes the run as given; train needs --resume (a plain rerun is refused)."""
    want = "eyas train --store s --out r --resume"
    assert cli.resume_command("train", ["train", "--store", "s", "--out", "r"]) == want
    assert cli.resume_command("train", ["train", "--resume"]) == "eyas train --resume"
    assert cli.resume_command("extract", ["extract", "--store", "a b"]) == "eyas extract --store 'a b'"


def test_a_torchrun_rank_names_the_launcher_that_resumes_it(monkeypatch):
    """Issue 45: under torchrun the hint repeats the launcher and its process count (a plain `eyas train --resume`
    is refused: the checkpoint was written by 2 ranks)."""
    import eyas.core.dist  # noqa: F401  (what a rank of train or extract has loaded)

    for k, v in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    want = "torchrun --nproc_per_node 2 -m eyas train --out r --resume"
    assert cli.resume_command("train", ["train", "--out", "r"]) == want
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert cli.resume_command("extract", ["extract"]) == (
        "torchrun --nnodes 4 (and your rendezvous options) --nproc_per_node 2 -m eyas extract")


def test_every_dtype_spelling_is_accepted_by_every_command():
    """`--dtype fp32` and `--dtype float32` (bf16/bfloat16, fp16/float16) mean the same to every command that has
    a dtype; each keeps its own spelling inside, and a TOML table takes them too."""
    import argparse
    import dataclasses

    from eyas.cli import SUMMARIES, command_code
    from eyas.core.config import DTYPE_ALIASES

    seen = 0
    for command in SUMMARIES:
        cls, _ = command_code(command)
        field = next((f for f in dataclasses.fields(cls) if f.name == "dtype"), None)
        if field is None:
            continue
        parser = argparse.ArgumentParser()
        add_arguments(parser, cls)
        action = next(a for a in parser._actions if a.dest == "dtype")
        own = tuple(action.choices)
        for group in DTYPE_ALIASES:
            mine = [c for c in own if c in group]
            if not mine:
                continue
            for spelling in group + (f"torch.{group[-1]}",):
                assert action.type(spelling) == mine[0], (command, spelling)
        seen += 1
    assert seen >= 6  # prepare-less stages: regenerate, extract, train, evaluate, export, plan


def test_every_stage_shows_one_dtype_and_device_vocabulary():
    """Issue 43: every command with a --dtype offers auto, bf16, fp32, fp16 with default auto, and every command
    with a --device defaults to auto under one help text; a device no stage knows is refused the same way."""
    import dataclasses

    from eyas.cli import SUMMARIES, command_code
    from eyas.core.options import DEVICE_HELP, DTYPES
    from eyas.speculate.evaluate import EvalConfig

    dtypes = devices = 0
    for command in SUMMARIES:
        cls, _ = command_code(command)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if "dtype" in fields:
            dtypes += 1
            assert fields["dtype"].default == "auto" and tuple(fields["dtype"].metadata["choices"]) == DTYPES, command
        if "device" in fields:
            devices += 1
            assert fields["device"].default == "auto" and fields["device"].metadata["help"] == DEVICE_HELP, command
    assert dtypes >= 7 and devices >= 5  # prompts, regenerate, extract, train, evaluate, export, plan
    with pytest.raises(EyasError, match="--device 'gpu0' is not one of"):
        EvalConfig(device="gpu0")
    with pytest.raises(EyasError, match="--dtype 'int8' is not one of"):
        EvalConfig(dtype="int8")


def test_every_command_has_its_code_and_doctor_and_report_load_no_torch():
    """The help table and the registry name the same commands; doctor and report start without torch (they read
    logs and run folders: 0.2-0.3 s, where the stages' modules take 2.4 s)."""
    import subprocess
    import sys

    from eyas.cli import SUMMARIES
    from eyas.pipeline.registry import COMMANDS

    assert set(SUMMARIES) == set(COMMANDS) | {"demo", "run"}
    probe = ("import sys; from eyas.cli import command_code; command_code('doctor'); command_code('report'); "
             "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_dtype_from_a_toml_table_is_normalised_or_refused():
    from eyas.speculate.evaluate import EvalConfig
    from eyas.train.settings import TrainConfig

    assert from_mapping(EvalConfig, {"dtype": "float32"}).dtype == "fp32"
    assert from_mapping(TrainConfig, {"dtype": "bfloat16"}).dtype == "bf16"
    with pytest.raises(EyasError, match="dtype 'int4' in arguments is not one eyas knows"):
        from_mapping(TrainConfig, {"dtype": "int4"})


@pytest.mark.parametrize("name", ["smollm2-recipe", "smollm2-ablations", "smollm2-magpie"])
def test_every_stage_of_the_example_configs_is_a_valid_config(name, tmp_path):
    """The examples are what `eyas run` is told to run for hours: a misspelt or removed setting must fail here."""
    from pathlib import Path

    from eyas.core.config import load_toml
    from eyas.pipeline.demo import stages_from_toml

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.toml"
    stages = stages_from_toml(load_toml(path), tmp_path / name, str(path))
    assert len(stages) >= 6 and len({s.name for s in stages}) == len(stages)
    trains = [s for s in stages if s.command == "train"]
    assert trains and all(s.nproc == 2 and s.settings["resume"] for s in trains)


FINISH = """
import atexit, sys
import eyas.core.dist  # a stage that can run distributed has loaded it
from eyas.cli import finish
atexit.register(lambda: sys.stderr.write("finalized\\n"))
print("summary", end="")  # block-buffered into a pipe: lost unless finish flushes it
finish(int(sys.argv[1]))
"""


@pytest.mark.parametrize("world_size,code,finalized", [("1", 0, True), ("2", 0, False), ("2", 2, True)])
def test_a_torchrun_rank_that_succeeded_exits_without_interpreter_finalization(world_size, code, finalized):
    """A rank (WORLD_SIZE > 1) whose work succeeded leaves through os._exit, skipping finalization (where a rank
    of a finished 2-rank extraction once aborted in CI), with its code and its buffered output; a rank that failed
    and a single process exit normally."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "WORLD_SIZE": world_size}
    out = subprocess.run([sys.executable, "-c", FINISH, str(code)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == code
    assert out.stdout == "summary"
    assert ("finalized" in out.stderr) == finalized


def test_a_list_option_with_choices_takes_each_element_from_them():
    """`choices` on a tuple option holds for each element (bench_doctor's `--formats torchrun specforge`)."""
    import dataclasses as dc

    from eyas.core.config import from_mapping, opt, parse

    @dc.dataclass(frozen=True)
    class Listed:
        formats: tuple[str, ...] = opt(("a", "b"), "formats", choices=("a", "b", "c"))

    assert parse(Listed, ["--formats", "c", "a"]).formats == ("c", "a")
    assert from_mapping(Listed, {"formats": ["b"]}).formats == ("b",)
    with pytest.raises(EyasError, match="'d' not one of a, b, c"):
        from_mapping(Listed, {"formats": ["a", "d"]})
