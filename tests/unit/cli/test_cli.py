"""The command line behaves like the tools users know (Prefect's, huggingface-cli, vLLM's): `-h`, `--version`,
one meaning per short flag, the config as the first positional argument, `--store` and `--json` wherever they
apply, `last` as the default run, `draftline logs`, `gc` asking before it deletes on a shared store, helpful
answers to typos, output that is not folded when piped, and a hub id that fails at once without the hub.

The S3 cases run on the SeaweedFS fixture with the identities of tests/support/s3server.py: keys read-only on the
bucket, and keys scoped to one prefix of it. The run-related commands run against the real Prefect server
fixture with a small flow named like the pipeline (tasks named like its stages and shards)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cli.app import app
from tasks.core import owners
from tasks.core.config import StoreConfig
from tasks.store.artifacts import Store, StoreError

ROOT = Path(__file__).resolve().parents[3]
CONFIG = "configs/demo.yaml"


def draftline(*args: str, **kw):
    return CliRunner().invoke(app, list(args), **kw)


def flat(text: str) -> str:
    return " ".join(text.split())


def commands() -> dict:
    """Every leaf command by its full name (`config show`, `store init`, `ls`, ...)."""
    out: dict = {}

    def walk(cmd, prefix):
        for name, sub in getattr(cmd, "commands", {}).items():
            full = f"{prefix} {name}".strip()
            if getattr(sub, "commands", None):
                walk(sub, full)
            else:
                out[full] = sub
    walk(typer.main.get_command(app), "")
    return out


# =========================================================================== conventions

def test_help_is_h_or_help_everywhere_and_version_prints_the_installed_version():
    from importlib.metadata import version

    for args in ([], ["config"], ["config", "show"], ["store", "init"], ["logs"], ["report"], ["status"]):
        for flag in ("-h", "--help"):
            out = draftline(*args, flag)
            assert out.exit_code == 0 and "Usage" in out.output, (args, flag, out.output)
    for flag in ("--version", "-V"):
        out = draftline(flag)
        assert out.exit_code == 0 and out.output.strip() == f"draftline {version('draftline')}", out.output


def test_help_is_paragraphs_no_sentence_cut_where_the_source_was_wrapped(monkeypatch):
    """Rendered 1,000 columns wide, `draftline --help` and every command's help hold each paragraph on one line
    and each command, argument and option on one row: a second line is a docstring's hard line break, which a
    terminal of another width shows as a sentence cut in the middle."""
    import typer.rich_utils

    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", 1000)
    root = typer.main.get_command(app)
    groups = {"": root, **{n: c for n, c in root.commands.items() if getattr(c, "commands", None)}}
    for name, cmd in {**groups, **commands()}.items():
        out = draftline(*name.split(), "--help")
        assert out.exit_code == 0, (name, out.output)
        lines = out.output.splitlines()
        head = [x.strip() for x in lines[:next(i for i, x in enumerate(lines) if x.startswith("╭"))]]
        assert not [a for a, b in zip(head, head[1:]) if a and b], (name, head)  # paragraphs apart, one line each
        shown = [p for p in cmd.params if not getattr(p, "hidden", False)]
        want = {"Options": len([p for p in shown if p.param_type_name == "option"]) + 1,  # and -h/--help
                "Arguments": len([p for p in shown if p.param_type_name == "argument"]),
                "Commands": len(getattr(cmd, "commands", {}))}
        box, rows = None, 0
        for x in lines:
            if x.startswith("╭"):
                box, rows = x.strip("╭─ ╮"), 0
            elif x.startswith("╰"):
                assert rows == want[box], (name, box, out.output)
            elif box:
                rows += 1


def test_one_meaning_per_short_flag_config_first_and_store_json_where_they_apply():
    cmds = commands()
    assert {"logs", "store init", "report", "ls", "gc", "retry"} <= set(cmds)
    meaning: dict[str, set[str]] = {}
    for name, cmd in cmds.items():
        params = {p.name: p for p in cmd.params}
        for p in cmd.params:
            if p.param_type_name == "option":
                longs = sorted(o for o in p.opts + p.secondary_opts if o.startswith("--"))
                for short in (o for o in p.opts + p.secondary_opts if not o.startswith("--")):
                    meaning.setdefault(short, set()).add(longs[0] if longs else short)
        if "config" in params:  # the config is positional, first, in every command that takes one
            assert params["config"].param_type_name == "argument", name
            assert [p.name for p in cmd.params if p.param_type_name == "argument"][0] == "config", name
        if "overrides" in params and name not in ("plan", "weights"):  # neither reads the store
            assert any("--store" in p.opts for p in cmd.params), f"{name} has --set but no --store"
        if name in ("ls", "gc", "report", "status", "ui", "deploy", "doctor", "plan", "submit", "retry", "logs",
                    "config show", "store init", "run"):
            assert any("--json" in p.opts for p in cmd.params), f"{name} has no --json"
        if "run" in params and name != "run":  # a run to look at: the newest by default
            assert params["run"].default == "last", name
    shared = {s: m for s, m in meaning.items() if len(m) > 1}
    assert not shared, f"short flags with several meanings: {shared}"
    assert meaning["-n"] == {"--name"} and meaning["-s"] == {"--set"}


def test_store_is_the_same_as_set_store_uri_and_set_wins(tmp_path):
    uri = f"file://{tmp_path}/a"
    out = draftline("config", "show", CONFIG, "--store", uri, "--json")
    assert out.exit_code == 0 and json.loads(out.output)["store"]["uri"] == uri
    out = draftline("config", "show", CONFIG, "--store", uri, "--set", f"store.uri=file://{tmp_path}/b", "--json")
    assert json.loads(out.output)["store"]["uri"] == f"file://{tmp_path}/b"


def commit(store: Store, stage: str, payload: dict, **stats) -> str:
    digest = uuid.uuid4().hex * 2
    with store.write(stage, digest, "v1") as w:
        w.write_json("report.json" if stage == "benchmark" else "out.json", payload)
        w.commit(stats)
    return digest


def test_ls_json_and_unknown_stages_refused(tmp_path):
    store = Store(f"file://{tmp_path}/store")
    digest = commit(store, "prepare", {"x": 1}, samples=3)
    out = draftline("ls", "--store", store.uri, "--json")
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert [(r["stage"], r["digest"], r["stats"]["samples"]) for r in rows] == [("prepare", digest, 3)]
    assert rows[0]["uri"] == f"{store.uri}/prepare/{digest}" and rows[0]["attempt"] and rows[0]["bytes"] > 0
    out = draftline("ls", "--store", store.uri, "--stage", "extrat")
    assert out.exit_code == 2 and "--stage 'extrat': use one of prepare" in flat(out.output), out.output
    assert "(did you mean extract?)" in out.output
    assert draftline("run", CONFIG, "--store", store.uri, "--until", "trian").exit_code == 2


def test_ls_stage_lists_the_stages_own_artifact_then_its_shards(tmp_path):
    """`ls --stage extract` shows what the extract stage committed: its own artifact (extract-stage, the one train
    takes), then its shards (extract); no other stage's. The folders are the ones the flow's stages commit to."""
    from flows.pipeline import STAGE_DEFS
    from tasks.address.digests import STAGE_FOLDERS
    from tasks.store.stages import ShardedStage

    assert STAGE_FOLDERS == {st.name: (st.store_stage, st.shard_stage) if isinstance(st, ShardedStage) else (st.name,)
                             for st in STAGE_DEFS}
    store = Store(f"file://{tmp_path}/store")
    commit(store, "prepare", {"x": 1}, samples=3)
    shards = [commit(store, "extract", {"shard": i}, shard=i) for i in (0, 1)]
    stage = commit(store, "extract-stage", {"shards": shards}, num_shards=2)
    out = draftline("ls", "--store", store.uri, "--stage", "extract", "--json")
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert [r["stage"] for r in rows] == ["extract-stage", "extract", "extract"]
    assert rows[0]["digest"] == stage and {r["digest"] for r in rows[1:]} == set(shards)
    out = draftline("ls", "--store", store.uri, "--stage", "extract")
    lines = [line for line in out.output.splitlines() if "extract" in line and "committed" not in line]
    assert [line.split()[1] for line in lines] == ["extract-stage", "extract", "extract"], out.output
    assert "num_shards=2" in lines[0] and "prepare" not in out.output


@pytest.mark.parametrize("n", [20, 21, 64])
def test_ls_folds_a_folder_of_many_shards_into_one_row_and_all_lists_each(tmp_path, n):
    """A table of 1,024 shard rows is unreadable and takes seconds to render: `ls` shows a folder of more than 20
    artifacts as one row (how many, when, files and bytes in all); `--all` and `--json` list each."""
    from cli.commands.store import FOLD

    store = Store(f"file://{tmp_path}/store")
    commit(store, "prepare", {"x": 1}, samples=3)
    shards = [commit(store, "extract", {"shard": i}, shard=i) for i in range(n)]
    out = draftline("ls", "--store", store.uri)
    assert out.exit_code == 0, out.output
    rows = [line for line in out.output.splitlines() if line.startswith("│ extract")]
    if n > FOLD:
        assert len(rows) == 1 and f"{n} artifacts" in rows[0] and "--all lists each" in rows[0], out.output
        total = sum(store.open("extract", d).manifest.files[0].bytes for d in shards)
        assert f"{total:,}" in rows[0], (total, rows[0])
    else:
        assert sorted(r.split()[3] for r in rows) == sorted(shards), out.output
    assert "samples=3" in out.output  # the prepare artifact, alone in its folder, as before
    every = draftline("ls", "--store", store.uri, "--all")
    assert sorted(r.split()[3] for r in every.output.splitlines() if r.startswith("│ extract")) == sorted(shards)
    assert len(json.loads(draftline("ls", "--store", store.uri, "--json").output)) == n + 1


def test_config_typos_get_did_you_mean_and_broken_set_yaml_is_shown():
    out = draftline("config", "show", CONFIG, "--set", "train.max_step=5")
    text = flat(out.output)
    assert out.exit_code == 2 and "train.max_step: Extra inputs" in text and "(from --set train.max_step=5)" in text, text
    assert "(did you mean max_steps?)" in text and "fix: rename it to max_steps" in text
    out = draftline("config", "show", CONFIG, "--set", "data.sources=[{preset: chitchat, wieght: 3}]")
    assert "data.sources.0.wieght" in flat(out.output) and "did you mean weight?" in flat(out.output), out.output
    out = draftline("config", "show", CONFIG, "--set", "benchmark.evlas=[]")
    assert "did you mean evals?" in flat(out.output), out.output
    out = draftline("config", "show", CONFIG, "--set", "train.zzz=1")  # nothing close: no guess
    assert "did you mean" not in out.output and "remove it or check the spelling" in flat(out.output)
    # broken YAML in --set: the YAML error, about the --set, not "problems in configs/demo.yaml"
    out = draftline("config", "show", CONFIG, "--set", "extract.layer_ids=[2, 15")
    text = flat(out.output)
    assert out.exit_code == 2 and "--set 'extract.layer_ids=[2, 15': the value is not valid YAML" in text, text
    assert "expected ',' or ']'" in text and "problem(s) in the config" not in text
    # a plain string with YAML-looking characters stays a string
    out = draftline("config", "show", CONFIG, "--set", "target.revision=x: y: z", "--json")
    assert out.exit_code == 0 and json.loads(out.output)["target"]["revision"] == "x: y: z", out.output


def test_output_to_a_pipe_is_not_folded(tmp_path):
    """A real pipe (a subprocess): the store URI in ls's title and a long error line come out whole."""
    deep = tmp_path / ("x" * 90) / "store"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("COLUMNS", None)
    out = subprocess.run([sys.executable, "-m", "cli.app", "ls", "--store", f"file://{deep}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"committed artifacts in file://{deep}" in out.stdout.splitlines()[0], out.stdout
    missing = tmp_path / ("y" * 90) / "missing.yaml"
    out = subprocess.run([sys.executable, "-m", "cli.app", "config", "show", str(missing)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and f"config file {missing} not found; pass a YAML file" in out.stderr.splitlines()[0]


def test_an_unreachable_prefect_api_is_one_line_for_every_command_that_asks_it():
    """The one error handler: every command that talks to the Prefect API (status, retry of a run id, ui, logs,
    submit, deploy) ends the same way when the server is not there: one line naming the API address and the check,
    exit status 2, no traceback."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    closed = "http://127.0.0.1:9/api"  # the discard port: nothing listens there
    with temporary_settings(updates={PREFECT_API_URL: closed}):
        # `retry last` reads this machine's own record of the runs it started first (tests/integration/
        # test_retry_parameters.py); a run id goes to the API
        for args in (["status"], ["retry", "0b7c9c4e-2f55-4d7e-9a53-1f0e7a3c1d2e"], ["ui"], ["logs"],
                     ["submit", CONFIG, "-d", "local"], ["deploy", "--name", "local"]):
            out = draftline(*args)
            assert out.exit_code == 2, (args, out.output)
            assert f"the Prefect API at {closed} failed" in flat(out.output), (args, out.output)
            assert "Traceback" not in out.output and not isinstance(out.exception, Exception), args


def test_a_hub_id_without_the_hub_fails_at_once(tmp_path, monkeypatch):
    """No HF_HUB_OFFLINE, and the hub endpoint does not answer (nothing listens on the discard port): the run
    is refused in seconds, not after huggingface_hub's retries. (A complete snapshot on the node is used
    offline: tests/unit/engine/test_weights.py.)"""
    from huggingface_hub import constants

    from tasks.engine import weights

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("DRAFTLINE_HOME", str(tmp_path / "home"))
    weights.hub_reachable.cache_clear()
    weights.resolve_commit.cache_clear()
    from transformers import AutoConfig  # noqa: F401 - its import time is not what is measured

    t0 = time.time()
    out = draftline("run", CONFIG, "--store", f"file://{tmp_path}/store", "--set", "target.model=someorg/not-here")
    took = time.time() - t0
    text = flat(out.output)
    assert out.exit_code == 2 and "target.model someorg/not-here: no complete snapshot on this node, and the model " \
        "hub (http://127.0.0.1:9) does not answer from this machine" in text, text
    assert took < 15, took
    weights.hub_reachable.cache_clear()


# =========================================================================== gc on a shared store

def dead_leftover(store: Store) -> str:
    """An attempt folder whose writer (a process on this host) has exited: what a killed run leaves."""
    p = subprocess.Popen(["true"])
    p.wait()
    w = store.writer("prepare", uuid.uuid4().hex * 2, "v1")
    w.write_bytes("part.bin", b"x" * 100)
    record = {**owners.me(), "pid": p.pid, "start": None}  # as that exited process would have written it
    store.fs.pipe_file(store.key(w.stage, w.digest, w.attempt, owners.OWNER_FILE), json.dumps(record).encode())
    return w.key("part.bin")


@pytest.mark.s3
def test_gc_asks_before_deleting_on_s3_and_refuses_without_a_terminal(s3_server, monkeypatch):
    import cli.leftovers

    monkeypatch.setattr(cli.leftovers, "local_folders", lambda: [])  # this machine's temp folders: not ours
    # a prefix of other files (no store marker): refused, nothing deleted; inside a store a user's folder
    # (not an attempt's name) is never taken, on S3 as on file://
    home = Store(f"s3://draftline-test/home-{uuid.uuid4().hex[:8]}", Store.from_config(StoreConfig(
        uri="s3://draftline-test/x")).storage_options)
    for f in USER_FOLDERS:
        home.fs.pipe_file(home.key(f, "keep.txt"), b"mine")
    out = draftline("gc", "--store", home.uri, "--yes", "--min-age", "0")
    assert out.exit_code == 2 and "is not a draftline store" in flat(out.output), out.output
    store = Store.from_config(StoreConfig(uri=f"s3://draftline-test/gc-{uuid.uuid4().hex[:8]}"))
    key = dead_leftover(store)
    planted = [store.key(key.split("/")[-4], key.split("/")[-3], "assets", "keep.txt"), *(store.key(
        f, "keep.txt") for f in USER_FOLDERS)]
    for k in planted:
        store.fs.pipe_file(k, b"mine")
    out = draftline("gc", "--store", store.uri)  # CliRunner's stdin is no terminal
    text = flat(out.output)
    assert out.exit_code == 2 and "1 leftover(s) of s3://" in text and "pass --yes" in text, text
    assert store.fs.exists(key)
    out = draftline("gc", "--store", store.uri, "--dry-run")
    assert out.exit_code == 0 and "found (--dry-run: nothing removed)" in out.output and store.fs.exists(key)
    out = draftline("gc", "--store", store.uri, "--yes", "--json", "--min-age", "0")
    assert out.exit_code == 0, out.output
    assert [r["kind"] for r in json.loads(out.output)] == ["attempt"]
    store.fs.invalidate_cache()
    home.fs.invalidate_cache()
    assert not store.fs.exists(key) and all(store.fs.cat_file(k) == b"mine" for k in planted)
    assert all(home.fs.cat_file(home.key(f, "keep.txt")) == b"mine" for f in USER_FOLDERS)


def test_gc_on_a_local_store_asks_too(tmp_path, monkeypatch):
    """file:// as s3://: gc lists what it would delete and, with no terminal to ask on, deletes only with --yes."""
    import cli.leftovers

    monkeypatch.setattr(cli.leftovers, "local_folders", lambda: [])
    store = Store(f"file://{tmp_path}/store")
    key = dead_leftover(store)
    out = draftline("gc", "--store", store.uri)
    assert out.exit_code == 2 and "pass --yes" in flat(out.output) and Path(key).parent.name in out.output, \
        out.output
    assert Path(key).exists()
    out = draftline("gc", "--store", store.uri, "--yes")
    assert out.exit_code == 0 and "1 leftover(s) removed" in out.output and not Path(key).exists(), out.output


def _aged(root: Path, hours: float = 2) -> None:
    then = time.time() - hours * 3600
    for p in [root, *root.rglob("*")]:
        os.utime(p, (then, then), follow_symlinks=False)


def _user_files(root: Path, folders: list[str]) -> list[Path]:
    files = []
    for f in folders:
        (root / f).mkdir(parents=True, exist_ok=True)
        (root / f / "keep.txt").write_text("mine")
        files.append(root / f / "keep.txt")
    return files


# folder shapes a user has: the issue's, folders starting with 'a', names close to draftline's
USER_FOLDERS = ["projects/myrepo/assets", "Documents/taxes/archive-2023", "a/b/a", "photos/2023/album-1",
                "src/app/attempt-2", "work/notes/draftline-attempt-notes", "x/y/a20260101T000000-me-1-0123abcd.bak"]


def test_gc_refuses_a_folder_that_is_not_a_store_and_deletes_nothing(tmp_path, monkeypatch):
    """The issue's repro: `draftline gc --store ~ --yes` on a home-like folder aged two hours. The old gc took
    every ROOT/X/Y/a* folder; now a root without draftline's store marker is refused, naming the fix."""
    import cli.leftovers

    monkeypatch.setattr(cli.leftovers, "local_folders", lambda: [])
    home = tmp_path / "home"
    files = _user_files(home, USER_FOLDERS)
    _aged(home)
    for args in (["--yes"], ["--yes", "--min-age", "0"], ["--dry-run"]):
        out = draftline("gc", "--store", f"file://{home}", *args)
        text = flat(out.output)
        assert out.exit_code == 2 and "is not a draftline store" in text and "draftline store init" in text, text
    assert all(f.read_text() == "mine" for f in files)
    # `store init` does not make a folder of other files a store either
    out = draftline("store", "init", "--store", f"file://{home}")
    assert out.exit_code == 2 and "no draftline artifact" in flat(out.output), out.output
    assert not (home / "draftline-store.json").exists()


def test_gc_in_a_store_removes_only_draftline_attempts(tmp_path, monkeypatch):
    """A real store with user folders planted inside it (beside a committed attempt, at every depth): gc
    removes the abandoned attempt of a dead writer and nothing else; the committed artifact still verifies."""
    import cli.leftovers

    monkeypatch.setattr(cli.leftovers, "local_folders", lambda: [])
    root = tmp_path / "store"
    store = Store(f"file://{root}")
    with store.write("prepare", "d" * 16, "v1") as w:
        w.write_bytes("data.bin", b"y" * 10)
        w.commit()
    assert (root / "draftline-store.json").is_file()  # the first write marks the store
    dead = Path(dead_leftover(store)).parent
    files = _user_files(root, [f"prepare/{'d' * 16}/{f}" for f in ("assets", "archive-2023", "a1")]
                        + USER_FOLDERS)
    (root / "prepare" / ("d" * 16) / "manifest.json.tmp-notes").write_text("mine")
    _aged(root)
    out = draftline("gc", "--store", store.uri, "--yes", "--min-age", "0", "--json")
    assert out.exit_code == 0, out.output
    assert [(r["kind"], r["where"]) for r in json.loads(out.output)] == [("attempt", str(dead))]
    assert not dead.exists() and all(f.read_text() == "mine" for f in files)
    assert (root / "prepare" / ("d" * 16) / "manifest.json.tmp-notes").exists()
    store.open("prepare", "d" * 16, checksums=True)


def test_a_store_without_the_marker_gets_it_at_its_next_write_or_store_init(tmp_path):
    """Stores made before the marker existed keep working: the next commit (or `store init`) marks them."""
    from tasks.store.artifacts import NotAStore

    root = tmp_path / "store"
    store = Store(f"file://{root}")
    with store.write("prepare", "e" * 16, "v1") as w:
        w.write_bytes("data.bin", b"y")
        w.commit()
    (root / "draftline-store.json").unlink()  # as an older draftline left it
    with pytest.raises(NotAStore, match="draftline store init"):
        Store(store.uri).garbage_detail(0)
    out = draftline("store", "init", "--store", store.uri)
    assert out.exit_code == 0 and (root / "draftline-store.json").is_file(), out.output
    (root / "draftline-store.json").unlink()
    again = Store(store.uri)
    with again.write("vocab", "f" * 16, "v1") as w:
        w.write_bytes("d2t.bin", b"z")
        w.commit()
    assert (root / "draftline-store.json").is_file() and again.garbage_detail(0) == []


def test_owners_on_hosts_whose_names_differ_only_in_punctuation_are_distinct(tmp_path, monkeypatch):
    """EC2's ip-172-31-10-15 and ip-172-31-101-5 (the old 16-char tag made both `ip172311015`): an attempt
    written on one is never taken by gc on the other while its owner's lease is fresh; on its own host a
    dead owner's attempt goes at once."""
    import socket

    store = Store(f"file://{tmp_path}/store")
    monkeypatch.setattr(socket, "gethostname", lambda: "ip-172-31-10-15")
    key = dead_leftover(store)
    record = owners.read(Path(key).parent)
    assert record["host"] == "ip-172-31-10-15" and record["boot"] and owners.alive(record) is False
    monkeypatch.setattr(socket, "gethostname", lambda: "ip-172-31-101-5")
    assert owners.alive(record) is None and owners.alive(owners.me()) is True
    assert store.garbage_detail(min_age_s=3600) == []  # another host's attempt, written just now: kept
    monkeypatch.setattr(socket, "gethostname", lambda: "ip-172-31-10-15")
    assert [g["key"] for g in store.garbage_detail(min_age_s=3600)] == [str(Path(key).parent)]


def test_a_live_process_temp_folder_survives_gc_and_a_dead_ones_goes(tmp_path, monkeypatch):
    """A temp folder a live process uses (the benchmark's draft copy, a checkpoint copy) has an owner record and
    survives gc however old; a dead owner's goes; a user's `draftline-*` folder without one is never touched."""
    import cli.leftovers

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(cli.leftovers, "local_folders", lambda: [temp])
    live = Path(owners.owned_tempdir("copy", str(temp)))
    dead = Path(owners.owned_tempdir("ckpt", str(temp)))
    p = subprocess.Popen(["true"])
    p.wait()
    (dead / owners.OWNER_FILE).write_text(json.dumps({**owners.me(), "pid": p.pid, "start": None, "beat": 0}))
    user = temp / "draftline-notes"
    user.mkdir()
    _aged(temp)
    assert live.name.startswith("draftline-copy-") and oct(live.stat().st_mode & 0o777) == "0o700"
    out = draftline("gc", "--store", f"file://{tmp_path}/no-store", "--yes", "--json")
    assert out.exit_code == 0, out.output
    assert [(r["kind"], r["where"]) for r in json.loads(out.output)] == [("temp-dir", str(dead))]
    assert live.is_dir() and user.is_dir() and not dead.exists()


# =========================================================================== S3 keys as teams hand them out

def keys_env(monkeypatch, keys: tuple[str, str]) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys[1])


def objects(s3_server, prefix: str) -> list[str]:
    import s3fs
    from s3server import ACCESS_KEY, SECRET_KEY

    fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, client_kwargs={"endpoint_url": s3_server.endpoint},
                           skip_instance_cache=True)
    return sorted(fs.find(prefix))


@pytest.mark.s3
def test_keys_scoped_to_the_prefix_run_the_store(s3_server, monkeypatch):
    """Keys allowed only under s3://draftline-test/team-a/ (not the bucket root): the store check, a commit,
    reading it back, ls and gc pass; a store outside the prefix is refused naming what the keys lack."""
    from s3server import SCOPED_KEYS, SCOPED_PREFIX

    keys_env(monkeypatch, SCOPED_KEYS)
    store = Store.from_config(StoreConfig(uri=f"s3://{SCOPED_PREFIX}/{uuid.uuid4().hex[:8]}"))
    store.check()
    digest = commit(store, "prepare", {"x": 1})
    assert store.open("prepare", digest).read_json("out.json") == {"x": 1}
    out = draftline("ls", "--store", store.uri, "--json")
    assert out.exit_code == 0 and [r["digest"] for r in json.loads(out.output)] == [digest], out.output
    assert draftline("gc", "--store", store.uri, "--dry-run").exit_code == 0
    outside = Store.from_config(StoreConfig(uri="s3://draftline-test/team-b"))
    with pytest.raises(StoreError, match=r"access denied listing s3://draftline-test/team-b .*must be allowed to "
                                         r"read and list"):
        outside.check()


@pytest.mark.s3
def test_read_only_keys_list_and_report_and_write_nothing(s3_server, monkeypatch):
    from s3server import READER_KEYS

    prefix = f"draftline-test/ro-{uuid.uuid4().hex[:8]}"
    store = Store.from_config(StoreConfig(uri=f"s3://{prefix}"))  # the fixture's read-write keys
    commit(store, "prepare", {"x": 1})
    report = {"benchmark": {}, "measured_by": {"flow_run_id": "r-1"}, "note": "hello"}
    digest = commit(store, "benchmark", report)
    before = objects(s3_server, prefix)
    keys_env(monkeypatch, READER_KEYS)
    ro = Store.from_config(StoreConfig(uri=f"s3://{prefix}"))
    ro.check(write=False)
    with pytest.raises(StoreError, match="access denied writing a probe object .* need no more than read and list"):
        ro.check()
    out = draftline("ls", "--store", ro.uri, "--json")
    assert out.exit_code == 0 and len(json.loads(out.output)) == 2, out.output
    for args in (["report", "--store", ro.uri, "--json"],  # the newest benchmark
                 ["report", CONFIG, digest[:12], "--store", ro.uri, "--json"],
                 ["report", digest, "-c", CONFIG, "--store", ro.uri, "--json"]):  # the old form still works
        out = draftline(*args)
        assert out.exit_code == 0 and json.loads(out.output)["note"] == "hello", (args, out.output)
    out = draftline("gc", "--store", ro.uri, "--dry-run")  # looking is reading
    assert out.exit_code == 0 and "found (--dry-run: nothing removed)" in out.output, out.output
    out = draftline("gc", "--store", ro.uri, "--yes")  # deleting is not
    assert out.exit_code == 2 and "s3:DeleteObject" in flat(out.output), out.output
    out = draftline("run", CONFIG, "--store", ro.uri)  # a command that writes: refused, naming what is missing
    assert out.exit_code == 2 and "s3:PutObject" in flat(out.output), out.output
    assert objects(s3_server, prefix) == before  # no probe object, nothing else


def runbook_store_init():
    from tests.e2e.test_runbooks import COMMANDS

    found = [c for c in COMMANDS if c.argv[1:3] == ["store", "init"]]
    assert found and all(c.doc == "docs/DEPLOY.md" for c in found), found
    return found[0]


@pytest.mark.s3
def test_the_guides_bucket_step_creates_the_bucket_once(s3_server, monkeypatch):
    """docs/DEPLOY.md's `draftline store init --store s3://BUCKET/PREFIX`, as written, on SeaweedFS: it creates
    the bucket, then says it found it; keys of another bucket get the reason."""
    from s3server import READER_KEYS

    cmd = runbook_store_init()
    uri = cmd.argv[cmd.argv.index("--store") + 1]
    bucket = uri.removeprefix("s3://").split("/")[0]
    keys_env(monkeypatch, READER_KEYS)
    out = draftline(*cmd.argv[1:])
    text = flat(out.output)  # keys of another bucket: the server denies rather than say whether it exists
    assert out.exit_code == 2 and f"access denied listing {uri}" in text and "store init" in text, text
    monkeypatch.undo()
    out = draftline(*cmd.argv[1:])
    assert out.exit_code == 0 and f"created bucket s3://{bucket}; {uri} is ready" in flat(out.output), out.output
    out = draftline(*cmd.argv[1:], "--json")
    assert out.exit_code == 0 and json.loads(out.output) == {"store": uri, "created": False}
    Store.from_config(StoreConfig(uri=uri)).check()


# =========================================================================== runs: logs, retry, ui, watch

@pytest.fixture(scope="module")
def a_run(prefect_server):
    """A finished run of a flow named like the pipeline: stage tasks, two extraction shards, logs, and the
    extraction progress bar (the pipeline's own Progress artifact)."""
    from prefect import flow, get_run_logger, task
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.report_artifacts import Progress

    @task(task_run_name="prepare")
    def prepare():
        get_run_logger().info("prepared 3 samples")

    @task(task_run_name="extract-shard-{shard}")
    def shard(shard: int):
        get_run_logger().warning(f"shard {shard} extracted")

    @flow(name="draftline", flow_run_name=f"cli-test-{uuid.uuid4().hex[:6]}")
    def pipeline():
        get_run_logger().info("run started")
        prepare()
        Progress("extract-progress", "Extraction: 2/2 shards").update(100.0, "Extraction: 2/2 shards")
        for s in (0, 1):
            shard(s)

    with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}):
        state = pipeline(return_state=True)
        from flows.started_runs import record_started

        record_started(state.state_details.flow_run_id, {})  # as the pipeline records a run it starts here
        from prefect.logging.handlers import APILogHandler

        APILogHandler().flush()  # logs reach the API in batches: send this run's now
        yield state.state_details.flow_run_id


