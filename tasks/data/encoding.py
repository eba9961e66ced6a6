"""prepare's encoding (chat template + tokens + the verified loss mask, tasks/data/chat.py), in its own process or
fanned out over worker processes (`data.workers`), with the same outcome either way.

prepare takes each source's conversations in order until its share of the mix is met (tasks/data/prepare.py
`_fill`). The pool encodes ahead of that walk in chunks of consecutive conversations and hands the results back IN
ORDER, so the samples, the drop counts, the stats and the address are those of one process. It never encodes a
conversation the walk would not reach: it keeps no more conversations in flight than samples are still wanted,
so nothing is thrown away, and at most `WINDOW_PER_WORKER` chunks per worker are in flight (memory stays flat).

Each worker (spawned, not forked: no copy of the parent's threads or locks) builds its own masker from the run's
config once (`make_masker`), reads the conversations by row from the conversations' spill file (finished by the
parent before the pool starts, tasks/data/spill.py) and returns token ids and masks; the parent writes the
samples' spill. Then the same workers build the shards' Parquet bytes from the two finished spills
(`shard_files`: at most SHARDS_IN_FLIGHT shards at once), which the parent writes to the store in order: the
parent's own part per sample (reading the sources, the spill, the writes) is what bounds prepare on many cores
(benchmarks/RESULTS.md, "prepare over a node's cores"), and a shard's Parquet bytes were ~40% of it.

A worker ignores SIGINT (Ctrl-C reaches the parent, which cancels what is queued and waits for the chunks
running: CHUNK conversations each, a fraction of a second) and exits when its parent is gone (killed
without a chance to shut the pool down). Spawned workers import the parent's main module: a script of one's own
that runs prepare keeps its code under `if __name__ == "__main__":`. An error a worker meets while encoding (a template that raises, a row it cannot
read) is raised again by the parent encoding that conversation itself: the same exception, type and message,
as a run with `data.workers: 1` raises.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from tasks.core.config import DataConfig, RunConfig
from tasks.core.errors import DraftlineError
from tasks.data.chat import ChatMasker, SampleDropped, encode_sample, make_masker
from tasks.data.sources import Conversation, conversation_spill, spilled_conversation
from tasks.data.spill import Spill, SpillRows
from tasks.formats.samples import Sample, parquet_bytes

AUTO_MAX_WORKERS = 32
AUTO_CONVERSATIONS_PER_WORKER = 2000  # a worker's start (imports, tokenizer): ~4-6 CPU-s alone, ~17 with 16 at once (RESULTS)
CHUNK = 16  # conversations per task sent to a worker
WINDOW_PER_WORKER = 4  # chunks in flight per worker, at most
SHARDS_IN_FLIGHT = 8  # shards' Parquet bytes being built or waiting to be written, at most (each ~1/512 of the data)

log = logging.getLogger("draftline.data")


class EncodingWorkerError(DraftlineError, RuntimeError):
    """An encoding worker process died (killed, out of memory) or could not start; the message says what to try."""


@dataclass
class Encoded:
    """One conversation's outcome: its token ids and loss mask, or the reason it was dropped. `modes`: the mask
    modes its encoding used (ChatMasker.modes), counted by whoever consumes it; `error`: what a worker raised."""

    row: int
    input_ids: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    truncated: bool = False
    dropped: str = ""
    modes: Counter = field(default_factory=Counter)
    error: str = ""


def default_workers(cores: int, conversations: int) -> int:
    """data.workers' default for CONVERSATIONS to encode on CORES: one per core, at most AUTO_MAX_WORKERS, at most one
    per AUTO_CONVERSATIONS_PER_WORKER (1 = in this process, no pool). `draftline plan` prices prepare with it."""
    return max(1, min(cores, AUTO_MAX_WORKERS, conversations // AUTO_CONVERSATIONS_PER_WORKER))


def auto_workers(data: DataConfig, conversations: int) -> int:
    """`data.workers`, or its default for CONVERSATIONS to encode on the cores this process may use."""
    if data.workers is not None:
        return data.workers
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return default_workers(cores, conversations)


def _encode_one(masker: ChatMasker, conv: Conversation, data: DataConfig) -> Encoded:
    """Encode CONV; SampleDropped becomes a dropped outcome, any other error propagates."""
    try:
        sample, truncated = encode_sample(masker, conv, data)
    except SampleDropped as drop:
        return Encoded(conv.row, dropped=drop.reason)
    return Encoded(conv.row, sample.input_ids, sample.loss_mask, truncated)


def samples_schema() -> Any:
    """The samples' spill (prepare's encoded samples): each one's conversation row, token ids and loss mask."""
    import pyarrow as pa

    return pa.schema([("conversation", pa.int64()), ("input_ids", pa.list_(pa.int32())),
                      ("loss_mask", pa.list_(pa.int8()))])


