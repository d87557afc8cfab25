"""The draft vocabulary's count before training: every stored sample read and checked (the old way, rank 0
alone, while the other ranks waited at the first collective) against the token ids alone (`StoreReader.token_ids`,
what training setup does now, each rank over its share). Side by side in one process, alternated; the first round
is each sample's first (checked) read, later rounds find the shards in the page cache.

    python bench/bench_vocab.py STORE [--rounds 3]
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from eyas.core.config import opt, parse
from eyas.draft.vocab import count_tokens
from eyas.store.reader import StoreReader


@dataclasses.dataclass(frozen=True, kw_only=True)
class VocabConfig:
    store: str = opt(None, "an eyas store folder", positional=True)
    rounds: int = opt(3, "rounds of both counts, alternated")


def main() -> None:
    a = parse(VocabConfig, description=__doc__)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    size = sum(f.stat().st_size for f in os.scandir(os.path.join(a.store, "shards")))
    vocab = StoreReader(a.store).identity["vocab_size"]
    print(f"bench_vocab: {cpu}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; store {a.store}, "
          f"{size / 2**20:,.0f} MiB")
    for r in range(a.rounds):
        reader = StoreReader(a.store)  # a fresh reader: every sample unchecked again
        t0 = time.perf_counter()
        old = count_tokens(((reader[i].input_ids.numpy(), reader[i].loss_mask.numpy()) for i in range(len(reader))),
                           vocab)
        t_old = time.perf_counter() - t0
        reader = StoreReader(a.store)
        t0 = time.perf_counter()
        new = count_tokens((reader.token_ids(i) for i in range(len(reader))), vocab)
        t_new = time.perf_counter() - t0
        print(f"round {r}: {len(reader):,} samples: every sample read and checked {t_old:.3f} s, token ids only "
              f"{t_new:.3f} s ({t_old / t_new:.0f}x); counts equal: {np.array_equal(old, new)}")
    print(f"bench_vocab: load {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
