"""A hidden-states KV connector for vLLM engines without CUDA.

vLLM's `ExampleHiddenStatesConnector` copies the captured hidden states into
pinned host memory on a CUDA stream and writes them from a thread pool. On a
CPU build that crashes at the first request (`pin_memory=True requires a CUDA
or other accelerator backend`, `torch.cuda.Stream`). This subclass does the
same work synchronously on the worker: gather the request's rows from the
hidden-states cache, `save_file`, release the per-file lock. It would work on
a GPU too, but there TP rank 0 would write each file inside the engine step
while the other ranks wait: engines on CUDA use the stock class
(`tasks.engine.process.vllm_extract_kwargs(..., asynchronous=True)`, chosen per engine
group in `tasks.engine.settings.engine_for_group`). Both write the same files
(tests/unit/engine/test_vllm_connector.py).

It is loaded by module path from the engine process:

    kv_transfer_config={"kv_connector": "SyncHiddenStatesConnector",
                        "kv_connector_module_path": "tasks.engine.vllm_connector",
                        "kv_role": "kv_producer",
                        "kv_connector_extra_config": {"shared_storage_path": DIR}}

Each request's file holds `hidden_states` [T, L, H] (the model dtype) and
`token_ids` int64 [T]; its path comes back in
`output.kv_transfer_params["hidden_states_path"]`.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA copy event: the write already happened."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        return None


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.view(1, -1) + block_ids.view(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), num_tokens)
        tensors = {
            "hidden_states": hidden.to("cpu").contiguous(),
            "token_ids": pending.token_ids.clone(),
        }
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file(tensors, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers waiting on LOCK_SH proceed
        # get_finished reports a request "done sending" (and frees its blocks)
        # once its copy event completes; ours completed already.
        self._req_copy_events[pending.req_id] = _Done()  # type: ignore[assignment]
