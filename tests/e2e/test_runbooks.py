"""Every command in the runbooks (README.md, docs/DEPLOY.md, docs/kimi-k2.5.md) runs, or at least parses.

The fenced bash blocks are read as a user would copy them. Each command goes to the real program:
- `draftline ...`: parsed by the typer app (a wrong flag, argument or --set key fails), and the cheap ones
  (`config show`, `plan`) run; the rest runs in tests/integration/test_deploy.py's deployment story and tests/e2e/test_e2e.py
  (`draftline weights CONFIG` in tests/unit/engine/test_weights.py);
- `prefect worker start ...`: parsed by Prefect's own CLI;
- `bash infra/node-bootstrap.sh ...`: run with `--check` and the exports shown above it in the same block,
  which must hold every variable the script requires (only the machine may lack something: GPUs, Python
  3.12, a Docker daemon);
- `infra/local-stack.sh up`, `source .draftline/stack/env.sh`, `draftline doctor`, `status`, `env`, `down`:
  run for real (slow test);
- `make TARGET`: the target exists (`make -n`); `docker build/push`: the docker client parses the flags (no
  daemon here: it fails connecting, not parsing).
A command of any other kind fails the test until it gets a handler here. docs/kimi-k2.5.md and docs/DEPLOY.md
list a node's steps in order: weights, bootstrap, doctor, submit, watch, retry.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cli.app import app
from tasks.core.config_load import load_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/DEPLOY.md", "docs/kimi-k2.5.md")
BIN = Path(sys.executable).parent


@dataclass
class Command:
    doc: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # `export`s earlier in the same block
    block: int = 0  # which fenced block of the doc

    def __str__(self) -> str:
        return f"{self.doc}: {shlex.join(self.argv)}"


def runbook_commands() -> list[Command]:
    out = []
    for doc in DOCS:
        for n, block in enumerate(re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), re.S)):
            env: dict[str, str] = {}
            for line in block.replace("\\\n", " ").splitlines():
                argv = shlex.split(line, comments=True)
                if not argv:
                    continue
                if argv[0] == "export":
                    env.update(a.split("=", 1) for a in argv[1:] if "=" in a)
                    continue
                out.append(Command(doc, argv, dict(env), n))
    return out


COMMANDS = runbook_commands()


def kind(cmd: Command) -> str:
    a = cmd.argv
    if a[:2] == ["sudo", "-E"]:
        a = a[2:]
    if a[0] in (".venv/bin/draftline", "draftline"):
        return "draftline"
    if a[0] == ".venv/bin/prefect":
        return "prefect"
    if a[:2] == ["bash", "infra/node-bootstrap.sh"]:
        return "bootstrap"
    if a[0] == "infra/local-stack.sh" or a[0] == "source" and a[1] == ".draftline/stack/env.sh":
        return "local-stack"
    if a[0] in ("make", "docker"):
        return a[0]
    return "unknown"


def test_the_runbooks_hold_the_commands_this_test_knows():
    kinds = {str(c): kind(c) for c in COMMANDS}
    assert "unknown" not in kinds.values(), [c for c, k in kinds.items() if k == "unknown"]
    found = set(kinds.values())
    assert {"draftline", "prefect", "bootstrap", "local-stack", "make", "docker"} <= found, found
    assert len(COMMANDS) > 50
    # the commands the issue found broken are there, fixed
    assert any(c.doc == "docs/kimi-k2.5.md" and c.argv[-2:] == ["--pool", "draftline-b300"] for c in COMMANDS)


# =========================================================================== the node's steps, in order

NODE_STEPS = ("weights", "bootstrap", "doctor", "submit", "watch", "retry")


def steps_of(cmd: Command) -> set[str]:
    """Which of the node's steps a command is (`submit --watch` is the submit and the watch)."""
    if kind(cmd) == "bootstrap":
        return set() if "--docker" in cmd.argv else {"bootstrap"}
    if kind(cmd) != "draftline":
        return set()
    sub = cmd.argv[1]
    watch = sub in ("status", "ui") or sub == "submit" and "--watch" in cmd.argv
    return ({sub} & set(NODE_STEPS)) | ({"watch"} if watch else set())


