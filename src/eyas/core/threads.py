"""CPU threads for torch: chosen from the cores actually free, re-checked on long runs.

torch's OpenMP threads wait for each other at the end of every parallel region, so when one of them is
descheduled (another process wants its core) all of them wait: on 2 cores beside two busy processes, 2 threads
make less progress than 1 (measured in docs/threads.md). So the default is not "all cores" but the cores this
process may run on (its affinity) that other processes leave free, sampled from /proc/stat over a quarter of a
second at start-up and again every `RECHECK_S` of a long run. The user decides when they say so: `--threads N`,
or an explicit OMP_NUM_THREADS, always wins and is never changed (the one `eyas run` sets for torchrun, marked in
EYAS_OMP_DEFAULTED, is not the user's).

Nothing here reads the distributed environment: callers pass how many ranks share this node
(`eyas.core.dist.read_env().local_world_size`).
"""

from __future__ import annotations

import os
import time

import torch

RECHECK_S = 30.0  # seconds between re-checks of the free cores during a run
OMP_DEFAULTED = "EYAS_OMP_DEFAULTED"  # holds the OMP_NUM_THREADS that `eyas run` set (so torchrun keeps it): not
# the user's choice, so not fixed
SAMPLE_S = 0.25  # seconds /proc/stat is sampled over at start-up


def cores() -> list[int]:
    """The cores this process may run on (its affinity)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def user_threads(requested: int = 0) -> tuple[int, str] | None:
    """The thread count the user fixed, and how: `--threads N`, else an explicit OMP_NUM_THREADS (not the one
    `eyas run` set, marked in OMP_DEFAULTED); None when it is eyas's to choose."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if requested:
        return requested, "--threads"
    if env.isdigit() and int(env) > 0 and os.environ.get(OMP_DEFAULTED) != env:
        return int(env), f"OMP_NUM_THREADS={env}"
    return None


def _busy_ticks(cores: list[int]) -> tuple[int, int] | None:
    """(busy, total) clock ticks of these cores since boot, from /proc/stat (None where it is not readable)."""
    want = {f"cpu{c}" for c in cores}
    busy = total = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name in want:
                    ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                    total += sum(ticks)
                    busy += sum(ticks) - ticks[3] - ticks[4]
    except (OSError, ValueError, IndexError):
        return None
    return (busy, total) if total else None


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


class Sampler:
    """Cores kept busy by other processes between two readings: busy time on our cores minus our own CPU time."""

    def __init__(self, cores: list[int]):
        self.cores = cores
        self.ticks = _busy_ticks(cores)
        self.own = _own_seconds()
        self.wall = time.monotonic()

    def others(self) -> float | None:
        """Cores' worth of other processes' work since the last reading (then a new reading starts)."""
        ticks, own, wall = _busy_ticks(self.cores), _own_seconds(), time.monotonic()
        if ticks is None or self.ticks is None or wall <= self.wall:
            return None
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        busy = (ticks[0] - self.ticks[0]) / hz
        elapsed = wall - self.wall
        out = max(0.0, busy - (own - self.own)) / elapsed
        self.ticks, self.own, self.wall = ticks, own, wall
        return min(out, float(len(self.cores)))


class Threads:
    """How many threads torch uses for CPU work, why, and its re-checks during a run.

    `Threads(requested, ranks_on_node, device).apply()` at start-up; `recheck()` in a long loop (cheap: it reads
    /proc/stat at most every RECHECK_S seconds) returns a line to print when it changed the count."""

    def __init__(self, requested: int = 0, ranks_on_node: int = 1, device: str = "cpu", slot: int | None = None):
        self.cores = cores()
        self.slot = None if str(device).startswith("cuda") else slot  # this rank's index on the node (local rank)
        self.pinned: int | None = None
        self.share = max(1, len(self.cores) // max(1, ranks_on_node))
        self.ranks = max(1, ranks_on_node)
        self.fixed = ""
        if str(device).startswith("cuda"):
            self.fixed, self.n = "torch's default (the GPU computes)", torch.get_num_threads()
        elif fixed := user_threads(requested):
            self.n, self.fixed = fixed
        self.sampler: Sampler | None = None
        self.last_check = 0.0
        self.why = self.fixed

    def choose(self) -> tuple[int, str]:
        """Choose the count (measuring the free cores unless it is fixed): (threads, why). torch is not touched: for
        a process of another kind that takes the count (a vLLM engine, eyas.core.vllm_server.cpu_env)."""
        if not self.fixed:
            self.sampler = Sampler(self.cores)
            time.sleep(SAMPLE_S)
            self.n, self.why = self._choose(self.sampler.others())
            self.last_check = time.monotonic()
        return self.n, self.why

    def apply(self) -> tuple[int, str]:
        """Choose and set torch's count: (threads, why)."""
        self.choose()
        if torch.get_num_threads() != self.n:
            torch.set_num_threads(self.n)
        self._pin()
        return self.n, self.why

    def _pin(self) -> None:
        """One rank per core (a `slot` given, as many ranks on the node as cores, one thread each): the rank stays
        on its own core, so beside other work the scheduler moves the other processes rather than the ranks.
        Extraction's two ranks on two cores beside two busy processes kept 0.50x of their quiet throughput pinned
        against 0.47x unpinned, and varied less (medians of three alternated rounds: 0.45-0.50x against
        0.39-0.53x; the same quiet throughput; docs/threads.md)."""
        if (self.slot is None or self.pinned is not None or self.n != 1 or self.ranks < 2
                or self.ranks != len(self.cores) or not hasattr(os, "sched_setaffinity")):
            return
        self.pinned = self.cores[self.slot % len(self.cores)]
        os.sched_setaffinity(0, {self.pinned})
        self.why += f"; on core {self.pinned} (one rank per core)"

    def _choose(self, others: float | None) -> tuple[int, str]:
        mine = f"{len(self.cores)} cores" + (f" shared by this run's {self.ranks} processes" if self.ranks > 1 else "")
        if others is None:
            return self.share, mine + " (their load is not readable here)"
        # this run's other ranks on the node are not other work: at most (ranks - 1) x share of the busy cores
        foreign = max(0.0, others - (self.ranks - 1) * self.share)
        n = max(1, min(self.share, round((len(self.cores) - foreign) / self.ranks)))
        if n < self.share:
            return n, (f"{mine}, {foreign:.1f} busy with other work: {n} thread{'s' if n > 1 else ''} (more would "
                       "wait on descheduled ones; --threads or OMP_NUM_THREADS fixes the count)")
        return n, mine + (", free" if foreign < 0.5 else f", {foreign:.1f} busy with other work")

    def recheck(self) -> str:
        """Re-measure the free cores if RECHECK_S has passed: a line saying what changed, or ''."""
        if self.fixed or self.sampler is None or time.monotonic() - self.last_check < RECHECK_S:
            return ""
        self.last_check = time.monotonic()
        n, why = self._choose(self.sampler.others())
        if n == self.n:
            return ""
        before, self.n, self.why = self.n, n, why
        torch.set_num_threads(n)
        return f"threads: {before} -> {n} ({why})"
