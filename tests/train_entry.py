"""`python tests/train_entry.py ARGS` runs `python -m eyas.train ARGS`, and, when EYAS_TEST_IDS_DIR is set, records
the store ids of every sample this process loads for training into EYAS_TEST_IDS_DIR/rank-<RANK>.json (with its
LOCAL_RANK): what the loader really read, independently of the trainer's own audit."""

import atexit
import json
import os
import sys
from pathlib import Path

import eyas.train.batches
from eyas import cli

out = os.environ.get("EYAS_TEST_IDS_DIR")
if out:
    seen: list[str] = []
    original = eyas.train.batches.load_micro_batch

    def recording(source, micro, *args, **kw):
        seen.extend(source[i].id for unit in micro for i in unit)
        return original(source, micro, *args, **kw)

    eyas.train.batches.load_micro_batch = recording

    @atexit.register
    def _dump():
        Path(out).mkdir(parents=True, exist_ok=True)
        rank = os.environ.get("RANK", "0")
        (Path(out) / f"rank-{rank}.json").write_text(json.dumps(
            {"rank": int(rank), "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "ids": seen}))

sys.exit(cli.main(["train", *sys.argv[1:]]))
