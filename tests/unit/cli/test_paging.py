"""`draftline status` over runs with more task runs than one page of Prefect's API (200 rows): every task run
is read, and the unfinished shards are exactly the ones listed (issue 43, item 4). Task runs are created
through the client (fast: no flow runs them) on a Prefect server of this module's own (`own_prefect_server`):
on the session's server these failed runs would be the newest, the `last` that other modules' tests read."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli.app import app


def a_run_with_shards(n: int, unfinished: set[int], landing: set[int] = frozenset()) -> str:
    """A flow run with N extraction-shard task runs, the shards in UNFINISHED Failed, those in LANDING still Running
    (their final state not written yet), the others Completed."""
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Failed, Running

    @flow(name="draftline")
    def f():
        pass

    @task
    def extract_shard():
        pass

    with get_client(sync_client=True) as c:
        run = c.create_flow_run(f, state=Failed(message="shards not finished"))
        for s in range(n):
            state = Failed(message="lost") if s in unfinished else Running() if s in landing else Completed()
            c.create_task_run(extract_shard, run.id, dynamic_key=str(s), name=f"extract-shard-{s}", state=state)
    return str(run.id)


@pytest.mark.parametrize("n", [150, 450])
def test_status_reads_every_task_run_past_one_page(own_prefect_server, n):
    unfinished = {3, n // 2, n - 1}
    run_id = a_run_with_shards(n, unfinished)
    out = CliRunner().invoke(app, ["status", run_id, "--json"])
    assert out.exit_code == 0, out.output
    rep = json.loads(out.stdout)
    extract = rep["stages"]["extract"]
    assert extract["tasks"] == n and extract["states"] == {"Completed": n - 3, "Failed": 3}, extract
    assert extract["failed_shards"] == sorted(unfinished)
    assert sorted(t["name"] for t in rep["tasks"]) == sorted(f"extract-shard-{s}" for s in range(n))
    assert rep["settling"] == 0


@pytest.mark.parametrize("landing", [{5}, {5, 6, 7, 8}])
def test_status_says_when_a_finished_runs_task_states_have_not_all_landed(own_prefect_server, landing):
    """Right after a run ends, the server may still be writing its task runs' final states (they travel over
    Prefect's events stream): status says how many are not final and that its counts are not settled."""
    run_id = a_run_with_shards(20, {3}, landing)
    out = CliRunner().invoke(app, ["status", run_id, "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["settling"] == len(landing)
    out = CliRunner().invoke(app, ["status", run_id])
    assert out.exit_code == 0, out.output
    assert f"still writing {len(landing)} task runs' final states" in " ".join(out.output.split())


def test_paging_stops_at_a_short_page_and_never_asks_for_more_than_a_page():
    from cli.prefect_api import PAGE, paged

    rows = list(range(2 * PAGE + 5))
    asked = []

    def read(offset, limit, **kw):
        asked.append((offset, limit, kw))
        return rows[offset:offset + limit]

    assert paged(read, sort="ID_DESC") == rows
    assert asked == [(0, PAGE, {"sort": "ID_DESC"}), (PAGE, PAGE, {"sort": "ID_DESC"}),
                     (2 * PAGE, PAGE, {"sort": "ID_DESC"})]
