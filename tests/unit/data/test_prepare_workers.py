"""prepare's encoding on worker processes (data.workers, tasks/data/encoding.py): an error met while encoding
surfaces as a one-process run raises it, no worker process outlives a failure, Ctrl-C or a killed parent, the
address does not depend on the count, and the default count follows the work and the cores.

That the pool writes the one-process artifact (rows, stats, address) at two counts is
tests/unit/data/test_prepare_stream.py's pinned test, run at workers 1 and 2."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jinja2
import psutil
import pytest

from tasks.address import digests
from tasks.core.config import DataConfig, RunConfig
from tasks.data.chat import make_masker
from tasks.data.encoding import auto_workers
from tasks.data.prepare import run_prepare
from tasks.store.artifacts import Store

ROOT = Path(__file__).resolve().parents[3]


def _refusing_template(tmp_path: Path) -> Path:
    """The demo target's own template, made to raise on any message that says BOOM."""
    own = make_masker(RunConfig()).tok.chat_template
    p = tmp_path / "refusing.jinja"
    p.write_text("{% for m in messages %}{% if 'BOOM' in m['content'] %}"
                 "{{ raise_exception('this template refuses BOOM') }}{% endif %}{% endfor %}" + own)
    return p


def _prompt_cfg(tmp_path: Path, workers: int) -> RunConfig:
    """Prompt-only rows (regenerate answers them later), the 41st of 60 says BOOM: encoding its prompt raises."""
    rows = tmp_path / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Question {i}" + (" BOOM" if i == 40 else "")}) + "\n"
                            for i in range(60)))
    return RunConfig.model_validate({
        "target": {"chat_template": str(_refusing_template(tmp_path))},
        "data": {"sources": [{"path": str(rows)}], "heldout": 2, "num_shards": 2, "seed": 1, "workers": workers}})


def _workers_of(proc: psutil.Process) -> list[psutil.Process]:
    """PROC's encoding workers (multiprocessing's spawned processes; not its resource tracker, which
    multiprocessing keeps for the life of the process)."""
    return [c for c in proc.children() if "multiprocessing.spawn" in " ".join(c.cmdline())
            and "resource_tracker" not in " ".join(c.cmdline())]