def test_logs_of_the_last_run_with_its_tasks(a_run, prefect_server):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}):
        out = draftline("logs", "--json")  # `last` by default
        assert out.exit_code == 0, out.output
        rows = [json.loads(line) for line in out.output.splitlines()]
        assert {r["flow_run_id"] for r in rows} == {str(a_run)}
        msgs = {(r["task"], r["message"]) for r in rows}
        assert {(None, "run started"), ("prepare", "prepared 3 samples"), ("extract-shard-1", "shard 1 extracted")} \
            <= msgs, msgs
        out = draftline("logs", str(a_run), "--level", "WARNING", "--follow")  # ended: --follow returns
        assert out.exit_code == 0 and "WARNING extract-shard-0 | shard 0 extracted" in out.output, out.output
        assert "run started" not in out.output
        assert draftline("logs", "--level", "LOUD").exit_code == 2


def test_retry_and_ui_default_to_the_last_run(a_run, prefect_server):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}):
        out = draftline("retry")
        assert out.exit_code == 2 and "completed: nothing to retry" in flat(out.output), out.output
        out = draftline("ui", "--json")
        info = json.loads(out.output)
        assert info["id"] == str(a_run) and info["state"] == "COMPLETED"
        assert info["ui_url"] == f"{prefect_server.ui_url}/runs/flow-run/{a_run}"


