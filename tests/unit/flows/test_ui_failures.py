"""What the Prefect UI shows is a view of the run, never a reason to fail it, and never silently gone: a bar or a
table the API refuses is said in the run's log (issue 44: no `except Exception: pass`)."""

from __future__ import annotations

import logging

from prefect.client.orchestration import get_client

from flows.report_artifacts import Progress


def test_a_progress_bar_the_api_lost_is_said_once_and_the_run_goes_on(prefect_server, caplog):
    bar = Progress("rooms-progress", "a bar whose artifact is deleted under it")
    assert bar.id is not None
    bar.update(10.0)
    with get_client(sync_client=True) as c:  # the real fault: the artifact is gone from the server
        c.delete_artifact(bar.id)
    with caplog.at_level(logging.WARNING, logger="draftline.ui"):
        bar.update(50.0)
        bar.update(100.0)  # a second failure is not said again
    said = [r.getMessage() for r in caplog.records if r.name == "draftline.ui"]
    assert len(said) == 1 and "'rooms-progress' not updated" in said[0], said
    assert "ObjectNotFound" in said[0] or "404" in said[0] or "not found" in said[0].lower(), said
