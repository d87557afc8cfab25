"""eyas: train EAGLE-3 speculative-decoding draft models."""

import os as _os

# Before torch is imported: torch's CPU allocator then places allocations of 2 MiB and more (activations, KV
# caches, gradients) in transparent huge pages, faster to stream on CPUs (eyas.core.memory, docs/architecture.md).
# EYAS_HUGEPAGES=0 turns this off, and so does setting THP_MEM_ALLOC_ENABLE=0 yourself.
if _os.environ.get("EYAS_HUGEPAGES", "1") != "0":
    _os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
