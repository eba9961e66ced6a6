"""Config loading, overrides and the errors a user sees."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.core.config import RunConfig

from tasks.core.config_load import load_config

from tasks.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.app", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_demo_config_loads_and_sets_override_types():
    cfg = load_config(ROOT / "configs/demo.yaml", ["train.max_steps=7", "benchmark.num_speculative_tokens=[5,1]",
                                                  "extract.enforce_eager=false", "store.uri=s3://bkt/prefix"])
    assert cfg.train.max_steps == 7
    assert cfg.benchmark.num_speculative_tokens == [1, 5]
    assert cfg.extract.enforce_eager is False
    assert cfg.store.uri == "s3://bkt/prefix"
    assert cfg.target.model == "smollm2-135m-instruct"


@pytest.mark.parametrize("override, needle", [
    ("train.bogus=1", "train.bogus: Extra inputs are not permitted"),
    ("data.num_shards=abc", "data.num_shards: Input should be a valid integer"),
    ("data.num_shards=0", "data.num_shards: Input should be greater than or equal to 1"),
    ("extract.backend=tensorrt", "extract.backend: Input should be 'vllm' or 'transformers'"),
    ("extract.layer_ids=[3,3,5]", "extract.layer_ids: layer ids must be distinct and ascending"),
    ("extract.layer_ids=[0,3,5]", "layer ids start at 1"),
    ("store.uri=ftp://host/x", "store.uri: store uri must start with file:// or s3://"),
    ("store.uri=s3://KEY:SECRET@bucket/x", "store.uri: holds a credential (s3://***@bucket/x)"),
    ("benchmark.num_speculative_tokens=[]", "non-empty list of positive integers"),
    ("data.sources=[{preset: chitchat, path: x.jsonl}]", "exactly one of preset/path/hub"),
    ("benchmark.evals=[]", "benchmark.evals is empty"),
    ("benchmark.evals=[{name: a, source: heldout}, {name: a, source: heldout}]", "['a'] appear more than once"),
])
def test_bad_values_name_the_field_and_the_fix(override, needle):
    with pytest.raises(ConfigError) as exc:
        load_config(ROOT / "configs/demo.yaml", [override])
    assert needle in str(exc.value)
    assert str(ROOT / "configs/demo.yaml") in str(exc.value)


def test_malformed_override_and_missing_file():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(None, ["train.max_steps"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/run.yaml")


def test_yaml_that_is_not_a_mapping(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(p)


def test_cli_config_show_prints_resolved_yaml_roundtrip():
    out = cli("config", "show", "configs/demo.yaml", "--set", "train.lr=0.001")
    assert out.returncode == 0, out.stderr
    shown = yaml.safe_load(out.stdout)
    assert shown["train"]["lr"] == 0.001
    assert RunConfig.model_validate(shown).train.lr == 0.001  # what is shown loads back


def test_cli_bad_config_exits_nonzero_with_message():
    out = cli("config", "show", "configs/demo.yaml", "--set", "train.nope=1")
    assert out.returncode == 2
    assert "train.nope" in out.stderr and "Extra inputs are not permitted" in out.stderr


def test_cli_help_lists_the_commands():
    out = cli("--help")
    assert out.returncode == 0
    for cmd in ("run", "config", "ls", "gc", "report"):
        assert cmd in out.stdout
