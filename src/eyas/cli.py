"""The `eyas` command: one subcommand per pipeline stage, each generated from its stage's config dataclass.

The commands and their stage modules are listed in `eyas.pipeline.registry`; only the chosen stage's module is
imported, so `eyas --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
import threading

from eyas import __version__
from eyas.core.config import add_arguments, from_namespace
from eyas.core.errors import EyasError, Incomplete, os_failure

SUMMARIES: dict[str, str] = {  # command -> its one line in `eyas --help` (and its --help's description)
    "prepare": "chat data -> tokens + assistant-only loss mask",
    "prompts": "user prompts written by the target itself (Magpie), for regenerate to answer",
    "regenerate": "replace assistant turns with the target's own answers",
    "extract": "target hidden states -> checksummed, rank-sharded store",
    "store info": "print a store's figures",
    "store verify": "recompute every checksum of a store",
    "store import": "import hidden states from vLLM/speculators or SpecForge",
    "train": "train the EAGLE-3 draft (one process or torchrun)",
    "evaluate": "speculative decoding: acceptance length, speedup, lossless check",
    "export": "write a draft that vLLM, SGLang or speculators load",
    "import": "read an eagle3/speculators draft into an eyas checkpoint",
    "plan": "the arithmetic of a run before it starts: steps, ETA, disk",
    "doctor": "diagnose a training log (eyas, speculators, SpecForge, torchrun)",
    "demo": "the whole pipeline on the built-in default target (docs/demo.md: what it costs)",
    "run": "run the pipeline stages from a TOML config file",
    "report": "write a run's self-contained HTML report",
}


def command_code(command: str) -> tuple[type, object]:
    """(settings dataclass, run function) of a command."""
    # imported here, not at the top: the stage modules import torch (2.4 s), which `eyas --help` never needs, and
    # doctor and report (0.2-0.3 s, no torch) are loaded alone, never through the registry of every stage
    if command == "doctor":
        from eyas.doctor import diagnose
        return diagnose.DoctorConfig, diagnose.run
    if command == "report":
        from eyas.report import build
        return build.ReportConfig, build.run
    from eyas.pipeline import demo, registry
    pipelines = {"demo": (demo.DemoConfig, demo.run), "run": (demo.RunConfig, demo.run_config)}
    return pipelines[command] if command in pipelines else tuple(registry.load_stage(command))


def _top_help() -> str:
    lines = ["usage: eyas COMMAND [options]   (eyas COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<14} {desc}" for name, desc in SUMMARIES.items()]
    return "\n".join(lines)


def _split_command(argv: list[str]) -> tuple[str, list[str]]:
    if len(argv) >= 2 and f"{argv[0]} {argv[1]}" in SUMMARIES:
        return f"{argv[0]} {argv[1]}", argv[2:]
    if argv and argv[0] in SUMMARIES:
        return argv[0], argv[1:]
    if argv and argv[0] == "store":
        raise EyasError("eyas store needs a subcommand", fix="use eyas store info|verify|import DIR")
    raise EyasError(f"unknown command {argv[0]!r}" if argv else "no command given", fix="run eyas --help")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_help())
        return 0
    if argv[0] == "--version":
        print(f"eyas {__version__}")
        return 0
    cfg = command = None
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None  # kill, a scheduler or a dying
    try:  # launcher stop eyas as Ctrl-C does
        command, rest = _split_command(argv)
        cls, run = command_code(command)
        parser = argparse.ArgumentParser(prog=f"eyas {command}", description=SUMMARIES[command])
        add_arguments(parser, cls)
        cfg = from_namespace(cls, parser.parse_args(rest))
        summary = run(cfg)
        if getattr(cfg, "json", False) and summary is not None:
            print(json.dumps(summary, default=str))
        return 0
    except Incomplete as e:  # completed work kept, the rest to do: not a success, not a failure to fix first
        if getattr(cfg, "json", False):
            print(json.dumps(e.summary, default=str))
        print(f"eyas: incomplete: {e}", file=sys.stderr)
        return 3
    except EyasError as e:
        print(f"eyas: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a refused write, a full disk (also inside safetensors' writer), a file in a folder's
        if (err := os_failure(e)) is None:  # place: named, not a traceback; anything else is a bug to see whole
            raise
        print(f"eyas: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        how = "stopped (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        print(f"eyas: {how}; completed work is kept. To resume: {resume_command(command, argv)}", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so that it stops as after Ctrl-C: files closed, the resume hint said."""


def _terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated()


def entry() -> None:
    """The process's entry point (the `eyas` script, `python -m eyas`, each torchrun rank): run, then exit."""
    finish(main())


def finish(code: int) -> None:
    """End the process with `code`. A torchrun rank whose work succeeded leaves through os._exit once its output
    is flushed: its work is done and written, and interpreter finalization, where torch may release tensors from
    its own C++ threads, once aborted a rank of a complete 2-rank extraction in CI ("terminate called without an
    active exception", pytorch#190489), which made torchrun fail a finished stage. A rank that failed exits
    normally: one that lost a killed peer would otherwise be gone within milliseconds of it, and torchrun would
    name it, not the killed rank, as the root cause. A single process exits normally."""
    sys.stdout.flush()
    sys.stderr.flush()
    dist = sys.modules.get("eyas.core.dist")  # loaded only by a stage that can run distributed
    if code == 0 and dist is not None and dist.read_env().distributed:
        logging.shutdown()
        os._exit(code)
    raise SystemExit(code)


def resume_command(command: str | None, argv: list[str]) -> str:
    """The command line that continues an interrupted run: the same one, and for train with --resume (a train
    rerun without it is refused, so that two runs never mix in one folder). A rank of a torchrun launch says the
    launcher and its process count too: a checkpoint resumes under the world size that wrote it."""
    args = list(argv)
    if command == "train" and "--resume" not in args:
        args.append("--resume")
    launcher = "eyas"
    dist = sys.modules.get("eyas.core.dist")  # loaded by every stage that can run distributed
    if dist is not None:
        env = dist.read_env()
        if env.distributed:
            nodes = f" --nnodes {env.nodes} (and your rendezvous options)" if env.nodes > 1 else ""
            started_by = os.environ.get("EYAS_LAUNCHER", "")  # eyas-torchrun says so (eyas.torchrun)
            launcher = f"{started_by or 'torchrun'}{nodes} --nproc_per_node {env.local_world_size} -m eyas"
    return launcher + " " + " ".join(shlex.quote(a) for a in args)

if __name__ == "__main__":
    raise SystemExit(main())
