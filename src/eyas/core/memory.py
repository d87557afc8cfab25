"""Frozen weights in 2 MiB pages on CPUs.

A forward pass over few tokens streams every weight once, and on a CPU that is a memory-bound read. From
ordinary 4 KiB pages that read can be several times slower than from 2 MiB pages: each 4 KiB costs a TLB miss,
and in a virtual machine a miss walks two page tables. On an Intel Xeon build machine (2 vCPUs), a one-token
SmolLM2 decode step took 98 ms with its weights in 4 KiB pages and 59 ms in 2 MiB pages (bench/bench_memory.py);
inside a whole decode loop, its output head alone went from 39 ms to 4.9 ms (torch profiler).

`to_hugepages` copies a set of tensors into one anonymous mapping advised with MADV_HUGEPAGE (Linux's
transparent huge pages in their `madvise` mode, the common default) and returns views of it; `pack_module` does
that for a frozen module's parameters and buffers. Neither changes a value. Elsewhere (CUDA tensors, no
MADV_HUGEPAGE, EYAS_HUGEPAGES=0) they leave the tensors as they are.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

HUGE = 2 << 20  # bytes in one huge page
ALIGN = 64  # bytes: every tensor starts on a cache line
CHUNK = 256 << 20  # bytes moved at a time by pack_module: the copy never holds a second whole model


def available() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("EYAS_HUGEPAGES", "1") != "0"


def _padded(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def to_hugepages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the CPU tensors, contiguous, side by side in one huge-page mapping; others are returned as they are.

    The mapping lives as long as any view of it (the tensors hold the buffer)."""
    picked = [i for i, t in enumerate(tensors) if t.device.type == "cpu" and t.numel()]
    if not available() or not picked:
        return list(tensors)
    total = sum(_padded(tensors[i].numel() * tensors[i].element_size()) for i in picked)
    area = mmap.mmap(-1, (total + HUGE - 1) // HUGE * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)
    arena = torch.frombuffer(area, dtype=torch.uint8)  # holds `area` alive
    out, offset = list(tensors), 0
    for i in picked:
        t = tensors[i]
        n = t.numel() * t.element_size()
        view = arena[offset:offset + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out[i] = view
        offset += _padded(n)
    return out


def pack_module(module: torch.nn.Module) -> torch.nn.Module:
    """Moves a frozen module's CPU parameters and buffers into huge pages (tied weights stay tied); returns it."""
    owners: dict[tuple, list[torch.Tensor]] = {}  # one view of memory -> the parameters and buffers that are it
    for t in [*module.parameters(), *module.buffers()]:
        owners.setdefault((t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())), []).append(t)
    groups, chunk, size = [], [], 0
    for ts in owners.values():
        chunk.append(ts)
        size += ts[0].numel() * ts[0].element_size()
        if size >= CHUNK:
            groups.append(chunk)
            chunk, size = [], 0
    for group in [*groups, chunk]:
        for ts, packed in zip(group, to_hugepages([ts[0] for ts in group])):
            if packed is not ts[0]:
                for t in ts:  # the same memory registered twice (a buffer that is also a parameter, ...)
                    t.data = packed
    return module


def available_bytes() -> int | None:
    """The memory the system has free now (Linux's available pages), or None where the platform does not say."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def tune_allocator() -> None:
    """Keep freed buffers inside the process (glibc): by default every buffer over 32 MiB goes back to the OS
    when freed and is page-faulted in again by the next batch, which cost 10-25 % of the CPU time of a forward
    pass on a 2-core machine (kernel time). Nothing happens on other C libraries."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, (1 << 31) - 1)
