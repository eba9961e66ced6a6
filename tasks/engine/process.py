"""The one way draftline runs a model: an engine in its own child process.

    with EngineProcess("vllm", model_path, {"max_model_len": 2048}, env={"VLLM_CPU_KVCACHE_SPACE": "2"}) as eng:
        outs = eng.generate([[1, 2, 3]], {"max_tokens": 16, "temperature": 0})
    with EngineProcess("vllm", model_path, vllm_extract_kwargs([2, 15, 27, 30])) as eng:
        hs = eng.extract([[1, 2, 3]], [2, 15, 27, 30])   # [tensor [3, 4, 576] bf16]

Why a child process: the engine is loaded once (a 1T model takes many minutes)
and serves many requests; it gets its own environment (CUDA_VISIBLE_DEVICES,
VLLM_CPU_KVCACHE_SPACE); and when it dies (OOM, kill -9, a node losing a GPU)
the caller gets an `EngineError` carrying the tail of the engine's log instead
of a hung or crashed pipeline, and may start a new one.

Protocol: `python -m tasks.engine.child --fd N` (the child: backends and its serve
loop live in tasks/engine/child.py) talks over one end of a socketpair
(`multiprocessing.connection` framing, small pickled dicts). Hidden states never
travel through the socket: the engine writes safetensors files (vLLM) or fills two
shared ring buffers (transformers) in a private work folder and answers with where;
the caller reads them in place. The engine's stdout/stderr go to `<workdir>/engine.log`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

from tasks.core.errors import DraftlineError
from tasks.core import owners, stopping
from tasks.engine.vllm_versions import check_vllm
from tasks.core.home import private_folder

ROOT = Path(__file__).resolve().parents[2]  # the repository root
LOG_TAIL_CHARS = 4000
LOG_WAIT_EVERY_S = 30.0
START_TIMEOUT_ENV = "DRAFTLINE_ENGINE_START_TIMEOUT_S"
DEFAULT_START_TIMEOUT_S = 1800.0
log = logging.getLogger("draftline.engine")
HS_CONNECTOR = "SyncHiddenStatesConnector"  # ours, for engines without CUDA (tasks/engine/vllm_connector.py)
HS_CONNECTOR_MODULE = "tasks.engine.vllm_connector"
# vLLM's own, asynchronous on CUDA (copy stream, pinned memory, writer threads): the name its
# KVConnectorFactory registers (vLLM 0.32 and 0.33), so no module path.
HS_CONNECTOR_ASYNC = "ExampleHiddenStatesConnector"


def release_cached_gpu_memory() -> None:
    """Give back the GPU memory this process's caching allocator holds (a head trained in the flow's process keeps
    ~5 GB cached on an H100) before a child engine claims its gpu_memory_utilization share of the card: measured
    on the lent H100, the benchmark's first engine ran out of memory at its first sampling step without this.
    torch is looked up, not imported: a process that never touched the GPU has nothing to give back."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class EngineError(DraftlineError, RuntimeError):
    """The engine failed. `log_tail` holds the end of its log; `fatal` says whether it is gone."""

    def __init__(self, message: str, log_tail: str = "", fatal: bool = True):
        self.log_tail = log_tail
        self.fatal = fatal
        super().__init__(message + (f"\n--- engine log (tail) ---\n{log_tail}" if log_tail else ""))


def vllm_extract_kwargs(layer_ids: list[int], asynchronous: bool = False) -> dict[str, Any]:
    """`vllm.LLM` kwargs that turn a target into a hidden-state extractor for `layer_ids`.

    asynchronous=True (an engine on CUDA GPUs): vLLM's own `ExampleHiddenStatesConnector`, whose TP rank 0
    copies on a side stream into pinned memory and writes from a thread pool, so the engine never waits
    on a write. False (no CUDA): ours, `SyncHiddenStatesConnector`, the same class with that one step done
    inline (the stock one needs CUDA). Both write the same files under the same lock protocol
    (tests/unit/engine/test_vllm_connector.py). The connector's `shared_storage_path` is filled in by the engine (its
    work folder).
    """
    connector: dict[str, Any] = ({"kv_connector": HS_CONNECTOR_ASYNC} if asynchronous else
                                 {"kv_connector": HS_CONNECTOR, "kv_connector_module_path": HS_CONNECTOR_MODULE})
    return {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        "kv_transfer_config": {**connector, "kv_role": "kv_producer", "kv_connector_extra_config": {}},
    }


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX). Without it (e.g. AVX2-only
    EPYC/Xeon) torch's bf16 matmuls run ~50x slower than float32 (measured: 0.4 vs 19 GFLOP/s)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return True  # unknown platform: trust the requested dtype


