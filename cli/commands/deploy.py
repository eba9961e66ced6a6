"""`draftline deploy` and `draftline submit`: work pools and deployments from
deployments/prefect.yaml, the automation that marks a run Crashed when its heartbeats stop (on any
host), the store's credentials block, and a run started on a pool with its config checked here first.

    draftline deploy [--name b300]               pools + deployments + the crash automation
    draftline submit CONFIG --deployment b300    start a run on a work pool"""

from __future__ import annotations

# Prefect is imported inside the functions that use it: it takes seconds to import (heavy), and every
# command's --help would wait for it.

import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import typer
import yaml
from rich.table import Table

from cli.console import ROOT, JsonOpt, SetOpt, TimeoutOpt, console, err
from cli.prefect_api import (
    HEARTBEAT_SECONDS,
    RELEASE_STEP,
    api_url,
    client,
    deployment_config,
    require_server,
    run_url,
    state_of,
    wait_for,
)
from flows.flow_runs import EXTRACT_FLOW, FLOW_NAME, OpsError, slice_deployment
from tasks.train.preflight import remote_code_problem, remote_code_tag
from flows.release import code_commit
from flows.started_runs import record_started
from tasks.core.config import STAGES
from tasks.core.config_load import STORE_URI_ENV, load_config
from tasks.core.stages import check_until
from tasks.core.secrets import WORKER_FIX, refuse_secrets
from tasks.store.location import s3_endpoint

PREFECT_FILE = ROOT / "deployments" / "prefect.yaml"

TEMPLATES = ROOT / "deployments" / "job-templates"

# The server-side crash detection `draftline deploy` sets up (a Prefect automation on heartbeats).
CRASH_AUTOMATION = "draftline-crash-silent-runs"

CRASH_AFTER = 90


def load_deployments() -> list[dict[str, Any]]:
    spec = yaml.safe_load(PREFECT_FILE.read_text())
    return list(spec.get("deployments") or [])


def pool_spec(dep: dict[str, Any]) -> tuple[str, str, Path]:
    """(pool name, worker type, base job template) of a deployment in prefect.yaml."""
    wp = dep.get("work_pool") or {}
    name = wp.get("name")
    if not name:
        raise OpsError(f"deployment {dep.get('name')!r} in {PREFECT_FILE} names no work pool")
    kind = "docker" if "gpus" in (wp.get("job_variables") or {}) else "process"  # gpus: the docker pool's only
    template = TEMPLATES / ("docker-gpu.json" if kind == "docker" else "process.json")
    return name, kind, template


def pool_template(template: Path, image: str | None = None) -> dict[str, Any]:
    """A pool's base job template: the file's, with the operator's worker image (`deploy --image`) in a docker
    template's job configuration (a run cannot choose the image: it is no job variable)."""
    base = json.loads(template.read_text())
    if image and "image" in base["job_configuration"]:
        base["job_configuration"]["image"] = image
    return base


def ensure_pool(c: Any, name: str, kind: str, template: Path, update: bool, image: str | None = None) -> str:
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    base = pool_template(template, image if kind == "docker" else None)
    try:
        pool = c.read_work_pool(name)
    except ObjectNotFound:
        c.create_work_pool(WorkPoolCreate(name=name, type=kind, base_job_template=base))
        return "created"
    if pool.type != kind:
        raise OpsError(f"work pool {name!r} exists with type {pool.type!r}, this deployment needs {kind!r}; "
                       f"delete it (prefect work-pool delete {name}) or rename the pool in {PREFECT_FILE}")
    if update and pool.base_job_template != base:
        c.update_work_pool(name, WorkPoolUpdate(base_job_template=base))
        return "template updated"
    held = (pool.base_job_template or {}).get("job_configuration", {}).get("image")
    if image and kind == "docker" and held != image:
        raise OpsError(f"work pool {name!r} runs the image {held!r}, not {image!r}: the image is the pool's, set by "
                       "its operator; pass --update-pools to change it")
    return "exists"