@pytest.mark.parametrize("doc", ["docs/kimi-k2.5.md", "docs/DEPLOY.md"])
def test_the_runbooks_list_the_nodes_steps_in_order(doc):
    """weights, bootstrap, doctor, submit, watch, retry: each step's command comes after the previous step's."""
    cmds = [c for c in COMMANDS if c.doc == doc]
    at = 0
    for step in NODE_STEPS:
        found = next((i for i in range(at, len(cmds)) if step in steps_of(cmds[i])), None)
        assert found is not None, f"{doc}: no `{step}` command after {cmds[at] if at else 'the start'}"
        at = found
    weights = next(c for c in cmds if "weights" in steps_of(c))
    assert weights.argv[1:] == ["weights", "configs/kimi-k2.5-b300.yaml"], weights


# =========================================================================== draftline

def parse(cmd, name: str, args: list[str], parent=None):
    """What the program does with ARGS before it runs anything: options, arguments, subcommands (typer's
    own click: its groups are not `click.Group`s)."""
    ctx = cmd.make_context(name, list(args), parent=parent)
    if hasattr(cmd, "resolve_command"):
        rest = [*getattr(ctx, "_protected_args", getattr(ctx, "protected_args", [])), *ctx.args]
        sub_name, sub, sub_args = cmd.resolve_command(ctx, rest)
        return parse(sub, sub_name, sub_args, ctx)
    return ctx


DRAFTLINE = [c for c in COMMANDS if kind(c) == "draftline"]

# Node-only commands that land from another branch: until their command is registered, the test checks their
# config argument and skips the parse (then they parse like every other command).
@pytest.mark.parametrize("cmd", DRAFTLINE, ids=[" ".join(c.argv[1:4]) for c in DRAFTLINE])
def test_draftline_commands_parse_with_their_exact_flags(cmd):
    ctx = parse(typer.main.get_command(app), "draftline", cmd.argv[1:])
    assert ctx.command.name == {"config": "show", "store": "init"}.get(cmd.argv[1], cmd.argv[1]), cmd  # the subcommand
    params = ctx.params
    config = params.get("config")
    if config is not None:  # a config path: it exists, and the --set overrides are valid keys and values
        assert (ROOT / config).is_file(), f"{cmd}: {config} does not exist"
        load_config(ROOT / config, list(params.get("overrides") or []))
    for key in ("store",):
        if params.get(key):
            assert str(params[key]).startswith("s3://"), cmd


CHEAP = [c for c in DRAFTLINE if c.argv[1] in ("plan", "ls") or c.argv[1:3] == ["config", "show"]
         or c.argv[1] == "gc" and "--dry-run" in c.argv]


@pytest.mark.parametrize("cmd", CHEAP, ids=[" ".join(c.argv[1:5]) for c in CHEAP])
def test_the_cheap_draftline_commands_run(cmd, tmp_path, monkeypatch):
    # ls and gc read the store: an empty one here (DRAFTLINE_STORE_URI sits above the config's store.uri)
    monkeypatch.setenv("DRAFTLINE_STORE_URI", f"file://{tmp_path}/store")
    out = CliRunner().invoke(app, cmd.argv[1:])
    assert out.exit_code == 0, f"{cmd}\n{out.output}"
    expect = {"plan": "| **total** |", "ls": "committed artifacts in", "gc": "leftover(s) found",
              "config": "benchmark:"}[cmd.argv[1]]
    assert expect in " ".join(out.output.split()) or expect in out.output, out.output


def test_prefect_commands_parse_with_prefects_own_cli():
    from prefect.cli._app import _app

    cmds = [c for c in COMMANDS if kind(c) == "prefect"]
    assert cmds
    for cmd in cmds:
        command, bound, _ = _app.parse_args(cmd.argv[1:], exit_on_error=False, print_error=False)
        assert command.__name__ == "start" and bound.arguments["work_pool_name"], cmd


# =========================================================================== infra/node-bootstrap.sh

BOOT = [c for c in COMMANDS if kind(c) == "bootstrap"]
MACHINE = ("nvidia-smi", "GPUs (nvidia-smi shows", "Python 3.12", "python3.12", "Docker daemon", "docker:",
           "NVIDIA Container Toolkit")


