"""glibc's malloc arenas, bounded in a process that runs shards.

A shard runs on threads of its own (the engine's look-ahead, the part writers, the lease renewer, Prefect's
task thread), and glibc gives threads their own malloc arenas, up to 8 per core. Memory a thread frees stays in
its arena for reuse, so the flow process's resident memory grows with the shards it has run until the arena
count stops: measured on 256 local shards, the flow process's peak RSS was 1.36-1.40 GB with glibc's default,
1.14 GB with the arenas bounded at 4 and 1.05 GB (the 32-shard figure) with MALLOC_ARENA_MAX=2 set before the
process started (benchmarks/RESULTS.md "The Kimi preset's shape rehearsed on the CPUs"). On a node with 100+
cores glibc's own bound, 8 arenas per core, is never reached. Large buffers (hidden states, parts) are few and
long-lived: the bounded runs above were not slower (60 s at 4 arenas against 68-88 s at the default, same
shared machine).

Where it is bounded: the deployments' job templates set MALLOC_ARENA_MAX for every flow-run process a worker
starts (job variable `malloc_arenas`, default 4: glibc reads it at the process's start, the strongest form);
`bound_arenas()` does the same at run time with mallopt, first thing in the `draftline` command (a local run's
flow runs in that process) and in every flow run (a worker whose pool predates the template). An explicit
`MALLOC_ARENA_MAX` in the environment is left alone; `DRAFTLINE_MALLOC_ARENAS=0` leaves glibc's default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger("draftline.arenas")

M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)
DEFAULT_ARENAS = 4


def bound_arenas(env: dict[str, str] | None = None) -> int | None:
    """Bound this process's malloc arenas (glibc on Linux); the bound set, or None when left as it was."""
    env = os.environ if env is None else env
    if sys.platform != "linux" or "MALLOC_ARENA_MAX" in env:
        return None
    raw = env.get("DRAFTLINE_MALLOC_ARENAS", str(DEFAULT_ARENAS))
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"DRAFTLINE_MALLOC_ARENAS={raw!r} is not a whole number: set it to the arenas to allow "
                         "(e.g. 2), or 0 to leave glibc's default") from None
    if n <= 0:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(M_ARENA_MAX, n)
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): nothing to bound
        return None
    if not ok:
        log.debug("mallopt(M_ARENA_MAX, %d) refused", n)
        return None
    return n
