"""Real child processes that start in milliseconds: forked from a warm server.

A fresh Python that imports torch and transformers takes 5-20 s on 2 cores, so a
test that kills a process ten times and starts it again would spend minutes on
imports. `multiprocessing`'s forkserver imports them ONCE (it never runs a torch
op, so forking it is safe); every child is a fork of it: a separate process with
its own pid, killed by a real SIGKILL, exactly like the production one except
for how it was launched.

- `fork_call(fn, *args, env=...)`: run `fn(*args)` in a child; returns the Process
  (exitcode -9 after SIGKILL). `fn` must be importable (module-level).
- `start_draftline(args, folder, name)` / `finish(...)`: `draftline ARGS` in a child (Prefect
  is imported there, with the caller's environment: in-process flow runs would bind Prefect's
  settings and log handlers to whatever the first test left behind).
- `WarmEngine`: `tasks.engine.process.EngineProcess` whose engine child is forked from the
  server instead of exec'ing `python -m tasks.engine.child`; the child runs the production
  `tasks.engine.child.serve` loop and backend, and the parent side (requests, death
  detection, killing the process group) is the production class unchanged.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

from tasks.core import owners
from tasks.engine.process import ROOT, EngineProcess, _LIVE, engine_tmp_base

PRELOAD = [
    "torch", "numpy", "pyarrow.parquet", "safetensors.torch", "transformers",
    "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama", "speculators.models.eagle3",
    "tasks.engine.process", "tasks.engine.child", "tasks.extract.stage", "tasks.store.artifacts", "tasks.train.stage", "tasks.data.prepare", "warm",
]
_CTX: Any = None


def context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def _enter(env: dict[str, str], cwd: str, log: str | None) -> None:
    """In the child: the caller's environment and folder (the server froze its own at start)."""
    import tempfile

    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # read TMPDIR again
    os.chdir(cwd)
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    import torch

    torch.set_num_threads(1)


def _call(fn: Callable, args: tuple, env: dict[str, str], cwd: str, log: str | None) -> None:
    _enter(env, cwd, log)
    fn(*args)


def fork_call(fn: Callable, *args: Any, env: dict[str, str] | None = None, log: str | None = None):
    p = context().Process(target=_call, args=(fn, args, dict(env or os.environ), os.getcwd(), log))
    p.start()
    return p


def _draftline(args: list[str], out: str, session: bool = False) -> None:
    """Child process: `draftline ARGS`, its stdout to OUT, its exit code as ours. session=True: its own
    session and process group, as a `draftline` started from a shell (a kill of "the whole run"
    then reaches it and what it started, and nothing of the test's)."""
    import contextlib

    import click

    if session:
        os.setsid()

    from cli.app import app

    code = 0
    with open(out, "w") as fh, contextlib.redirect_stdout(fh):
        try:
            ret = app(args, standalone_mode=False)  # an Exit(n) comes back as n here
            code = ret if isinstance(ret, int) else 0
        except click.exceptions.Exit as exc:
            code = exc.exit_code
        except SystemExit as exc:
            code = int(exc.code or 0)
        except Exception:  # noqa: BLE001 - what standalone click would do: print and exit 1
            import traceback

            traceback.print_exc()
            code = 1
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=60)  # children skip atexit: send the run's logs to the API now
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start_draftline(args: list[str], folder: Path, name: str = "draftline", env: dict[str, str] | None = None,
                    session: bool = False):
    return fork_call(_draftline, list(args), str(folder / f"{name}.out"), session, env=env,
                     log=str(folder / f"{name}.log"))


def finish(p, folder: Path, name: str = "draftline", timeout: float = 900) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr) of a `start_draftline` child."""
    p.join(timeout)
    read = lambda f: f.read_text() if f.exists() else ""  # noqa: E731
    return p.exitcode, read(folder / f"{name}.out"), read(folder / f"{name}.log")


# ----------------------------------------------------------------------------- engines


def _engine_child(sock: socket.socket, env: dict[str, str], log: str) -> None:
    from tasks.engine import child as engine_child

    _enter(env, str(ROOT), log)
    os.setsid()  # its own process group, as EngineProcess gives its engines (start_new_session)
    # Its parent is the fork server: the engine watches that pid and dies with it.
    os._exit(engine_child.serve(sock.detach(), os.getppid()))


class _Proc:
    """The bits of subprocess.Popen that EngineProcess uses, over a multiprocessing.Process."""

    def __init__(self, p):
        self.p = p
        self.pid = p.pid

    def poll(self):
        return self.p.exitcode

    def wait(self, timeout=None):
        import subprocess

        self.p.join(timeout)
        if self.p.exitcode is None:
            raise subprocess.TimeoutExpired("engine", timeout)
        return self.p.exitcode


class WarmEngine(EngineProcess):
    starts = 0

    def start(self, timeout_s: float = 300) -> None:
        if self.alive:
            return
        self._cleanup()
        self._dead = False
        self.workdir = owners.owned_tempdir(f"engine-{self.name}", engine_tmp_base())  # as EngineProcess.start
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        parent_sock, child_sock = socket.socketpair()
        Path(self.log_path).touch()
        p = context().Process(target=_engine_child, args=(child_sock, env, self.log_path))
        p.start()
        child_sock.close()
        self._proc = _Proc(p)  # type: ignore[assignment]
        self._conn = Connection(parent_sock.detach())
        _LIVE.add(self)
        WarmEngine.starts += 1
        try:
            self._conn.send({"op": "init", "kind": self.kind, "model": self.model,
                             "llm_kwargs": self.llm_kwargs, "workdir": self.workdir})
            self.info = self._receive(timeout_s, "starting")
        except BaseException:
            self._failed = True
            self.close(timeout_s=5)
            raise
