"""The training stream's loader: fp8 parts stay fp8 until the device (their stored bytes through packing
and the copy; dequantized in `Batch.model_inputs`), reusable staging buffers, parts mapped not copied.
The CUDA side (pinned buffers, events, the copy over PCIe) cannot run here; these tests run the same code
on the CPU, where the device is the host."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tasks.store.artifacts import Store
from tasks.train.stream import BatchStream, PartReader

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from bench_part_cache import write_parts  # noqa: E402


def streams(store: Store, dtype: str, **kw):
    arts, parts, _ = write_parts(store, 4, 300, 32, 4, dtype=dtype, samples_per_part=5)
    ids = [1, 2, 3, 4]
    mk = lambda dequantize, **k: BatchStream(parts, PartReader(arts, ids, 32, dequantize=dequantize),  # noqa: E731
                                             batch_tokens=128, seed=2, **{"prefetch": 0, **k})
    return mk, parts


def same_inputs(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_fp8_batches_carry_the_stored_bytes_and_dequantize_on_the_device_to_the_same_inputs(tmp_path):
    store = Store(f"file://{tmp_path}/store")
    mk, _ = streams(store, "fp8")
    on_host, on_device = mk(True), mk(False)
    cpu = torch.device("cpu")
    for _ in range(8):
        a, b = on_host.next(), on_device.next()
        assert a.hidden_states.dtype == torch.bfloat16 and a.hidden_scales is None
        assert b.hidden_states.dtype == torch.float8_e4m3fn and b.hidden_scales.shape == (1, 128, 3)
        assert b.hidden_states.nbytes * 2 == a.hidden_states.nbytes  # half the bytes to pack and to copy
        same_inputs(a.model_inputs(cpu), b.model_inputs(cpu))
        assert a.position == b.position


def test_staging_buffers_are_reused_and_change_no_batch(tmp_path):
    store = Store(f"file://{tmp_path}/store")
    for dtype in ("bf16", "fp8"):
        mk, _ = streams(store, dtype)
        plain, staged = mk(False), mk(False, staging=True, prefetch=2)
        try:
            cpu = torch.device("cpu")
            for i in range(30):
                a, b = plain.next(), staged.next()
                assert b.staging is not None
                same_inputs(a.model_inputs(cpu), b.model_inputs(cpu))
                if i == 10:
                    staged.next()  # a batch dropped without use gives its buffer back as well
                    plain.next()
            pool = staged.pool
            assert pool.reused >= 25 and pool.made <= 5, (pool.made, pool.reused)
        finally:
            staged.close()


def test_a_part_is_mapped_from_its_file_not_read_into_memory(tmp_path):
    """safetensors maps the part (the loader's only copy is packing into the batch buffer)."""
    store = Store(f"file://{tmp_path}/store")
    arts, parts, _ = write_parts(store, 1, 4096, 256, 4, samples_per_part=4)
    data = PartReader(arts, [1, 2, 3, 4], 256, dequantize=False)(parts[0])
    maps = Path("/proc/self/maps").read_text()
    assert parts[0].name in maps, "the part's file is not mapped into the process"
    assert data.hidden.shape == (4096, 4, 256)


def test_a_staging_buffer_is_reused_only_after_its_copies_to_the_device_are_done():
    """On a GPU, model_inputs hands the buffer back with a CUDA event recorded after its copies; the packer
    waits on that event before packing into the buffer again. (A stand-in for the event: no GPU here.)"""
    from tasks.train.stream import StagingPool

    class Event:
        waited = 0

        def synchronize(self):
            Event.waited += 1

    pool = StagingPool(pin=False, keep=2)
    layout = {"hs": ((4, 3), torch.bfloat16)}
    a = pool.get(layout)
    pool.put(a, Event())
    assert pool.get(layout) is a and Event.waited == 1 and pool.reused == 1
    b, c = pool.get(layout), pool.get(layout)  # all out: new ones, never a wait
    assert b is not a and c is not b and pool.made == 3
    for buf in (a, b, c):
        pool.put(buf)
    assert len(pool._free) == 2  # at most `keep` kept
    assert pool.get({"hs": ((8, 3), torch.bfloat16)})["hs"].shape == (8, 3)  # another layout: a fresh buffer
