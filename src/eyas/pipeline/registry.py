"""Every stage command (what `eyas COMMAND` and a pipeline table name) and the code that runs it.

A stage module exposes one frozen dataclass (its settings) and `run(cfg) -> dict`, the stage's summary. The links
are plain imports, so a reader, a tool and tests/test_layout.py all see which module runs which command. Importing
them all costs what importing one torch stage does (measured in docs/architecture.md), so `eyas COMMAND` pays
nothing for the table; `eyas --help`, `eyas doctor` and `eyas report` never load it (eyas.cli).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from eyas.data import prepare, prompts, regenerate
from eyas.doctor import diagnose
from eyas.draft import export, importer
from eyas.report import build
from eyas.speculate import evaluate
from eyas.store import extract, importers, verify
from eyas.train import plan, settings, trainer


class Command(NamedTuple):
    config: type  # the stage's frozen settings dataclass
    run: Callable[[Any], dict | None]  # runs it, returns its summary


COMMANDS: dict[str, Command] = {
    "prepare": Command(prepare.PrepareConfig, prepare.run),
    "prompts": Command(prompts.PromptsConfig, prompts.run),
    "regenerate": Command(regenerate.RegenerateConfig, regenerate.run),
    "extract": Command(extract.ExtractConfig, extract.run),
    "store info": Command(verify.StoreInfoConfig, verify.run_info),
    "store verify": Command(verify.StoreVerifyConfig, verify.run_verify),
    "store import": Command(importers.StoreImportConfig, importers.run),
    "train": Command(settings.TrainConfig, trainer.run),
    "evaluate": Command(evaluate.EvalConfig, evaluate.run),
    "export": Command(export.ExportConfig, export.run),
    "import": Command(importer.ImportConfig, importer.run_import),
    "plan": Command(plan.PlanConfig, plan.run),
    "doctor": Command(diagnose.DoctorConfig, diagnose.run),
    "report": Command(build.ReportConfig, build.run),
}


def load_stage(command: str) -> Command:
    """(config class, run function) of a stage command."""
    return COMMANDS[command]
