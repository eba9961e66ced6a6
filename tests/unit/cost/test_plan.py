"""`draftline plan`: the runbook's tables are its output, its rates name real sources, and its formulas
give back what benchmarks/RESULTS.md measured."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tasks.cost import plan as planner
from tasks.cost import rates as cost_rates
from tasks.cost import shape as cost_shape
from cli.app import app
from tasks.core.config import HeadConfig
from tasks.core.config_load import load_config

ROOT = Path(__file__).resolve().parents[3]
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
    for figure in ("18.67 GFLOP per token", "1.47B generated", "105 TB", "57,349", "28,693", "$13,211", "$5,589",
                   "902 TB", "$2,424 per month", "61.1", "12.32"):
        assert figure in out.output, figure
        assert figure.split()[0] in prose, f"docs/kimi-k2.5.md's text no longer quotes {figure}"
    # what the issue asks of it: every stage, both dtypes, totals, and a source for every rate
    assert "| **total** |" in out.output and "written, fp8" in out.output
    rates = _rate_rows(out.output)
    assert len(rates) >= 15
    for cells in rates.values():
        assert cells[3] in ("measured", "cited", "assumption") and len(cells[4]) > 20, cells
    assert "| **total** |" in out.output and "cost, 4 node(s) held" in out.output


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
    entries = cost_rates.all_rates()
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
    # a cited figure says it is not reproduced here; an assumption says why
    for r in entries:
        assert r.kind != "cited" or "not measured" in r.source.lower(), r


def _shape_only_target(rates: dict, name: str, config: dict) -> None:
    """A target known by its config.json fields alone (its rates are not what these tests look at)."""
    rate = {"value": 1.0, "unit": "-", "kind": "assumption", "source": "a test's stand-in"}
    rates["targets"][name] = {"config": config, "active_params": rate,
                              "machines": {rates["machine"]: {k: rate for k in cost_rates.TARGET_RATES}}}


def _draft_flops(rates: dict, cfg, layer_ids: list[int], tmp_path: Path) -> tuple[float, int]:
    from tasks.train.model import flops_per_token

    target = cost_rates.load_target(cfg, rates, tmp_path)
    draft = cost_shape.draft_model(cfg, target, layer_ids)
    return flops_per_token(draft, cfg.train.ttt_steps), cost_shape.trainable_params(draft)


def test_the_formulas_give_back_the_measured_figures(tmp_path):
    # bytes per token of an extract part: RESULTS measured 4,613 (bf16) and 2,325 (fp8) on SmolLM2's 4 x 576
    assert cost_shape.hidden_bytes_per_token(4, 576, "bf16") == 4613
    assert cost_shape.hidden_bytes_per_token(4, 576, "fp8") == 2325
    # the 8B-shaped draft of RESULTS' H200 training runs: 6.52 GFLOP per token (tasks.train.model.flops_per_token)
    rates = cost_rates.load_rates()
    _shape_only_target(rates, "llama-3.1-8b-shape", {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256})
    cfg = load_config(None, ["target.model=llama-3.1-8b-shape", "vocab.draft_vocab_size=32000",
                             "train.ttt_steps=3"])
    flops, trainable = _draft_flops(rates, cfg, [2, 16, 29, 32], tmp_path / "8b")
    assert flops / 1e9 == pytest.approx(6.52, abs=0.01)
    assert trainable / 1e6 == pytest.approx(293.6, abs=0.5)  # RESULTS: 293.6M trainable
    # MFU x the H200's measured matmul rate / FLOPs per token = the measured tok/s (run C: 63,980, MFU 0.542)
    assert 0.542 * 762e12 / flops == pytest.approx(63_980, rel=0.02)
    # the Kimi-width loop of RESULTS (bench_train.py's random target at hidden 7168): 17.55 GFLOP per token, and
    # the plan's training MFU gives back its 30.1K tok/s on the H200's 762 TFLOP/s
    _shape_only_target(rates, "bench-train-random-7168", {
        "model_type": "llama", "hidden_size": 7168, "num_hidden_layers": 4, "num_attention_heads": 56,
        "num_key_value_heads": 14, "intermediate_size": int(3.5 * 7168), "vocab_size": 163840})
    cfg = load_config(None, ["target.model=bench-train-random-7168", "vocab.draft_vocab_size=32000",
                             "train.ttt_steps=3"])
    flops, trainable = _draft_flops(rates, cfg, [1, 2, 3, 4], tmp_path / "7168")
    assert flops / 1e9 == pytest.approx(17.55, abs=0.01) and trainable / 1e6 == pytest.approx(899.2, abs=0.5)
    mfu = rates["rates"]["train.mfu_flex_attention"].value
    assert mfu * 762e12 / flops == pytest.approx(30_100, rel=0.005)


KIMI = ROOT / "configs" / "kimi-k2.5-b300.yaml"


@pytest.fixture(scope="module")
def kimi_shape():
    """The Kimi preset's target and draft sizes, built once (no lever of the plan changes them)."""
    cfg = load_config(KIMI)
    return cost_shape.make_shape(cfg, cost_rates.load_rates())


