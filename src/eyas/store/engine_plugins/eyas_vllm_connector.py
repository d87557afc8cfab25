"""Loaded by vLLM inside its own Python environment, never imported by eyas: `eyas extract --engine vllm` puts
this folder on the engine's PYTHONPATH and names `EyasHiddenStatesConnector` in `--kv-transfer-config`.

vLLM's `ExampleHiddenStatesConnector` (0.32) writes, once a request of the `extract_hidden_states` method has
finished, its hidden states [T, layers, H] and prompt token ids [T] to one safetensors file per request, guarded by
an exclusive lock on `FILE.lock` until the write is done. Its write path copies the states off the GPU on a CUDA
stream, into pinned memory, and polls a CUDA event: on vLLM's CPU build the event is a placeholder without `query`
(`vllm/v1/worker/cpu/shm.py`), so the first finished request fails. This subclass changes only that path on a
CPU cache: a plain copy, and a completion marker that is done at once. On a GPU it is the original connector.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Done:
    """What the connector polls for a finished copy: on the CPU the copy is finished when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class EyasHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size)[None, :] + blocks[:, None] * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()  # [T, layers, H]
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