def engine_dtype(requested: str, on_gpu: bool) -> str:
    """The dtype to run a target in: as requested, except bf16/fp16 on a CPU that lacks native bf16,
    where float32 is many times faster (and exact-er). Hidden states are stored as bf16 either way."""
    if on_gpu or requested == "float32" or cpu_has_fast_bf16():
        return requested
    return "float32"


# ============================================================================ parent side


def engine_tmp_base() -> str | None:
    """Where engines put their hidden-state files: DRAFTLINE_ENGINE_TMP, else /dev/shm when it is
    big enough (RAM: the files are written once and read once), else the system temp folder."""
    explicit = os.environ.get("DRAFTLINE_ENGINE_TMP")
    if explicit:
        return explicit
    shm = "/dev/shm"
    with contextlib.suppress(OSError):
        if os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= 8 << 30:
            return shm
    return None

_LIVE: "weakref.WeakSet[EngineProcess]" = weakref.WeakSet()


def kill_all() -> int:
    """SIGKILL the process group of every live engine now, without waiting (a run told to stop);
    returns how many there were. Their callers see them dead at their next poll."""
    n = 0
    for eng in list(_LIVE):
        proc = eng._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
                n += 1
    return n


@atexit.register
def _close_all() -> None:
    for eng in list(_LIVE):
        with contextlib.suppress(Exception):
            eng.close(timeout_s=10)


