"""`python -m eyas.train ARGS`: the torchrun entry, the same as `eyas train ARGS`."""

import sys

from eyas import cli

cli.finish(cli.main(["train", *sys.argv[1:]]))