def gather(samples: Spill, convs: Spill, indices: Sequence[int]) -> list[Sample]:
    """The samples at INDICES of the samples' spill, each with its conversation's id, source and messages."""
    out = []
    for i in indices:
        r = samples.get(i)
        c = spilled_conversation(convs.get(r["conversation"]), r["conversation"])
        out.append(Sample(c.sample_id, c.source, c.messages, r["input_ids"], r["loss_mask"]))
    return out


class LocalEncoder:
    """Encoding in this process, one conversation at a time (data.workers 1)."""

    def __init__(self, masker: ChatMasker, data: DataConfig):
        self.masker, self.data = masker, data

    def encoded(self, convs: Sequence[Conversation], start: int, wanted: Callable[[], int]) -> Iterator[Encoded]:
        """The outcomes of CONVS[START:] in order, while WANTED() (samples still wanted) is above 0."""
        for i in range(start, len(convs)):
            if wanted() <= 0:
                return
            yield _encode_one(self.masker, convs[i], self.data)

    def shard_files(self, samples: Spill, convs: Spill, parts: Sequence[Sequence[int]]) -> Iterator[bytes]:
        """Each of PARTS (indices into the samples' spill) as a shard's Parquet bytes, in order."""
        for part in parts:
            yield parquet_bytes(gather(samples, convs, part))

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- the worker processes

_WORKER: dict[str, Any] = {}


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)  # the parent died without shutting the pool down: nobody will read what this process makes