def test_an_error_in_a_worker_surfaces_as_in_one_process_and_leaves_no_worker(tmp_path, caplog):
    raised = {}
    for workers in (1, 2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="draftline.data"), \
                pytest.raises(jinja2.exceptions.TemplateError) as got:
            run_prepare(_prompt_cfg(tmp_path, workers), Store(f"file://{tmp_path}/store-{workers}"))
        raised[workers] = (type(got.value), str(got.value))
        said = "in this process" if workers == 1 else "on 2 worker processes"  # the log says how it encoded
        assert any(f"prepare: encoding up to 60 conversations {said} (set by data.workers)" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert not _workers_of(psutil.Process()), "a worker process outlived the failed prepare"
        assert not (tmp_path / f"store-{workers}" / "prepare").exists() or not any(
            (tmp_path / f"store-{workers}" / "prepare").rglob("manifest.json"))  # nothing committed
    assert raised[1] == raised[2] == (jinja2.exceptions.TemplateError, "this template refuses BOOM")


def test_the_address_and_the_artifact_do_not_depend_on_data_workers(tmp_path):
    cfg = _prompt_cfg(tmp_path, 1)
    addresses = {digests.prepare(cfg.model_copy(update={"data": cfg.data.model_copy(update={"workers": w})}))
                 for w in (None, 1, 2, 32)}
    assert len(addresses) == 1
    other = cfg.model_copy(update={"data": cfg.data.model_copy(update={"seed": 2})})
    assert digests.prepare(other) not in addresses  # a content key still moves it


@pytest.mark.parametrize("cores,conversations,expected", [
    (64, 1_000, 1), (64, 10_000, 5), (64, 600_000, 32), (2, 10_000, 2), (2, 3_000, 1)])
def test_the_default_worker_count_follows_the_work_and_the_cores(monkeypatch, cores, conversations, expected):
    """One worker per 2,000 conversations to encode, at most one per core and 32; a set count is used as is."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert auto_workers(DataConfig(), conversations) == expected
    assert auto_workers(DataConfig(workers=3), conversations) == 3


CHILD = r"""
import json, signal, sys
# Ctrl-C as a terminal's shell gives it: the default handler, not blocked. A child inherits an ignored SIGINT from
# whatever started it, and a suite started in the background (`make test &`: a non-interactive shell ignores SIGINT
# and SIGQUIT for a background command) hands it down to every process: Python then installs no KeyboardInterrupt,
# and this prepare ran on to FINISHED after the Ctrl-C (twice, in fresh-clone runs started that way).
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
signal.signal(signal.SIGINT, signal.default_int_handler)
from tasks.core.config import RunConfig
from tasks.data.prepare import run_prepare
from tasks.store.artifacts import Store
rows, store = sys.argv[1], sys.argv[2]
cfg = RunConfig.model_validate({"regenerate": {"enabled": False}, "target": {"max_model_len": 8192}, "data": {
    "sources": [{"path": rows}], "heldout": 2, "num_shards": 2, "workers": 2, "max_length": 6000}})
run_prepare(cfg, Store("file://" + store))
print("FINISHED")
"""


def _start_prepare(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    """A prepare of 5,000 long chats (~4,000 tokens each: ~20 s of encoding per worker after their start, so the
    run is still encoding when the test acts) on two workers in its own process group; returns once both run."""
    rows = tmp_path / "chats.jsonl"
    with open(rows, "w") as fh:
        for i in range(5_000):
            fh.write(json.dumps({"prompt": f"Tell me about {i}.", "response": f"{i} is a number. " * 800}) + "\n")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(rows), str(tmp_path / "store")], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        workers = _workers_of(psutil.Process(proc.pid))
        if len(workers) == 2 and all(w.cpu_times().user > 6 for w in workers):  # started, and encoding
            return proc, [w.pid for w in workers]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("the two encoding workers did not start within 120 s")


def _gone(pids: list[int], within: float) -> bool:
    deadline = time.time() + within
    while time.time() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.2)
    return False


def test_ctrl_c_stops_prepare_and_its_workers(tmp_path):
    """Ctrl-C at a terminal signals the whole foreground group: the workers ignore it, the parent stops and
    shuts the pool down; nothing is committed."""
    proc, workers = _start_prepare(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)
    # ~4 s alone or beside three busy loops; the bound only catches a hang, with room for a loaded 2-core machine.
    # A Ctrl-C ignored shows as FINISHED (the child sets up Ctrl-C as a terminal would: see CHILD).
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "FINISHED" not in out and "KeyboardInterrupt" in err, err[-2000:]
    assert _gone(workers, 5)
    assert not list((tmp_path / "store").rglob("manifest.json"))


def test_workers_exit_when_their_parent_is_killed(tmp_path):
    """A parent killed outright (SIGKILL, no cleanup) leaves no encoding worker running."""
    proc, workers = _start_prepare(tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    assert _gone(workers, 10), [psutil.Process(p).cmdline() for p in workers if psutil.pid_exists(p)]


def test_a_worker_killed_mid_run_fails_prepare_with_the_fix_and_leaves_no_worker(tmp_path):
    """A worker that dies (the OOM killer, a kill -9) fails the stage with an error that says what to do; the
    other worker is stopped and nothing is committed."""
    proc, workers = _start_prepare(tmp_path)
    os.kill(workers[0], signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "FINISHED" not in out, err[-2000:]
    assert "EncodingWorkerError: a prepare encoding worker process died or could not start" in err, err[-2000:]
    assert "set it to 1 to encode in this process" in err
    assert _gone(workers, 10)
    assert not list((tmp_path / "store").rglob("manifest.json"))