ONE_HEAD = "train.heads=[{kind: eagle3}]"  # the preset with one head: the figures below are one train task's


def test_the_plan_follows_the_config_and_the_price(kimi_shape):
    rates = cost_rates.load_rates()
    kimi = load_config(KIMI, [ONE_HEAD])
    one = planner.make_plan(kimi, rates, nodes=1, shape=kimi_shape)
    four = planner.make_plan(kimi, rates, nodes=4, shape=kimi_shape)
    by1, by4 = ({s.stage: s for s in p.stages} for p in (one, four))
    # 600K samples, 4 layers x 7168 hidden; fp8 half the bytes of bf16
    assert by1["extract"].tokens == pytest.approx(600_000 * (600 + 0.6 * 4096))
    assert by1["extract"].bytes_bf16 == by1["extract"].tokens * 57_349
    assert by1["extract"].bytes_fp8 / by1["extract"].bytes_bf16 == pytest.approx(0.5, abs=0.001)
    # training tokens are steps x tokens per rank x 8 ranks, for every head of train.heads
    assert by1["train"].tokens == 60_000 * 16_384 * 8
    two = planner.make_plan(load_config(KIMI, ["train.heads=[{kind: eagle3}, {kind: eagle3.1, max_steps: 1000}]"]),
                            rates, shape=kimi_shape)
    assert {s.stage: s for s in two.stages}["train"].tokens == (60_000 + 1_000) * 16_384 * 8
    # each head kind is priced at its own FLOPs per token: a DFlash/DSpark block per sampled anchor (8 x 512 /
    # 16,384 = 0.25 decoder passes per token) against EAGLE-3's 3 TTT steps; EAGLE-3.1 and the MLA variant as EAGLE-3
    kinds = planner.make_plan(load_config(KIMI, ["train.heads=[{kind: eagle3}, {kind: eagle3-mla}, {kind: dflash}, "
                                                 "{kind: dspark}]"]), rates, shape=kimi_shape)
    cost = {h: kimi_shape.head_cost(HeadConfig(kind=h), kimi.train) for h in ("eagle3", "eagle3.1", "eagle3-mla",
                                                                              "dflash", "dspark")}
    assert cost["eagle3"] == cost["eagle3.1"] == cost["eagle3-mla"] == 1.0
    assert cost["dflash"] == cost["dspark"] == pytest.approx(
        (kimi_shape.flops_fixed + 0.25 * kimi_shape.flops_per_pass) / kimi_shape.train_flops) and cost["dflash"] < 0.5
    assert kinds.totals["train_compute_hours"] == pytest.approx(
        one.totals["train_compute_hours"] * (2 + 2 * cost["dflash"]))
    assert (f"eagle3 1.00, eagle3-mla 1.00, dflash {cost['dflash']:.2f}, dspark {cost['dspark']:.2f}"
            in " ".join(kinds.notes))
    # every kind but EAGLE-3's (whose MFU is measured) is priced by a rate named as the assumption it is
    named = {r.name: r for r in kinds.rates if r.name.startswith("train.head_cost.")}
    assert sorted(named) == ["train.head_cost.dflash", "train.head_cost.dspark", "train.head_cost.eagle3-mla"]
    assert all(r.kind == "assumption" and r.value == pytest.approx(cost[r.name.split(".")[-1]]) and
               "not measured on a GPU" in r.source for r in named.values())
    # each head's own train task: its hours, read-bound here (the store's reads, the same for every kind), add up
    # to the train stage's
    per_head = next(n for n in kinds.notes if n.startswith("Per head"))
    hours = [float(h) for h in re.findall(r": ([\d.]+) h \(", per_head)]
    assert len(hours) == 4 and per_head.count("read-bound") == 4
    assert sum(hours) == pytest.approx({s.stage: s for s in kinds.stages}["train"].wall_hours, rel=1e-3)
    # the Kimi presets' own heads (eagle3-mla, dflash of 6 layers): each priced on its own, its train task and its
    # benchmark engines (one per k); read-bound, so both train for the same hours whatever their FLOPs
    for preset in (KIMI, KIMI.with_name("kimi-k2.5-workstation.yaml")):
        out = draftline("plan", str(preset))
        assert out.exit_code == 0, out.output
        per_head = re.search(r"Per head[^\n]*", " ".join(out.output.split("\n- "))).group(0)
        assert re.search(r"engine per k in \[3, 7\]\): eagle3-mla \(eagle3-mla, 1 layer\(s\), 962M parameters\) 60,000 "
                         r"steps x 1.00: ([\d.,]+) h \(read-bound\), \$([\d,]+), \+ 2 engine\(s\) ([\d.]+) h, \$([\d,]+); "
                         r"dflash \(dflash, 6 layer\(s\), [\d.]+B parameters\) 60,000 steps x 0\.\d\d: \1 h \(read-bound\), "
                         r"\$\2, \+ 2 engine\(s\) \3 h, \$\4\.", per_head), per_head
    # more nodes: the sharded stages finish sooner, cost a little more (one engine start per node)
    assert by4["extract"].wall_hours < by1["extract"].wall_hours / 3
    assert by4["extract"].node_hours > by1["extract"].node_hours
    assert by4["train"].node_hours == by1["train"].node_hours
    # fp8 storage lifts the store bound of extraction and halves training's reads
    fp8 = planner.make_plan(load_config(KIMI, [ONE_HEAD, "extract.storage_dtype=fp8"]), rates, nodes=1, shape=kimi_shape)
    assert {s.stage: s for s in fp8.stages}["extract"].node_hours < by1["extract"].node_hours
    assert fp8.totals["train_read_bytes"] == pytest.approx(one.totals["train_read_bytes"] * 28_693 / 57_349)
    # checkpoints: 60 written, keep_checkpoints (2) kept, 12 bytes per trainable parameter
    assert by1["train"].bytes_bf16 == 60 * kimi_shape.trainable * 12
    assert by1["train"].kept == 2 * kimi_shape.trainable * 12
    # cost scales with the command line's price, which is named among the rates
    out = draftline("plan", str(KIMI), "--set", ONE_HEAD, "--gpu-hour-price", "3", "--storage-price-gb-month", "0.01",
                    "--json")
    assert out.exit_code == 0, out.output
    import json

    data = json.loads(out.output)
    assert data["totals"]["cost_held"] == pytest.approx(one.totals["cost_held"] / 2)
    assert data["totals"]["storage_month"] == pytest.approx(data["totals"]["kept"] / 1e9 * 0.01)
    sources = {r["source"] for r in data["rates"] if r["kind"] == "command line"}
    assert {"--gpu-hour-price 3", "--storage-price-gb-month 0.01"} <= sources
    # the demo config plans too (its target is in configs/rates.yaml)
    assert draftline("plan", "configs/demo.yaml").exit_code == 0


