"""Security checks: secrets stay in the environment; no code path runs untrusted code
or unpickles data by default.

The secret test runs a real piece of the pipeline (`draftline run --until vocab`: prepare and vocab,
their manifests, a markdown artifact, logs, task runs, flow parameters)
against the SeaweedFS store with a secret nobody else uses, then greps everything that was written.
"""

from __future__ import annotations

import ast
import json
import uuid
from pathlib import Path

import pytest
from tasks.core.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "tests/configs/deploy-small.yaml"
# Every Python source file the product ships or runs: cli/, flows/, tasks/ (all its packages), deployments/, benchmarks/.
SOURCES = sorted(p for d in ("cli", "flows", "tasks", "deployments", "benchmarks") for p in (ROOT / d).rglob("*.py"))


def test_the_checks_scan_every_source_file():
    """The AST checks below look at every source file, not a hand-picked few."""
    assert len(SOURCES) > 60
    for d in ("cli", "cli/commands", "flows", "tasks/core", "tasks/store", "tasks/engine", "tasks/train", "tasks/data", "benchmarks"):
        assert any(p.is_relative_to(ROOT / d) for p in SOURCES), d
    assert ROOT / "tasks/train/dist.py" in SOURCES and ROOT / "flows/caching.py" in SOURCES


@pytest.mark.s3
@pytest.mark.slow
def test_no_secret_reaches_the_store_prefect_or_the_logs(s3_server, prefect_server, monkeypatch, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from s3server import CANARY_ACCESS_KEY
    from warm import finish, start_draftline

    from tasks.store.artifacts import Store

    aws_secret = s3_server.canary_secret  # an identity of the S3 server that only this test uses
    hf_token = "hf_canary" + uuid.uuid4().hex
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", CANARY_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", aws_secret)
    monkeypatch.setenv("HF_TOKEN", hf_token)
    uri = f"s3://draftline-test/security-{uuid.uuid4().hex[:8]}"
    code, out, err = finish(start_draftline(["run", CONFIG, "--until", "vocab", "--json", "--set", f"store.uri={uri}",
                                             "--set", "vocab.draft_vocab_size=1024",
                                             "--set", "target.trust_remote_code=true"], tmp_path), tmp_path)
    assert code == 0, err[-4000:]
    run_id = json.loads(out)["flow_run_id"]
    # The same keys given as values instead: refused before any flow run is created, and not echoed.
    refused = tmp_path / "refused"
    refused.mkdir()
    code2, out2, err2 = finish(start_draftline(["run", CONFIG, "--until", "vocab", "--set",
                                                f"store.uri=s3://{CANARY_ACCESS_KEY}:{aws_secret}@draftline-test/x",
                                                "--set", f"engines.engine_args.hf_token={hf_token}"], refused), refused)
    assert code2 == 2 and "credential(s) given as values, refused" in err2, err2[-3000:]

    written: dict[str, bytes] = {"cli stdout": out.encode(), "cli stderr": err.encode(),
                                 "refused cli": (out2 + err2).encode()}
    store = Store(uri, {"client_kwargs": {"endpoint_url": s3_server.endpoint}})
    keys = store.fs.find(store.root)
    assert any(k.endswith("/manifest.json") for k in keys), keys
    assert not any("/_prefect/" in k for k in keys), keys  # Prefect keeps nothing on the store (flows/caching.py)
    written.update({k: store.fs.cat_file(k) for k in keys})
    with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}), get_client(sync_client=True) as c:
        runs = FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
        api = {
            "flow run": c.read_flow_run(run_id),
            "task runs": c.read_task_runs(flow_run_filter=runs),
            "logs": c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))),
            "artifacts": c.read_artifacts(flow_run_filter=runs),
            "blocks": c.read_block_documents(include_secrets=True),
            "every flow run": c.read_flow_runs(),  # parameters of all of them
        }
    for name, value in api.items():
        items = value if isinstance(value, list) else [value]
        written[f"prefect api: {name}"] = json.dumps([i.model_dump(mode="json") for i in items]).encode()
    for p in prefect_server.home.rglob("*"):  # the server's database (and WAL), its log, the client's files
        if p.is_file():
            written[f"prefect home: {p.relative_to(prefect_server.home)}"] = p.read_bytes()

    leaks = [name for name, blob in written.items() if aws_secret.encode() in blob or hf_token.encode() in blob]
    assert leaks == []
    # The grep looked at real content: the run's parameters, logs and artifacts are among it.
    assert CONFIG.encode() in written["prefect api: flow run"]
    messages = [log.message for log in api["logs"]]
    assert any("target.trust_remote_code is ON" in m for m in messages), messages  # and the warning is logged
    assert "draft-vocabulary" in {a.key for a in api["artifacts"]}


