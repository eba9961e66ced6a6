"""The process worker of a draftline node: Prefect's own, with a flow run's job variables checked against its
pool's template before anything starts.

    python -m flows.node_worker --pool draftline-b300 --name draftline@HOST --limit 1

(the arguments of `prefect worker start`; infra/node-bootstrap.sh starts it so). The pool's template
(deployments/job-templates/process.json) declares what a run may choose, with `additionalProperties: false`
and `env` limited to named keys. Prefect 3.7.7's server checks a run's job variables against it when the run
is created through its deployment (`POST /deployments/{id}/create_flow_run`) or updated, but not when it is
created through the older `POST /flow_runs/` with a `deployment_id`, a `work_pool_name` and `job_variables`;
its worker then merges that run's `env` into the process's environment whatever the template says (a
`LD_PRELOAD` or `PYTHONPATH` would run code on the node). This worker applies the template's schema itself:
such a run is marked Crashed with the refused names, and no process is started for it.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from prefect.cli import app
from prefect.utilities.schema_tools import validate
from prefect.workers.process import ProcessJobConfiguration, ProcessWorker


def job_variable_problems(base_job_template: dict[str, Any], values: dict[str, Any]) -> list[str]:
    """What in a run's job variables VALUES its pool's template does not allow, as the server would say it; []
    when the template declares no variables schema (the pool's operator chose so)."""
    schema = (base_job_template or {}).get("variables")
    if not schema:
        return []
    errors = validate(values, schema, raise_on_error=False, preprocess=True, ignore_required=True,
                      allow_none_with_default=True)
    return [f"{'.'.join(map(str, e.absolute_path)) or 'job variables'}: {e.message}" for e in errors]


class NodeJobConfiguration(ProcessJobConfiguration):
    @classmethod
    async def from_template_and_values(cls, base_job_template: dict[str, Any], values: dict[str, Any],
                                       client: Any = None):
        problems = job_variable_problems(base_job_template, values)
        if problems:
            raise ValueError("this flow run's job variables are not allowed by its work pool's template, so it "
                             f"does not start: {'; '.join(problems)}. Fix: create the run through its deployment "
                             "with only the variables the pool declares (`draftline submit`), and set anything "
                             "else in the worker's environment")
        return await super().from_template_and_values(base_job_template, values, client=client)


with warnings.catch_warnings():  # it replaces Prefect's process worker in this process's registry, on purpose
    warnings.simplefilter("ignore")

    class NodeWorker(ProcessWorker):
        """Prefect's process worker whose runs' job variables must match the pool's template."""

        type = "process"
        job_configuration = NodeJobConfiguration


def main(argv: list[str]) -> int:
    sys.argv = ["prefect", "worker", "start", "--type", "process", *argv]
    return app() or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
