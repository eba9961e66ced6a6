"""`draftline retry` treats a run's parameters as untrusted: any Prefect API user can create a run or edit one's
parameters, and a local run (no deployment) is re-run in the user's own process. So retry re-runs here only runs
this machine started (flows/started_runs.py keeps their parameters), shows what differs from that record, and
refuses a change that would run a repository's code or send data elsewhere unless the user accepts it; `last` is
the newest run this machine started, for retry, check and export. Against a real Prefect server."""

from __future__ import annotations

import datetime as dt
import uuid

import httpx
import pytest
from typer.testing import CliRunner

from cli.app import app

CONFIG = "configs/demo.yaml"
EVIL = ["target.trust_remote_code=true", "target.model=evil-org/planted-code"]


def _create(api: str, flow_id, params: dict, state: dict) -> uuid.UUID:
    r = httpx.post(f"{api}/flow_runs/", json={"flow_id": str(flow_id), "parameters": params, "state": state})
    assert r.status_code == 201, r.text
    return uuid.UUID(r.json()["id"])


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_retry_reruns_here_only_what_this_machine_started_as_it_started_it(prefect_server, monkeypatch, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from cli.commands.runs import local_rerun_problem
    from cli.drafts import run_train_digest
    from flows.started_runs import record_started
    from tasks.benchmark.serve import ExportError
    from tasks.store.artifacts import Store

    monkeypatch.setenv("DRAFTLINE_HOME", str(tmp_path / "home"))  # this machine's record starts empty
    api = prefect_server.api_url
    failed = {"type": "FAILED", "name": "Failed"}
    with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as c:
        flow_id = c.create_flow_from_name("draftline")
        before = {r.id for r in c.read_flow_runs(limit=200)}
        try:
            # another API user's failed run: remote code from a hub id of theirs
            theirs = _create(api, flow_id, {"config_path": CONFIG, "overrides": EVIL, "until": "prepare"}, failed)
            out = CliRunner().invoke(app, ["retry"])  # `last`: none of this machine's
            assert out.exit_code == 2 and "no run on" in out.output
            assert "was started from this machine" in _flat(out.output)
            out = CliRunner().invoke(app, ["retry", str(theirs)])
            assert out.exit_code == 2 and "was not started from this machine" in _flat(out.output), out.output
            assert "running it again here" not in out.output
            # check/export of that run would load its target with remote code: refused too
            with pytest.raises(ExportError, match="parameters this machine did not record"):
                run_train_digest(Store(f"file://{tmp_path / 'store'}"), str(theirs))

            # this machine's own failed run; someone schedules another run in the future, which `last` must not mean
            mine_params = {"config_path": CONFIG, "overrides": ["data.max_samples=8"], "until": "prepare"}
            mine = _create(api, flow_id, mine_params, failed)
            record_started(mine, mine_params)
            later = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1)).isoformat()
            _create(api, flow_id, {"config_path": CONFIG, "overrides": EVIL, "until": None},
                    {"type": "SCHEDULED", "name": "Scheduled", "state_details": {"scheduled_time": later}})
            run = c.read_flow_run(mine)
            assert local_rerun_problem(run, dict(run.parameters), accept=False) == ([], None)  # as started: it runs

            # its parameters edited on the server after it started: refused, with what changed
            edited = dict(mine_params, overrides=mine_params["overrides"] + EVIL)
            r = httpx.patch(f"{api}/flow_runs/{mine}", json={"parameters": edited})
            assert r.status_code == 204, r.text
            assert c.read_flow_run(mine).parameters == edited
            out = CliRunner().invoke(app, ["retry"])  # `last` = this machine's run, not the one scheduled later
            text = _flat(out.output)
            assert out.exit_code == 2, out.output
            assert f"{run.name}'s parameters differ from what this machine recorded" in text
            assert "overrides: + target.trust_remote_code=true" in text
            assert "overrides: + target.model=evil-org/planted-code" in text
            assert "target.trust_remote_code is on for evil-org/planted-code (recorded: off)" in text
            assert "--accept-changed-parameters" in text and "running it again here" not in text
            # a store elsewhere is refused the same way; a change of neither is shown and runs
            moved = dict(mine_params, overrides=mine_params["overrides"] + ["store.uri=s3://elsewhere/x"])
            diff, problem = local_rerun_problem(run, moved, accept=False)
            assert diff == ["overrides: + store.uri=s3://elsewhere/x"] and "store.uri 's3://elsewhere/x'" in problem
            assert local_rerun_problem(run, moved, accept=True)[1] is None  # the user's explicit decision
            diff, problem = local_rerun_problem(run, dict(mine_params, until="vocab"), accept=False)
            assert diff == ['until: "prepare" -> "vocab"'] and problem is None
        finally:  # its runs (one scheduled in the future) must not stay the newest on the session's server
            for r in c.read_flow_runs(limit=200):
                if r.id not in before:
                    c.delete_flow_run(r.id)
