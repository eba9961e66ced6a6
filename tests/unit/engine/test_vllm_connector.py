"""The two hidden-states connectors write the same files under the same lock protocol.

On CUDA, extraction engines use vLLM's own `ExampleHiddenStatesConnector` (asynchronous: a copy stream,
pinned memory, writer threads); without CUDA, ours (`tasks.engine.vllm_connector.SyncHiddenStatesConnector`,
the same class with the copy-and-write done inline). The stock class cannot run on a CPU as is, so each
is driven here through its real methods, scheduler side then worker side (`build_connector_meta`,
`wait_for_save`, `request_finished`, `get_finished`: its real constructor, lock files, slot arithmetic,
thread pool and `save_file`) over one synthetic hidden-states cache, with only the CUDA calls stood in
for (`torch.cuda.Stream/Event/stream` and `pin_memory`). The CPU build's class file is byte-identical to
vLLM 0.33.0's (read from the 0.33.0 wheel, see the report of issue 24 item 3).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from types import SimpleNamespace as NS

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # noqa: E402
    ExampleHiddenStatesConnector,
)

from tasks.engine.process import read_safetensors  # noqa: E402
from tasks.engine.child import _wait_written  # noqa: E402
from tasks.engine.vllm_connector import SyncHiddenStatesConnector  # noqa: E402

BLOCK, LAYERS, HIDDEN, BLOCKS = 16, 4, 64, 8
# request id -> (prompt token ids, its blocks of the hidden-states cache)
REQUESTS = {"req-a": (list(range(100, 120)), [3, 5]), "req-b": (list(range(7)), [1]),
            "req-c": (list(range(40, 72)), [6, 0])}


class _Event:
    """Stands in for torch.cuda.Event: on a CPU the copy it marks is already done."""

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _Stream:
    def wait_event(self, event) -> None:
        pass


@pytest.fixture
def no_cuda_calls(monkeypatch):
    """Only the CUDA calls of the stock class stood in for; everything else is vLLM's own code."""
    empty_like = torch.empty_like

    def unpinned(*args, pin_memory=False, **kwargs):
        return empty_like(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch, "empty_like", unpinned)


def kv_cache() -> torch.Tensor:
    """[blocks, hidden states, block size, hidden] bf16: the layout vLLM's CacheOnlyAttentionLayer fills."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(BLOCKS, LAYERS, BLOCK, HIDDEN, generator=g).to(torch.bfloat16)


def locked(path: str) -> bool:
    with open(path + ".lock") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
        return False


def drive(cls: type, folder: str, cache: torch.Tensor) -> tuple[dict[str, str], set[str], dict[str, bool]]:
    """One engine step's worth of the connector protocol for REQUESTS; returns (request -> file, requests
    reported done sending, request -> whether its file was locked before the write)."""
    # The config keys draftline's kv_transfer_config gives (tasks.engine.process.vllm_extract_kwargs, then the engine
    # fills shared_storage_path: tasks/engine/child.py).
    kv = KVTransferConfig(kv_connector=cls.__name__, kv_role="kv_producer",
                          kv_connector_extra_config={"shared_storage_path": folder})
    spec = NS(draft_model_config=NS(hf_config=NS(eagle_aux_hidden_state_layer_ids=[1, 2, 3, 4])))
    vllm_config = NS(kv_transfer_config=kv, cache_config=NS(block_size=BLOCK), speculative_config=spec)
    conn = cls(vllm_config=vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=None)
    conn._kv_cache = cache  # what register_kv_caches takes from the engine's CacheOnlyAttentionLayer

    # scheduler: new requests get their files; worker: locks them before the client sees a path
    conn.bind_connector_metadata(conn.build_connector_meta(NS(scheduled_new_reqs=[
        NS(req_id=r, sampling_params=None) for r in REQUESTS])))
    conn.wait_for_save()
    paths = {}
    for rid, (tokens, blocks) in REQUESTS.items():
        delay, params = conn.request_finished(NS(request_id=rid, kv_transfer_params=None, prompt_token_ids=tokens),
                                              blocks)
        assert delay is True  # the blocks stay allocated until the write has them
        paths[rid] = params["hidden_states_path"]
    was_locked = {rid: locked(p) for rid, p in paths.items()}
    # worker, next step: the finished requests' hidden states are gathered and written
    conn.bind_connector_metadata(conn.build_connector_meta(NS(scheduled_new_reqs=[])))
    done, _ = conn.get_finished(set(REQUESTS))
    for p in paths.values():
        _wait_written(p, timeout_s=60)  # what the engine's reader does (tasks/engine/child.py)
    conn._executor.shutdown(wait=True)
    return paths, set(done or ()), was_locked


def test_the_stock_connector_writes_what_ours_writes(tmp_path, no_cuda_calls):
    cache = kv_cache()
    ours, ours_done, ours_locked = drive(SyncHiddenStatesConnector, str(tmp_path / "ours"), cache)
    stock, stock_done, stock_locked = drive(ExampleHiddenStatesConnector, str(tmp_path / "stock"), cache)

    assert ours_done == stock_done == set(REQUESTS)  # blocks freed for every request, by both
    assert all(ours_locked.values()) and all(stock_locked.values())  # a reader waits until the write is done
    for rid, (tokens, blocks) in REQUESTS.items():
        assert os.path.basename(ours[rid]) == os.path.basename(stock[rid]) == f"{rid}.safetensors"
        assert not locked(ours[rid]) and not locked(stock[rid])
        with open(ours[rid], "rb") as a, open(stock[rid], "rb") as b:
            assert a.read() == b.read(), rid  # byte for byte
        data, _ = read_safetensors(stock[rid])
        # ... and what both hold is the request's rows of the cache, in token order
        rows = torch.cat([cache[b].transpose(0, 1) for b in blocks])[:len(tokens)]
        assert data["token_ids"].tolist() == tokens
        assert data["hidden_states"].shape == (len(tokens), LAYERS, HIDDEN)
        assert torch.equal(data["hidden_states"], rows)