def deploy(names: list[str] = typer.Option([], "--name", "-n", help="Deployment(s) to register (default: all in "
                                                                   "deployments/prefect.yaml)."),
           image: Optional[str] = typer.Option(None, help="Worker image of the docker pool, set in its job "
                                                          "template when the pool is created (with --update-pools: "
                                                          "changed), e.g. ghcr.io/ORG/draftline-worker:0.1.0."),
           store: Optional[str] = typer.Option(None, "--store", help="Default store_uri job variable of the "
                                                                     "deployments (s3://BUCKET/PREFIX)."),
           update_pools: bool = typer.Option(False, "--update-pools", help="Overwrite existing pools' job "
                                                                            "templates with deployments/job-templates/."),
           save_s3_credentials: Optional[str] = typer.Option(
               None, "--save-s3-credentials", metavar="BLOCK",
               help="Also save AWS_ACCESS_KEY_ID/SECRET/ENDPOINT from this environment as a prefect-aws "
                    "AwsCredentials block (the docker deployment reads `draftline-store`)."),
           crash_after: int = typer.Option(
               CRASH_AFTER, "--crash-after", metavar="SECONDS",
               help="The server marks a draftline flow run Crashed when its heartbeats (every 30 s) stop for "
                    "this long: a lost node, on any host (a Prefect automation, created or updated here)."),
           remote_code: list[str] = typer.Option(
               [], "--allow-trust-remote-code", metavar="REPO",
               help="Let runs of these deployments set target.trust_remote_code for the hub repository REPO (e.g. "
                    "moonshotai/Kimi-K2.5, which configs/kimi-k2.5-b300.yaml needs): its own Python code runs on "
                    "the nodes. Repeat for several; without it such a run is refused."),
           as_json: bool = JsonOpt):
    """Create the work pools, register the deployments of deployments/prefect.yaml, and the automation
    that marks a flow run Crashed when its node stops sending heartbeats."""
    refuse_secrets({"store": store}, "draftline deploy")
    url = require_server("draftline deploy")
    deps = load_deployments()
    known = [d["name"] for d in deps]
    chosen = [d for d in deps if not names or d["name"] in names]
    missing = [n for n in names if n not in known]
    if missing:
        raise OpsError(f"no deployment {', '.join(missing)} in {PREFECT_FILE}; choose from {', '.join(known)}")
    if save_s3_credentials:
        save_credentials_block(save_s3_credentials)
        (err if as_json else console).print(f"saved AwsCredentials block {save_s3_credentials!r} (keys not shown)")
    if crash_after < 2 * HEARTBEAT_SECONDS:
        raise OpsError(f"--crash-after {crash_after}: flow runs send a heartbeat every {HEARTBEAT_SECONDS} s; "
                       f"give at least {2 * HEARTBEAT_SECONDS} (default {CRASH_AFTER})")
    rows = []
    with client() as c:
        for d in chosen:
            pool, kind, template = pool_spec(d)
            rows.append((f"{flow_of(d)}/{d['name']}", pool, kind, ensure_pool(c, pool, kind, template,
                                                                             update_pools, image)))
        automation = ensure_crash_automation(c, crash_after)
    _prefect_deploy(chosen, store=store, remote_code=remote_code)
    if as_json:
        print(json.dumps({"api_url": url, "automation": {"name": CRASH_AUTOMATION, "status": automation,
                                                         "crash_after_s": crash_after},
                          "deployments": [{"deployment": n, "work_pool": p, "type": k, "pool": h}
                                          for n, p, k, h in rows]}, indent=2))
        return
    table = Table(title=f"deployments on {url}")
    for col in ("deployment", "work pool", "type", "pool", "start a worker"):
        table.add_column(col, overflow="fold")
    for name, pool, kind, how in rows:
        start = (f"prefect worker start --pool {pool}" if name.endswith("/local")
                 else "infra/node-bootstrap.sh" + (" --docker" if kind == "docker" else ""))
        table.add_row(name, pool, kind, how, start)
    console.print(table)
    console.print(f"automation {CRASH_AUTOMATION!r} ({automation}): a flow run silent for {crash_after} s "
                  "(no heartbeat) is marked Crashed")
    console.print("next: draftline submit CONFIG --deployment NAME")


def flow_of(dep: dict[str, Any]) -> str:
    """The flow name of a deployment in prefect.yaml (from its entrypoint)."""
    return EXTRACT_FLOW if dep.get("entrypoint", "").endswith(":extract_slice") else FLOW_NAME