def test_watch_has_no_cap_and_progress_counts_stages_and_shards(a_run, prefect_server):
    import inspect

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from cli.commands import deploy, runs
    from cli.prefect_api import client, progress_line

    with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}), client() as c:
        line = progress_line(c, c.read_flow_run(a_run))
    assert line == "prepare 1/1 tasks; extract 2/2 shards", line
    for fn in (deploy.submit, runs.retry):
        assert inspect.signature(fn).parameters["timeout"].default.default is None, fn


@pytest.mark.s3
def test_gc_on_s3_asks_on_a_terminal_and_no_keeps_everything(s3_server):
    """The interactive path, on a real terminal (a pty): gc shows what it found, asks, and `n` deletes nothing."""
    import pty

    store = Store.from_config(StoreConfig(uri=f"s3://draftline-test/gc-tty-{uuid.uuid4().hex[:8]}"))
    key = dead_leftover(store)
    primary, secondary = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "cli.app", "gc", "--store", store.uri], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=secondary, stdout=subprocess.PIPE,
                            stderr=secondary, text=True)
    os.close(secondary)
    seen = b""
    deadline = time.time() + 180
    while b"[y/N]" not in seen and time.time() < deadline and proc.poll() is None:
        try:
            seen += os.read(primary, 4096)
        except OSError:
            break
    # the store's dead attempt, and whatever this host's killed processes left (engine folders, cache temp files
    # of other tests): gc lists the host's leftovers beside the store's
    assert re.search(rb"delete these \d+ leftover\(s\) on " + re.escape(store.uri.encode()), seen), seen[-2000:]
    os.write(primary, b"n\n")
    proc.wait(60)
    os.close(primary)
    assert proc.returncode == 1
    store.fs.invalidate_cache()
    assert store.fs.exists(key)