def test_engine_starts_are_priced_by_weight_bytes_and_counted_as_the_benchmark_starts_them(kimi_shape):
    """One engine start = engine.start_fixed_s + target.weights_gb / tensor_parallel_size x engine.start_s_per_gb
    (both measured on the lent H100); the benchmark's count is what tasks/benchmark/stage.py starts: the baseline,
    one per head and k, the replay's."""
    rates = cost_rates.load_rates()

    def bench(sets: list[str], rate_sets: list[str] = ()) -> float:
        r = cost_rates.load_rates(overrides=list(rate_sets)) if rate_sets else rates
        plan = planner.make_plan(load_config(KIMI, sets), r, shape=kimi_shape, levers=False)
        return {s.stage: s for s in plan.stages}["benchmark"].wall_hours

    fixed, per_gb = (rates["rates"][f"engine.{k}"].value for k in ("start_fixed_s", "start_s_per_gb"))
    assert load_config(KIMI).extract.tensor_parallel_size == 8
    start_h = (fixed + 595 / 8 * per_gb) / 3600
    assert load_config(KIMI).benchmark.num_speculative_tokens == [3, 7]  # the anchors' ks
    base = bench([ONE_HEAD, "benchmark.num_speculative_tokens=[3]"])
    assert bench([ONE_HEAD, "benchmark.num_speculative_tokens=[3]", "benchmark.offline_replay=true"]) - base == \
        pytest.approx(start_h)  # one more start, no decode
    decode = (base - 2 * start_h) / 2  # one engine's decoding (the baseline's and the draft's are priced alike)
    assert bench([ONE_HEAD, "benchmark.num_speculative_tokens=[1, 3, 5]"]) == pytest.approx(4 * (start_h + decode))
    assert bench(["train.heads=[{kind: eagle3}, {kind: eagle3.1}]", "benchmark.num_speculative_tokens=[3]"]) == \
        pytest.approx(3 * (start_h + decode))
    assert bench([]) == pytest.approx(5 * (start_h + decode))  # the preset: 2 heads x k in [3, 7], the baseline
    # the rate prices every start: the benchmark's two, one per node for regeneration and extraction
    one = [ONE_HEAD, "benchmark.num_speculative_tokens=[3]"]
    assert bench(one, [f"engine.start_s_per_gb={2 * per_gb}"]) - base == pytest.approx(2 * 595 / 8 * per_gb / 3600)
    assert bench(one + ["extract.tensor_parallel_size=4"]) - base == pytest.approx(2 * 595 / 8 * per_gb / 3600)
    plan = planner.make_plan(load_config(KIMI), rates, nodes=4, shape=kimi_shape, levers=False)
    minutes = f"{start_h * 60:,.1f}"
    assert any(n.startswith(f"Engine starts: {minutes} min each ({fixed:g} s, engine.start_fixed_s, + 595 GB of "
                            f"weights / 8 GPU(s) x {per_gb:g} s per GB") for n in plan.notes), plan.notes
    kinds = {r.name: r.kind for r in plan.rates}
    assert kinds["engine.start_s_per_gb"] == kinds["engine.start_fixed_s"] == "measured"


