"""The `eyas` command: one subcommand per pipeline stage, each generated from its stage's config dataclass.

A stage module `eyas.<module>` exposes a frozen dataclass (the table's config name) and `run(cfg) -> dict`,
the stage's summary. Only the chosen stage's module is imported, so `eyas --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from eyas.config import add_arguments, from_namespace
from eyas.errors import EyasError

# command -> (module, config class, run function, one-line description)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "prepare": ("eyas.prepare", "PrepareConfig", "run", "chat data -> tokens + assistant-only loss mask"),
    "regenerate": ("eyas.regenerate", "RegenerateConfig", "run", "replace assistant turns with the target's own answers"),
    "extract": ("eyas.extract", "ExtractConfig", "run", "target hidden states -> checksummed, rank-sharded store"),
    "store info": ("eyas.store_cli", "StoreInfoConfig", "run_info", "print a store's figures"),
    "store verify": ("eyas.store_cli", "StoreVerifyConfig", "run_verify", "recompute every checksum of a store"),
    "store import": ("eyas.store_import", "StoreImportConfig", "run", "import hidden states from vLLM/speculators or SpecForge"),
    "train": ("eyas.train", "TrainConfig", "run", "train the EAGLE-3 draft (one process or torchrun)"),
    "evaluate": ("eyas.evaluate", "EvalConfig", "run", "speculative decoding: acceptance length, speedup, lossless check"),
    "export": ("eyas.export", "ExportConfig", "run", "write a draft that vLLM, SGLang or speculators load"),
    "import": ("eyas.draft_import", "ImportConfig", "run_import", "read an eagle3/speculators draft into an eyas checkpoint"),
    "plan": ("eyas.plan", "PlanConfig", "run", "the arithmetic of a run before it starts: steps, ETA, disk"),
    "doctor": ("eyas.doctor", "DoctorConfig", "run", "diagnose a training log (eyas, speculators, SpecForge, torchrun)"),
    "demo": ("eyas.demo", "DemoConfig", "run", "the whole pipeline on the embedded default target, in minutes"),
    "run": ("eyas.demo", "RunConfig", "run_config", "run the pipeline stages from a TOML config file"),
    "report": ("eyas.report", "ReportConfig", "run", "write a run's self-contained HTML report"),
}


def _top_help() -> str:
    lines = ["usage: eyas COMMAND [options]   (eyas COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<14} {desc}" for name, (_, _, _, desc) in COMMANDS.items()]
    return "\n".join(lines)


def _split_command(argv: list[str]) -> tuple[str, list[str]]:
    if len(argv) >= 2 and f"{argv[0]} {argv[1]}" in COMMANDS:
        return f"{argv[0]} {argv[1]}", argv[2:]
    if argv and argv[0] in COMMANDS:
        return argv[0], argv[1:]
    if argv and argv[0] == "store":
        raise EyasError("eyas store needs a subcommand", fix="use eyas store info|verify|import DIR")
    raise EyasError(f"unknown command {argv[0]!r}" if argv else "no command given", fix="run eyas --help")


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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_help())
        return 0
    if argv[0] == "--version":
        from eyas import __version__

        print(f"eyas {__version__}")
        return 0
    try:
        command, rest = _split_command(argv)
        cls, run = load_stage(command)
        parser = argparse.ArgumentParser(prog=f"eyas {command}", description=COMMANDS[command][3])
        add_arguments(parser, cls)
        cfg = from_namespace(cls, parser.parse_args(rest))
        summary = run(cfg)
        if getattr(cfg, "json", False) and summary is not None:
            print(json.dumps(summary, default=str))
        return 0
    except EyasError as e:
        print(f"eyas: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("eyas: interrupted; completed work is kept, rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