def test_watch_prints_stage_and_shard_progress_while_the_run_runs(prefect_server, monkeypatch, capsys):
    """`submit --watch` / `retry --watch` (prefect_api.wait_for) on a run in flight: one shard done, one running."""
    import threading

    from prefect import flow, task
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from cli import prefect_api
    from cli.prefect_api import client, find_run, state_of

    gate = threading.Event()

    @task(task_run_name="prepare")
    def prepare():
        return 1

    @task(task_run_name="extract-shard-{shard}")
    def shard(shard: int):
        if shard == 1:
            gate.wait(120)
        return shard

    name = f"cli-watch-{uuid.uuid4().hex[:6]}"

    @flow(name="draftline", flow_run_name=name)
    def pipeline():
        prepare()
        futures = [shard.submit(s) for s in (0, 1)]
        return [f.result() for f in futures]

    def go():
        from prefect.logging.handlers import APILogHandler

        with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}):
            pipeline()
            APILogHandler().flush()

    th = threading.Thread(target=go, daemon=True)
    th.start()
    monkeypatch.setattr(prefect_api, "PROGRESS_EVERY_S", 0.5)
    try:
        with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}), client() as c:
            deadline = time.time() + 120
            while time.time() < deadline:  # until shard 0 finished and shard 1 waits at the gate
                try:
                    line = prefect_api.progress_line(c, find_run(c, name))
                except Exception:  # noqa: BLE001 - the run is not created yet
                    line = ""
                if "extract 1/2 shards (1 running)" in line:
                    break
                time.sleep(0.5)
            threading.Timer(5, gate.set).start()
            done = prefect_api.wait_for(c, find_run(c, name).id)
    finally:
        gate.set()
        th.join(120)
    out = capsys.readouterr().out
    assert f"{name}: prepare 1/1 tasks; extract 1/2 shards (1 running)" in out, out
    assert state_of(done) == "COMPLETED" and f"{name}: Completed" in out


@pytest.mark.s3
def test_a_flow_with_keys_scoped_to_the_prefix_stores_results_and_reuses_them(s3_server, prefect_server, tmp_path):
    """Under keys scoped to the prefix a flow of two stage tasks (tests/support/toy_flow.py, a process per run) commits
    both, and a second run finds both on the store: Cached (flows/caching.py), in the flow and the API."""
    from s3server import SCOPED_KEYS, SCOPED_PREFIX

    toy = Path(__file__).resolve().parents[2] / "support" / "toy_flow.py"
    uri = f"s3://{SCOPED_PREFIX}/flow-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), **prefect_server.env(), "AWS_ACCESS_KEY_ID": SCOPED_KEYS[0],
           "AWS_SECRET_ACCESS_KEY": SCOPED_KEYS[1]}
    for expect in ("Completed", "Cached"):
        out = subprocess.run([sys.executable, str(toy), uri, str(tmp_path / "marker")], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=400)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert {k: got[k] for k in ("prepare", "vocab")} == got["api"] == {"prepare": expect, "vocab": expect}
    assert (tmp_path / "marker").read_text().split() == ["prepare", "vocab"]