def crash_automation(within_s: int) -> Any:
    """Prefect's own crash detection for flow runs on any host: after a heartbeat of a draftline flow run,
    the server expects another heartbeat (or a final state) within `within_s`; when none comes the
    automation sets the run Crashed. Flow runs send heartbeats when PREFECT_FLOWS_HEARTBEAT_FREQUENCY is
    set: the job templates set it (heartbeat_seconds, 30)."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    ends = [f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")]
    return AutomationCore(
        name=CRASH_AUTOMATION,
        description="Marks a draftline flow run Crashed when its heartbeats stop (its node or process died); "
                    "`draftline retry` then re-runs what did not finish. Created by `draftline deploy`.",
        trigger=EventTrigger(
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.role": "flow", "prefect.resource.name": [FLOW_NAME, EXTRACT_FLOW]},
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *ends},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=dt.timedelta(seconds=within_s),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"no heartbeat for {within_s} s: its node or process died "
                                            f"(automation {CRASH_AUTOMATION!r}); `draftline retry` re-runs what "
                                            "did not finish")],
    )


def ensure_crash_automation(c: Any, within_s: int) -> str:
    want = crash_automation(within_s)
    found = c.read_automations_by_name(CRASH_AUTOMATION)
    if not found:
        c.create_automation(want)
        return "created"
    first, *extra = found
    for a in extra:
        c.delete_automation(a.id)
    if first.trigger.within != want.trigger.within or not first.enabled or extra:
        c.update_automation(first.id, want)
        return "updated"
    return "exists"


def deploy_spec(deps: list[dict[str, Any]], store: str | None, remote_code: list[str] = ()) -> dict[str, Any]:
    """prefect.yaml with only DEPS, carrying --store, the tags of --allow-trust-remote-code (the operator's
    decision, tasks/train/preflight.py) and this checkout's commit in each release pull step (nodes then must run this
    commit, not only this version: flows/release.py)."""
    spec = yaml.safe_load(PREFECT_FILE.read_text())
    commit = code_commit(ROOT)
    for dep in deps:
        dep["tags"] = list(dep.get("tags") or []) + [remote_code_tag(r) for r in remote_code
                                                     if remote_code_tag(r) not in (dep.get("tags") or [])]
        jv = dep.setdefault("work_pool", {}).setdefault("job_variables", {})
        if store:
            jv["store_uri"] = store
        refuse_secrets(jv, f"{PREFECT_FILE.name} deployment {dep.get('name')}" + (" with --store" if store else ""),
                       "work_pool.job_variables")
        for step in dep.get("pull") or []:
            if commit and isinstance(step.get(RELEASE_STEP), dict):
                step[RELEASE_STEP]["commit"] = commit
    spec["deployments"] = deps
    return spec


def _prefect_deploy(deps: list[dict[str, Any]], store: str | None, remote_code: list[str] = ()) -> None:
    """`prefect deploy` of the chosen deployments, from the repository root (so that `local`
    records this checkout as its code folder). A temporary copy of prefect.yaml carries
    --store (prefect's own --job-variable flag drops the file's other job variables), and this checkout's
    commit in each release pull step."""
    spec = deploy_spec(deps, store, remote_code)
    prefect = Path(sys.executable).parent / "prefect"
    cmd = [str(prefect) if prefect.exists() else "prefect", "--no-prompt", "deploy", "--all"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="draftline-deploy-", delete=False) as fh:
        yaml.safe_dump(spec, fh, sort_keys=False)
        tmp = fh.name
    try:
        out = subprocess.run([*cmd, "--prefect-file", tmp], cwd=ROOT, capture_output=True, text=True, timeout=900)
    finally:
        os.unlink(tmp)
    text = out.stdout + out.stderr
    done = text.count("successfully created")
    if out.returncode != 0 or done < len(deps):
        raise OpsError(f"`prefect deploy` registered {done} of {len(deps)} deployment(s) (exit {out.returncode}):\n"
                       + text.strip()[-2500:])


def save_credentials_block(name: str) -> None:
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not key or not secret:
        raise OpsError("--save-s3-credentials reads AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY from the "
                       "environment; set both")
    from prefect_aws import AwsCredentials
    from prefect_aws.client_parameters import AwsClientParameters

    endpoint = s3_endpoint()
    block = AwsCredentials(aws_access_key_id=key, aws_secret_access_key=secret,
                           region_name=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"),
                           aws_client_parameters=AwsClientParameters(endpoint_url=endpoint) if endpoint else
                           AwsClientParameters())
    block.save(name, overwrite=True)


def check_slice_deployment(c: Any, cfg: Any, dep: Any) -> str:
    """The deployment that a run of DEP with extract.nodes > 1 sends its slices to, checked to exist."""
    from prefect.exceptions import ObjectNotFound

    full = slice_deployment(cfg, dep.name)
    try:
        c.read_deployment_by_name(full)
    except ObjectNotFound:
        raise OpsError(f"extract.nodes={cfg.extract.nodes} sends slices of the shards to {full}, which is not "
                       f"registered on {api_url()}: `draftline deploy --name {full.split('/', 1)[1]}` registers it "
                       "(or set extract.deployment to one that exists)") from None
    return full


def _env_pairs(items: list[str]) -> dict[str, str]:
    env = {}
    for it in items:
        if "=" not in it:
            raise OpsError(f"--env {it!r}: expected NAME=VALUE")
        k, v = it.split("=", 1)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise OpsError(f"--env {it!r}: {k!r} is not a valid environment variable name")
        env[k] = v
    # The job variables are readable by every Prefect API user: keys belong in the worker's environment.
    refuse_secrets(env, "draftline submit --env", "env", fix=WORKER_FIX)
    return env


def refuse_unnamed_env(pool: Any, env: dict[str, str]) -> None:
    """A run's environment may hold only the names its pool's template declares (deployments/job-templates/: a
    run never sets what the node executes, its loader or its Prefect API); the server would refuse the rest."""
    spec = ((getattr(pool, "base_job_template", None) or {}).get("variables") or {}).get("properties", {}).get("env")
    if not isinstance(spec, dict) or spec.get("additionalProperties") is not False:
        return  # a pool whose operator allows any name
    named = sorted(spec.get("properties") or {})
    bad = sorted(set(env) - set(named))
    if bad:
        raise OpsError(f"--env {', '.join(bad)}: work pool {pool.name}'s template lets a run set only "
                       f"{', '.join(named)}; set anything else in the worker's environment on the node (its "
                       "operator's, infra/node-bootstrap.sh), or have the pool's operator add the name to "
                       "deployments/job-templates/ and run `draftline deploy --update-pools`")


def submit(config: Path = typer.Argument(..., help="YAML config (validated here before it is sent)."),
           deployment: str = typer.Option(..., "--deployment", "-d", help="local, b300, b300-docker (or FLOW/NAME)."),
           overrides: list[str] = SetOpt,
           until: Optional[str] = typer.Option(None, help=f"Stop after this stage: {', '.join(STAGES)}."),
           store: Optional[str] = typer.Option(None, "--store", help="Store for this run (job variable store_uri), "
                                                                     "e.g. s3://BUCKET/PREFIX."),
           gpus: Optional[int] = typer.Option(None, "--gpus", help="GPUs for this run: the first N of the node "
                                                                   "(process pools) or a count (docker pool)."),
           env: list[str] = typer.Option([], "--env", "-e", help="Extra environment for the run: NAME=VALUE."),
           inline: Optional[bool] = typer.Option(None, "--inline/--by-path",
                                                 help="Send the config's content, or only its path (default: path "
                                                      "when the deployment's workers hold the same file; "
                                                      "--by-path refuses one that differs)."),
           name: Optional[str] = typer.Option(None, "--name", help="Flow run name (default: Prefect's)."),
           watch: bool = typer.Option(False, "--watch", help="Wait for the run to finish; exit 1 unless it completed."),
           timeout: Optional[float] = TimeoutOpt,
           as_json: bool = typer.Option(False, "--json", help="Print {id, name, ui_url, state} as JSON.")):
    """Start a run of a deployment: parameters = the config (path or content) plus --set overrides. A config
    inside this checkout travels as its path only when the deployment's workers hold the same file (the
    release commit `draftline deploy` recorded); one you edited travels as its content."""
    from prefect.deployments import run_deployment

    refuse_secrets({"store": store, "env": _env_pairs(env)}, "draftline submit")  # before anything is sent
    require_server("draftline submit")
    check_until(until)
    cfg = load_config(config, overrides)  # fail here, not on the node
    full = deployment if "/" in deployment else f"{FLOW_NAME}/{deployment}"
    with client() as c:
        from prefect.exceptions import ObjectNotFound

        try:
            dep = c.read_deployment_by_name(full)
        except ObjectNotFound:
            raise OpsError(f"no deployment {full} on {api_url()}; `draftline deploy --name "
                           f"{full.split('/', 1)[1]}` registers it") from None
        problem = remote_code_problem(cfg.target.trust_remote_code, full, list(dep.tags or []), cfg.target.model)
        if problem:  # the run would be refused on the node: say so now
            raise OpsError(problem)
        # the config that runs is the one validated here: inlined unless the workers hold the same file
        params, file_store, inlined_why = deployment_config(config, overrides, inline, dep.pull_steps)
        params["until"] = until
        pool = c.read_work_pool(dep.work_pool_name) if dep.work_pool_name else None
        job_vars = _job_variables(full, dep, pool, overrides, store, file_store, gpus, env)
        online = []
        if pool is not None:
            online = [w.name for w in c.read_workers_for_work_pool(pool.name)
                      if getattr(w.status, "value", str(w.status)) == "ONLINE"]
        slices = check_slice_deployment(c, cfg, dep) if cfg.extract.nodes > 1 else None
        run = run_deployment(full, parameters=params, job_variables=job_vars or None, timeout=0,
                             flow_run_name=name, tags=[f"config:{config.name}"])
        record_started(run.id, params)  # `last` of retry/check/export: the newest run this machine started
        store_note = job_vars.get("store_uri") or (dep.job_variables or {}).get("store_uri") or \
            f"the worker's {STORE_URI_ENV} (if set; else {cfg.store.uri})"
        info = {"id": str(run.id), "name": run.name, "deployment": full, "ui_url": run_url(run.id),
                "store": store_note, "state": state_of(run),
                "config": params["config_path"] or "inlined", "inlined_because": inlined_why}
        if not as_json:
            _print_submitted(info, config, params, cfg, pool, online, slices)
        if watch:
            run = wait_for(c, run.id, timeout, quiet=as_json)
            info["state"] = state_of(run)
    if as_json:
        print(json.dumps(info))
    if watch and info["state"] != "COMPLETED":
        raise typer.Exit(1)


def _job_variables(full: str, dep: Any, pool: Any, overrides: list[str], store: str | None, file_store: str | None,
                   gpus: int | None, env: list[str]) -> dict[str, Any]:
    """The run's job variables: its store (--store, or a store.uri the config names other than the default), its
    GPUs (a count on a docker pool, the first N ids on a process pool) and --env (only names the pool's template
    lets a run set). A docker pool's run needs an s3:// store: a container's file:// store vanishes with it."""
    job_vars: dict[str, Any] = {}
    if store or (file_store and file_store != "file://.draftline/store"):
        job_vars["store_uri"] = store or file_store
    if gpus is not None:
        if gpus < 0:
            raise OpsError("--gpus must be 0 or more")
        if pool is not None and pool.type == "docker":
            job_vars["gpus"] = gpus
        else:
            job_vars["gpu_ids"] = ",".join(str(i) for i in range(gpus))
    if env:
        job_vars["env"] = _env_pairs(env)
        refuse_unnamed_env(pool, job_vars["env"])
    if pool is not None and pool.type == "docker":
        chosen = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("store.uri=")), None)
        chosen = chosen or job_vars.get("store_uri") or (dep.job_variables or {}).get("store_uri")
        if not chosen or not str(chosen).startswith("s3://"):
            raise OpsError(f"{full} runs in containers: give it a shared store (--store s3://BUCKET/PREFIX, "
                           "or `draftline deploy --store ...`); a file:// store would vanish with the container")
    return job_vars


