"""`python -m eyas.train ARGS`: the torchrun entry, the same as `eyas train ARGS`."""

import sys

from eyas import cli

sys.exit(cli.main(["train", *sys.argv[1:]]))
