"""`draftline plan`: the runbook's tables are its output, its rates name real sources, and its formulas
give back what benchmarks/RESULTS.md measured."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows import plan as planner
from flows.cli import app
from tasks.config import load_config

ROOT = Path(__file__).resolve().parents[1]
RUNBOOK = ROOT / "docs" / "kimi-k2.5.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"


def draftline(*args: str):
    return CliRunner().invoke(app, list(args))


def test_the_runbook_shows_the_plan_commands_output_unchanged():
    doc = RUNBOOK.read_text()
    m = re.search(r"<!-- plan: (.+?) -->\n(.*?)<!-- end of plan -->", doc, re.S)
    assert m, "docs/kimi-k2.5.md lost its plan markers"
    args = m.group(1).split()
    assert f".venv/bin/draftline plan {m.group(1)}" in doc  # the command is shown with its output
    out = draftline("plan", *args)
    assert out.exit_code == 0, out.output
    assert m.group(2) == out.output, ("docs/kimi-k2.5.md is stale: paste the output of "
                                      f"`draftline plan {m.group(1)}` between the plan markers")
    # the prose around the table quotes figures of this output: they must be in it
    prose = doc[:m.start()] + doc[m.end():]
    for figure in ("18.67 GFLOP per token", "1.47B generated", "105 TB", "57,349", "28,693"):
        assert figure in out.output, figure
        assert figure.split()[0] in prose, f"docs/kimi-k2.5.md's text no longer quotes {figure}"
    # what the issue asks of it: every stage, both dtypes, totals, and a source for every rate
    assert "| **total** |" in out.output and "store, fp8" in out.output
    rates = [line for line in out.output.splitlines() if re.match(r"\| [a-z_]+\.[a-z_0-9]+ \|", line)]
    assert len(rates) >= 10
    for line in rates:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[3] in ("measured", "assumption") and len(cells[4]) > 20, line


def _section(heading: str) -> str:
    text = RESULTS.read_text()
    starts = [m for m in re.finditer(r"^#{2,3} (.+)$", text, re.M) if m.group(1).startswith(heading)]
    assert starts, f"benchmarks/RESULTS.md has no section {heading!r}"
    start = starts[0].end()
    nxt = re.search(r"^## ", text[start:], re.M)
    return text[start:start + nxt.start()] if nxt else text[start:]


def _spellings(value: float) -> set[str]:
    out = {f"{value:g}", f"{value:,.0f}", f"{value:,g}"}
    if value >= 1e6:
        out.add(f"{value / 1e9:g}B")
    return out


def test_every_measured_rate_is_written_in_the_results_section_it_names():
    rates = planner.load_rates()
    entries = list(rates["rates"].values())
    for model, entry in rates["targets"].items():
        entries += [planner._rate(f"{model}.{k}", v) for k, v in entry.items() if k != "config"]
    measured = [r for r in entries if r.kind == "measured"]
    assert len(measured) >= 4
    for r in measured:
        m = re.search(r'RESULTS "([^"]+)"', r.source)
        assert m, f"{r.name}: a measured rate names its RESULTS.md section in quotes: {r.source}"
        section = _section(m.group(1).rstrip(". "))
        assert any(s in section for s in _spellings(r.value)), \
            f"{r.name} = {r.value:g} is not written in RESULTS.md's section {m.group(1)!r}"
    for r in entries:
        assert r.source and r.unit, r


def test_the_formulas_give_back_the_measured_figures(tmp_path):
    # bytes per token of an extract part: RESULTS measured 4,613 (bf16) and 2,325 (fp8) on SmolLM2's 4 x 576
    assert planner.hidden_bytes_per_token(4, 576, "bf16") == 4613
    assert planner.hidden_bytes_per_token(4, 576, "fp8") == 2325
    # the 8B-shaped draft of RESULTS' H200 training runs: 6.52 GFLOP per token (tasks.train_model.flops_per_token)
    rates = planner.load_rates()
    rates["targets"]["llama-3.1-8b-shape"] = {"config": {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}}
    cfg = load_config(None, ["target.model=llama-3.1-8b-shape", "vocab.draft_vocab_size=32000",
                             "train.ttt_steps=3"])
    rates["targets"]["llama-3.1-8b-shape"].update({k: {"value": 8e9, "unit": "-", "kind": "assumption",
                                                       "source": "test"} for k in
                                                   ("active_params", "engine_start_minutes", "decode_tok_s")})
    from tasks.train_model import flops_per_token

    target = planner.load_target(cfg, rates, tmp_path)
    draft = planner.draft_model(cfg, target, [2, 16, 29, 32])
    flops = flops_per_token(draft, 3)
    assert flops / 1e9 == pytest.approx(6.52, abs=0.01)
    assert planner.trainable_params(draft) / 1e6 == pytest.approx(293.6, abs=0.5)  # RESULTS: 293.6M trainable
    # MFU x the H200's measured matmul rate / FLOPs per token = the measured tok/s (run C: 63,980, MFU 0.542)
    assert 0.542 * 762e12 / flops == pytest.approx(63_980, rel=0.02)


def test_the_plan_follows_the_config_and_the_price():
    rates = planner.load_rates()
    kimi = load_config(ROOT / "configs" / "kimi-k2.5-b300.yaml")
    one = planner.make_plan(kimi, rates, nodes=1)
    four = planner.make_plan(kimi, rates, nodes=4)
    by1, by4 = ({s.stage: s for s in p.stages} for p in (one, four))
    # 600K samples, 4 layers x 7168 hidden; fp8 half the bytes of bf16
    assert by1["extract"].tokens == pytest.approx(600_000 * (600 + 0.6 * 4096))
    assert by1["extract"].bytes_bf16 == by1["extract"].tokens * 57_349
    assert by1["extract"].bytes_fp8 / by1["extract"].bytes_bf16 == pytest.approx(0.5, abs=0.001)
    # training tokens are steps x tokens per rank x 8 ranks, for every head of train.heads
    assert by1["train"].tokens == 60_000 * 16_384 * 8
    two = planner.make_plan(load_config(ROOT / "configs" / "kimi-k2.5-b300.yaml",
                                        ["train.heads=[{kind: eagle3}, {kind: eagle3.1, max_steps: 1000}]"]), rates)
    assert {s.stage: s for s in two.stages}["train"].tokens == (60_000 + 1_000) * 16_384 * 8
    # more nodes: the sharded stages finish sooner, cost a little more (one engine start per node)
    assert by4["extract"].wall_hours < by1["extract"].wall_hours / 3
    assert by4["extract"].node_hours > by1["extract"].node_hours
    assert by4["train"].node_hours == by1["train"].node_hours
    # fp8 storage lifts the store bound of extraction
    fp8 = planner.make_plan(load_config(ROOT / "configs" / "kimi-k2.5-b300.yaml", ["extract.storage_dtype=fp8"]),
                            rates, nodes=1)
    assert {s.stage: s for s in fp8.stages}["extract"].node_hours < by1["extract"].node_hours
    # cost is node-hours x GPUs x price; the command line's price is used and named
    out = draftline("plan", "configs/kimi-k2.5-b300.yaml", "--gpu-hour-price", "3", "--json")
    assert out.exit_code == 0, out.output
    import json

    data = json.loads(out.output)
    assert data["totals"]["cost"] == pytest.approx(one.totals["cost"] / 2)
    assert any(r["kind"] == "command line" and r["source"] == "--gpu-hour-price 3" for r in data["rates"])
    # the demo config plans too (its target is in configs/rates.yaml)
    assert draftline("plan", "configs/demo.yaml").exit_code == 0


@pytest.mark.parametrize("args, message", [
    (["plan", "configs/demo.yaml", "--set", "data.max_samples=null"], "data.max_samples is not set"),
    (["plan", "configs/demo.yaml", "--rate", "node.warp_speed=9"], "is not a rate; one of"),
    (["plan", "configs/demo.yaml", "--rate", "node.gpus=eight"], "expected NAME=NUMBER"),
    (["plan", "configs/demo.yaml", "--nodes", "0"], "--nodes must be 1 or more"),
    (["plan", "configs/demo.yaml", "--gpu-hour-price", "-1"], "--gpu-hour-price must be positive"),
    (["plan", "configs/demo.yaml", "--set", "target.model=./no-such-model"], "configs/rates.yaml"),
    (["plan", "configs/nope.yaml"], "not found"),
])
def test_bad_input_names_the_fix(args, message):
    out = draftline(*args)
    assert out.exit_code == 2, out.output
    assert message in " ".join(out.output.split()), out.output


PRESETS = sorted(p for p in (ROOT / "configs").glob("*.yaml") if p.name != "rates.yaml")  # rates: not a run


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_passes_config_show_and_plan(preset):
    """A preset that `config show` or `plan` refuses (e.g. data.max_length >= target.max_model_len, a
    misspelt engine argument) fails here, not hours into a run."""
    shown = draftline("config", "show", str(preset))
    assert shown.exit_code == 0, shown.output
    cfg = load_config(preset)
    assert f"name: {cfg.name}" in shown.output and "engines:" in shown.output
    plan = draftline("plan", str(preset))
    assert plan.exit_code == 0, plan.output
    assert f"Plan for {preset}" in plan.output and "| **total** |" in plan.output


def test_the_kimi_preset_leaves_room_and_its_parts_are_the_size_its_comment_says():
    cfg = load_config(ROOT / "configs" / "kimi-k2.5-b300.yaml")
    assert cfg.data.max_length + 1 <= cfg.target.max_model_len
    assert cfg.data.max_length + cfg.regenerate.max_tokens <= cfg.target.max_model_len
    e = cfg.extract
    assert e.batch_tokens > e.part_tokens  # so engine batches are dealt into parts of at most part_tokens
    part_bytes = e.part_tokens * len(e.layer_ids) * 7168 * 2  # Kimi-K2.5's hidden size, bf16
    assert f"{part_bytes / 1e9:.2f} GB per part" in (ROOT / "configs" / "kimi-k2.5-b300.yaml").read_text()
