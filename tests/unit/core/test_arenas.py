"""glibc's malloc arenas bounded in the processes that run shards (tasks/core/arenas.py), and in the flow runs a
worker starts (the job templates' MALLOC_ARENA_MAX)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.core.arenas import DEFAULT_ARENAS, bound_arenas

ROOT = Path(__file__).resolve().parents[3]
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")


@linux_only
def test_bound_by_default_and_by_the_setting():
    assert bound_arenas({}) == DEFAULT_ARENAS
    assert bound_arenas({"DRAFTLINE_MALLOC_ARENAS": "2"}) == 2


def test_the_users_choice_is_left_alone():
    # glibc read MALLOC_ARENA_MAX at the process's start: the user's value stands
    assert bound_arenas({"MALLOC_ARENA_MAX": "8"}) is None
    assert bound_arenas({"DRAFTLINE_MALLOC_ARENAS": "0"}) is None


def test_a_bad_setting_names_the_fix():
    with pytest.raises(ValueError, match="DRAFTLINE_MALLOC_ARENAS='two' is not a whole number.*0 to leave"):
        bound_arenas({"DRAFTLINE_MALLOC_ARENAS": "two"})


ARENAS = """
import threading, ctypes
import cli.app  # noqa: F401  the command's module: it bounds the arenas as it is imported
gate = threading.Barrier(32)
def work():
    held = [bytearray(200_000) for _ in range(20)]  # glibc's malloc, in this thread's arena
    gate.wait()
ts = [threading.Thread(target=work) for _ in range(32)]
[t.start() for t in ts]
[t.join() for t in ts]
ctypes.CDLL(None).malloc_stats()  # glibc: one "Arena N:" block per arena, on stderr
"""


@linux_only
@pytest.mark.parametrize("bound", [2, 4])
def test_the_command_bounds_its_own_process(bound):
    """`draftline` bounds its arenas as it starts (a local run's flow runs in that process): with 32 threads
    allocating at once glibc makes no more arenas than the bound; left at its default, it makes more."""
    def arenas(setting: str) -> int:
        out = subprocess.run([sys.executable, "-c", ARENAS], cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(ROOT),
                                  "DRAFTLINE_MALLOC_ARENAS": setting})
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stderr.count("Arena ")

    assert 1 <= arenas(str(bound)) <= bound
    assert arenas("0") > 4  # glibc's own bound is 8 per core: 32 threads get many more


@pytest.mark.parametrize("template", ["process.json", "docker-gpu.json"])
def test_worker_flow_runs_get_the_bound(template):
    """Every flow-run process a worker starts has MALLOC_ARENA_MAX from the pool's template (job variable
    malloc_arenas), which a run may set and the schema checks."""
    t = json.loads((ROOT / "deployments" / "job-templates" / template).read_text())
    assert t["job_configuration"]["env"]["MALLOC_ARENA_MAX"] == "{{ malloc_arenas }}"
    var = t["variables"]["properties"]["malloc_arenas"]
    assert var["type"] == "integer" and var["default"] == DEFAULT_ARENAS and var["minimum"] == 1
