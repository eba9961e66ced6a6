"""Security checks: secrets stay in the environment; no code path runs untrusted code
or unpickles data by default.

The secret test runs a real piece of the pipeline (`draftline run --until vocab`: prepare and vocab,
their manifests, Prefect's cache records and results, a markdown artifact, logs, flow parameters)
against the SeaweedFS store with a secret nobody else uses, then greps everything that was written.
"""

from __future__ import annotations

import ast
import json
import uuid
from pathlib import Path

import pytest
from tasks.core.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "tests/configs/deploy-small.yaml"
SOURCES = sorted([*ROOT.glob("tasks/*.py"), *ROOT.glob("flows/*.py")])


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

    written: dict[str, bytes] = {"cli stdout": out.encode(), "cli stderr": err.encode()}
    store = Store(uri, {"client_kwargs": {"endpoint_url": s3_server.endpoint}})
    keys = store.fs.find(store.root)
    assert any(k.endswith("/manifest.json") for k in keys) and any("/_prefect/" in k for k in keys), keys
    written.update({k: store.fs.cat_file(k) for k in keys})
    with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}), get_client(sync_client=True) as c:
        runs = FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
        api = {
            "flow run": c.read_flow_run(run_id),
            "task runs": c.read_task_runs(flow_run_filter=runs),
            "logs": c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))),
            "artifacts": c.read_artifacts(flow_run_filter=runs),
            "blocks": c.read_block_documents(include_secrets=True),
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
            elif name.endswith("np.load") or name.endswith("numpy.load"):
                value = kw.get("allow_pickle")
                if isinstance(value, ast.Constant) and value.value is True:
                    bad.append(where + " with allow_pickle=True")
    assert bad == []
