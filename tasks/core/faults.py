"""Named points where a recovery drill (or a test) kills the whole run for real.

    DRAFTLINE_FAULT_KILL=extract.part-written        SIGKILL the run's process group the first time
    DRAFTLINE_FAULT_KILL=extract.part-written:3      ... the third time this process passes there
    DRAFTLINE_FAULT_KILL=train.checkpoint-file:2:TERM  ... with SIGTERM instead

The kill is real (the process group gets the signal, as from a preempted node, the OOM killer or
Ctrl-C); only the moment is chosen. Points, in the order a run meets them:

    commit.<stage>.before-manifest   every file of an artifact written, its manifest not yet
    extract.part-written             a part of a shard is on the store, the shard not finished
    store.<stage>.mid-file           a file of a <stage> artifact partly written (4 KiB of it so far)
    train.checkpoint-file            one file of a training checkpoint written, the others not
    cache.mid-fill                   the node part cache's filler has written the first chunk of a part
    benchmark.baseline-measured      the benchmark's baseline decoded, the draft not yet
    benchmark.engine-committed       a benchmark engine's figures committed (`:2`: the baseline's and the next one's)
    train.rank<R>.step               training rank R (of train.gpus > 1) after a step: that rank alone dies
    engine.<name>.request            an engine (e.g. extract-cpu1) about to serve a request: the engine
                                     kills its own process group (the run itself lives on)

With DRAFTLINE_FAULT_ONCE_DIR set, a point fires once across all processes (a marker file in that
folder): an engine restarted after the kill does not kill itself again.

The second kind of fault is an exception, not a kill: a shard that fails on its first attempt and
succeeds on the next (a flaky worker node), for the retry drills of docs/DEPLOY.md:

    DRAFTLINE_FAULT_EXTRACT_SHARDS=1,3    extraction shards 1 and 3 raise `InjectedFault` before any work,
                                          once per shard digest (a marker in DRAFTLINE_FAULT_DIR, default
                                          the temp folder, lets the next attempt through)

Unset (always, outside drills), `kill_point` and `fail_point` cost one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from pathlib import Path

from tasks.core.errors import DraftlineError

_COUNTS: dict[str, int] = {}
_LOCK = threading.Lock()


def _spec() -> tuple[str, int, int] | None:
    raw = os.environ.get("DRAFTLINE_FAULT_KILL", "").strip()
    if not raw:
        return None
    name, _, rest = raw.partition(":")
    nth, _, sig = rest.partition(":")
    return name, int(nth or 1), getattr(signal, f"SIG{sig or 'KILL'}")


def kill_point(name: str) -> None:
    spec = _spec()
    if spec is None or spec[0] != name:
        return
    with _LOCK:
        _COUNTS[name] = _COUNTS.get(name, 0) + 1
        hit = _COUNTS[name] == spec[1]
    once = os.environ.get("DRAFTLINE_FAULT_ONCE_DIR")
    if hit and once:
        try:
            os.close(os.open(os.path.join(once, f"fired-{name}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            hit = False
    if hit:
        os.killpg(os.getpgid(0), spec[2])
        if spec[2] != signal.SIGKILL:
            return  # a catchable signal: the run's own handler takes it from here
        threading.Event().wait()  # SIGKILL is asynchronous: never run past the point


class InjectedFault(DraftlineError, RuntimeError):
    """A fault a drill asked for (`fail_point`); the next attempt succeeds."""


def fail_point(stage: str, item: int, digest: str) -> None:
    """Raise `InjectedFault` the first time item `item` of `stage` (addressed by `digest`) is attempted, when
    DRAFTLINE_FAULT_<STAGE>_SHARDS lists it; every later attempt goes through."""
    env = f"DRAFTLINE_FAULT_{stage.upper()}_SHARDS"
    listed = os.environ.get(env, "")
    if str(item) not in {s.strip() for s in listed.split(",")}:
        return
    marker = Path(os.environ.get("DRAFTLINE_FAULT_DIR") or tempfile.gettempdir()) / f"draftline-fault-{stage}-{digest}"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    raise InjectedFault(f"injected fault in {'extraction' if stage == 'extract' else stage} shard {item} "
                        f"({env}={listed}); a retry of the run succeeds")
