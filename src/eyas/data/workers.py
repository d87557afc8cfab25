"""The local backend on several worker processes: one per core on a CPU, each with its own copy of the target.

On a CPU a decode step of a small model is many small matrix products, and torch's OpenMP threads meet at the
end of each: two threads on two cores made 229 new tokens/s where two processes of one thread each made 297
(docs/regenerate.md). Beside other busy processes the gap widens (a descheduled thread holds up the other, and
the scheduler shares the cores per process), as for extract's and train's ranks (docs/threads.md).

The parent keeps everything that must happen once: it reads the input, holds the output's lock and writes every
reply (eyas.data.replies.Sink), so resuming, the settings check and the summary are the single-process ones. The
workers take conversations from one queue as their slots free up (no worker waits on another's long replies) and
send back each finished conversation, each failure and their token counts. A worker ignores Ctrl-C (the parent
stops them all), and stops by itself when its parent is gone (killed), so nothing is left running.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import traceback
from pathlib import Path
from typing import Iterable, Iterator, Protocol

from eyas.core.dist import pick_device
from eyas.core.errors import EyasError
from eyas.core.memory import available_bytes
from eyas.core.precision import FULL
from eyas.core.target import TINY, resolve_source
from eyas.core.threads import cores, user_threads
from eyas.data.formats import Conversation
from eyas.data.local import LocalBackend, LocalSettings, answer_here
from eyas.data.replies import Dialogue, Failed, Sink


class WorkerSettings(LocalSettings, Protocol):
    """The local backend's settings and how many workers run it (eyas.data.regenerate.RegenerateConfig)."""

    workers: int

POLL_S = 1.0  # seconds between the parent's checks that its workers live, and a worker's that its parent does
START_S = 600.0  # longest a worker may take to load the target
MEMORY_SHARE = 0.5  # the workers' copies of the target may take up to this share of the memory available


