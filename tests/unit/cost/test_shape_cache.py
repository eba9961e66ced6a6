"""`draftline plan` builds a draft's shape once (tasks/cost/shape_cache.py): a second plan of the same draft
reads its numbers from draftline's cache home, imports neither speculators nor torch, and prints the same plan;
a changed input builds again; a damaged entry is rebuilt, never trusted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.core.config_load import load_config
from tasks.cost import rates as cost_rates
from tasks.cost import shape as cost_shape
from tasks.cost import shape_cache

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = {"demo": ROOT / "configs" / "demo.yaml", "kimi": ROOT / "configs" / "kimi-k2.5-b300.yaml"}
NUMBERS = ("hidden", "n_layers", "train_flops", "trainable", "flops_fixed", "flops_per_pass", "layer_params")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTLINE_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / shape_cache.FOLDER


@pytest.fixture
def builds(monkeypatch):
    """The shapes make_shape built (each call a build: a cache miss)."""
    built = []

    def counting(cfg, rates):
        built.append(cfg)
        return cost_shape.make_shape(cfg, rates)

    monkeypatch.setattr(shape_cache, "make_shape", counting)
    return built


def numbers(shape) -> tuple:
    return tuple(getattr(shape, k) for k in NUMBERS) + (shape.target.experts, shape.target.known_as)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_kept_numbers_are_the_built_ones(name, home, builds):
    cfg, rates = load_config(CONFIGS[name]), cost_rates.load_rates()
    built = cost_shape.make_shape(cfg, rates)
    first, second = shape_cache.cached_shape(cfg, rates), shape_cache.cached_shape(cfg, rates)
    assert len(builds) == 1 and len(list(home.glob("*.json"))) == 1  # built once, then read
    assert numbers(first) == numbers(second) == numbers(built)
    assert second.target.rates == built.target.rates
    assert second.target.hf_config.num_hidden_layers == built.target.hf_config.get_text_config().num_hidden_layers
    assert second.hidden == {"demo": 576, "kimi": 7168}[name]
    shutil.rmtree(home)  # the README: the folder is safe to delete, the next plan builds again
    assert numbers(shape_cache.cached_shape(cfg, rates)) == numbers(built) and len(builds) == 2


def test_a_changed_draft_input_builds_again_and_another_field_does_not(home, builds):
    rates = cost_rates.load_rates()
    base = shape_cache.cached_shape(load_config(CONFIGS["demo"]), rates)
    two_layers = shape_cache.cached_shape(load_config(CONFIGS["demo"], ["train.num_layers=2"]), rates)
    assert len(builds) == 2 and two_layers.trainable > base.trainable
    shape_cache.cached_shape(load_config(CONFIGS["demo"], ["train.ttt_steps=5"]), rates)
    shape_cache.cached_shape(load_config(CONFIGS["demo"], ["extract.layer_ids=[1, 5, 9, 29]"]), rates)
    assert len(builds) == 4
    # the same draft under another learning rate and sample count: read, not built
    same = shape_cache.cached_shape(load_config(CONFIGS["demo"], ["train.lr=0.001", "data.max_samples=77"]), rates)
    assert len(builds) == 4 and numbers(same) == numbers(base)
    assert len(list(home.glob("*.json"))) == 4


@pytest.mark.parametrize("damage", ["not json {", '{"schema_version": 1}', "extra field", "foreign key",
                                    "schema 2", "number as text", "a text field missing"])
def test_a_damaged_entry_is_rebuilt(damage, home, builds):
    cfg, rates = load_config(CONFIGS["demo"]), cost_rates.load_rates()
    good = numbers(shape_cache.cached_shape(cfg, rates))
    (path,) = home.glob("*.json")
    entry = json.loads(path.read_text())
    bad = {"not json {": "not json {", '{"schema_version": 1}': '{"schema_version": 1}',
           "extra field": json.dumps({**entry, "pickle": "x"}),
           "foreign key": json.dumps({**entry, "key": "0" * 32, "trainable": 1}),
           "schema 2": json.dumps({**entry, "schema_version": 2}),
           "number as text": json.dumps({**entry, "trainable": str(entry["trainable"])}),
           "a text field missing": json.dumps({**entry, "text": {k: v for k, v in entry["text"].items()
                                                                 if k != "kv_lora_rank"}})}[damage]
    path.write_text(bad)
    assert numbers(shape_cache.cached_shape(cfg, rates)) == good
    assert len(builds) == 2  # rebuilt, and written back whole
    assert json.loads(path.read_text()) == entry


@pytest.mark.parametrize("keep", [1, 3])
def test_only_the_newest_entries_are_kept(keep, home, builds, monkeypatch):
    monkeypatch.setattr(shape_cache, "KEEP", keep)
    rates = cost_rates.load_rates()
    for n in (1, 2, 3, 4):
        shape_cache.cached_shape(load_config(CONFIGS["demo"], [f"train.num_layers={n}"]), rates)
        os.utime(max(home.glob("*.json"), key=lambda p: p.stat().st_mtime_ns), (n, n))  # in order, coarse clocks
    assert len(list(home.glob("*.json"))) == keep
    shape_cache.cached_shape(load_config(CONFIGS["demo"], ["train.num_layers=4"]), rates)
    assert len(builds) == 4  # the newest was kept
    shape_cache.cached_shape(load_config(CONFIGS["demo"], ["train.num_layers=1"]), rates)
    assert len(builds) == 5  # the oldest was not


def test_a_kept_shape_still_refuses_a_context_longer_than_the_target(home, builds):
    rates = cost_rates.load_rates()
    shape_cache.cached_shape(load_config(CONFIGS["kimi"]), rates)
    cfg = load_config(CONFIGS["kimi"], ["target.max_model_len=300000", "data.max_length=299999"])
    with pytest.raises(cost_rates.PlanError, match=r"target.max_model_len \(300000\) is longer than .* \(262144"):
        shape_cache.cached_shape(cfg, rates)
    assert len(builds) == 1  # read from the cache, and checked against this config


PLAN = """import sys
sys.argv = ["draftline", "plan", {config!r}]
from cli.app import app
try:
    app()
except SystemExit as exc:
    assert not exc.code, exc.code
print("IMPORTED", sorted({{m.split(".")[0] for m in sys.modules}} & {{"speculators", "torch", "transformers"}}))
"""


def test_a_second_plan_imports_neither_speculators_nor_torch_and_prints_the_same(tmp_path):
    env = {**os.environ, "DRAFTLINE_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    code = PLAN.format(config=str(CONFIGS["demo"]))
    cold, warm = (subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=300) for _ in range(2))
    assert cold.returncode == 0 and warm.returncode == 0, cold.stderr[-2000:] + warm.stderr[-2000:]
    plan_cold, imported_cold = cold.stdout.rsplit("IMPORTED", 1)
    plan_warm, imported_warm = warm.stdout.rsplit("IMPORTED", 1)
    assert imported_cold.strip() == "['speculators', 'torch', 'transformers']"  # the check sees a build's imports
    assert imported_warm.strip() == "[]"
    assert plan_warm == plan_cold and "| **total** |" in plan_warm


def test_without_draftline_home_the_shapes_are_kept_under_the_users_cache(tmp_path, monkeypatch, builds):
    monkeypatch.delenv("DRAFTLINE_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    shape_cache.cached_shape(load_config(CONFIGS["demo"]), cost_rates.load_rates())
    assert len(list((tmp_path / ".cache" / "draftline" / shape_cache.FOLDER).glob("*.json"))) == 1
