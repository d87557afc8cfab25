"""`eyas-torchrun` (or `python -m eyas.torchrun`): torchrun, with the same arguments, that ends a Ctrl-C or SIGTERM
in one line instead of torch's `SignalException` traceback.

torchrun's agent turns a death signal into an exception that its entry point re-raises, so a stopped launch ends in
a traceback after each rank's own message (eyas's ranks stop as after Ctrl-C and say how to resume). This launcher
runs torchrun's own `main` and catches that one exception; everything else (arguments, rendezvous, the ranks' exit
codes, the error files) is torchrun's. The ranks learn that it started them (EYAS_LAUNCHER), so their resume hint
repeats this launcher."""

import os
import sys

from torch.distributed import run
from torch.distributed.elastic.multiprocessing.api import SignalException

LAUNCHER_ENV = "EYAS_LAUNCHER"  # read by eyas.cli.resume_command on each rank
NAME = "eyas-torchrun"


def main(argv: list[str] | None = None) -> int:
    os.environ[LAUNCHER_ENV] = NAME  # inherited by the ranks
    try:
        run.main(argv)
    except SignalException as e:
        print(f"{NAME}: stopped ({e.sigval.name}); its ranks were stopped and said above how to resume",
              file=sys.stderr)
        return 128 + int(e.sigval)
    except KeyboardInterrupt:  # a Ctrl-C that came before torchrun's agent set its handlers
        print(f"{NAME}: interrupted before its ranks started", file=sys.stderr)
        return 130
    return 0


def entry() -> None:
    raise SystemExit(main())


if __name__ == "__main__":
    entry()