@pytest.mark.parametrize("cmd", BOOT, ids=[f"{c.doc} {' '.join(c.argv[3:])}" for c in BOOT])
def test_bootstrap_commands_have_their_flags_and_every_variable_they_need(cmd, tmp_path):
    argv = cmd.argv[2:] if cmd.argv[:2] == ["sudo", "-E"] else cmd.argv
    env = {k: (v if v != "..." else "value-from-the-doc") for k, v in cmd.env.items()}
    run_env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "DRAFTLINE_PREFIX": str(tmp_path / "opt"), **env}
    out = subprocess.run([*argv, "--check"], cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=120)
    assert "unknown option" not in out.stderr and "needs a value" not in out.stderr, f"{cmd}\n{out.stderr}"
    missing = [line[4:] for line in out.stderr.splitlines() if line.startswith("  - ")]
    not_machine = [m for m in missing if not any(s in m for s in MACHINE)]
    assert not not_machine, f"{cmd}: the doc's exports lack what the script needs: {not_machine}"
    assert out.returncode in (0, 2), out.stderr
    if out.returncode == 2:  # it stopped on the machine alone (this one has no GPU)
        assert missing, out.stderr


def test_the_scripts_required_variables_are_all_exported_in_the_runbooks():
    script = (ROOT / "infra" / "node-bootstrap.sh").read_text()
    header = script[script.index("# Required environment:"):script.index("# Optional:")]
    required = set(re.findall(r"\b((?:PREFECT|DRAFTLINE|AWS)_[A-Z_]+)", header)) - {"DRAFTLINE_SOURCE_DIR",
                                                                                     "AWS_PROFILE"}
    assert {"PREFECT_API_URL", "DRAFTLINE_STORE_URI", "DRAFTLINE_RELEASE", "DRAFTLINE_REPO"} <= required
    for doc in ("docs/DEPLOY.md", "docs/kimi-k2.5.md"):
        nodes = [c for c in BOOT if c.doc == doc and "--docker" not in c.argv]
        assert nodes, doc
        for c in nodes:
            assert required <= set(c.env), f"{c}: export {sorted(required - set(c.env))} before it"


# =========================================================================== make, docker