def test_trust_remote_code_is_off_unless_the_config_says_so():
    assert RunConfig().target.trust_remote_code is False
    for path in SOURCES:  # nothing switches it on by itself
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "trust_remote_code":
                assert not (isinstance(node.value, ast.Constant) and node.value.value is True), \
                    f"{path.name}:{node.lineno} passes trust_remote_code=True"


def _call_name(node: ast.Call) -> str:
    f = node.func
    parts = []
    while isinstance(f, ast.Attribute):
        parts.append(f.attr)
        f = f.value
    if isinstance(f, ast.Name):
        parts.append(f.id)
    return ".".join(reversed(parts))


def test_nothing_is_unpickled_from_files():
    """torch.load only with weights_only=True; no pickle/yaml.load/np.load(allow_pickle) on data.
    (The engine's socketpair carries small pickled dicts between a parent and its own child only.)"""
    bad = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = _call_name(node)
            kw = {k.arg: k.value for k in node.keywords}
            where = f"{path.relative_to(ROOT)}:{node.lineno} {name}"
            if name.endswith("torch.load") or name == "load" and "weights_only" in kw:
                value = kw.get("weights_only")
                if not (isinstance(value, ast.Constant) and value.value is True):
                    bad.append(where + " without weights_only=True")
            elif name in ("pickle.load", "pickle.loads", "cloudpickle.load", "cloudpickle.loads", "yaml.load",
                          "yaml.unsafe_load", "marshal.loads", "dill.load", "dill.loads"):
                bad.append(where)
            elif name.rsplit(".", 1)[-1] in ("all_gather_object", "gather_object", "broadcast_object_list",
                                             "scatter_object_list", "recv_object_list", "send_object_list"):
                bad.append(where + ": torch's *_object collectives unpickle what peers send; send JSON in tensors")
            elif name.endswith("np.load") or name.endswith("numpy.load"):
                value = kw.get("allow_pickle")
                if isinstance(value, ast.Constant) and value.value is True:
                    bad.append(where + " with allow_pickle=True")
    assert bad == []


def test_prefect_reads_and_writes_no_record_of_its_own():
    """What Prefect would decode from a record on the store (a pickle, a JSON naming any class) cannot reach
    a run when Prefect keeps no record: every task of the flows has no cache policy and persists no result
    (flows/caching.py TASK_OPTIONS), and nothing names a result or cache-key storage, a result serializer or
    a cache key function. A record planted under STORE/_prefect is therefore never read:
    tests/unit/flows/test_caching.py::test_a_planted_prefect_record_is_inert_and_an_older_store_is_reused_whole."""
    from prefect import Task
    from prefect.cache_policies import NO_CACHE

    import flows.pipeline as pipeline

    tasks = [v for v in vars(pipeline).values() if isinstance(v, Task)]
    assert {t.name for t in tasks} == {"stage", "shard"}, tasks  # every stage runs as one of these two (named per use)
    for t in tasks:
        assert t.cache_policy is NO_CACHE and t.persist_result is False, t.name
    bad = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg in ("result_storage", "key_storage", "result_serializer",
                                                               "cache_key_fn", "result_storage_key"):
                bad.append(f"{path.relative_to(ROOT)}:{node.value.lineno} {node.arg}=")
            if isinstance(node, ast.keyword) and node.arg == "persist_result":
                if not (isinstance(node.value, ast.Constant) and node.value.value is False):
                    bad.append(f"{path.relative_to(ROOT)}:{node.value.lineno} persist_result not False")
    assert bad == []


# Secrets as they come: about half of AWS secret keys hold a `/`, many a `+`; URL-encoded, `/` is `%2F`.
SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCY%2FEXAMPLEKEY"
KEY_ID = "AKIAIOSFODNN7EXAMPLE"
HF = "hf_" + "Q" * 34


def _no_secret(text: str) -> None:
    for needle in (SECRET, "K7MDENG", "EXAMPLEKEY", KEY_ID, HF):
        assert needle not in text, (needle, text)


