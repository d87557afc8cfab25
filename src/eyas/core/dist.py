"""The one place that reads the distributed environment (RANK, WORLD_SIZE, LOCAL_RANK, ...).

Everything else takes `rank, world_size` as arguments. `init()` returns a `DistEnv` once per process:
gloo on CPU, NCCL when CUDA is present, chosen at run time, with a timeout on collectives so a dead
rank makes the survivors fail with a clear error instead of hanging.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import IO

import numpy as np
import torch
import torch.distributed as dist

from eyas.core.errors import EyasError
from eyas.core.lock import hold


@dataclasses.dataclass(frozen=True)
class DistEnv:
    rank: int = 0  # global rank: the only rank that decides which data a process sees
    world_size: int = 1
    local_rank: int = 0  # rank within the node: only chooses the GPU
    local_world_size: int = 1
    device: str = "cpu"
    backend: str = ""  # "" when not distributed

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def read_env() -> DistEnv:
    """The launcher's view of this process (torchrun sets these variables), without initialising anything."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    guess = f"cuda:{local}" if torch.cuda.is_available() and local < torch.cuda.device_count() else "cpu"
    return DistEnv(rank=rank, world_size=world, local_rank=local, local_world_size=local_world,
                   device=guess)  # init() decides, and says so when a rank has no GPU


def pick_device(preference: str = "auto", local_rank: int = 0) -> str:
    """'auto' -> cuda:<local_rank> when CUDA is available, else cpu; 'cuda' -> cuda:<local_rank> (one GPU per rank
    of this node); cpu, or cuda:N when this node shows GPU N. A rank without a GPU of its own, or a GPU number
    past those shown, is an error, not a crash in CUDA."""
    if preference == "auto":
        preference = "cuda" if torch.cuda.is_available() else "cpu"
    if not preference.startswith("cuda"):
        return preference
    count, visible = torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    if count == 0:
        raise EyasError(f"--device {preference}, but no CUDA GPU is visible",
                        f"torch sees none (CUDA_VISIBLE_DEVICES={visible}, torch {torch.__version__})",
                        "pass --device cpu (or auto), or install a CUDA build of torch (README: \"On a GPU "
                        "machine\")")
    if preference == "cuda":
        if local_rank >= count:
            raise EyasError(f"local rank {local_rank} has no GPU of its own",
                            f"this node shows {count} GPU(s) (CUDA_VISIBLE_DEVICES={visible}) and each rank takes "
                            "cuda:LOCAL_RANK",
                            f"start at most {count} rank(s) per node (torchrun --nproc_per_node {max(count, 1)}, "
                            "nproc in a pipeline file), or pass --device cpu")
        return f"cuda:{local_rank}"
    index = preference.partition(":")[2]
    if not index.isdigit() or int(index) >= count:
        raise EyasError(f"--device {preference}: no such GPU",
                        f"this node shows {count} GPU(s), cuda:0 to cuda:{count - 1} "
                        f"(CUDA_VISIBLE_DEVICES={visible}: numbers count the visible ones only)",
                        "pass one of those, or --device cuda to give each rank cuda:LOCAL_RANK")
    return preference


def on_gpu(preference: str) -> bool:
    """Does this device choice mean a GPU? (For checking settings: asks no more of the hardware than that.)"""
    return preference.startswith("cuda") or (preference == "auto" and torch.cuda.is_available())


def init(device: str = "auto", timeout_s: float = 600.0) -> DistEnv:
    """Initialise the process group if launched with WORLD_SIZE > 1; returns this process's DistEnv."""
    env = read_env()
    dev = pick_device(device, env.local_rank)
    if dev.startswith("cuda"):
        torch.cuda.set_device(torch.device(dev))
    if env.world_size == 1:
        return dataclasses.replace(env, device=dev)
    die_with_launcher()
    backend = "nccl" if dev.startswith("cuda") else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dataclasses.replace(env, device=dev, backend=backend)