def _start_worker(cfg: RunConfig, spill_path: str, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it shuts the pool down
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
    _WORKER.update(masker=make_masker(cfg), data=cfg.data, convs=conversation_spill(spill_path, write=False))


def _shard_file(samples_path: str, indices: list[int]) -> bytes:
    """In a worker: the Parquet bytes of the samples at INDICES of the finished samples' spill at SAMPLES_PATH."""
    if _WORKER.get("samples_path") != samples_path:
        _WORKER.update(samples=Spill.open(samples_path, samples_schema()), samples_path=samples_path)
    return parquet_bytes(gather(_WORKER["samples"], _WORKER["convs"], indices))


def _encode_rows(rows: list[int]) -> list[Encoded]:
    """In a worker: the outcomes of the conversations at ROWS of the spill, each with the mask modes it used."""
    masker, data, convs = _WORKER["masker"], _WORKER["data"], _WORKER["convs"]
    out = []
    for row in rows:
        before = Counter(masker.modes)
        try:
            done = _encode_one(masker, spilled_conversation(convs.get(row), row), data)
        except Exception as exc:  # noqa: BLE001 - raised again by the parent encoding this row itself
            done = Encoded(row, error=f"{type(exc).__name__}: {exc}")
        done.modes = Counter(masker.modes) - before
        out.append(done)
    return out


class PoolEncoder:
    """Encoding on WORKERS spawned processes, results consumed in order (see the module's docstring). The
    conversations are rows of the finished conversations' spill at SPILL_PATH."""

    def __init__(self, cfg: RunConfig, masker: ChatMasker, spill_path: str, workers: int):
        self.masker, self.data, self.workers = masker, cfg.data, workers
        self.window = WINDOW_PER_WORKER * workers
        self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=_start_worker, initargs=(cfg, spill_path, os.getpid()))

    def encoded(self, convs: Sequence[Conversation], start: int, wanted: Callable[[], int]) -> Iterator[Encoded]:
        """The outcomes of CONVS[START:] in order, while WANTED() (samples still wanted) is above 0: conversations
        are sent ahead only while fewer are in flight than samples are still wanted, so each one sent is used."""
        if not isinstance(convs, SpillRows):
            raise TypeError("the encoding pool reads conversations from their spill file (load_sources(spill=...))")
        rows = convs.indices
        pending: deque[tuple[Future, int]] = deque()
        sent, in_flight = start, 0
        while True:
            room = wanted() - in_flight
            while room > 0 and sent < len(rows) and len(pending) < self.window:
                n = min(CHUNK, room, len(rows) - sent)
                pending.append((self.pool.submit(_encode_rows, rows[sent:sent + n]), n))
                sent, in_flight, room = sent + n, in_flight + n, room - n
            if not pending:
                return
            future, n = pending.popleft()
            in_flight -= n
            for done in self._result(future):
                if done.error:
                    self._raise_again(convs, done)
                self.masker.modes.update(done.modes)
                yield done

    def shard_files(self, samples: Spill, convs: Spill, parts: Sequence[Sequence[int]]) -> Iterator[bytes]:
        """Each of PARTS (indices into the samples' spill) as a shard's Parquet bytes, in order, built on the
        workers (the same bytes as LocalEncoder's), SHARDS_IN_FLIGHT at most at once."""
        samples.finish()  # the workers read it
        pending: deque[Future] = deque()
        todo = iter(parts)
        while True:
            for part in todo:
                pending.append(self.pool.submit(_shard_file, samples.path, list(part)))
                if len(pending) >= SHARDS_IN_FLIGHT:
                    break
            if not pending:
                return
            yield self._result(pending.popleft())

    def _result(self, future: Future) -> Any:
        try:
            return future.result()
        except BrokenProcessPool as exc:
            raise EncodingWorkerError(
                f"a prepare encoding worker process died or could not start ({exc}); nothing was committed. Look "
                f"for its error above (or the kernel's OOM killer), lower data.workers (now {self.workers}) or set "
                "it to 1 to encode in this process, then run again. The workers are spawned: a script of yours "
                "that runs prepare needs its code under `if __name__ == \"__main__\":`") from None

    def _raise_again(self, convs: SpillRows, done: Encoded) -> None:
        """A worker's error, raised by encoding its conversation here: the exception a one-process run raises."""
        conv = spilled_conversation(convs.spill.get(done.row), done.row)
        _encode_one(self.masker, conv, self.data)
        raise EncodingWorkerError(f"an encoding worker failed on conversation {conv.sample_id} of source "
                                  f"{conv.source!r} ({done.error}), which this process encodes without error; "
                                  "run again, or with data.workers: 1")

    def close(self) -> None:
        """Cancel what is queued, wait for the chunks running; no worker process is left behind."""
        self.pool.shutdown(wait=True, cancel_futures=True)


def make_encoder(cfg: RunConfig, masker: ChatMasker, spill_path: str, conversations: int
                 ) -> LocalEncoder | PoolEncoder:
    """The encoder for CONVERSATIONS to encode at the config's `data.workers` (auto_workers)."""
    workers = auto_workers(cfg.data, conversations)
    how = "set by data.workers" if cfg.data.workers is not None else "data.workers' default for this machine's cores"
    log.info(f"prepare: encoding up to {conversations:,} conversations "
             f"{'in this process' if workers == 1 else f'on {workers} worker processes'} ({how})")
    if workers == 1:
        return LocalEncoder(masker, cfg.data)
    return PoolEncoder(cfg, masker, spill_path, workers)