def plan_workers(cfg: WorkerSettings, conversations: int) -> tuple[int, str]:
    """(worker processes, why): --workers when given; else one per core on a CPU (each with --threads threads,
    one by default, or OMP_NUM_THREADS's), as long as each worker gets at least --batch-size conversations and
    their copies of the target fit in half the available memory."""
    if cfg.workers:
        return cfg.workers, "--workers"
    if pick_device(cfg.device).startswith("cuda"):
        return 1, "the GPU computes"
    here = len(cores())
    each = (user_threads(cfg.threads) or (1, ""))[0]
    n = max(1, here // each)
    why = f"one per {'core' if each == 1 else f'{each} cores'} ({here} here)"
    if n > 1 and (fill := max(1, conversations // cfg.batch_size)) < n:
        n, why = fill, f"{conversations} conversations fill --batch-size {cfg.batch_size} for {fill}"
    if n > 1 and (fits := _copies_that_fit(cfg)) < n:
        n, why = max(1, fits), f"{max(1, fits)} copies of the target fit in half the memory available"
    return n, why


def _copies_that_fit(cfg: WorkerSettings) -> int:
    """How many copies of the target's weights fit in MEMORY_SHARE of the available memory (a large number where
    either is unknown: a built-in tiny target, a platform without these counters)."""
    if cfg.target in TINY:
        return 1 << 10
    available = available_bytes()
    if available is None:
        return 1 << 10
    _, folder = resolve_source(cfg.target)
    stored = sum(f.stat().st_size for f in Path(folder).glob("*") if f.suffix in (".safetensors", ".bin"))
    # float32 doubles 16-bit weights; a margin otherwise (cfg.dtype in either spelling)
    per_copy = stored * (2 if FULL.get(cfg.dtype, cfg.dtype) == "float32" else 1)
    return int(available * MEMORY_SHARE // per_copy) if per_copy else 1 << 10


class Relay:
    """A worker's Sink: what the parent's Sink should record, sent to it over the results queue."""

    def __init__(self, results, index: int, parent: int):
        self.results, self.index, self.parent = results, index, parent

    def finished(self, d: Dialogue) -> None:
        self.results.put(("finished", self.index, d))

    def failed(self, conv: Conversation, e: Failed) -> None:
        self.results.put(("failed", self.index, (conv, e)))

    def step(self, tokens: int) -> None:
        self.results.put(("step", self.index, tokens))
        orphaned(self.parent)

    def print(self, *parts, force: bool = False) -> None:  # the backend's console: its lines go to the parent's
        self.results.put(("print", self.index, (" ".join(str(p) for p in parts), force)))


def orphaned(parent: int) -> None:
    """Exit at once if the parent is gone (killed): nobody would write this worker's replies."""
    if os.getppid() != parent:
        os._exit(3)


def next_task(tasks, parent: int):
    """The next item of the tasks queue, waiting as long as the parent lives."""
    while True:
        try:
            return tasks.get(timeout=POLL_S)
        except queue.Empty:
            orphaned(parent)


def conversations(tasks, parent: int) -> Iterator[Conversation]:
    """The conversations of one run, as the worker's slots ask for them, until the run's end marker (None)."""
    while (item := next_task(tasks, parent)) is not None:
        yield item


def worker_main(cfg: WorkerSettings, n: int, index: int, parent: int, control, tasks, results) -> None:
    """One worker: load the target, say it is ready, then answer each run's conversations (from the queue all
    workers share) each time its own control queue says "run", until the parent terminates it (Workers.close)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the workers
    relay = Relay(results, index, parent)
    try:
        backend = LocalBackend(cfg, relay, workers=n, index=index)
        results.put(("ready", index, backend.name))
        while next_task(control, parent) == "run":
            answer_here(backend, conversations(tasks, parent), relay)
            results.put(("done", index, None))
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent, which raises it
        if isinstance(e, EyasError):
            results.put(("error", index, (e.what, e.why, e.fix, traceback.format_exc())))
        else:
            results.put(("error", index, (type(e).__name__, "".join(traceback.format_exception_only(type(e), e))
                                          .strip(), "", traceback.format_exc())))


class Workers:
    """`n` worker processes, each a LocalBackend; `run(todo, sink)` as `answer_here` does in one process."""

    def __init__(self, cfg: WorkerSettings, con, n: int, why: str):
        self.cfg, self.con, self.n = cfg, con, n
        self.finished = [0] * n  # conversations each worker finished (the run's summary shows the split)
        resolve_source(cfg.target)  # a built-in GGUF is converted into the cache here, once, not by each worker
        ctx = multiprocessing.get_context("spawn")  # a fork of a process that has run torch's threads can hang
        self.tasks, self.results = ctx.Queue(), ctx.Queue()
        self.controls = [ctx.Queue() for _ in range(n)]
        con.print(f"workers: {n} processes, each with its own copy of the target: {why}")
        self.procs = [ctx.Process(target=worker_main, args=(cfg, n, i, os.getpid(), self.controls[i], self.tasks,
                                                                   self.results),
                                  daemon=True, name=f"eyas-regenerate-{i}") for i in range(n)]
        for p in self.procs:
            p.start()
        try:
            self.name = self._wait("ready", START_S)[0]
        except BaseException:
            self.close()
            raise

    def run(self, todo: Iterable[Conversation], sink: Sink) -> None:
        """Answer `todo` on the workers, recording every reply in `sink` as it comes."""
        for control in self.controls:
            control.put("run")
        for conv in todo:
            self.tasks.put(conv)
        for _ in range(self.n):
            self.tasks.put(None)  # each worker's end of the run
        self._wait("done", None, sink)

    def _wait(self, kind: str, timeout: float | None, sink: Sink | None = None) -> list:
        """Relay messages until every worker has sent `kind`: their payloads, by worker."""
        got: dict[int, object] = {}
        waited = 0.0
        while len(got) < self.n:
            try:
                what, i, payload = self.results.get(timeout=POLL_S)
            except queue.Empty:
                waited += POLL_S
                self._check_alive(kind)
                if timeout is not None and waited > timeout:
                    raise EyasError(f"regenerate's workers did not load the target in {timeout:.0f} s",
                                    fix="check memory and the target, or pass --workers 1") from None
                continue
            if what == kind:
                got[i] = payload
            elif what == "finished":
                sink.finished(payload)
                self.finished[i] += 1
            elif what == "failed":
                sink.failed(*payload)
            elif what == "step":
                sink.step(payload)
            elif what == "print":
                line, force = payload
                if line.startswith("threads"):  # each worker's own
                    self.con.print(f"worker {i}: {line}", force=force)
                elif i == 0:  # the target's line, the same in every worker: once
                    self.con.print(line, force=force)
            elif what == "error":
                what_, why, fix, trace = payload
                raise EyasError(f"regenerate worker {i}: {what_}", why or trace.strip().splitlines()[-1],
                                fix or "rerun to resume (what was written is kept), or pass --workers 1 to see the "
                                       "failure in one process")
        return [got[i] for i in range(self.n)]

    def _check_alive(self, kind: str) -> None:
        for i, p in enumerate(self.procs):
            if p.exitcode is None:
                continue
            if p.exitcode < 0:
                why = (f"it was killed by signal {-p.exitcode}"
                       + (", most likely by the kernel for memory (each worker holds a copy of the target)"
                          if p.exitcode == -signal.SIGKILL else ""))
            else:
                why = ("it failed before it could say why (its traceback is above; a script that starts regenerate "
                       "needs `if __name__ == '__main__':`, as every program starting processes does)")
            raise EyasError(f"regenerate worker {i} stopped (exit code {p.exitcode}) before it was {kind}", why,
                            "rerun to resume (what was written is kept), with --workers 1 if it recurs")

    def close(self) -> None:
        """Stop every worker (a worker in the middle of a run is terminated: its unfinished replies are lost,
        never half written)."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        for q in (self.tasks, self.results, *self.controls):
            q.close()
