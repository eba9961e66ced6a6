"""A seventh stage is its module and one registry line: the real flow (flows/pipeline.py) runs it, its variants
as tasks of their own, shows what it shows in the Prefect UI, and `resolve` (tasks/store/resolve.py) finds its
artifacts, with nothing in flows/ or cli/ changed; the process builds one Store for all of it. Two stages are registered after the six, which are switched
off here so that the flow runs in seconds: a stage with no inputs, and one whose variants are the config's heads
(at two counts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ALPHA = '''
from tasks.core.digest import stage_digest
from tasks.store.stages import Shown, Stage


def address(cfg, store):
    return stage_digest("alpha", {"samples": cfg.data.max_samples}, version="1")


def run(cfg, store, *, digest=None):
    digest = digest or address(cfg, store)

    def make():
        with store.write("alpha", digest, "1") as w:
            w.write_bytes("alpha.txt", b"made by the seventh stage")
            return w.commit({"samples": cfg.data.max_samples}).ref()

    return store.found_or_compute("alpha", digest, make)


def show(cfg, store, made):
    return Shown(markdown=[("alpha-note", "What alpha made", f"alpha: {made['alpha'].stats['samples']} samples")],
                 stats={"shown": "yes"})


STAGE_DEF = Stage(name="alpha", inputs=(), address=address, run=run, show=show)
'''

BETA = '''
from tasks.core.config import head_config
from tasks.core.digest import stage_digest
from tasks.store.stages import Stage


def address(cfg, store, alpha):
    return stage_digest("beta", {"head": cfg.train.head.label}, {"alpha": alpha.digest}, version="1")


def run(cfg, store, alpha, *, digest=None):
    digest = digest or address(cfg, store, alpha)

    def make():
        with store.write("beta", digest, "1", {"alpha": alpha.digest}) as w:
            w.write_bytes("beta.txt", cfg.train.head.label.encode())
            return w.commit({"head": cfg.train.head.label}).ref()

    return store.found_or_compute("beta", digest, make)


STAGE_DEF = Stage(name="beta", inputs=("alpha",), address=address, run=run,
                  variants=lambda cfg: [(h.label, head_config(cfg, h)) for h in cfg.train.heads])
'''

RUN = '''
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from tasks.core import stages
stages.register(stages.StageEntry("alpha", "throwaway_alpha"))  # the one line a new stage adds
stages.register(stages.StageEntry("beta", "throwaway_beta"))
# the six stages of draftline switched off for this run (their `enabled`), so that only the new ones do work
import tasks.store.stages as defs
switched = tuple(st if st.name in ("alpha", "beta") else dataclasses.replace(st, enabled=lambda cfg: False)
                 for st in defs.stage_defs())
defs.stage_defs = lambda: switched
from prefect.client.orchestration import get_client
from flows.pipeline import pipeline
from tasks.core.config_load import load_config
from tasks.store.artifacts import Store
from tasks.store.resolve import resolve

built = []  # every Store this process builds (the flow, each stage task, the resolution after)
init = Store.__init__
Store.__init__ = lambda self, *a, **k: built.append(1) or init(self, *a, **k)

overrides = sys.argv[2:]
out = pipeline(config_path=None, overrides=overrides)
cfg = load_config(None, overrides)
found = resolve(cfg, Store.from_config(cfg.store))
with get_client(sync_client=True) as client:
    notes = [a.data for a in client.read_artifacts() if a.key == "alpha-note"]
print(json.dumps({"stages": {k: [v["status"], v.get("stats", {})] for k, v in out["stages"].items()},
                  "beta": [[a.variant, a.digest, a.artifact is not None] for a in found.addresses["beta"]],
                  "alpha": found.of("alpha").digest, "missing": found.missing, "notes": notes,
                  "stores_built": len(built)}))
'''


def run_flow(tmp_path: Path, server, *sets: str) -> dict:
    for name, text in (("throwaway_alpha", ALPHA), ("throwaway_beta", BETA)):
        (tmp_path / f"{name}.py").write_text(text)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), **server.env())
    args = [f"store.uri=file://{tmp_path}/store", "data.max_samples=7", *sets]
    out = subprocess.run([sys.executable, "-c", RUN, str(tmp_path), *args], env=env, capture_output=True,
                         text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_seventh_stage_runs_in_the_flow_and_resolves_with_its_variants(prefect_server, tmp_path):
    one = run_flow(tmp_path, prefect_server)
    assert one["stages"]["alpha"][0] == "ran" and one["stages"]["beta"][0] == "ran", one
    assert one["stages"]["alpha"][1]["shown"] == "yes"  # its `show` reached the run's summary
    assert any("alpha: 7 samples" in (n or "") for n in one["notes"]), one["notes"]  # and the Prefect UI
    assert [(label, found) for label, _, found in one["beta"]] == [("eagle3", True)] and one["missing"] is None
    assert one["stores_built"] == 1  # one Store in the process: the flow's, its stage tasks' and resolve's

    two_heads = ["train.heads=[{kind: eagle3}, {kind: dflash}]"]
    two = run_flow(tmp_path, prefect_server, *two_heads)
    assert two["stages"]["alpha"][0] == "cached", two  # the same address: found, not made again
    assert two["alpha"] == one["alpha"]
    labels = [label for label, _, _ in two["beta"]]
    assert len(labels) == 2 and labels[0] == "eagle3" and all(found for *_, found in two["beta"]), two
    assert two["beta"][0][1] == one["beta"][0][1]  # the first head keeps its address beside a second one
    assert len({digest for _, digest, _ in two["beta"]}) == 2
    assert two["stores_built"] == 1