def _rate_rows(text: str) -> dict[str, list[str]]:
    rows = [line for line in text.splitlines() if re.match(r"\| [a-z_]+\.[a-z_0-9]+ \|", line)]
    return {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in rows)}


@pytest.mark.parametrize("nodes", [1, 4, 8])
def test_the_kimi_plan_prices_the_nodes_held_names_the_read_bound_and_the_dominant_stage(nodes, kimi_shape):
    rates = cost_rates.load_rates()
    rates["rates"]["node.gpu_hour_price"].value = 6.0
    p = planner.make_plan(load_config(KIMI), rates, nodes=nodes, shape=kimi_shape, config_name=str(KIMI))
    text = planner.render(p)
    by = {s.stage: s for s in p.stages}
    wall = sum(s.wall_hours for s in p.stages)
    # the nodes held for the whole wall-clock are paid for, not only their busy hours
    assert p.totals["cost_held"] == pytest.approx(nodes * wall * 8 * 6)
    assert f"{nodes} node(s) held for the {wall:,.1f} h wall-clock: **${p.totals['cost_held']:,.0f}**" in text
    # extraction and (REGENERATE_FANS_OUT) regeneration are dealt over the nodes; training and benchmark use one
    assert by["extract"].nodes == nodes and by["train"].nodes == 1 and by["benchmark"].nodes == 1
    assert by["regenerate"].nodes == (nodes if planner.REGENERATE_FANS_OUT else 1)
    if nodes > 1:  # renting per stage is cheaper than holding every node for training and the benchmark
        assert p.totals["cost_per_stage"] < p.totals["cost_held"]
        assert p.totals["cost_per_stage"] == pytest.approx(
            sum(s.nodes * s.wall_hours for s in p.stages) * 8 * 6)
        assert f"Renting per stage instead ({nodes} nodes for regenerate and extract" in text
    else:
        assert "Renting per stage" not in text
    # training: the slower of compute and reads, and the binding one named
    compute, read = p.totals["train_compute_hours"], p.totals["train_read_hours"]
    assert by["train"].wall_hours == pytest.approx(max(compute, read))
    assert p.totals["train_read_bytes"] == pytest.approx(by["train"].tokens * 57_349)
    bound = "compute" if compute >= read else "store read"  # 105 TB per epoch: most of it does not fit a cache
    assert f"**{bound}-bound**" in text
    # the dominant stage, and levers computed against it
    top = max(p.stages, key=lambda s: s.wall_hours)
    assert p.dominant == top.stage and f"Dominant stage: **{top.stage}**" in text
    levers = {lv["lever"]: lv for lv in p.levers}
    assert set(levers) == {f"--nodes {2 * nodes}", "--set extract.storage_dtype=fp8",
                           "--set data.max_samples=300000", "--set regenerate.max_tokens=2048"}
    assert levers["--set extract.storage_dtype=fp8"]["kept"] < p.totals["kept"] / 1.9
    assert levers["--set data.max_samples=300000"]["wall_hours"] < wall
    # each rate with its kind and source; regeneration's from the cited B300 figure, training's measured
    rows = _rate_rows(text)
    assert rows["target.decode_tok_s"][3] == "cited" and "1,059" in rows["target.decode_tok_s"][4]
    assert rows["train.mfu_flex_attention"][3] == "measured" and "30.1K" in rows["train.mfu_flex_attention"][4]
    for name in ("node.store_read_gb_s", "node.cache_read_gb_s", "node.cache_tb", "storage.gb_month_price"):
        assert name in rows
    for cells in rows.values():
        assert cells[3] in ("measured", "cited", "assumption") and len(cells[4]) > 20, cells