def _print_submitted(info: dict[str, Any], config: Path, params: dict[str, Any], cfg: Any, pool: Any,
                     online: list[str], slices: Any) -> None:
    """What `submit` says on the terminal: the run, its config and store, and what would keep it waiting."""
    console.print(f"submitted [bold]{info['name']}[/] ({info['id']}) to {info['deployment']}")
    console.print(f"  config {params['config_path'] or '(inlined) ' + config.name}, "
                  f"overrides {len(params['overrides'])}, store {info['store']}")
    if info["inlined_because"]:
        console.print(f"  sent the config's content: {info['inlined_because']}")
    if cfg.extract.nodes > 1:
        console.print(f"  regeneration and extraction over up to {cfg.extract.nodes} nodes: this run's node and child "
                      f"runs of {slices}")
        if pool is not None and len(online) < cfg.extract.nodes:
            err.print(f"[yellow]extract.nodes={cfg.extract.nodes} but pool {pool.name} has "
                      f"{len(online)} online worker(s)[/]: the run holds one node; a child that no node takes "
                      "within 30 s goes back to it (slower): start more workers or lower extract.nodes")
    if pool is not None and not online:
        err.print(f"[yellow]no worker is online in pool {pool.name}[/]: the run waits until one "
                  f"starts (prefect worker start --pool {pool.name}, or infra/node-bootstrap.sh)")
    if info["ui_url"]:
        console.print(f"  UI: {info['ui_url']}")
    console.print(f"  draftline status {info['id']}")