@pytest.mark.parametrize("args, field", [
    (["--set", f"store.uri=s3://{KEY_ID}:{SECRET}@bucket/x"], "store.uri"),
    (["--store", f"s3://{KEY_ID}:{SECRET}@bucket/x"], "store.uri"),
    (["--set", f"store.uri=s3://KEY:{SECRET}@bucket/x"], "store.uri"),
    (["--set", f"store.endpoint_url=https://user:{SECRET}@s3.example.com"], "store.endpoint_url"),
    (["--set", f"engines.engine_args.hf_token={SECRET}"], "engines.engine_args.hf_token"),
    (["--set", f"engines.extract.engine_args.api_key={SECRET}"], "engines.extract.engine_args.api_key"),
    (["--set", f"data.sources=[{{path: 'https://h.example/d.jsonl?X-Amz-Signature={SECRET}&a=1'}}]"],
     "data.sources[0].path"),
    (["--set", f"data.sources=[{{path: 'https://h.example/d.jsonl?AWSAccessKeyId={SECRET}'}}]"], "data.sources[0].path"),
    (["--set", f"target.model={HF}"], "target.model"),
    (["--set", f"target.chat_template=s3://{KEY_ID}@bucket/t.jinja"], "target.chat_template"),
], ids=["store-uri", "store-option", "store-uri-plain-key", "endpoint-userinfo", "engine-arg-hf-token",
        "engine-arg-api-key", "presigned-source", "source-key-id", "hf-token-as-model", "key-id-in-path"])
def test_a_credential_in_any_value_is_refused_and_never_echoed(tmp_path, args, field):
    """The same rule for every field and every way in (file, --set, --store), for `run`, `config show` and
    `ls`: refused before anything is printed, stored or sent (so no flow run holds it), masked in the message."""
    from typer.testing import CliRunner

    from cli.app import app

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"base: {ROOT / CONFIG}\n")
    for command in (["run", str(cfg)], ["config", "show", str(cfg)], ["ls", str(cfg)]):
        out = CliRunner().invoke(app, [*command, *args])
        assert out.exit_code == 2 and isinstance(out.exception, SystemExit), out.output
        text = " ".join(out.output.split())
        assert f"{field}: " in text and "credential" in text, text
        assert "fix: put credentials in the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, HF_TOKEN)" in text
        _no_secret(out.output)
    assert not (tmp_path / ".draftline").exists()


def test_a_credential_in_a_config_file_is_refused_and_never_echoed(tmp_path):
    from tasks.core.config_load import load_config
    from tasks.core.errors import ConfigError

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"base: {ROOT / CONFIG}\nstore: {{uri: 's3://{KEY_ID}:{SECRET}@b/x'}}\n"
                   f"engines: {{engine_args: {{hf_token: '{HF}'}}}}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(cfg)
    assert "store.uri" in str(exc.value) and "engines.engine_args.hf_token" in str(exc.value)
    _no_secret(str(exc.value))
    cfg.write_text(f"base: {ROOT / CONFIG}\n")
    load_config(cfg, ["engines.engine_args.hf_token=true", "store.uri=s3://bucket/with@sign"])  # not secrets


def test_deploy_and_submit_refuse_credentials_in_job_variables(monkeypatch):
    from cli.commands.deploy import _env_pairs, deploy_spec, load_deployments
    from tasks.core.secrets import SecretInValue

    with pytest.raises(SecretInValue) as exc:
        deploy_spec(load_deployments()[:1], f"s3://{KEY_ID}:{SECRET}@bucket/x")
    assert "work_pool.job_variables.store_uri" in str(exc.value)
    _no_secret(str(exc.value))
    for pair in (f"AWS_SECRET_ACCESS_KEY={SECRET}", f"HF_TOKEN={HF}", f"MY_VAR={HF}", f"AWS_SESSION_TOKEN={SECRET}"):
        with pytest.raises(SecretInValue) as exc:
            _env_pairs(["AWS_PROFILE=train", pair])
        assert "set it where the worker runs instead: its environment" in str(exc.value)
        assert "the AWS profile chain of the worker's user" in str(exc.value)
        _no_secret(str(exc.value))
    assert _env_pairs(["AWS_PROFILE=train", "VLLM_LOGGING_LEVEL=DEBUG"]) == {"AWS_PROFILE": "train",
                                                                             "VLLM_LOGGING_LEVEL": "DEBUG"}
    from typer.testing import CliRunner

    from cli.app import app

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # refused before any server is asked
    for args in (["submit", CONFIG, "-d", "local", "--store", f"s3://KEY:{SECRET}@b/x"],
                 ["submit", CONFIG, "-d", "local", "--env", f"AWS_SECRET_ACCESS_KEY={SECRET}"],
                 ["deploy", "--store", f"s3://KEY:{SECRET}@b/x"]):
        out = CliRunner().invoke(app, args)
        assert out.exit_code == 2 and "credential(s) given as values, refused" in out.output, out.output
        _no_secret(out.output)
    # a deployment whose prefect.yaml job variables hold a key
    deps = load_deployments()[:1]
    deps[0].setdefault("work_pool", {}).setdefault("job_variables", {})["env"] = {"HF_TOKEN": HF}
    with pytest.raises(SecretInValue, match=r"job_variables\.env\.HF_TOKEN"):
        deploy_spec(deps, None)