def test_regeneration_on_one_node_when_the_fan_out_assumption_is_flipped(kimi_shape, monkeypatch):
    monkeypatch.setattr(planner, "REGENERATE_FANS_OUT", False)
    p = planner.make_plan(load_config(KIMI), cost_rates.load_rates(), nodes=4, shape=kimi_shape)
    by = {s.stage: s for s in p.stages}
    assert by["regenerate"].nodes == 1 and by["regenerate"].wall_hours == pytest.approx(by["regenerate"].node_hours)
    monkeypatch.setattr(planner, "NODE_PART_CACHE", False)
    no_cache = planner.make_plan(load_config(KIMI), cost_rates.load_rates(), nodes=4, shape=kimi_shape)
    assert no_cache.totals["train_read_hours"] > p.totals["train_read_hours"]


def test_the_runs_own_stats_on_the_store_replace_the_assumed_lengths(tmp_path, monkeypatch):
    monkeypatch.delenv("DRAFTLINE_STORE_URI", raising=False)  # it would sit above --set store.uri
    from tasks.address import digests
    from tasks.store.artifacts import Store
    from tests.support.hub_cache import record_dataset_commits

    record_dataset_commits(monkeypatch, tmp_path / "hf")  # the hub datasets' commits, as a node that fetched them has

    uri = f"file://{tmp_path}/store"
    # the addresses hash what the target is (tasks/engine/weights.py): a local folder holding Kimi's config stands in
    # for the hub snapshot, which this offline machine cannot fingerprint
    model = tmp_path / "kimi-k2.5"
    cost_shape.make_shape(load_config(KIMI), cost_rates.load_rates()).target.hf_config.save_pretrained(model)
    sets = [f"store.uri={uri}", f"target.model={model}"]
    cfg = load_config(KIMI, sets)
    args = ["plan", str(KIMI), "--set", sets[0], "--set", sets[1], "--json"]

    def plan(*extra: str) -> dict:
        import json

        out = draftline(*args, *extra)
        assert out.exit_code == 0, out.output
        return json.loads(out.output)

    assumed = plan("--from-store")
    assert "no prepare artifact of this config" in assumed["notes"][0]
    # the preset trains on samples of up to data.max_length 12,287 tokens, the most max_model_len 12,288 takes
    # (issue 43: it trained at 8,192 and the plan warned about its own preset)
    assert not [n for n in assumed["notes"] if n.startswith("Lengths:")], assumed["notes"]
    assert cfg.data.max_length == cfg.target.max_model_len - 1 == 12_287
    shorter = draftline(*args, "--set", "data.max_length=8192")
    assert ("Lengths: contexts served up to target.max_model_len reach 12,287 tokens, past the longest training "
            "sample (data.max_length 8,192)") in shorter.output
    assert {s["stage"]: s for s in assumed["stages"]}["extract"]["tokens"] == pytest.approx(600_000 * 3057.6)
    # what prepare records: 1,000 samples of 900 tokens, 400 of them the data's answers
    store = Store(uri)
    prep_digest = digests.prepare(cfg)
    with store.write("prepare", prep_digest, digests.VERSIONS["prepare"]) as w:
        w.write_bytes("marker", b"stats only")
        prep = w.commit({"samples": 1000, "tokens": 900_000, "masked_tokens": 400_000, "num_shards": 512,
                         "longest": 1500, "length_buckets": {"<512": 10, "512-2K": 990}})
    p = plan("--from-store")
    assert "past the longest training sample (1,500 tokens; no training sample in 2K-8K, 8K-32K)" in [
        n for n in p["notes"] if n.startswith("Lengths:")][0]
    by = {s["stage"]: s for s in p["stages"]}
    assert by["prepare"]["tokens"] == 1000 * 500  # prompts only: 900 - 400
    assert by["extract"]["tokens"] == pytest.approx(1000 * (500 + 0.6 * 4096))
    assert "prompt from the run's prepare" in p["notes"][0] and "answer assumed" in p["notes"][0]
    # two regenerated shards: 20 samples, 1,500 generated tokens each on 520-token prompts
    reg_digest = digests.regenerate(cfg, prep.ref())
    for i in (0, 3):
        with store.write(digests.REGENERATE_SHARD, digests.regenerate_shard(reg_digest, i),
                         digests.VERSIONS["regenerate"]) as w:
            w.write_bytes("marker", b"stats only")
            w.commit({"samples": 10, "tokens": 10 * 2020, "generated_tokens": 10 * 1500, "prompts": 10,
                      "longest": 2100 + i, "length_buckets": {"512-2K": 5, "2K-8K": 5}})
    p = plan("--from-store")
    assert "(2,103 tokens; no training sample in 8K-32K)" in p["notes"][1]  # the regenerated answers' lengths
    by = {s["stage"]: s for s in p["stages"]}
    assert by["regenerate"]["tokens"] == pytest.approx(1000 * 1500)
    assert by["extract"]["tokens"] == pytest.approx(1000 * 2020)
    assert "from the run's prepare" in p["notes"][0] and "2 regenerate shard(s) (20 samples)" in p["notes"][0]
    kinds = {r["name"]: r["kind"] for r in p["rates"]}
    assert kinds["regenerate.prompt_tokens"] == kinds["regenerate.answer_tokens"] == "the run's stats"
    # without --from-store the store is not read
    assert {s["stage"]: s for s in plan()["stages"]}["extract"]["tokens"] == pytest.approx(600_000 * 3057.6)


