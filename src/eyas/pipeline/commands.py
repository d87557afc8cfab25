"""Every eyas command and the stage that runs it, for the CLI and for `eyas run`.

A stage module exposes a frozen dataclass (the table's config name) and `run(cfg) -> dict`, the stage's summary.
The modules are named, not imported, so a command imports only its own stage (`eyas --help` stays instant).
"""

from __future__ import annotations

import importlib

from eyas.core.errors import EyasError

# command -> (module, config class, run function, one-line description)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "prepare": ("eyas.data.prepare", "PrepareConfig", "run",
                "chat data -> tokens + assistant-only loss mask"),
    "prompts": ("eyas.data.prompts", "PromptsConfig", "run",
                "user prompts written by the target itself (Magpie), for regenerate to answer"),
    "regenerate": ("eyas.data.regenerate", "RegenerateConfig", "run",
                   "replace assistant turns with the target's own answers"),
    "extract": ("eyas.store.extract", "ExtractConfig", "run",
                "target hidden states -> checksummed, rank-sharded store"),
    "store info": ("eyas.store.commands", "StoreInfoConfig", "run_info",
                   "print a store's figures"),
    "store verify": ("eyas.store.commands", "StoreVerifyConfig", "run_verify",
                     "recompute every checksum of a store"),
    "store import": ("eyas.store.importers", "StoreImportConfig", "run",
                     "import hidden states from vLLM/speculators or SpecForge"),
    "train": ("eyas.train.trainer", "TrainConfig", "run",
              "train the EAGLE-3 draft (one process or torchrun)"),
    "evaluate": ("eyas.speculate.evaluate", "EvalConfig", "run",
                 "speculative decoding: acceptance length, speedup, lossless check"),
    "export": ("eyas.draft.export", "ExportConfig", "run",
               "write a draft that vLLM, SGLang or speculators load"),
    "import": ("eyas.draft.importer", "ImportConfig", "run_import",
               "read an eagle3/speculators draft into an eyas checkpoint"),
    "plan": ("eyas.train.plan", "PlanConfig", "run",
             "the arithmetic of a run before it starts: steps, ETA, disk"),
    "doctor": ("eyas.doctor.diagnose", "DoctorConfig", "run",
               "diagnose a training log (eyas, speculators, SpecForge, torchrun)"),
    "demo": ("eyas.pipeline.demo", "DemoConfig", "run",
             "the whole pipeline on the embedded default target, in minutes"),
    "run": ("eyas.pipeline.demo", "RunConfig", "run_config",
            "run the pipeline stages from a TOML config file"),
    "report": ("eyas.report.build", "ReportConfig", "run",
               "write a run's self-contained HTML report"),
}


def load_stage(command: str):
    """(config class, run function) of a command; a clear error if its module does not exist yet."""
    module_name, cls_name, func_name, _ = COMMANDS[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            raise EyasError(f"eyas {command}: not yet available in this version of eyas") from None
        raise
    return getattr(module, cls_name), getattr(module, func_name)