def test_make_targets_in_the_runbooks_exist():
    for cmd in (c for c in COMMANDS if kind(c) == "make"):
        out = subprocess.run(["make", "-n", *cmd.argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"{cmd}: {out.stderr}"


def test_docker_commands_parse():
    """The docker client parses the flags before it needs a daemon; there is none here (docs/DEPLOY.md)."""
    docker = shutil.which("docker")
    if not docker:
        pytest.skip("no docker client on this machine")
    for cmd in (c for c in COMMANDS if kind(c) == "docker"):
        out = subprocess.run([docker, *cmd.argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock"})
        text = out.stdout + out.stderr
        for usage_error in ("unknown flag", "unknown shorthand flag", "requires at least", "requires exactly",
                            "is not a docker command", "invalid argument"):
            assert usage_error not in text, f"{cmd}: {text[-500:]}"
        assert out.returncode != 125 and "Cannot connect to the Docker daemon" in text, f"{cmd}: {text[-500:]}"
        if cmd.argv[1] == "build":
            assert (ROOT / cmd.argv[cmd.argv.index("-f") + 1]).is_file()


# =========================================================================== the local stack, for real

@pytest.mark.slow
@pytest.mark.s3
def test_local_stack_sections_run_as_written(tmp_path):
    """docs/DEPLOY.md sections 1 and 2: `infra/local-stack.sh up`, `source .draftline/stack/env.sh`,
    `draftline doctor`; then the next block (a run until prepare on the stack's S3 store and Prefect server,
    `ls`, `ui`); then `status`, `env` and `down` (on free ports, state in a temp folder)."""
    from prefect_server import free_port
    from s3server import free_port_block

    stack = [c for c in COMMANDS if kind(c) == "local-stack"]
    assert [c.argv for c in stack if c.doc == "docs/DEPLOY.md"][:2] == [
        ["infra/local-stack.sh", "up"], ["source", ".draftline/stack/env.sh"]]
    state = tmp_path / "stack"
    env = {"PATH": f"{BIN}:{os.environ['PATH']}", "HOME": os.environ.get("HOME", "/root"),
           "DRAFTLINE_STACK_DIR": str(state), "DRAFTLINE_VENV": str(BIN.parent),
           "PREFECT_PORT": str(free_port()), "S3_PORT": str(free_port_block(5) + 3), "HF_HUB_OFFLINE": "1",
           "PREFECT_HOME": str(tmp_path / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    doctor = next(c for c in COMMANDS if c.doc == "docs/DEPLOY.md" and c.argv[1:] == ["doctor"])
    section2 = [c.argv for c in COMMANDS if c.doc == "docs/DEPLOY.md" and c.block == doctor.block + 1]
    assert [a[1] for a in section2] == ["run", "ls", "ui"], section2
    script = (f"set -e; infra/local-stack.sh up; source {state}/env.sh; {shlex.join(doctor.argv)}; "
              + "; ".join(shlex.join(a) for a in section2)
              + "; infra/local-stack.sh status; infra/local-stack.sh env >/dev/null")
    try:
        out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
        assert "ready" in out.stdout and "prefect running" in out.stdout and "weed running" in out.stdout
        assert "COMPLETED" in out.stdout and "s3://draftline/dev" in out.stdout  # the run, on the stack's store
        assert re.search(r"committed artifacts in s3://draftline/dev", out.stdout) and "prepare" in out.stdout
        assert f"http://127.0.0.1:{env['PREFECT_PORT']}" in out.stdout  # `draftline ui`
    finally:
        down = subprocess.run(["bash", "infra/local-stack.sh", "down"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
    assert "stopped the Prefect server" in down.stdout and "stopped SeaweedFS" in down.stdout, down.stdout


@pytest.mark.slow
def test_the_team_server_on_postgresql_runs_as_written():
    """docs/DEPLOY.md section 4: `export PREFECT_DB=postgres`, `infra/local-stack.sh up` and `status` start the
    Prefect server on a real PostgreSQL server (this machine's install), whose database then holds Prefect's
    tables and a flow run made through the API; `down` stops all three."""
    import tempfile

    from prefect_server import free_port
    from s3server import free_port_block

    block = [c for c in COMMANDS if c.doc == "docs/DEPLOY.md" and c.env.get("PREFECT_DB") == "postgres"]
    assert [c.argv for c in block] == [["infra/local-stack.sh", "up"], ["infra/local-stack.sh", "status"]], block
    state = Path(tempfile.mkdtemp(prefix="stack-pg-"))
    state.chmod(0o755)  # PostgreSQL runs as the postgres user when the tests run as root: it must reach it
    env = {"PATH": f"{BIN}:{os.environ['PATH']}", "HOME": os.environ.get("HOME", "/root"),
           "DRAFTLINE_STACK_DIR": str(state / "stack"), "DRAFTLINE_VENV": str(BIN.parent),
           "PREFECT_PORT": str(free_port()), "S3_PORT": str(free_port_block(5) + 3), "PG_PORT": str(free_port()),
           "PREFECT_HOME": str(state / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **block[0].env}
    made = (f"{BIN / 'python'} -c 'from prefect import flow; from prefect.client.orchestration import get_client\n"
            "with get_client(sync_client=True) as c: print(\"made\", c.create_flow_run(flow(lambda: 0, "
            "name=\"pg-probe\")).id)'")
    script = "set -e; " + "; ".join(shlex.join(c.argv) for c in block) + \
        f"; source {state}/stack/env.sh; {made}"
    try:
        out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
        assert "database: postgres" in out.stdout and "postgres running" in out.stdout, out.stdout
        run_id = re.search(r"made (\S+)", out.stdout).group(1)
        url = (state / "stack" / "postgres.url").read_text().strip()
        assert oct((state / "stack" / "postgres.url").stat().st_mode)[-3:] == "600"
        password = (state / "stack" / "postgres.password").read_text().strip()
        assert password not in out.stdout + out.stderr and password not in (state / "stack" / "env.sh").read_text()
        psql = subprocess.run(["psql", url.replace("postgresql+asyncpg", "postgresql"), "-tAc",
                               f"SELECT count(*) FROM flow_run WHERE id = '{run_id}'"],
                              capture_output=True, text=True, timeout=60)
        assert psql.stdout.strip() == "1", psql.stdout + psql.stderr  # the server's database is PostgreSQL
    finally:
        down = subprocess.run(["bash", "infra/local-stack.sh", "down"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
        shutil.rmtree(state, ignore_errors=True)
    assert "stopped PostgreSQL" in down.stdout, down.stdout
