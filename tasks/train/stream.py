"""Training data from extraction parts: parts read (and sha256-checked) ahead of the loop, samples
packed into fixed-size batches in a seeded order that a checkpoint can resume exactly, and the
held-out tail the validation batches come from.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from tasks.core.config import TrainConfig
from tasks.store.model import ArtifactCorrupt
from tasks.store.reader import Artifact
from tasks.train import TrainError

HOLDOUT_MAX_FRACTION = 0.1

@dataclass(frozen=True)
class PartSpec:
    """One extraction part, as the data stream sees it."""

    index: int  # position in the run's part list (shard order, then part name)
    shard: int
    digest: str  # the extract artifact holding it
    name: str  # its file name there
    holdout: int = 0  # samples at the END of this part kept out of training for evaluation


@dataclass
class PartData:
    """One part in memory: bf16 hidden states [T, L, H] and its token arrays."""

    spec: PartSpec
    hidden: torch.Tensor
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    offsets: list[int]  # [N + 1]
    scales: torch.Tensor | None = None  # float32 [T, L] when `hidden` is float8_e4m3fn (dequantized on the device)

    @property
    def num_samples(self) -> int:
        return len(self.offsets) - 1

    @property
    def train_samples(self) -> int:
        return self.num_samples - self.spec.holdout


class PartReader:
    """Reads parts from the store: a sha256-verified local file (the store's own when it is local; else
    the node's part cache, `tasks.store.part_cache`, or a streamed temporary copy without one), then
    `tasks.formats.parts.load_part` (bf16 whatever the storage dtype, or fp8 kept with dequantize=False; its
    tensors map the file, read into the page cache ahead by `readahead`). The file stays leased (never evicted from
    the cache) while its PartData lives. Thread-safe; used by the loader threads."""

    def __init__(self, artifacts: dict[str, Artifact], layer_ids: list[int], hidden_size: int,
                 keep: list[int] | None = None, cache: Any = None, dequantize: bool = True):
        """`layer_ids`: what the parts hold; `keep`: the ids a head reads (its auxiliary layers, then the
        last one), a subset in order; default all of them. `cache`: a `tasks.store.part_cache.PartCache`.
        dequantize=False: fp8 parts stay fp8 with their scales (half the bytes through packing and PCIe;
        `Batch.model_inputs` dequantizes on the device)."""
        self.artifacts = artifacts
        self.dequantize = dequantize
        self.layer_ids = list(layer_ids)
        self.hidden_size = hidden_size
        self.cache = cache
        self.slots = None if keep is None or list(keep) == self.layer_ids else [self.layer_ids.index(i) for i in keep]
        self.verified: set[tuple[str, str]] = set()  # sha256 checked once per process, sizes every read

    def __call__(self, spec: PartSpec) -> PartData:
        from tasks.store.part_cache import cached_copy
        from tasks.formats.parts import load_part

        art = self.artifacts[spec.digest]
        key = (spec.digest, spec.name)
        held = contextlib.ExitStack()  # the file (cache lease / temporary copy) while the part's tensors map it
        try:
            path = held.enter_context(cached_copy(self.cache, art, spec.name, verify=key not in self.verified))
            readahead(path)
            raw = load_part(path, dequantize=self.dequantize)
            self.verified.add(key)
            data = self._check(spec, art, raw)
        except ArtifactCorrupt as exc:
            held.close()
            raise TrainError(f"{exc}: rerun the run (`draftline retry`) to extract that shard again") from None
        except BaseException:
            held.close()
            raise
        weakref.finalize(data, held.close)
        return data

    def _check(self, spec: PartSpec, art: Artifact, raw: dict[str, Any]) -> PartData:
        where = f"{art.uri}/{spec.name}"
        hs = raw["hidden_states"]
        offsets = [int(x) for x in raw["offsets"].tolist()]
        if raw.get("layer_ids") and list(raw["layer_ids"]) != self.layer_ids:
            raise TrainError(f"{where}: part metadata says layer ids {raw['layer_ids']}, the shard manifest says "
                             f"{self.layer_ids}; the shard is inconsistent: rerun its extraction")
        n_t = int(raw["input_ids"].shape[0])
        if (hs.ndim != 3 or hs.shape[0] != n_t or hs.shape[1] != len(self.layer_ids)
                or hs.shape[2] != self.hidden_size):
            raise TrainError(f"{where}: hidden_states has shape {list(hs.shape)}, expected [{n_t}, "
                             f"{len(self.layer_ids)}, {self.hidden_size}]")
        if not offsets or offsets[0] != 0 or offsets[-1] != n_t or any(b < a for a, b in zip(offsets, offsets[1:])):
            raise TrainError(f"{where}: offsets do not split its {n_t} tokens into samples; the part is corrupt")
        if spec.holdout > len(offsets) - 1:
            raise TrainError(f"{where}: {spec.holdout} held-out samples but the part has only {len(offsets) - 1}")
        scales = raw.get("hidden_scales")
        if self.slots is not None:
            hs = hs[:, self.slots].contiguous()
            scales = scales[:, self.slots].contiguous() if scales is not None else None
        return PartData(spec=spec, hidden=hs, input_ids=raw["input_ids"].to(torch.int64),
                        loss_mask=raw["loss_mask"].to(torch.bool), offsets=offsets, scales=scales)


def readahead(path: str) -> None:
    """Ask the kernel to start reading the whole file into the page cache now (asynchronously), so the
    packer's copies out of the part's mmap find its pages in memory instead of faulting them in 128 KiB
    at a time from a cold disk."""
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


@dataclass
class Batch:
    """`batch_tokens` packed positions in speculators' layout (after its `shift_batch`):
    position p pairs hidden state t with token t+1 of its sample."""

    hidden_states: torch.Tensor  # [1, T, (L-1)*H], aux layers concatenated
    verifier_last_hidden_states: torch.Tensor  # [1, T, H]
    input_ids: torch.Tensor  # [1, T]
    loss_mask: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    document_ids: torch.Tensor  # [1, T], -1 = padding
    tokens: int  # non-padding positions
    position: dict[str, int] | None = None  # stream position after this batch
    # fp8 batches: hidden_states / verifier_last_hidden_states hold the stored float8_e4m3fn bytes and these
    # their float32 scales ([1, T, L-1] and [1, T]); model_inputs dequantizes on the device
    hidden_scales: torch.Tensor | None = None
    last_scales: torch.Tensor | None = None
    staging: "_Ticket | None" = None  # the reusable staging buffer these tensors live in, if any

    def model_inputs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The forward pass's inputs on `device`: the stored bytes are copied (non-blocking from pinned
        staging on a GPU), fp8 is dequantized there, and the staging buffer goes back to its pool once
        the copies are done (a CUDA event on a GPU; at once on a CPU, where the outputs are copies)."""
        from tasks.formats.parts import dequantize_fp8

        nb = device.type == "cuda"
        hs = self.hidden_states.to(device, non_blocking=nb)
        last = self.verifier_last_hidden_states.to(device, non_blocking=nb)
        if self.hidden_scales is not None:
            _, t, h = last.shape
            hs = dequantize_fp8(hs.view(t, -1, h), self.hidden_scales.to(device, non_blocking=nb)[0]).view(1, t, -1)
            last = dequantize_fp8(last[0], self.last_scales.to(device, non_blocking=nb)[0]).unsqueeze(0)
        if device.type != "cuda":  # CPU: fp32 math
            hs, last = hs.float(), last.float()
        out = {"hidden_states": hs, "verifier_last_hidden_states": last}
        for name in ("input_ids", "loss_mask", "position_ids", "document_ids"):
            x = getattr(self, name).to(device, non_blocking=nb)
            out[name] = x.clone() if self.staging is not None and x.data_ptr() == getattr(self, name).data_ptr() else x
        if self.staging is not None:
            event = None
            if nb:
                event = torch.cuda.Event()
                event.record()  # after the copies on the current stream: the buffer is free once it completes
            self.staging.release(event)
        return out


class _Ticket:
    """A staging buffer lent to one batch: handed back once (model_inputs, or when the batch is dropped)."""

    def __init__(self, pool: "StagingPool", buf: dict[str, torch.Tensor]):
        self.pool, self.buf, self.done = pool, buf, False

    def release(self, event: Any = None) -> None:
        if not self.done:
            self.done = True
            self.pool.put(self.buf, event)


class StagingPool:
    """Reusable host buffers for packed batches, page-locked (pinned) where CUDA is present, so each batch
    is packed straight into memory the GPU copies from without a fresh pinned allocation per step. A
    buffer comes back when its batch's copies to the device are done (a CUDA event, waited on by the
    packer thread before reuse). When all are out, a new one is made (never a deadlock); at most `keep`
    are kept for reuse."""

    def __init__(self, pin: bool, keep: int = 5):
        self.pin, self.keep = pin, keep
        self._free: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self.made = 0
        self.reused = 0

    def get(self, layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
        with self._lock:
            while self._free:
                buf, event = self._free.popleft()
                if {k: (tuple(v.shape), v.dtype) for k, v in buf.items()} == layout:
                    self.reused += 1
                    break
            else:
                buf, event = None, None
        if buf is None:
            self.made += 1
            return {k: torch.empty(shape, dtype=dtype, pin_memory=self.pin) for k, (shape, dtype) in layout.items()}
        if event is not None:
            event.synchronize()  # the previous batch's copies out of it are done
        return buf

    def put(self, buf: dict[str, torch.Tensor], event: Any = None) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append((buf, event))


Piece = tuple[PartData, int, int, int]  # (part, sample start token, offset in the shifted sample, length)


def assemble(pieces: Sequence[Piece], length: int, position: dict[str, int] | None = None,
             pin_memory: bool = False, pool: StagingPool | None = None) -> Batch:
    """Copy pieces of samples into one batch of `length` positions (padding at the end), in the parts'
    stored dtype (fp8 parts: their bytes and scales; see Batch.model_inputs). `pool`: pack into one of
    its reusable staging buffers instead of fresh tensors.

    A sample of n tokens gives n-1 positions (speculators' shift): position j pairs
    the aux hidden states of token j with token j+1, its loss mask, the verifier's
    last hidden state of token j+1 (the target) and position id j+1.
    """
    first = pieces[0][0]
    n_l, h = int(first.hidden.shape[1]), int(first.hidden.shape[2])
    fp8 = first.scales is not None
    layout = {"hs": ((length, n_l - 1, h), first.hidden.dtype), "last": ((length, h), first.hidden.dtype),
              "ids": ((length,), torch.int64), "mask": ((length,), torch.bool), "pos": ((length,), torch.int64),
              "doc": ((length,), torch.int64)}
    if fp8:
        layout.update(hs_scales=((length, n_l - 1), torch.float32), last_scales=((length,), torch.float32))
    if pool is not None:
        buf = pool.get(layout)
    else:  # pinned (page-locked) on a GPU run, so the copy to the device can overlap compute
        buf = {k: torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
               for k, (shape, dtype) in layout.items()}
    hs, last, ids, mask, pos, doc = (buf[k] for k in ("hs", "last", "ids", "mask", "pos", "doc"))
    o = 0
    for d, (data, start, j, n) in enumerate(pieces):
        a = start + j
        hs[o:o + n].copy_(data.hidden[a:a + n, :-1])
        last[o:o + n].copy_(data.hidden[a + 1:a + 1 + n, -1])
        if fp8:
            buf["hs_scales"][o:o + n].copy_(data.scales[a:a + n, :-1])
            buf["last_scales"][o:o + n].copy_(data.scales[a + 1:a + 1 + n, -1])
        ids[o:o + n] = data.input_ids[a + 1:a + 1 + n]
        mask[o:o + n] = data.loss_mask[a + 1:a + 1 + n]
        pos[o:o + n] = torch.arange(j + 1, j + 1 + n)
        doc[o:o + n] = d
        o += n
    # padding (buffers are reused: every position past the pieces is reset)
    hs[o:].zero_()
    last[o:].zero_()
    ids[o:] = 0
    mask[o:] = False
    pos[o:] = 1
    doc[o:] = -1
    if fp8:
        buf["hs_scales"][o:] = 0
        buf["last_scales"][o:] = 0
    batch = Batch(hidden_states=hs.view(1, length, -1), verifier_last_hidden_states=last.unsqueeze(0),
                  input_ids=ids.unsqueeze(0), loss_mask=mask.unsqueeze(0), position_ids=pos.unsqueeze(0),
                  document_ids=doc.unsqueeze(0), tokens=o, position=position,
                  hidden_scales=buf["hs_scales"].unsqueeze(0) if fp8 else None,
                  last_scales=buf["last_scales"].unsqueeze(0) if fp8 else None)
    if pool is not None:
        batch.staging = _Ticket(pool, buf)
        weakref.finalize(batch, batch.staging.release)  # a batch dropped unused gives its buffer back too
    return batch


def _rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng([int(k) % (2**32) for k in keys])


def deal(n_parts: int, seed: int, world: int) -> list[list[int]]:
    """Part indices per rank: a seeded permutation dealt round-robin (shares differ by at most one part),
    each share in index order. A function of (n_parts, seed, world) only: every epoch, every resume with
    the same rank count, every node computes the same deal."""
    perm = _rng(seed, 0x5EA1, world).permutation(n_parts)
    return [sorted(int(i) for i in perm[r::world]) for r in range(world)]


_DONE = object()


class BatchStream:
    """Training batches of exactly `batch_tokens` positions, epoch after epoch, forever.

    Order: with several ranks the parts are dealt once (`deal`, seeded by seed and the rank
    count): each rank reads the same share every epoch, so a node's part cache
    (tasks/store/part_cache.py) fills with its ranks' shares once and serves every later epoch
    (with fewer parts than ranks, every rank reads every part and takes every world-th
    sample). Epoch e visits the rank's share in the permutation `rng(seed, e)` (one rank:
    all parts; several: `rng(seed, e, world, rank)`); inside a part the samples go in
    the permutation `rng(seed, e, part index + 1)`. Samples are packed back to back; one
    that does not fit is split, its rest opening the next batch (its positions continue,
    so no token is dropped or padded). The deal changes only with the rank count.

    The position {epoch, cursor, sample, offset} after each batch rides on the batch;
    a stream started from it continues exactly where the other stopped.

    prefetch > 0: `prefetch` loader threads read the next parts in parallel and a
    packer thread assembles batches (2 ahead), so the training loop only waits when
    the store is slower than training. Memory: about prefetch + 2 parts.
    prefetch = 0: everything in the caller's thread.
    """

    def __init__(self, parts: Sequence[PartSpec], load: Callable[[PartSpec], PartData], *, batch_tokens: int,
                 seed: int, rank: int = 0, world: int = 1, prefetch: int = 2,
                 position: dict[str, int] | None = None, pin_memory: bool = False, staging: bool | None = None):
        if not parts:
            raise TrainError("no extraction parts to train on")
        self.parts = list(parts)
        self.load = load
        self.batch_tokens = batch_tokens
        self.seed = seed
        self.rank, self.world = rank, world
        self.by_part = len(self.parts) >= world
        self.prefetch = prefetch
        self.pin_memory = pin_memory
        # reusable staging buffers: by default where batches are pinned (a GPU run)
        self.pool = StagingPool(pin_memory) if (pin_memory if staging is None else staging) else None
        self.start = dict(position or {"epoch": 0, "cursor": 0, "sample": 0, "offset": 0})
        self.position = dict(self.start)
        self.wait_s = 0.0  # time the consumer spent blocked, cumulative
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._batches: Iterator[Batch] | None = None
        self._batch_q: queue.Queue | None = None

    # ---------------------------------------------------------------- order
    def share(self) -> list[PartSpec]:
        """The parts this rank reads every epoch (all of them with one rank or fewer parts than ranks)."""
        if not self.by_part or self.world == 1:
            return list(self.parts)
        return [self.parts[i] for i in deal(len(self.parts), self.seed, self.world)[self.rank]]

    def part_order(self, epoch: int) -> list[PartSpec]:
        share = self.share()
        keys = (self.seed, epoch) if self.world == 1 or not self.by_part else (self.seed, epoch, self.world, self.rank)
        return [share[i] for i in _rng(*keys).permutation(len(share))]

    def sample_order(self, epoch: int, data: PartData) -> np.ndarray:
        order = _rng(self.seed, epoch, data.spec.index + 1).permutation(data.train_samples)
        return order if self.by_part else order[self.rank::self.world]

    def _specs(self) -> Iterator[tuple[int, int, PartSpec]]:
        epoch, cursor = self.start["epoch"], self.start["cursor"]
        while True:
            order = self.part_order(epoch)
            for c in range(cursor, len(order)):
                yield epoch, c, order[c]
            epoch, cursor = epoch + 1, 0

    # ---------------------------------------------------------------- packing
    def _pack(self, loaded: Iterator[tuple[int, int, PartData]]) -> Iterator[Batch]:
        size = self.batch_tokens
        pieces: list[Piece] = []
        room = size
        k, j = self.start["sample"], self.start["offset"]  # only the first part resumes mid-way
        idle = 0
        for epoch, cursor, data in loaded:
            order = self.sample_order(epoch, data)
            produced = False
            while k < len(order):
                i = int(order[k])
                start, n = data.offsets[i], data.offsets[i + 1] - data.offsets[i] - 1
                if j >= n:  # a 0/1-token sample has no position to train on
                    k, j = k + 1, 0
                    continue
                take = min(n - j, room)
                pieces.append((data, start, j, take))
                produced = True
                j += take
                room -= take
                if j >= n:
                    k, j = k + 1, 0
                if room == 0:
                    yield assemble(pieces, size, {"epoch": epoch, "cursor": cursor, "sample": k, "offset": j},
                                   self.pin_memory, self.pool)
                    pieces, room = [], size
            k, j = 0, 0
            idle = 0 if produced else idle + 1
            if idle > 2 * len(self.parts) + 2:
                raise TrainError("the extraction parts hold no sample of 2 or more tokens; nothing to train on")

    def _loaded_sync(self) -> Iterator[tuple[int, int, PartData]]:
        for epoch, cursor, spec in self._specs():
            yield epoch, cursor, self.load(spec)

    # ---------------------------------------------------------------- threads
    def _put(self, q: queue.Queue, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _get(self, q: queue.Queue) -> Any:
        while True:
            try:
                item = q.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set():
                    return _DONE
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def _loader(self, part_q: queue.Queue) -> None:
        """Loads the next `prefetch` parts in parallel (reading, sha256 and safetensors parsing
        release the GIL) and hands them on in order."""
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=self.prefetch, thread_name_prefix="draftline-part-load")
        pending: collections.deque = collections.deque()
        specs = self._specs()
        try:
            while not self._stop.is_set():
                while len(pending) < self.prefetch:
                    epoch, cursor, spec = next(specs)
                    pending.append((epoch, cursor, pool.submit(self.load, spec)))
                epoch, cursor, fut = pending.popleft()
                if not self._put(part_q, (epoch, cursor, fut.result())):
                    return
        except BaseException as exc:  # handed to the consumer, which raises it
            self._put(part_q, exc)
        finally:
            for *_, fut in pending:
                fut.cancel()
            pool.shutdown(wait=False)

    def _packer(self, part_q: queue.Queue, batch_q: queue.Queue) -> None:
        def parts() -> Iterator[tuple[int, int, PartData]]:
            while True:
                item = self._get(part_q)
                if item is _DONE:
                    return
                yield item

        try:
            for batch in self._pack(parts()):
                if not self._put(batch_q, batch):
                    return
        except BaseException as exc:
            self._put(batch_q, exc)

    def _start(self) -> None:
        if self.prefetch <= 0:
            self._batches = self._pack(self._loaded_sync())
            return
        part_q: queue.Queue = queue.Queue(maxsize=1)  # + `prefetch` loading + 1 being packed
        self._batch_q = queue.Queue(maxsize=2)
        self._threads = [
            threading.Thread(target=self._loader, args=(part_q,), name="draftline-part-loader", daemon=True),
            threading.Thread(target=self._packer, args=(part_q, self._batch_q), name="draftline-packer",
                             daemon=True),
        ]
        for t in self._threads:
            t.start()

    def next(self) -> Batch:
        if self._batches is None and self._batch_q is None:
            self._start()
        t0 = time.perf_counter()
        if self._batches is not None:
            batch = next(self._batches)
        else:
            assert self._batch_q is not None
            batch = self._get(self._batch_q)
            if batch is _DONE:
                raise RuntimeError("the batch stream was closed")
        self.wait_s += time.perf_counter() - t0
        self.position = dict(batch.position or self.position)
        return batch

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        self._threads = []


def holdout_plan(parts: list[PartSpec], last_part: PartData, total_samples: int, train: TrainConfig) -> int:
    """How many samples at the end of the last part are held out for evaluation.

    Enough for `eval_batches` batches, but at most 10% of all samples (at least
    one), and never the whole dataset. 0 when eval_batches is 0.
    """
    n = last_part.num_samples
    if train.eval_batches == 0 or (len(parts) == 1 and n < 2):
        return 0
    cap = max(1, int(max(total_samples, n) * HOLDOUT_MAX_FRACTION))
    if len(parts) == 1:
        cap = min(cap, n - 1)
    want = train.eval_batches * train.batch_tokens
    held, tokens = 0, 0
    while held < min(cap, n) and tokens < want:
        i = n - 1 - held
        tokens += last_part.offsets[i + 1] - last_part.offsets[i] - 1
        held += 1
    return held


def eval_batches(data: PartData, first: int, batch_tokens: int, max_batches: int) -> list[Batch]:
    """Held-out samples first.. of `data`, in order, packed like training (last batch padded)."""
    out: list[Batch] = []
    pieces: list[Piece] = []
    room = batch_tokens
    for i in range(first, data.num_samples):
        start, n = data.offsets[i], data.offsets[i + 1] - data.offsets[i] - 1
        j = 0
        while j < n and len(out) < max_batches:
            take = min(n - j, room)
            pieces.append((data, start, j, take))
            j += take
            room -= take
            if room == 0:
                out.append(assemble(pieces, batch_tokens))
                pieces, room = [], batch_tokens
    if pieces and len(out) < max_batches:
        out.append(assemble(pieces, batch_tokens))
    return out


def tail_copy(data: PartData, first: int) -> PartData:
    """Samples first.. of a part as a standalone copy (so the full part can be freed)."""
    a = data.offsets[first]
    return PartData(spec=data.spec, hidden=data.hidden[a:].clone(), input_ids=data.input_ids[a:].clone(),
                    loss_mask=data.loss_mask[a:].clone(), offsets=[o - a for o in data.offsets[first:]],
                    scales=data.scales[a:].clone() if data.scales is not None else None)