def test_the_workstation_profile(kimi_shape):
    out = draftline("plan", str(KIMI), "--machine", "workstation-rtx-pro-6000")
    assert out.exit_code == 0, out.output
    assert "on workstation-rtx-pro-6000 (the user's own box: 8 x RTX PRO 6000" in out.output
    rows = _rate_rows(out.output)
    # its own rates, each an assumption that says how it is derived (no measurement of that box exists)
    for name, value in (("node.matmul_tflops", "385"), ("target.decode_tok_s", "1,330"),
                        ("extract.mfu_moe", "0.12"), ("node.store_read_gb_s", "1.25")):
        assert rows[name][1] == value and rows[name][3] == "assumption", rows[name]
    assert "PCIe" in rows["target.decode_tok_s"][4] and "8,472" in rows["target.decode_tok_s"][4]
    # the runbook quotes the box's regeneration hours from this output
    regen = next(line for line in out.output.splitlines() if line.startswith("| regenerate |"))
    hours = float(regen.split("|")[8].replace(",", ""))
    assert f"~{hours:.0f} h" in RUNBOOK.read_text()
    # slower than a B300 node at every GPU stage of the same config
    rates = cost_rates.load_rates(machine="workstation-rtx-pro-6000")
    box = planner.make_plan(load_config(KIMI), rates, shape=cost_shape.make_shape(load_config(KIMI), rates))
    node = planner.make_plan(load_config(KIMI), cost_rates.load_rates(), shape=kimi_shape)
    for stage in ("regenerate", "extract", "train"):
        assert ({s.stage: s for s in box.stages}[stage].wall_hours
                > {s.stage: s for s in node.stages}[stage].wall_hours), stage
    # one box: more nodes are refused with the way out; a preset named for the box picks it by default
    refused = draftline("plan", str(KIMI), "--machine", "workstation-rtx-pro-6000", "--nodes", "2")
    assert refused.exit_code == 2 and "--machine b300-node" in " ".join(refused.output.split())
    named = draftline("plan", str(KIMI), "--set", "name=kimi-k2.5-workstation")
    assert named.exit_code == 0 and "on workstation-rtx-pro-6000" in named.output, named.output