def test_a_config_base_stays_in_the_checkout_or_the_configs_folder(tmp_path):
    """A flow run's parameters name configs: a `base:` cannot read a worker's other files, and a YAML error
    shows where and what, never a line of the file."""
    from tasks.core.config_load import load_config
    from tasks.core.errors import ConfigError

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("password: [hunter2-top-secret\n")
    folder = tmp_path / "configs"
    folder.mkdir()
    for base in (str(outside / "secret.txt"), "../outside/secret.txt", "/etc/passwd"):
        (folder / "c.yaml").write_text(f"base: {base}\n")
        with pytest.raises(ConfigError, match="is outside this checkout and the config's folder") as exc:
            load_config(folder / "c.yaml")
        assert "hunter2" not in str(exc.value) and "root:" not in str(exc.value)
    (folder / "b.yaml").write_text("train: {max_steps: [1, hunter2-top-secret\n")
    (folder / "c.yaml").write_text("base: b.yaml\n")
    with pytest.raises(ConfigError, match=r"b.yaml: not valid YAML at line 2, column 1") as exc:
        load_config(folder / "c.yaml")
    assert "hunter2" not in str(exc.value)
    (folder / "c.yaml").write_text(f"base: {ROOT / CONFIG}\n")  # a preset of the checkout
    load_config(folder / "c.yaml")


def test_trust_remote_code_from_a_flow_run_needs_the_deployment_to_allow_it():
    from tasks.train.preflight import REMOTE_CODE_TAG, remote_code_problem

    problem = remote_code_problem(True, "draftline/b300", ["draftline", "b300"], "org/model")
    assert "does not allow it" in problem and "`draftline deploy --name b300 --allow-trust-remote-code org/model`" in problem
    assert remote_code_problem(True, "b300", ["draftline", REMOTE_CODE_TAG]) is None  # the owner allowed every repo
    # the operator's opt-in names one repository (`draftline deploy --allow-trust-remote-code REPO`): no other
    assert remote_code_problem(True, "b300", [f"{REMOTE_CODE_TAG}:org/model"], "org/model") is None
    assert "(it allows org/model)" in remote_code_problem(True, "b300", [f"{REMOTE_CODE_TAG}:org/model"], "evil/x")
    assert remote_code_problem(True, None, []) is None  # `draftline run`: the user's own config
    assert remote_code_problem(False, "b300", []) is None


def test_no_secret_travels_on_a_command_line():
    """A process's arguments are readable by every user of the machine (ps, /proc/PID/cmdline): the infra
    scripts pass keys in the environment, never as arguments."""
    import re

    bad = []
    for path in sorted((ROOT / "infra").glob("*.sh")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("#"):
                continue
            line = re.sub(r"\[\[.*?\]\]", "", line)  # bash's own tests start no process
            for m in re.finditer(r'(^|[\s(])"?\$\{?([A-Z0-9_]*(?:SECRET|TOKEN|PASSWORD)[A-Z0-9_]*)', line):
                if not re.match(r"\s*(export\s+)?[A-Z_]+=", line):  # an assignment, not a command
                    bad.append(f"{path.name}:{n} passes ${m.group(2)} as an argument")
    assert bad == []


def test_the_node_worker_runs_as_an_unprivileged_user():
    """infra/node-bootstrap.sh runs the worker as an unprivileged user (never root), with no new privileges: the
    systemd unit's User=, or setpriv outside systemd; only a docker worker joins the docker group."""
    text = (ROOT / "infra" / "node-bootstrap.sh").read_text()
    unit = text[text.index('cat > "/etc/systemd/system/$unit" <<EOF'):]
    unit = unit[: unit.index("\nEOF\n")]
    assert "\nUser=$RUN_AS\n" in unit and "\nNoNewPrivileges=yes\n" in unit
    assert 'RUN_AS="${DRAFTLINE_USER:-draftline}"' in text
    assert '[[ "$RUN_AS" != root ]] || die' in text
    # outside systemd (--foreground, --background) root hands the worker to the same user
    assert 'exec "${drop_root[@]}" "${worker_cmd[@]}"' in text and 'setsid nohup "${drop_root[@]}"' in text
    assert 'drop_root=(setpriv --reuid="$RUN_AS" --regid="$(id -g "$RUN_AS")" --no-new-privs)' in text
    # the docker group is root by another door: only a docker worker joins it
    groups = text[text.index("worker_groups() {"):text.index("ensure_worker_user() {")]
    assert "for g in video render; do" in groups and "if (( DOCKER )) && getent group docker" in groups
    # a process pool's worker is draftline's, which checks each run's job variables (tests/integration/test_job_variables.py)
    assert 'worker_cmd=("$VENV/bin/python" -m flows.node_worker --pool' in text