class EngineProcess:
    """A model engine in a child process; see the module docstring."""

    def __init__(self, kind: Literal["vllm", "transformers"], model: str, llm_kwargs: dict | None = None,
                 env: dict[str, str] | None = None, name: str = "engine"):
        if kind not in ("vllm", "transformers"):
            raise ValueError(f"engine kind must be 'vllm' or 'transformers', got {kind!r}")
        self.kind = kind
        self.model = model
        self.llm_kwargs = dict(llm_kwargs or {})
        self.env = dict(env or {})
        self.name = name
        self.info: dict[str, Any] = {}
        self.workdir: str | None = None
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._dead = False
        self._failed = False  # died or was killed: keep its log when cleaning up
        self._lock = threading.Lock()
        self._seq = 0
        self.last_timings: dict[str, float] = {}  # of the last extract(): engine phases, call, load
        self.last_next_tokens: list[int | None] | None = None  # of the last extract(): the engine's next tokens
        self._ring_maps: dict[int, tuple[str, Any]] = {}  # slot -> (path, mapped tensor), extract(ring=True)

    # ------------------------------------------------------------------ lifecycle
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and not self._dead and self._proc.poll() is None

    @property
    def log_path(self) -> str | None:
        return os.path.join(self.workdir, "engine.log") if self.workdir else None

    def start(self, timeout_s: float | None = None) -> None:
        """Spawn the engine and wait until it has loaded the model (or raise EngineError).

        The wait is bounded by `timeout_s`, else DRAFTLINE_ENGINE_START_TIMEOUT_S, else 1800 s (a 1T
        model loads for many minutes); it logs every LOG_WAIT_EVERY_S while it waits."""
        if timeout_s is None:
            timeout_s = float(os.environ.get(START_TIMEOUT_ENV) or DEFAULT_START_TIMEOUT_S)
        if self.alive:
            return
        stopping.check(f"starting {self.name}")  # a run asked to stop starts no new engine
        if self.kind == "vllm":
            check_vllm()  # outside the releases draftline runs on: say so before a model loads for minutes
        release_cached_gpu_memory()
        self._cleanup()
        self._dead = False
        self.workdir = owners.owned_tempdir(f"engine-{self.name}", engine_tmp_base())
        env = {**os.environ, **self.env}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
        env.setdefault("PYTHONUNBUFFERED", "1")
        parent_sock, child_sock = socket.socketpair()
        with open(self.log_path, "wb") as log:  # type: ignore[arg-type]
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "tasks.engine.child", "--fd", str(child_sock.fileno()),
                     "--parent", str(os.getpid())],
                    pass_fds=[child_sock.fileno()], stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                    start_new_session=True,  # its own process group: close() reaps vLLM's workers too
                )
            finally:
                child_sock.close()
        self._conn = Connection(parent_sock.detach())
        _LIVE.add(self)
        try:
            self._conn.send({"op": "init", "kind": self.kind, "model": self.model, "name": self.name,
                             "llm_kwargs": self.llm_kwargs, "workdir": self.workdir})
            self.info = self._receive(timeout_s, "starting")
        except BaseException:
            self._failed = True
            self.close(timeout_s=5)  # kill what started, keep its log, drop the work folder
            raise

    def close(self, timeout_s: float = 60) -> None:
        """Shut the engine down (politely, then by force) and remove its work folder."""
        proc = self._proc
        if proc is not None and proc.poll() is None and self._conn is not None and not self._dead:
            with contextlib.suppress(Exception):
                self._conn.send({"op": "close"})
                deadline = time.monotonic() + timeout_s
                while proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
        self._dead = True
        self._kill_group()
        self._cleanup()
        _LIVE.discard(self)

    def __enter__(self) -> "EngineProcess":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "alive" if self.alive else "stopped"
        return f"EngineProcess({self.kind}, {self.model!r}, pid={self.pid}, {state})"

    # ------------------------------------------------------------------ requests
    def generate(self, prompt_token_ids: list[list[int]], sampling: dict) -> list[dict]:
        """One completion per prompt: {"token_ids", "text", "finish_reason", "prompt_tokens"}.

        `sampling` holds `vllm.SamplingParams` keyword arguments (max_tokens, temperature, top_p,
        seed, stop_token_ids, ...).
        """
        return self._call("generate", prompt_token_ids=_as_lists(prompt_token_ids), sampling=dict(sampling))

    def extract(self, prompt_token_ids: list[list[int]], layer_ids: list[int], ring: bool = False) -> list[Any]:
        """Hidden states per prompt: bf16 tensors [T, L, H], slots in `layer_ids` order.

        The tensors map the engine's file in shared memory (no copy); the file itself is unlinked.
        ring=True (transformers engines; ignored by vLLM's): no file is written at all; the tensors
        are views into one of two buffers the engine reuses, so they are valid only until the
        second-next `extract(ring=True)` call starts: copy what you keep before that (extract_shard
        does, into its part buffer, while the engine computes the next batch).
        """
        import torch

        prompts = _as_lists(prompt_token_ids)
        if not prompts:
            return []
        t0 = time.monotonic()
        extra = {"ring": True} if ring and self.kind == "transformers" else {}
        res = self._call("extract", prompt_token_ids=prompts, layer_ids=list(layer_ids), **extra)
        t1 = time.monotonic()
        out: list[Any] = [None] * len(prompts)
        files = list(res.get("paths", [])) + ([res["path"]] if "path" in res else [])
        try:
            if "paths" in res:  # vLLM: one connector file per request
                for i, (ids, path) in enumerate(zip(prompts, res["paths"])):
                    data, _ = read_safetensors(path)
                    got = data["token_ids"].tolist()
                    if got != ids:
                        raise EngineError(f"{self.name}: hidden states at {path} belong to other tokens "
                                          f"({len(got)} vs {len(ids)} tokens)", fatal=False)
                    out[i] = data["hidden_states"].to(torch.bfloat16)
            else:  # transformers: sub-batch k holds prompts order[k] concatenated
                if "ring" in res:  # ring=True: views into the engine's shared buffer
                    buf = self._ring_view(res["ring_slot"], res["ring"], res["ring_numel"])
                    n_l, h = res["row"]
                    subs = [buf[start:start + rows * n_l * h].view(rows, n_l, h) for start, rows in res["spans"]]
                else:  # one file
                    data, _ = read_safetensors(res["path"])
                    subs = [data[f"hidden_states.{k}"] for k in range(len(res["order"]))]
                for order, hs in zip(res["order"], subs):
                    pos = 0
                    for i in order:
                        out[i] = hs[pos:pos + len(prompts[i])]
                        pos += len(prompts[i])
        finally:
            for path in files:
                for p in (path, path + ".lock"):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(p)
        for ids, t in zip(prompts, out):
            if t is None or t.ndim != 3 or t.shape[0] != len(ids) or t.shape[1] != len(layer_ids):
                raise EngineError(f"{self.name}: expected hidden states [{len(ids)}, {len(layer_ids)}, H], "
                                  f"got {None if t is None else list(t.shape)}", fatal=False)
        self.last_timings = {**res.get("timings", {}), "call_s": t1 - t0, "load_s": time.monotonic() - t1}
        # the engine's greedy next token after each prompt (None where it gave none): read right after this call,
        # from the same thread, by the extraction check (tasks/extract/verify.py)
        got = res.get("next_tokens")
        self.last_next_tokens = list(got) if got is not None and len(got) == len(prompts) else None
        return out

    def _ring_view(self, slot: int, path: str, numel: int) -> Any:
        """The engine's ring buffer `path`, mapped shared once (the engine replaces a buffer that
        grows with a new file; old mappings are dropped here)."""
        import torch

        cur = self._ring_maps.get(slot)
        if cur is None or cur[0] != path:
            cur = self._ring_maps[slot] = (path, torch.from_file(path, shared=True, size=numel, dtype=torch.bfloat16))
        return cur[1]

    def metrics(self) -> dict[str, Any]:
        """vLLM's `llm.get_metrics()` flattened: counters/gauges -> number, vectors -> list,
        histograms -> {"count", "sum"}; same-named metrics (several engines) are summed."""
        return self._call("metrics")

    def _call(self, op: str, **args: Any) -> Any:
        with self._lock:
            if not self.alive or self._conn is None:
                if self._proc is not None and not self._dead:
                    self._mark_dead()  # it died between calls: reap what it left behind (vLLM's engine core)
                raise EngineError(f"{self.name} is not running ({self._exit_text()}); call start() first",
                                  self._log_tail())
            self._seq += 1
            try:
                self._conn.send({"op": op, "seq": self._seq, **args})
            except (BrokenPipeError, ConnectionError, OSError):
                self._mark_dead()
                raise EngineError(f"{self.name} died before {op} could be sent ({self._exit_text()})",
                                  self._log_tail()) from None
            return self._receive(None, op)

    def _receive(self, timeout_s: float | None, what: str) -> Any:
        assert self._conn is not None and self._proc is not None
        t0 = time.monotonic()
        deadline = None if timeout_s is None else t0 + timeout_s
        next_log = t0 + LOG_WAIT_EVERY_S
        while True:
            if stopping.requested():
                self._mark_dead()
                stopping.check(f"{self.name} was {what}")
            if deadline is not None and time.monotonic() >= next_log:  # a bounded wait says what it waits for
                log.info(f"{self.name} (pid {self.pid}) still {what} after {time.monotonic() - t0:.0f} s; "
                         f"gives up after {timeout_s:.0f} s; its log: {self.log_path}")
                next_log += LOG_WAIT_EVERY_S
            try:
                ready = self._conn.poll(0.2)
            except (OSError, EOFError):
                ready = True
            if ready:
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    self._wait_exit(5)
                    self._mark_dead()
                    raise EngineError(f"{self.name} died while {what} ({self._exit_text()})",
                                      self._log_tail()) from None
                if msg.get("ok"):
                    return msg.get("result")
                fatal = bool(msg.get("fatal"))
                if fatal:
                    self._wait_exit(10)
                    self._mark_dead()
                raise EngineError(f"{self.name} failed while {what}: {msg.get('error')}",
                                  msg.get("traceback", "") if not fatal else self._log_tail(), fatal=fatal)
            if self._proc.poll() is not None:
                self._mark_dead()
                raise EngineError(f"{self.name} died while {what} ({self._exit_text()})", self._log_tail())
            if deadline is not None and time.monotonic() > deadline:
                self._mark_dead()
                hint = (f"; a large model may need longer: set {START_TIMEOUT_ENV} (seconds)"
                        if what == "starting" else "")
                raise EngineError(f"{self.name} did not answer within {timeout_s:.0f} s while {what}; killed it{hint}",
                                  self._log_tail())

    # ------------------------------------------------------------------ helpers
    def _wait_exit(self, seconds: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            assert self._proc is not None
            self._proc.wait(seconds)

    def _mark_dead(self) -> None:
        self._dead = True
        self._failed = True
        self._kill_group()

    def _kill_group(self) -> None:
        """Kill the engine and everything it started (vLLM's engine-core/worker processes)."""
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # pgid == pid: start_new_session
        with contextlib.suppress(Exception):
            proc.wait(10)
        # vLLM's engine-core process is reparented when its parent dies; wait until
        # the group is really gone so a new engine does not compete with a dying one.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)

    def _cleanup(self) -> None:
        self._ring_maps.clear()
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None
        keep = self._failed or os.environ.get("DRAFTLINE_KEEP_ENGINE_LOGS") == "1"  # every engine's, for a scan
        if keep and self.log_path and os.path.exists(self.log_path):
            with contextlib.suppress(OSError):
                os.chmod(self.log_path, 0o600)
                shutil.move(self.log_path, self.kept_log_path())
        self._failed = False
        if self.workdir and os.path.isdir(self.workdir) and not os.environ.get("DRAFTLINE_KEEP_ENGINE_DIR"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def kept_log_path(self) -> str:
        """Where the full log of an engine that died (of every engine, with DRAFTLINE_KEEP_ENGINE_LOGS=1) is kept
        after cleanup: this user's private (0700) engine-logs folder (tasks/core/home.py), not the shared temp
        folder."""
        return os.path.join(private_folder("engine-logs"), f"draftline-{self.name}-{self.pid}.log")

    def _exit_text(self) -> str:
        if self._proc is None:
            return "never started"
        rc = self._proc.poll()
        if rc is None:
            return "still running"
        if rc < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-rc).name}"
        return f"exit code {rc}"

    def _log_tail(self) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - LOG_TAIL_CHARS))
            tail = fh.read().decode("utf-8", "replace")
        if self._failed:
            tail += f"\n--- full log: {self.kept_log_path()} (after close) ---"
        return tail


_ST_TORCH = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
             "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def read_safetensors(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """(tensors, metadata) of a safetensors file, mapped read-only without copying.

    The tensors stay valid after the file is deleted (the mapping holds the pages).
    """
    import json
    import mmap
    import struct

    import torch

    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < 8:
            raise EngineError(f"{path}: {size} bytes is not a safetensors file", fatal=False)
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + n else None
    meta = header.pop("__metadata__", None) or {}
    out: dict[str, Any] = {}
    for name, info in header.items():
        dtype = getattr(torch, _ST_TORCH[info["dtype"]])
        begin, end = info["data_offsets"]
        shape = info["shape"]
        if end == begin or mm is None:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        t = torch.frombuffer(mm, dtype=torch.uint8, count=end - begin, offset=8 + n + begin)
        out[name] = t.view(dtype).reshape(shape)
    return out, meta


def _as_lists(prompts: Any) -> list[list[int]]:
    out = []
    for p in prompts:
        if hasattr(p, "tolist"):
            p = p.tolist()
        out.append([int(t) for t in p])
    return out