@pytest.mark.parametrize("args, message", [
    (["plan", "configs/demo.yaml", "--set", "data.max_samples=null"], "data.max_samples is not set"),
    (["plan", "configs/demo.yaml", "--rate", "node.warp_speed=9"], "is not a rate; one of"),
    (["plan", "configs/demo.yaml", "--rate", "node.gpus=eight"], "expected NAME=NUMBER"),
    (["plan", "configs/demo.yaml", "--rate", "target.decode=5"], "is not a rate; one of"),
    (["plan", "configs/demo.yaml", "--machine", "laptop"], "is not in rates.yaml; one of: b300-node"),
    (["plan", "configs/demo.yaml", "--machine", "workstation-rtx-pro-6000"], "machines: workstation-rtx-pro-6000"),
    (["plan", "configs/demo.yaml", "--storage-price-gb-month", "0"], "--storage-price-gb-month must be positive"),
    (["plan", "configs/demo.yaml", "--nodes", "0"], "--nodes must be 1 or more"),
    (["plan", "configs/demo.yaml", "--gpu-hour-price", "-1"], "--gpu-hour-price must be positive"),
    (["plan", "configs/demo.yaml", "--set", "target.model=./no-such-model"], "configs/rates.yaml"),
    (["plan", "configs/nope.yaml"], "not found"),
    (["plan", "configs/demo.yaml", "--set", "train.heads=[{kind: eagle3}, {kind: eagle3-mla, name: mla}]"],
     "train.heads: head 'mla' is eagle3-mla, which needs an MLA target (kv_lora_rank in its config: DeepSeek-V3, "
     "Kimi-K2.5); target 'smollm2-135m-instruct' has llama layers without MLA. Fix: give that head kind eagle3 or "
     "eagle3.1 for this target, or drop it"),
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
    # trained at the length it serves (issue 43): samples as long as the served context, the most extraction takes
    assert cfg.data.max_length + 1 == cfg.target.max_model_len == 12_288
    # the mix's usual prompt gets the whole answer budget; a long one (LongAlign-10k) the room it leaves, batched
    # (tests/unit/data/test_regenerate.py::test_overlong_prompts_are_filtered_before_generating)
    assert cost_rates.load_rates()["rates"]["regenerate.prompt_tokens"].value + cfg.regenerate.max_tokens <= 12_288
    assert any(s.hub == "THUDM/LongAlign-10k" for s in cfg.data.sources)
    e = cfg.extract
    assert e.batch_tokens > e.part_tokens  # so engine batches are dealt into parts of at most part_tokens
    part_bytes = e.part_tokens * len(e.layer_ids) * 7168 * 2  # Kimi-K2.5's hidden size, bf16
    assert f"{part_bytes / 1e9:.2f} GB per part" in (ROOT / "configs" / "kimi-k2.5-b300.yaml").read_text()


def test_a_local_copy_of_a_known_target_plans_with_its_rates(tmp_path, kimi_shape):
    # the workstation's /models/kimi-k2.5 (issue 26): the same config.json under a path, no weights needed
    rates = cost_rates.load_rates()
    cost_shape.make_shape(load_config(KIMI), rates).target.hf_config.save_pretrained(tmp_path / "kimi-k2.5")
    out = draftline("plan", str(KIMI), "--set", f"target.model={tmp_path / 'kimi-k2.5'}", "--nodes", "4")
    assert out.exit_code == 0, out.output
    assert "has the shape of moonshotai/Kimi-K2.5" in " ".join(out.output.split())
    assert "| target.decode_tok_s | 8,472 |" in out.output and "18.67 GFLOP per token" in out.output


def test_training_on_several_nodes_is_priced_on_that_many(kimi_shape):
    rates = cost_rates.load_rates()
    one, two = (planner.make_plan(load_config(KIMI, sets), rates, nodes=4, shape=kimi_shape)
                for sets in ([], ["train.nodes=2"]))
    t1, t2 = (next(s for s in p.stages if s.stage == "train") for p in (one, two))
    # batch_tokens is per rank: two nodes train twice the tokens in the same steps, in no more hours (each node
    # reads its share; the one store read of the first epoch is a smaller fraction of the tokens)
    assert (t1.nodes, t2.nodes) == (1, 2) and t2.tokens == 2 * t1.tokens
    assert 0.9 * t1.wall_hours < t2.wall_hours <= t1.wall_hours
    assert t2.node_hours == pytest.approx(2 * t2.wall_hours) and t1.node_hours == pytest.approx(t1.wall_hours)


def test_a_context_longer_than_the_target_allows_is_refused_by_the_plan(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, vocab_size=1000,
                max_position_embeddings=1024).save_pretrained(tmp_path / "model")
    cfg = load_config("configs/demo.yaml", [f"target.model={tmp_path / 'model'}", "target.max_model_len=4096",
                                            "data.max_length=1000"])
    with pytest.raises(cost_rates.PlanError, match=r"target.max_model_len \(4096\) is longer than .* allows \(1024 tokens"):
        cost_rates.load_target(cfg, cost_rates.load_rates(), tmp_path / "t")


def test_prepare_is_priced_per_encoding_worker_times_the_workers_it_runs(kimi_shape):
    """prepare.samples_per_s is one process's; on several workers (data.workers, or its default on the node's
    cores, node.cpus: one per core, at most 32, one per 2,000 samples) the plan prices the parent's serial part
    plus a worker's part (one process's time per sample less the parent's) shared by the workers at
    prepare.worker_efficiency, and says so."""
    rates = cost_rates.load_rates()
    one = rates["rates"]["prepare.samples_per_s"].value
    eff = rates["rates"]["prepare.worker_efficiency"].value
    parent = rates["rates"]["prepare.parent_s_per_sample"].value
    for name in ("samples_per_s", "worker_efficiency", "parent_s_per_sample"):  # each cites its RESULTS section
        r = rates["rates"][f"prepare.{name}"]
        assert r.kind == "measured" and "RESULTS \"prepare over a node's cores\"" in r.source, name
    worker = 1 / one - parent
    assert 0 < worker < 1 / one

    def prepare(sets=(), rate_sets=()):
        r = cost_rates.load_rates(overrides=list(rate_sets)) if rate_sets else rates
        plan = planner.make_plan(load_config(KIMI, list(sets)), r, shape=kimi_shape, levers=False)
        note = next(n for n in plan.notes if n.startswith("Prepare:"))
        return {s.stage: s for s in plan.stages}["prepare"].wall_hours, note

    hours, note = prepare(["data.workers=1"])
    assert hours == pytest.approx(600_000 / one / 3600) and "in one process (data.workers 1) =" in note
    hours, note = prepare(["data.workers=2"])
    assert hours == pytest.approx(600_000 * (parent + worker / (2 * eff)) / 3600)
    assert f"on 2 encoding workers (data.workers 2) the parent's own {parent * 1e3:g} ms" in note
    assert f"/ (2 x {eff:g} (prepare.worker_efficiency))" in note
    # the default: the node's cores, capped at 32 (the preset's 600,000 samples allow 300)
    for cpus, workers in ((8, 8), (112, 32)):
        hours, note = prepare(rate_sets=[f"node.cpus={cpus}"])
        assert hours == pytest.approx(600_000 * (parent + worker / (workers * eff)) / 3600)
        assert f"on {workers} encoding workers (data.workers' default on node.cpus {cpus}" in note
    # more workers never cost more time, and the parent's part bounds it however many there are
    assert prepare(rate_sets=["node.cpus=112"])[0] < prepare(rate_sets=["node.cpus=8"])[0]
    assert prepare(rate_sets=["node.cpus=112"])[0] > 600_000 * parent / 3600
    # and one per 2,000 conversations to encode (the samples and the preset's 2,000 held out)
    hours, note = prepare(["data.max_samples=7000"], ["node.cpus=112"])
    assert "on 4 encoding workers" in note and hours == pytest.approx(7_000 * (parent + worker / (4 * eff)) / 3600)



def test_a_parent_part_longer_than_one_process_is_refused(kimi_shape):
    """The parent's part is a share of one process's time per sample: a rates file (or --rate) that makes it the
    larger is two figures from different measurements, and the plan says which to set, not a negative time."""
    r = cost_rates.load_rates(overrides=["prepare.parent_s_per_sample=0.02", "node.cpus=8"])
    with pytest.raises(cost_rates.PlanError, match=r"prepare.parent_s_per_sample \(0.02 s\) is not below .*"
                                                   r"1 / prepare.samples_per_s"):
        planner.make_plan(load_config(KIMI), r, shape=kimi_shape, levers=False)
