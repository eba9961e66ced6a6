"""Stage `extract`: run the target over each data shard once and store its hidden states.

One artifact per shard (`extract/DIGEST/`), so a failed or killed shard is the
only work repeated: every other shard is committed and found on the store. When every
shard is there, `assemble_extract` commits the stage's own artifact (`extract-stage/DIGEST/`,
a manifest naming each shard), the one input training takes.

    plans = plan_extract(cfg, data_ref, hf_config)           # one ExtractShard plan (and digest) per shard
    for group in engine_groups(cfg):                         # the flow fans shards over groups
        with engine_for_group(cfg, model_path, group) as engine:
            refs = [extract_shard(cfg, store, p, engine) for p in my_plans]
    extracted = assemble_extract(cfg, store, refs, t0, reused)       # extract-stage/DIGEST: names every shard

Inside a shard three things run at once: the engine computes batch k+1, the
calling thread collects batch k into the current part, and a background writer
serializes, hashes and uploads the previous part (`extract.write_overlap`, at
most `extract.write_queue` parts waiting, so memory stays bounded). The
manifest is committed after the last part is written; any failure commits nothing.

A shard's parts hold `hidden_states` [T, L, H] for the auxiliary layers
`layer_ids[:-1]` plus the last decoder layer's pre-norm output, `input_ids`,
`loss_mask` and `offsets` (docs/ARTIFACTS.md); `load_part` reads one back as
bf16 whatever the storage dtype. `storage_dtype: fp8` stores float8_e4m3fn with
one float32 scale per token and layer, about half the bytes of bf16.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, Iterator, Sequence

from tasks.core.config import RunConfig
from tasks.core.digest import VERSIONS
from tasks.core.faults import kill_point
from tasks.engine.process import EngineProcess
from tasks.engine.target import load_hf_config, resolve_model
from tasks.address import digests
from tasks.extract.shards import STAGE, STAGE_ARTIFACT, ExtractError, ExtractShard, ProgressCallback, plan_extract  # noqa: F401
from tasks.extract.verify import StateCheck, markdown, pooled_failure, summarize, summary_line, verifier_head
from tasks.formats.parts import PartBuffer
from tasks.store.artifacts import ArtifactRef, Store
from tasks.store.writer import ArtifactWriter
from tasks.store.stages import ShardedStage, Shown

# ============================================================================ the stage


def _read_shard(store: Store, plan: ExtractShard) -> list[tuple[str, list[int], list[int]]]:
    import pyarrow.parquet as pq

    data = store.open(plan.data_stage, plan.data_digest, only=plan.data_file)  # this shard's file, not all N
    if plan.data_file not in data.files():
        raise ExtractError(f"{data.uri} has no {plan.data_file} (files: {data.files()[:5]}...); "
                           "its num_shards does not match its files: re-run the data stage")
    with data.local_copy(plan.data_file) as path:
        table = pq.read_table(path, columns=["sample_id", "input_ids", "loss_mask"])
    rows = table.to_pydict()
    samples = []
    for sid, ids, mask in zip(rows["sample_id"], rows["input_ids"], rows["loss_mask"]):
        if len(ids) != len(mask):
            raise ExtractError(f"{data.uri}/{plan.data_file}: sample {sid} has {len(ids)} input_ids but "
                               f"{len(mask)} loss_mask values; re-run the data stage")
        if ids:
            samples.append((sid, ids, mask))
    return samples


def _batches(samples: list, batch_tokens: int) -> Iterator[list]:
    batch: list = []
    tokens = 0
    for s in samples:
        n = len(s[1])
        if batch and tokens + n > batch_tokens:
            yield batch
            batch, tokens = [], 0
        batch.append(s)
        tokens += n
    if batch:
        yield batch


def _store_batch(plan: ExtractShard, buf: "PartBuffer", batch: list, hidden: list, done: int,
                 masked: int) -> tuple[int, int]:
    """`hidden`: (hidden states, the engine's next token or None) per sample of `batch`."""
    if len(hidden) != len(batch):
        raise ExtractError(f"the engine returned {len(hidden)} results for {len(batch)} samples")
    for (sid, ids, mask), (hs, next_token) in zip(batch, hidden):
        if hs.shape[-1] != plan.hidden_size:
            raise ExtractError(f"the engine returned hidden size {hs.shape[-1]}, the target config says "
                               f"{plan.hidden_size}: the engine runs a different model than planned")
        buf.add(sid, ids, mask, hs, next_token)
        masked += int(sum(mask))
        done += len(ids)
    return done, masked


def part_rule(batch: list, hidden: list, filled: int, part_tokens: int, deal: bool) -> Iterator[tuple[list, list, bool]]:
    """How an engine batch goes into parts: (samples, their hidden states, close the current part first).

    Engine batches no larger than a part (`deal` False: extract.batch_tokens <= part_tokens) go in whole,
    and a part ends after the first batch that brings it to part_tokens, so it holds at most
    part_tokens - 1 + batch_tokens tokens (the rule parts were always made by: their bytes, and so the
    addresses of what was stored, do not change). A larger engine batch (`deal`: batch_tokens > part_tokens,
    e.g. a GPU node computing 262,144 tokens per call into 65,536-token parts) is dealt out sample by
    sample, a part closing before the sample that would take it past part_tokens: no part is larger than
    part_tokens, except one holding a single sample longer than that.
    """
    if not deal:
        yield batch, hidden, False
        return
    start, tokens, close = 0, filled, False
    for i, s in enumerate(batch):
        n = len(s[1])
        if tokens and tokens + n > part_tokens:  # the part is full: what came before goes in, then it closes
            if i > start:
                yield batch[start:i], hidden[start:i], close
            start, tokens, close = i, 0, True
        tokens += n
    yield batch[start:], hidden[start:], close


class _Cancelled(Exception):
    """The shard failed elsewhere: the background writer stops mid-part."""


class _CancellableFile:
    """Passes writes through until the shard is cancelled, then stops the part being written."""

    def __init__(self, fh: BinaryIO, cancelled: threading.Event):
        self.fh, self.cancelled = fh, cancelled

    def write(self, b: Any) -> int:
        if self.cancelled.is_set():
            raise _Cancelled("the shard failed; part write stopped")
        return self.fh.write(b)


class _PartWriter:
    """Writes finished parts into the attempt, on `workers` background threads when `depth` > 0.

    Serializing, hashing (while writing, see `ArtifactWriter.open`) and uploading parts then
    overlap the engine's forward of the next batches; several workers write several parts at
    once (one stream hashes and writes at ~1 GB/s, less than a GPU extracts). At most `depth`
    parts are handed over and not yet written (those being written included): `put` blocks
    beyond that, so hidden states in memory stay bounded by depth + 1 parts. `depth` 0 writes
    inline (the serial path). Written buffers are emptied and kept for `take` to hand out again,
    so at most depth + 1 buffers are ever allocated.

    A write error is re-raised in the caller, unchanged, at the next `put`/`check`/`finish`, and
    stops the other workers' parts. Leaving the `with` block stops the threads (cancelling the
    parts being written when the shard failed), so the attempt is aborted with no writer still
    adding files to it.
    """

    def __init__(self, w: ArtifactWriter, depth: int, name: str, workers: int = 1, check: StateCheck | None = None):
        self.w = w
        self.state_check = check  # the extraction check of each part, on the writer's thread (off the engine's path)
        self.depth = depth
        self.parts: list[tuple[str, int]] = []  # (name, tokens) in hand-over order
        self.write_s = 0.0  # time spent writing parts, summed over the workers
        self.peak_in_flight = 0
        self.error: BaseException | None = None
        self._pending: deque[tuple[str, PartBuffer]] = deque()  # handed over, not started
        self._free: list[PartBuffer] = []  # written and emptied, for `take`
        self._active = 0  # being written
        self._closing = False
        self._cancelled = threading.Event()
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        if depth > 0:
            for k in range(max(1, min(workers, depth))):
                t = threading.Thread(target=self._run, name=f"{name}-{k}", daemon=True)
                t.start()
                self._threads.append(t)

    def put(self, buf: "PartBuffer") -> None:
        """Hand over a filled part; the caller starts a new buffer."""
        if not buf.tokens:
            return
        name = f"part-{len(self.parts):05d}.safetensors"
        if not self._threads:
            self.parts.append((name, buf.tokens))
            self.peak_in_flight = 1
            self._write(name, buf)
            buf.reset()
            self._free.append(buf)
            return
        with self._cond:
            while len(self._pending) + self._active >= self.depth and self.error is None:
                self._cond.wait()
            self._raise_error()
            self.parts.append((name, buf.tokens))
            self._pending.append((name, buf))
            self.peak_in_flight = max(self.peak_in_flight, len(self._pending) + self._active)
            self._cond.notify_all()

    def take(self) -> "PartBuffer | None":
        """A written, emptied buffer to fill again (its memory already touched), or None."""
        with self._cond:
            return self._free.pop() if self._free else None

    def check(self) -> None:
        """Raise the writer's error, if it has failed, without waiting."""
        with self._cond:
            self._raise_error()

    def finish(self) -> None:
        """Wait until every part handed over is written; raise the writer's error if it failed."""
        self._stop(cancel=False)
        self._raise_error()

    def __enter__(self) -> "_PartWriter":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self._stop(cancel=exc_type is not None)

    def _stop(self, cancel: bool) -> None:
        if not self._threads:
            return
        with self._cond:
            if cancel:
                self._cancelled.set()
                self._pending.clear()
            self._closing = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()
        self._threads = []

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def _write(self, name: str, buf: "PartBuffer") -> None:
        if self.state_check is not None:
            self.state_check.add_part(buf)
        t0 = time.monotonic()
        with self.w.open(name) as fh:
            buf.write(_CancellableFile(fh, self._cancelled))  # type: ignore[arg-type]
        with self._cond:
            self.write_s += time.monotonic() - t0
        kill_point("extract.part-written")

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                name, buf = self._pending.popleft()
                self._active += 1
            try:
                if self.error is None and not self._cancelled.is_set():
                    self._write(name, buf)
            except BaseException as exc:  # handed to the caller; the other parts are stopped
                if not isinstance(exc, _Cancelled):
                    with self._cond:
                        self.error = self.error or exc
                    self._cancelled.set()
            finally:
                buf.reset()
                with self._cond:  # back to the pool before `put` may go on, so buffers stay <= depth + 1
                    self._free.append(buf)
                    self._active -= 1
                    self._cond.notify_all()


def _skipped(cfg: RunConfig, engine: Any) -> str:
    if cfg.extract.verify_positions <= 0:
        return "extract.verify_positions is 0"
    return f"the engine ({getattr(engine, 'kind', '?')}) gives no next tokens or no model folder"


def _state_check(cfg: RunConfig, engine: Any) -> StateCheck | None:
    """The shard's check of its stored states against the engine's next tokens, or None where it cannot run
    (turned off; an engine without a model folder, e.g. a test's stand-in)."""
    model = getattr(engine, "model", None)
    if cfg.extract.verify_positions <= 0 or not isinstance(model, str) or not hasattr(engine, "last_next_tokens"):
        return None
    head = verifier_head(model, load_hf_config(cfg.target, model))
    return StateCheck(head, cfg.extract.verify_positions, cfg.extract.verify_min_agreement,
                      cfg.extract.verify_confidence)


def extract_shard(cfg: RunConfig, store: Store, plan: ExtractShard, engine: EngineProcess, *,
                  on_progress: ProgressCallback | None = None) -> ArtifactRef:
    """Extract one shard into `extract/<plan.digest>/`; returns at once if it is already committed.

    Three things run at once: the engine computes batch k+1 (one call ahead), this thread
    collects batch k into the current part, and a background writer stores the previous
    part(s) (`extract.write_overlap`, at most `extract.write_queue` parts queued). The
    manifest is committed only after every part is written; a failure anywhere (the engine
    dying, a store error in the writer) raises that error and commits nothing.
    """
    return store.found_or_compute(STAGE, plan.digest, lambda: _extract(cfg, store, plan, engine, on_progress))


def _extract(cfg: RunConfig, store: Store, plan: ExtractShard, engine: EngineProcess,
             on_progress: ProgressCallback | None) -> ArtifactRef:
    """One shard: the engine's batches collected into parts while the next batch computes and earlier parts are
    written, then checked and committed. Kept as one function (~95 lines) on purpose: the part buffer and the
    three timers the manifest reports (engine wait, write wait, collect) pass through every step of the loop."""
    e = cfg.extract
    samples = _read_shard(store, plan)
    total = sum(len(s[1]) for s in samples)
    _check_engine_fits(cfg, plan, engine, samples)

    t0 = time.monotonic()
    done = masked = 0
    engine_wait = write_wait = 0.0  # time this thread waited for the engine / for the part writer
    collect = 0.0  # time this thread spent collecting batches into parts
    batches = list(_batches(samples, e.batch_tokens))
    deal = e.batch_tokens > e.part_tokens  # part_rule: engine batches larger than a part are dealt out
    capacity = _part_capacity(e.part_tokens, deal, samples, batches, total)
    new_buffer = lambda: PartBuffer(plan.layer_ids, plan.hidden_size, e.storage_dtype, capacity)  # noqa: E731
    buf = new_buffer()
    check = _state_check(cfg, engine)

    with store.write(STAGE, plan.digest, VERSIONS[STAGE], inputs=plan.inputs, config=plan.config) as w:
        if on_progress:
            on_progress(0, total)
        depth = e.write_queue if e.write_overlap else 0
        with ThreadPoolExecutor(1, thread_name_prefix=f"extract-{plan.shard}") as ahead, \
                _PartWriter(w, depth, f"extract-{plan.shard}-writer", e.write_workers, check) as writer:
            # The engine computes batch k+1 while this thread collects batch k. A transformers engine
            # copies into two shared buffers it alternates between (no file written per call): batch
            # k is copied out here before batch k+2 is asked for, which is when its buffer is reused.
            ring = engine.kind == "transformers"
            extract = functools.partial(engine.extract, ring=True) if ring else engine.extract

            def call(prompts: list, layer_ids: list) -> tuple[list, list]:
                """(hidden states, the engine's next tokens): read on this one thread, right after its call."""
                hidden = extract(prompts, layer_ids)
                tokens = getattr(engine, "last_next_tokens", None)
                return hidden, list(tokens) if tokens is not None else [None] * len(hidden)
            pending = ahead.submit(call, [s[1] for s in batches[0]], plan.layer_ids) if batches else None
            for k, batch in enumerate(batches):
                assert pending is not None
                t1 = time.monotonic()
                hidden, next_tokens = pending.result()
                engine_wait += time.monotonic() - t1
                pending = (ahead.submit(call, [s[1] for s in batches[k + 1]], plan.layer_ids)
                           if k + 1 < len(batches) else None)
                if len(hidden) != len(batch):
                    raise ExtractError(f"the engine returned {len(hidden)} results for {len(batch)} samples")
                hidden = list(zip(hidden, next_tokens))
                for piece, piece_hidden, close_before in part_rule(batch, hidden, buf.tokens, e.part_tokens, deal):
                    if close_before:
                        t1 = time.monotonic()
                        writer.put(buf)  # blocks while write_queue parts are still being written
                        write_wait += time.monotonic() - t1
                        buf = writer.take() or new_buffer()
                    t1 = time.monotonic()
                    done, masked = _store_batch(plan, buf, piece, piece_hidden, done, masked)
                    collect += time.monotonic() - t1
                del hidden
                if not deal and buf.tokens >= e.part_tokens:
                    t1 = time.monotonic()
                    writer.put(buf)  # blocks while write_queue parts are still being written
                    write_wait += time.monotonic() - t1
                    buf = writer.take() or new_buffer()
                writer.check()  # a failed write fails the shard now, not after the last batch
                if on_progress:
                    on_progress(done, total)
            t1 = time.monotonic()
            writer.put(buf)
            writer.finish()
            write_wait += time.monotonic() - t1
        if check is not None:
            failed = check.failure(plan.shard, plan.layer_ids, e.storage_dtype, engine.info.get("layers"))
            if failed:
                raise ExtractError(failed)  # the attempt is removed: nothing of the shard is committed
        seconds = time.monotonic() - t0
        stored = sum(f.bytes for f in w.files)
        w.files.sort(key=lambda f: f.path)  # workers finish parts in any order; names are zero-padded
        if [f.path for f in w.files] != [n for n, _ in writer.parts]:  # never expected: a writer bug
            raise ExtractError(f"shard {plan.shard}: parts written {[f.path for f in w.files]} differ from "
                               f"parts planned {[n for n, _ in writer.parts]}; nothing was committed")
        stats = {
            "shard": plan.shard, "samples": len(samples), "tokens": total, "masked_tokens": masked,
            "layer_ids": plan.layer_ids, "hidden_size": plan.hidden_size, "storage_dtype": e.storage_dtype,
            "bytes": stored, "bytes_per_token": round(stored / total, 2) if total else 0.0,
            "tokens_per_s": round(total / seconds, 1) if seconds > 0 else 0.0, "seconds": round(seconds, 2),
            "parts": [{"name": n, "tokens": t} for n, t in writer.parts], "backend": engine.kind,
            "engine": engine.name,
            # Where the time went: writing parts (summed), and how long the loop was held up by the
            # writer (all of write_s when writing inline) and by the engine.
            "write_overlap": depth > 0, "write_workers": min(e.write_workers, depth) if depth else 0,
            "write_s": round(writer.write_s, 3),
            "write_wait_s": round(write_wait, 3), "engine_wait_s": round(engine_wait, 3),
            "collect_s": round(collect, 3),
            # the stored last layer reproduces the engine's next token (tasks/extract/verify.py)
            "verify": (check.stats() if check is not None
                       else {"positions": 0, "skipped": _skipped(cfg, engine)}),
        }
        art = w.commit(stats)
    return art.ref()


def _check_engine_fits(cfg: RunConfig, plan: ExtractShard, engine: EngineProcess, samples: list) -> None:
    """Refuse a shard the engine cannot extract as planned: a sample longer than its max_model_len, or other layers
    than the shard's (an engine started for another config)."""
    limit = int(engine.info.get("max_model_len") or cfg.target.max_model_len)
    too_long = [(s[0], len(s[1])) for s in samples if len(s[1]) >= limit]
    if too_long:
        raise ExtractError(
            f"shard {plan.shard}: {len(too_long)} sample(s) do not fit the engine's max_model_len={limit} "
            f"(e.g. {too_long[0][0]}: {too_long[0][1]} tokens); raise target.max_model_len above "
            "data.max_length or lower data.max_length"
        )
    engine_ids = engine.info.get("layer_ids")
    if engine_ids is not None and list(engine_ids) != plan.layer_ids:
        raise ExtractError(f"the engine extracts layers {engine_ids}, shard {plan.shard} needs {plan.layer_ids}; "
                           "start it with engine_for_group(cfg, ...) for this config")


def _part_capacity(part_tokens: int, deal: bool, samples: list, batches: list, total: int) -> int:
    """The most tokens one part buffer must hold (its allocation, made once and reused)."""
    if deal:  # engine batches larger than a part are dealt out: a part holds part_tokens, or one longer sample
        return min(total, max(part_tokens, max((len(s[1]) for s in samples), default=0)))
    # a part ends at the first batch that reaches part_tokens: at most part_tokens - 1 + one batch
    longest_batch = max((sum(len(s[1]) for s in b) for b in batches), default=0)
    return min(total, part_tokens - 1 + longest_batch)


def extract_address(shards: Sequence[ExtractShard | ArtifactRef]) -> str:
    """The extract stage artifact's digest: the set of its shards' addresses (their plans' or artifacts', the
    same digests). The flow's `STAGE_DEF.address`, and `assemble_extract`'s without one."""
    return digests.extract_stage([s.digest for s in shards])


def assemble_extract(cfg: RunConfig, store: Store, shards: list[ArtifactRef], t0: float, reused: int, *,
                     digest: str | None = None) -> ArtifactRef:
    """The extract stage's artifact from every shard's: a manifest naming each shard (inputs `shard-I`) with the
    stage's totals, committed at `extract-stage/DIGEST` (the flow's address for it; default `extract_address`,
    the set of shards' addresses). `reused`: how many shards were on the store before this run; `t0`: when this
    run's stage began (its `wall_seconds`)."""
    shards = sorted(shards, key=lambda r: int(r.stats.get("shard", 0)))
    numbers = [int(r.stats.get("shard", -1)) for r in shards]
    if not shards or len(set(numbers)) != len(numbers):
        raise ExtractError(f"the extract stage's artifact needs each shard once, got shards {numbers}")
    digest = digest or extract_address(shards)
    return store.found_or_compute(STAGE_ARTIFACT, digest, lambda: _assemble(cfg, store, shards, t0, reused, digest))


def _assemble(cfg: RunConfig, store: Store, shards: list[ArtifactRef], t0: float, reused: int,
              digest: str) -> ArtifactRef:
    stats: dict[str, Any] = {
        "num_shards": len(shards),
        **{k: sum(int(r.stats.get(k, 0)) for r in shards) for k in ("samples", "tokens", "masked_tokens", "bytes")},
        "layer_ids": shards[0].stats.get("layer_ids"), "hidden_size": shards[0].stats.get("hidden_size"),
        "storage_dtype": shards[0].stats.get("storage_dtype"), "shards_reused": reused,
        "seconds": round(sum(float(r.stats.get("seconds", 0)) for r in shards), 2),
    }
    verified = summarize([r.stats for r in shards])
    refused = pooled_failure(verified, stats["layer_ids"], stats["storage_dtype"])
    if refused:  # shards each too small to be refused alone, confidently below the threshold together
        raise ExtractError(refused)
    if verified is not None:
        stats["verified"] = verified
    inputs = {f"shard-{i}": r.digest for i, r in enumerate(shards)}
    with store.write(STAGE_ARTIFACT, digest, VERSIONS[STAGE], inputs, digests.extract_section(
            cfg, list(shards[0].stats.get("layer_ids") or []))) as w:
        # no file: the manifest's inputs name every shard, checked against this address when read
        # (tasks/extract/shards.py `extract_shards`); a file of its own would be one more list to check
        stats["wall_seconds"] = round(time.time() - t0, 2)  # the stage: engine starts, every shard, every node
        return w.commit(stats).ref()


def plan_shards(cfg: RunConfig, data: ArtifactRef) -> list[ExtractShard]:
    """The run's extraction shards of DATA (plan_extract on the target's own config)."""
    return plan_extract(cfg, data, load_hf_config(cfg.target, resolve_model(cfg.target)))


def show_check(refs: list[ArtifactRef], errors: list[str]) -> Shown:
    """The extraction check's figures (tasks/extract/verify.py) in the run's summary and, as a markdown artifact,
    in the Prefect UI, the refused shards' causes included."""
    verified = summarize([r.stats for r in refs])
    out = Shown(markdown=[("extraction-check", "Stored hidden states against the engine's next token",
                           markdown([r.stats for r in refs], errors))])
    if verified is not None:
        out.stats["verified"] = verified
        out.log.append(f"extract: {summary_line(verified)}")
    return out


# the stage as the flow runs it (tasks/store/stages.py)
STAGE_DEF = ShardedStage(
    name=STAGE, inputs=("data",), store_stage=STAGE_ARTIFACT, shard_stage=STAGE, plan=plan_shards,
    address=lambda cfg, data, plans: extract_address(plans), shard=extract_shard,
    assemble=lambda cfg, store, data, shards, t0, reused, *, digest=None: assemble_extract(
        cfg, store, shards, t0, reused, digest=digest),
    copies_shards=False, label="extraction", title="Extraction", tokens="tokens", rate="tok/s",
    show_shards=lambda refs, errors: show_check(refs, errors))