def die_with_launcher() -> None:
    """A rank ends when the launcher that started it does: a torchrun killed by SIGKILL cannot stop its ranks, which
    would go on writing the run's files beside a resumed run. Linux's parent-death signal sends this process
    SIGTERM then (eyas.cli turns it into an orderly stop); elsewhere nothing is set."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher died before the signal was set
        os.kill(os.getpid(), signal.SIGTERM)


# What a collective says when another rank is gone (gloo: its socket closed or reset; any backend: the timeout)
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out", "timed out",
              "NCCL communicator was aborted", "remote process exited")


def peer_failure(e: BaseException, env: DistEnv, fix: str) -> EyasError | None:
    """The error to show when a collective failed because another rank died, hung or became unreachable (gloo
    notices a dead peer's closed connection at once; a hung one after the collective timeout), else None."""
    text = str(e)
    if not env.distributed or not isinstance(e, RuntimeError) or not any(s in text for s in _PEER_LOST):
        return None
    detail = text.strip().split("\n")[0].split("] ", 1)[-1].split(". This is typically")[0]  # no source path
    return EyasError(f"rank {env.rank} of {env.world_size}: lost contact with another rank ({detail})",
                     "another rank died (killed, out of memory, crashed), stopped answering within the collective "
                     "timeout, or the network between them failed; no rank can go on without it", fix)


def shutdown(finished: bool = False) -> None:
    """Tear the process group down. `finished`: this rank's work succeeded, so every rank is expected here: wait
    for the others first, so that no rank closes its connections while another still uses them and the ranks
    leave together. After a failure the others may never come, so then there is no wait. (A rank whose work
    succeeded then leaves through eyas.cli.finish, which skips interpreter finalization, where a rank once
    aborted in CI.)"""
    if not dist.is_initialized():
        return
    if finished:
        try:
            dist.barrier()
        except RuntimeError:  # a peer died after its work: nothing left to wait for
            pass
    dist.destroy_process_group()


def all_gather_objects(obj, env: DistEnv) -> list:
    """Gather one picklable object per rank (eyas-made objects only: lists of ints, dicts of numbers)."""
    if not env.distributed:
        return [obj]
    out = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(values: list[float], env: DistEnv) -> list[float]:
    """Sum a few numbers over ranks (counts, losses) in float64."""
    if not env.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_collective_device(env))
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_tensor(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a tensor over ranks and leave the sum where the tensor is: nothing is read back to the host (NCCL queues
    the reduction on the device's stream; gloo reduces host tensors, where reading costs nothing)."""
    if not env.distributed:
        return t
    c = t.to(_collective_device(env))
    dist.all_reduce(c)
    return c.to(t.device, non_blocking=True)


def all_reduce_counts(counts: np.ndarray, env: DistEnv) -> np.ndarray:
    """Sum an int64 array over ranks, exactly (token frequencies)."""
    if not env.distributed:
        return counts
    t = torch.from_numpy(np.ascontiguousarray(counts, dtype=np.int64)).to(_collective_device(env))
    dist.all_reduce(t)
    return t.cpu().numpy()


def _collective_device(env: DistEnv) -> str:
    """Where a collective's tensor must be: NCCL reduces device tensors only, gloo host ones."""
    return env.device if env.backend == "nccl" else "cpu"


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def on_every_rank(env, fn: Callable[[], dict]) -> dict:
    """Run fn on every rank, then tell every rank whether all succeeded (the barrier before the merge), so a
    failing rank makes the others stop with its message instead of waiting for it until the timeout."""
    err, result, exc = None, None, None
    try:
        result = fn()
    except EyasError as e:
        err = (f"rank {env.rank}: {e.what}", e.why, e.fix)
    except Exception as e:  # noqa: BLE001 - re-raised below on this rank, with its traceback
        exc, err = e, (f"rank {env.rank} failed: {type(e).__name__}: {e}", "", "see that rank's traceback")
    errors = [e for e in all_gather_objects(err, env) if e]
    if exc is not None:
        raise exc
    if errors:
        raise EyasError(*errors[0])
    return result


def agree(env, fn: Callable[[], dict]) -> dict:
    """Run fn on rank 0 and hand its result (or its EyasError) to every rank, so no rank waits on a dead one."""
    result = None
    if env.is_main:
        try:
            result = {"ok": fn()}
        except EyasError as e:
            result = {"error": (e.what, e.why, e.fix)}
    result = all_gather_objects(result, env)[0]
    if "error" in result:
        raise EyasError(*result["error"])
    return result["ok"]


def hold_output(env, out: Path, command: str) -> IO | None:
    """Rank 0 takes `out`'s lock for every rank of the run (eyas.core.lock); a refusal reaches every rank, so a
    second launch on the same output stops on all of its ranks. -> the lock on rank 0 (close it at the end)."""
    held: list[IO] = []

    def take() -> bool:
        held.append(hold(out, command))
        return True

    agree(env, take)
    return held[0] if held else None
