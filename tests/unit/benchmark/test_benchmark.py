"""The benchmark stage: report math and rendering on fabricated counters (fast), one real vLLM run (slow)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from tasks.address import digests
from tasks.formats.acceptance import simulated_acceptance_length
from tasks.benchmark.results import find_report, load_report
from tasks.benchmark.stage import check_draft, draft_folder, run_benchmark
from tasks.benchmark import BenchmarkError
from tasks.benchmark.measure import acceptance_figures, histogram_delta, measure, RunResult, SpecCounters
from tasks.benchmark.prompts import load_eval_prompts, select_evenly
from tasks.benchmark.results import assemble_report, report_stats
from tasks.benchmark.replay import chain_lengths, position_average, replay, replay_average
from tasks.benchmark.report import plot_report, render_terminal, report_markdown, report_table_rows
from tasks.core.config import BenchmarkConfig, EvalConfig, RunConfig, SourceConfig
from tasks.store.artifacts import Store

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- helpers

def bench_cfg(**kw) -> RunConfig:
    b = dict(evals=[EvalConfig(name="mtbench", source=SourceConfig(preset="mtbench"), num_prompts=2),
                    EvalConfig(name="heldout", source="heldout", num_prompts=2)],
             num_speculative_tokens=[1, 3], batch_sizes=[1, 4], temperature=0.0, max_tokens=8)
    b.update(kw)
    return RunConfig(benchmark=BenchmarkConfig(**b))


def run(bs: int, outputs: list[list[int]], seconds: float, spec: SpecCounters | None = None,
        ttft: float | None = 12.0, tpot: float | None = 4.0) -> RunResult:
    return RunResult(bs, outputs, seconds, ttft, tpot, spec)


OUTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]


def fabricated_report(cfg: RunConfig, acc=(0.5, 0.4, 0.3), k3_diverges: bool = True,
                      replayed: dict | None = None, draft_info: dict | None = None,
                      base_outs: dict[int, list] | None = None, k3_outs: dict[int, list] | None = None,
                      controls: dict[str, list] | None = None) -> dict:
    """Baseline 12 tokens/s... figures chosen so the expected numbers are easy to check by hand.

    base_outs / k3_outs: greedy outputs per batch size of the baseline / the k=3 engine (default OUTS, and
    OUTS with a token changed when k3_diverges); controls: extra baseline decodes (label -> outputs)."""
    from tasks.benchmark.prompts import EvalPrompts

    evals = [EvalPrompts(e.name, e.name, [[1, 2]] * 2, ["a", "b"], 2, requested=2) for e in cfg.benchmark.evals]
    bo = base_outs or {1: OUTS, 4: OUTS}
    base = {e.name: {1: run(1, bo[1], 1.0), 4: run(4, bo[4], 0.5)} for e in evals}
    k1 = SpecCounters(drafts=100, draft_tokens=100, accepted=45, per_pos=[45])       # AL 1.45
    k3 = SpecCounters(drafts=100, draft_tokens=300, accepted=44, per_pos=[30, 10, 4])  # AL 1.44
    diverged = [[1, 2, 3, 4, 5, 6], [7, 8, 99, 10, 11, 12]] if k3_diverges else OUTS
    ko = k3_outs or {1: diverged, 4: diverged}
    spec = {
        1: {e.name: {1: run(1, bo[1], 2.0, k1), 4: run(4, bo[4], 1.0, k1)} for e in evals},
        3: {e.name: {1: run(1, ko[1], 1.5, k3), 4: run(4, ko[4], 2.0, k3)} for e in evals},
    }
    stats = {"val_acc_per_pos": list(acc)} if acc else {}
    mb = {"flow_run_id": "run-123", "date": "2026-12-02T00:00:00+00:00", "machine": "test: 2 x cpu"}
    ctrl = {e.name: {label: run(4, outs, 0.5) for label, outs in controls.items()} for e in evals} if controls else None
    return assemble_report(cfg, evals, base, spec, stats, draft_info or {"draft_vocab_size": 8}, mb,
                           {"total_s": 1.0, "engine_start_s": {"baseline": 30.0}}, replayed, ctrl)


# --------------------------------------------------------------------------- math

def test_simulated_acceptance_length_is_the_cumulative_product():
    assert simulated_acceptance_length([0.5, 0.4, 0.3]) == pytest.approx(1 + 0.5 + 0.2 + 0.06)
    assert simulated_acceptance_length([0.5, 0.4, 0.3], k=1) == pytest.approx(1.5)
    # beyond the trained positions the last accuracy repeats
    assert simulated_acceptance_length([0.5, 0.4], k=3) == pytest.approx(1 + 0.5 + 0.2 + 0.08)
    assert simulated_acceptance_length(None) is None and simulated_acceptance_length([]) == 1.0
    assert simulated_acceptance_length([1.0, 1.0, 1.0]) == pytest.approx(4.0)


def test_acceptance_figures_from_counter_deltas():
    before = SpecCounters.from_metrics({"vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_draft_tokens": 30,
                                        "vllm:spec_decode_num_accepted_tokens": 12,
                                        "vllm:spec_decode_num_accepted_tokens_per_pos": [6, 4, 2]})
    after = SpecCounters.from_metrics({"vllm:spec_decode_num_drafts": 110, "vllm:spec_decode_num_draft_tokens": 330,
                                       "vllm:spec_decode_num_accepted_tokens": 132,
                                       "vllm:spec_decode_num_accepted_tokens_per_pos": [66, 44, 22]})
    f = acceptance_figures(after - before, k=3)
    assert f["mean_acceptance_length"] == pytest.approx(2.2)
    assert f["per_position_acceptance"] == pytest.approx([0.6, 0.4, 0.2])
    assert f["per_position_conditional"] == pytest.approx([0.6, 0.4 / 0.6, 0.5])
    assert f["draft_acceptance_rate"] == pytest.approx(0.4)
    # per-position acceptance can never rise with the position, and sums to the accepted share
    assert sum(f["per_position_acceptance"]) == pytest.approx(f["mean_acceptance_length"] - 1)


def test_no_drafts_is_an_error_that_says_why():
    with pytest.raises(BenchmarkError, match="no speculative drafts"):
        acceptance_figures(SpecCounters(), k=3)


def test_histogram_delta():
    before = {"h": {"count": 2, "sum": 0.5}}
    after = {"h": {"count": 5, "sum": 2.0}}
    assert histogram_delta(before, after, "h") == (3, 1.5)
    assert histogram_delta({}, after, "h") == (5, 2.0)
    assert histogram_delta(before, {}, "h") is None


def test_select_evenly_spreads_over_categories():
    assert select_evenly(80, 8) == [0, 10, 20, 30, 40, 50, 60, 70]
    assert select_evenly(3, 8) == [0, 1, 2]


class FakeEngine:
    """Counts like vLLM: per request 10 ms TTFT and 2 ms per output token; k=2 drafts, 1 accepted per draft."""

    def __init__(self):
        self.m = {"vllm:time_to_first_token_seconds": {"count": 0, "sum": 0.0},
                  "vllm:request_time_per_output_token_seconds": {"count": 0, "sum": 0.0},
                  "vllm:spec_decode_num_drafts": 0, "vllm:spec_decode_num_draft_tokens": 0,
                  "vllm:spec_decode_num_accepted_tokens": 0, "vllm:spec_decode_num_accepted_tokens_per_pos": [0, 0]}
        self.calls = []

    def generate(self, prompts, sampling):
        self.calls.append(len(prompts))
        n = sampling["max_tokens"]
        m = self.m
        for _ in prompts:
            m["vllm:time_to_first_token_seconds"]["count"] += 1
            m["vllm:time_to_first_token_seconds"]["sum"] += 0.010
            m["vllm:request_time_per_output_token_seconds"]["count"] += 1
            m["vllm:request_time_per_output_token_seconds"]["sum"] += 0.002
            m["vllm:spec_decode_num_drafts"] += n // 2
            m["vllm:spec_decode_num_draft_tokens"] += n
            m["vllm:spec_decode_num_accepted_tokens"] += n // 2
            pp = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
            m["vllm:spec_decode_num_accepted_tokens_per_pos"] = [pp[0] + n // 2, pp[1]]
        return [{"token_ids": list(range(n)), "text": "", "finish_reason": "length"} for _ in prompts]

    def metrics(self):
        return json.loads(json.dumps(self.m))


def test_measure_batches_and_reads_engine_latencies():
    eng = FakeEngine()
    eng.generate([[1]], {"max_tokens": 4})  # warm-up before the run must not count
    r = measure(eng, [[1, 2]] * 5, {"max_tokens": 8}, batch_size=2)
    assert eng.calls[1:] == [2, 2, 1]
    assert r.output_tokens == 40 and len(r.outputs) == 5
    assert r.ttft_ms == pytest.approx(10.0) and r.tpot_ms == pytest.approx(2.0)
    assert r.spec.drafts == 20 and r.spec.accepted == 20
    assert acceptance_figures(r.spec, 2)["mean_acceptance_length"] == pytest.approx(2.0)
    assert r.throughput()["output_tokens_per_s"] > 0


def test_acceptance_by_context_length_follows_each_requests_verify_steps():
    from tasks.formats.acceptance import acceptance_by_length, length_counts, steps_by_length

    # a 508-token prompt: the first draft sees 509 tokens, each step adds its accepted tokens and the bonus
    assert steps_by_length(508, [1, 0, 2, 0]) == {"<512": [2, 1], "512-2K": [2, 2]}
    by = acceptance_by_length([508, 3000, 10], [[1, 0, 2, 0], [3, 3], None])
    assert list(by) == ["<512", "512-2K", "2K-8K"]  # shortest first, empty buckets left out
    assert by["2K-8K"] == {"mean_acceptance_length": 4.0, "drafts": 2, "accepted_tokens": 6, "requests": 1}
    assert by["<512"]["requests"] == by["512-2K"]["requests"] == 1  # one request's answer crossed 512
    assert sum(b["drafts"] for b in by.values()) == 6 and sum(b["accepted_tokens"] for b in by.values()) == 9
    assert acceptance_by_length([5], [None]) == {}
    assert length_counts([10, 600, 40_000, 20]) == {"<512": 2, "512-2K": 1, ">32K": 1}
    # measure() keeps each request's steps beside its prompt; spec_figures buckets them
    eng = FakeEngine()
    orig = eng.generate
    eng.generate = lambda prompts, sampling: [{**o, "spec_steps": [1] * 4} for o in orig(prompts, sampling)]
    r = measure(eng, [[1] * 600, [1] * 5], {"max_tokens": 8}, batch_size=1)
    assert r.prompt_tokens == [600, 5] and r.spec_steps == [[1] * 4, [1] * 4]
    from tasks.benchmark.measure import spec_figures

    assert spec_figures(r, r, 2, 0.0, None)["by_length"] == {
        "<512": {"mean_acceptance_length": 2.0, "drafts": 4, "accepted_tokens": 4, "requests": 1},
        "512-2K": {"mean_acceptance_length": 2.0, "drafts": 4, "accepted_tokens": 4, "requests": 1}}
    # benchmark.length_buckets: the same steps in other buckets
    assert spec_figures(r, r, 2, 0.0, None, [1024, 4096])["by_length"] == {
        "<1K": {"mean_acceptance_length": 2.0, "drafts": 8, "accepted_tokens": 8, "requests": 2}}


@pytest.mark.parametrize("n", [3, 40])
def test_configured_length_buckets_count_every_draft_and_request_at_two_counts(n):
    """benchmark.length_buckets [1K, 4K, 8K, 12K] (the Kimi preset's): n requests of each prompt length put their
    drafts and their n requests in that bucket, and only buckets that hold drafts appear, shortest first."""
    from tasks.formats.acceptance import acceptance_by_length, buckets_of

    bounds = [1024, 4096, 8192, 12288]
    assert [lb for _, lb in buckets_of(bounds)] == ["<1K", "1K-4K", "4K-8K", "8K-12K", ">12K"]
    prompts = [100] * n + [5000] * n + [9000] * n  # none in 1K-4K or past 12K
    steps = [[2, 2]] * (3 * n)  # two verify steps of 2 accepted tokens each: AL 3, contexts stay in the bucket
    by = acceptance_by_length(prompts, steps, bounds)
    assert list(by) == ["<1K", "4K-8K", "8K-12K"]
    for cell in by.values():
        assert cell == {"mean_acceptance_length": 3.0, "drafts": 2 * n, "accepted_tokens": 4 * n, "requests": n}
    # a prompt at a bound belongs to the bucket above it; a context that grows past one counts in both
    assert list(acceptance_by_length([1022], [[0, 0]], bounds)) == ["<1K", "1K-4K"]
    assert acceptance_by_length([1022], [[0, 0]], bounds)["1K-4K"]["requests"] == 1
    with pytest.raises(ValueError, match="ascending positive token counts"):
        bench_cfg(length_buckets=[4096, 1024])


def test_the_by_length_table_shows_every_head_in_the_configured_buckets():
    """report.md's 'Acceptance by context length': a row per head, eval, k and bucket that holds drafts, with its
    requests; the training columns only for the main head in the training data's buckets."""
    from tasks.benchmark.report import lengths_markdown

    cell = {"mean_acceptance_length": 2.5, "drafts": 10, "accepted_tokens": 15, "requests": 4}
    fig = {"batch_size": 4, "simulated_acceptance_length": 2.0, "by_length": {"<1K": cell, "8K-12K": cell}}
    report = {"settings": {"length_buckets": [1024, 4096, 8192, 12288]}, "benchmark": {"long": {"7": fig}},
              "heads": {"eagle3-mla": {}, "dflash": {"benchmark": {"long": {"7": fig}}}},
              "training_lengths": {"length_buckets": {"<512": 5}, "longest": 300}}
    md = "\n".join(lengths_markdown(report))
    assert "benchmark.length_buckets [1024, 4096, 8192, 12288]" in md
    for head in ("eagle3-mla", "dflash"):
        for bucket in ("<1K", "8K-12K"):
            assert f"| {head} | long | 7 | {bucket} | 2.50 | 10 | 4 | - | - |" in md
    assert "4K-8K" not in md and "1K-4K" not in md  # buckets without drafts are left out
    # the shared buckets: the main head's rows carry the training samples and the estimate
    report["settings"]["length_buckets"] = None
    fig["by_length"] = {"<512": cell}
    md = "\n".join(lengths_markdown(report))
    assert "| eagle3-mla | long | 7 | <512 | 2.50 | 10 | 4 | 5 | 2.00* |" in md
    assert "| dflash | long | 7 | <512 | 2.50 | 10 | 4 | - | - |" in md


def test_training_lengths_that_do_not_cover_the_served_ones_are_warned():
    from tasks.benchmark.results import length_gap

    train = {"length_buckets": {"<512": 90, "512-2K": 10}, "longest": 1500, "max_length": 2048}
    assert length_gap(train, 1400, "x") is None
    gap = length_gap(train, 9000, "eval long's contexts")
    assert "9,000" in gap and "1,500" in gap and "2K-8K, 8K-32K" in gap
    assert length_gap({"max_length": 2048}, 4000, "x").startswith("x reach 4,000 tokens, past the longest training "
                                                                   "sample (data.max_length 2,048")
    assert length_gap(None, 10**6, "x") is None
    cfg = bench_cfg()
    evals = cfg.benchmark.evals
    rep = fabricated_report(cfg)
    assert rep["training_lengths"] is None and not any("past the longest" in w for w in rep["warnings"])
    from tasks.benchmark.prompts import EvalPrompts

    long_ev = [EvalPrompts(e.name, e.name, [[1] * 3000] * 2, ["a", "b"], 2, requested=2) for e in evals]
    base = {e.name: {bs: run(bs, OUTS, 1.0) for bs in (1, 4)} for e in evals}
    k = SpecCounters(drafts=10, draft_tokens=10, accepted=5, per_pos=[5])
    spec = {kk: {e.name: {bs: run(bs, OUTS, 1.0, k) for bs in (1, 4)} for e in evals} for kk in (1, 3)}
    rep = assemble_report(cfg, long_ev, base, spec, {}, {}, {}, {}, data_stats=train,
                          vocab_coverage={"mtbench": 0.875})
    warned = [w for w in rep["warnings"] if "past the longest training sample" in w]
    assert len(warned) == 2 and "3,008 tokens" in warned[0] and "raise data.max_length" in warned[0]
    assert rep["evals"]["mtbench"]["draft_vocab_coverage"] == 0.875
    assert "holds 87.5% of the target's output tokens" in report_markdown(rep)


def test_long_context_eval_concatenates_whole_conversations(tmp_path):
    from tasks.data.prepare import make_masker

    store = Store(f"file://{tmp_path}/store")
    cfg = bench_cfg(max_tokens=8)
    convs = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i} " * 40}]
             for i in range(6)]
    data = commit(store, "prepare", "p" * 32, {"heldout.parquet": heldout_parquet(convs)})
    masker = make_masker(cfg)
    ev = load_eval_prompts(cfg, store, data, EvalConfig(name="long", num_prompts=2, context_tokens=300),
                           masker.prompt_ids)
    assert len(ev.prompts) == 2 and all(len(p) >= 300 for p in ev.prompts) and ev.short_of_context == 0
    text = masker.tok.decode(ev.prompts[0])
    # the histories are the next conversations, every turn; the prompt ends with a question and the generation prompt
    assert "answer 1" in text and "answer 0" not in text and text.rstrip().endswith("assistant")
    assert text.rindex("question 0") > text.rindex("answer")
    # capped by max_model_len - max_tokens, and said so
    cfg.target.max_model_len = 250
    short = load_eval_prompts(cfg, store, data, EvalConfig(name="long", num_prompts=2, context_tokens=10_000),
                              masker.prompt_ids)
    assert all(len(p) <= 242 for p in short.prompts) and short.short_of_context == 2
    # a first-turn eval keeps its address; a long one has its own
    long_cfg = bench_cfg(evals=[EvalConfig(name="heldout", num_prompts=2, context_tokens=300)])
    plain = bench_cfg(evals=[EvalConfig(name="heldout", num_prompts=2)])
    ref = commit(store, "train", "t" * 32, {"x": b"x"})
    assert digests.benchmark(plain, ref, data) != digests.benchmark(long_cfg, ref, data)
    with pytest.raises(BenchmarkError, match="needs conversations with answers"):
        q = commit(store, "prepare", "q" * 32, {"heldout.parquet": heldout_parquet([[{"role": "user", "content": "hi"}]])})
        load_eval_prompts(cfg, store, q, EvalConfig(name="long", context_tokens=100), masker.prompt_ids)


def test_chain_lengths_follow_vllm_alignment():
    seq = [10, 11, 12, 13, 14]
    # a draft started at t sees token seq[t+1]; step j proposes seq[t+2+j]
    preds = [[12, 99, 14, 0], [13, 14, 0, 0]]
    assert chain_lengths(preds, seq, k=2) == [2, 0, 1]
    assert chain_lengths(preds, seq, k=1) == [1, 0, 1]


def test_same_steps_compares_vllms_accepted_tokens_draft_by_draft():
    from tasks.benchmark.replay import same_steps, walk

    chain = [0, 2, 0, 1, 0, 2, 0, 0, 0]  # accepted run of a draft started at each position, k=2
    assert walk(chain, 1) == [(1, 2), (4, 0), (5, 2), (8, 0)]
    assert same_steps(chain, 1, len(chain) + 2, 2, [2, 0, 2, 0])
    assert same_steps(chain, 1, len(chain) + 2, 2, [2, 0, 2, 1])  # the last draft had no room for k: not compared
    assert not same_steps(chain, 1, len(chain) + 2, 2, [2, 1, 2, 0])
    assert not same_steps(chain, 1, len(chain) + 2, 2, [2, 0])  # vLLM stopped drafting early


def test_replay_walks_like_vllm_and_is_a_harmonic_mean():
    assert replay([9, 2, 0, 0, 1, 0, 0], first=1) == (3, 3)  # starts at 1, 4, 6
    # an easy stretch (every draft fully accepted, k=2) then a hard one (nothing accepted)
    chains = [([2] * 30 + [0] * 30, 0)]
    assert position_average(chains, 2)["mean_acceptance_length"] == pytest.approx(2.0)   # arithmetic
    assert position_average(chains, 2)["per_position_acceptance"] == pytest.approx([0.5, 0.5])
    assert replay_average(chains)["mean_acceptance_length"] == pytest.approx(1.5)        # 60 tokens / 40 drafts


# --------------------------------------------------------------------------- the report

def test_report_shape_matches_the_issue_contract():
    cfg = bench_cfg()
    rep = fabricated_report(cfg)
    assert set(rep["benchmark"]) == {"mtbench", "heldout"}
    assert set(rep["benchmark"]["mtbench"]) == {"1", "3"}
    k3 = rep["benchmark"]["mtbench"]["3"]
    for key in ("mean_acceptance_length", "per_position_acceptance", "draft_acceptance_rate", "output_tokens_per_s",
                "baseline_output_tokens_per_s", "speedup", "tpot_ms", "ttft_ms", "token_identical", "batch_size"):
        assert key in k3, key
    assert k3["batch_size"] == 4 and set(k3["by_batch_size"]) == {"1", "4"}
    assert rep["measured_by"]["flow_run_id"] == "run-123"
    assert rep["baseline"]["heldout"]["by_batch_size"]["1"]["output_tokens_per_s"] == pytest.approx(12.0)
    json.dumps(rep)  # report.json must serialize


def test_speedup_and_token_identity():
    rep = fabricated_report(bench_cfg())
    k1 = rep["benchmark"]["heldout"]["1"]["by_batch_size"]
    assert k1["1"]["speedup"] == pytest.approx(0.5)    # 6 tok/s vs 12 tok/s
    assert k1["4"]["speedup"] == pytest.approx(0.5)    # 12 vs 24
    assert k1["1"]["token_identical"] is True
    k3 = rep["benchmark"]["heldout"]["3"]["by_batch_size"]["1"]
    assert k3["token_identical"] is False and k3["identical_requests"] == 1 and k3["first_divergence"] == 2
    # the baseline agrees with itself at both batch sizes, so a changed token is beyond its noise
    assert k3["greedy_identity"] == "beyond_noise"
    assert any("likely a bug" in w and "heldout k=3" in w for w in rep["warnings"])
    # slower than plain decoding is said plainly
    assert any("SLOWER" in n for n in rep["notes"])


# The demo's case (issue 20): vLLM's CPU bf16 decode of a lone sequence rounds differently from the same
# sequence in a batch, so the baseline at batch 1 parts from the baseline at batch 4 while the speculative
# engine (k+1 tokens per step) gives the batched outputs at every batch size.
B4 = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
B1 = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 55, 56]]      # request 2 parts at token 4 at batch 1


def test_greedy_identity_judged_against_the_baselines_own_divergence():
    rep = fabricated_report(bench_cfg(), k3_diverges=False, base_outs={1: B1, 4: B4}, k3_outs={1: B4, 4: B4},
                            controls={"batch 4 (repeat)": B4})
    gi = rep["greedy_identity"]
    pairs = {(p["a"], p["b"]): p for p in gi["control"]["heldout"]["pairs"]}
    assert set(pairs) == {("batch 1", "batch 4"), ("batch 4", "batch 4 (repeat)")}  # a repeat against its original
    assert pairs[("batch 1", "batch 4")]["differing"] == 1 and pairs[("batch 1", "batch 4")]["first_divergence"] == 4
    assert pairs[("batch 4", "batch 4 (repeat)")]["differing"] == 0
    k3 = rep["benchmark"]["heldout"]["3"]["by_batch_size"]
    assert k3["1"]["token_identical"] is False and k3["1"]["greedy_identity"] == "within_noise"
    assert k3["4"]["greedy_identity"] == "identical"
    line = next(x for x in gi["lines"] if x.startswith("heldout k=3 batch 1"))
    assert "differs within the engine's own numeric noise (measured: baseline batch 1 vs batch 4: 1 of 2 " \
           "prompts differ (first at token 4)" in line
    assert not any("bug" in w for w in rep["warnings"])
    md = report_markdown(rep)
    assert "## Greedy identity (temperature 0)" in md
    assert "| heldout | batch 1 | batch 4 | 1 of 2 | 4 |" in md and "| heldout | batch 4 | batch 4 (repeat) | 0 of 2 | - |" in md
    assert "| heldout | 3 | 1 | 1.44 |" in md and "noise (1/2 same)" in md
    assert report_stats(rep)["greedy_identity"] == "within_noise"
    from rich.console import Console

    console = Console(record=True, width=200)
    render_terminal(rep["benchmark"], console, rep)
    text = console.export_text()
    assert "greedy identity, heldout: k=3 batch 1: 1 of 2 differ, within the engine's own noise (control: " \
           "baseline batch 1 vs batch 4: 1 of 2 prompts differ (first at token 4)" in text


def test_greedy_identity_parting_where_the_baseline_parts_is_noise_elsewhere_a_bug():
    # a third continuation from token 4 of request 2, where batch 1 and batch 4 part: noise
    third = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 77, 78]]
    rep = fabricated_report(bench_cfg(), k3_diverges=False, base_outs={1: B1, 4: B4}, k3_outs={1: third, 4: B4})
    j = rep["greedy_identity"]["verdicts"]["mtbench"]["3"]["1"]
    assert j["verdict"] == "within_noise" and j["within_floor"] == 1
    # parting earlier than the baseline ever does (token 2), or on a request the baseline never varies: a bug
    early = [[1, 2, 3, 4, 5, 6], [7, 8, 66, 10, 11, 12]]
    other = [[1, 2, 3, 4, 9, 9], [7, 8, 9, 10, 11, 12]]
    for outs in (early, other):
        rep = fabricated_report(bench_cfg(), k3_diverges=False, base_outs={1: B1, 4: B4}, k3_outs={1: B4, 4: outs})
        j = rep["greedy_identity"]["verdicts"]["mtbench"]["3"]["4"]
        assert j["verdict"] == "beyond_noise" and j["beyond"] == 1, j
        assert j["sentence"].startswith("differs beyond it: likely a bug")
        assert any("mtbench k=3" in w and "likely a bug" in w for w in rep["warnings"])
        from rich.console import Console

        console = Console(record=True, width=200)
        render_terminal(rep["benchmark"], console, rep)
        assert "NO" in console.export_text()


def test_control_decodes_stay_few():
    from tasks.benchmark.identity import control_batch_sizes

    assert control_batch_sizes([1, 8], 8) == [8]          # the measured sizes already differ: one repeat
    assert control_batch_sizes([4], 4) == [4, 1]          # one measured size: a repeat and batch 1
    assert control_batch_sizes([1], 8) == [1, 8]


def test_mismatch_beyond_threshold_is_warned_with_causes():
    rep = fabricated_report(bench_cfg())
    # k=3: measured 1.44 vs simulated 1.76 (-18%): beyond 15%; k=1: 1.45 vs 1.5 (-3%): fine
    rows = {(r["eval"], r["k"], r["batch_size"]): r for r in rep["comparison"]}
    assert rows[("heldout", 3, 4)]["mismatch"] and rows[("heldout", 3, 4)]["simulated"] == pytest.approx(1.76)
    assert not rows[("heldout", 1, 4)]["mismatch"]
    first = rep["warnings"][0]
    assert "1.44" in first and "1.76" in first and "layer ids" in first and "teacher forcing" in first
    assert "heldout k=3" in first and "mtbench" not in first  # only the eval drawn from the training data
    md = report_markdown(rep)
    assert "Why measured and simulated acceptance differ" in md and "distribution shift" in md


def test_an_out_of_distribution_gap_is_reported_as_such_not_as_a_bug():
    """The demo's case: MT-Bench (not in the chitchat training mix) far below the estimate, the held-out eval
    matching it. The estimate-vs-measured check judges the held-out eval; MT-Bench's gap is distribution shift."""
    from tasks.benchmark.results import in_distribution

    cfg = bench_cfg()
    assert in_distribution(cfg, "heldout") and not in_distribution(cfg, "mtbench")
    # an eval drawn from a training source is in distribution too
    mixed = cfg.model_copy(deep=True)
    mixed.data.sources.append(SourceConfig(preset="mtbench"))
    assert in_distribution(mixed, "mtbench")
    # held-out matches its estimate (k=1: 1.45 vs 1.5), MT-Bench at k=3 is 18% under it
    rep = fabricated_report(bench_cfg(evals=[EvalConfig(name="mtbench", source=SourceConfig(preset="mtbench"),
                                                        num_prompts=2), EvalConfig(name="heldout", source="heldout",
                                                                                   num_prompts=2)],
                                      num_speculative_tokens=[1, 3]), k3_diverges=False)
    rep["benchmark"]["heldout"].pop("3")  # only k=1 measured on held-out: no in-distribution mismatch
    from tasks.benchmark.results import compare

    rows, warnings = compare(rep)
    shifted = [r for r in rows if r["distribution_shift"]]
    assert shifted and all(r["eval"] == "mtbench" and not r["mismatch"] for r in shifted)
    assert not any(r["mismatch"] for r in rows)
    assert len(warnings) == 1, warnings
    w = warnings[0]
    assert w.startswith("out of the training distribution") and "mtbench k=3" in w and "1.76" in w
    assert "distribution shift" in w and "heldout check the estimate and agree with it" in w
    assert "layer ids" not in w and "bug" not in w  # no list of bug causes
    rep["comparison"], rep["warnings"] = rows, warnings
    md = report_markdown(rep)
    assert "Why measured and simulated acceptance differ" not in md and "out of the training distribution" in md


def test_no_mismatch_warning_within_threshold():
    rep = fabricated_report(bench_cfg(mismatch_threshold=0.25), k3_diverges=False)
    assert rep["warnings"] == []
    assert "Why measured and simulated" not in report_markdown(rep)


def test_replay_table_splits_the_gap_and_flags_engine_loss():
    r = {"batch_size": 1, "seconds": 3.0, "by_eval": {
        ev: {"1": {"position_average": 1.47, "replayed": 1.46, "position_average_per_position": [0.47]},
             "3": {"position_average": 1.70, "replayed": 1.45, "position_average_per_position": [0.4, 0.2, 0.1]}}
        for ev in ("mtbench", "heldout")}}
    rep = fabricated_report(bench_cfg(), k3_diverges=False, replayed=r)
    md = report_markdown(rep)
    assert "## Where the acceptance goes (offline replay)" in md
    assert "| mtbench | 3 | 1.76 | 1.70 | 1.45 | 1.44 |" in md
    assert "HARMONIC" in md
    assert not any("engine integration" in w for w in rep["warnings"])  # 1.44 vs replay 1.45: the engine is fine
    r["by_eval"]["mtbench"]["3"]["replayed"] = 2.0
    rep = fabricated_report(bench_cfg(), k3_diverges=False, replayed=r)
    assert any("engine integration" in w and "mtbench k=3" in w for w in rep["warnings"])
    failed = fabricated_report(bench_cfg(), k3_diverges=False, replayed={"error": "EngineError: boom"})
    assert any("offline replay" in w and "boom" in w for w in failed["warnings"])


def test_draft_checks_catch_wrong_layers_and_a_full_depth_draft():
    info = {"layer_ids": [2, 15, 27], "extract_layer_ids": [3, 15, 27, 30], "num_layers": 30,
            "target_num_layers": 30}
    rep = fabricated_report(bench_cfg(), k3_diverges=False, draft_info=info)
    assert any("reads target layers [2, 15, 27]" in w and "[3, 15, 27]" in w for w in rep["warnings"])
    assert any("30 decoder layers" in w for w in rep["warnings"])
    ok = {"layer_ids": [2, 15, 27], "extract_layer_ids": [2, 15, 27, 30], "num_layers": 1, "target_num_layers": 30}
    assert fabricated_report(bench_cfg(), k3_diverges=False, draft_info=ok)["draft_checks"] == []


def test_report_without_validation_accuracy():
    rep = fabricated_report(bench_cfg(), acc=None, k3_diverges=False)
    assert rep["simulated_acceptance_length"] is None and rep["warnings"] == []
    assert "| 1.44 | - |" in report_markdown(rep)


def test_rendering_markdown_table_rows_png_and_terminal():
    from rich.console import Console

    rep = fabricated_report(bench_cfg())
    md = report_markdown(rep)
    assert "| eval | k | batch | accept len |" in md
    assert "| mtbench | 3 | 4 | 1.44 | 1.76 | 0.30 0.10 0.04 | 0.15 | 6.0 | 24.0 | 0.25x |" in md
    assert "http" not in md  # embeds nothing external
    rows = report_table_rows(rep)
    assert len(rows) == 2 * 2 + 2 * 2 * 2  # baseline rows + eval x k x batch
    assert {r["k"] for r in rows} == {0, 1, 3}
    png = plot_report(rep)
    assert png.startswith(PNG_MAGIC) and len(png) > 5000
    console = Console(record=True, width=200)
    render_terminal(rep["benchmark"], console, rep)
    text = console.export_text()
    assert "1.44" in text and "0.25x" in text and "run-123" in text and "warning" in text


def test_publish_summary_builds_prefect_artifacts(monkeypatch):
    import base64

    import flows.report_artifacts as ra
    from tasks.benchmark.shown import report_shown

    made = {}
    monkeypatch.setattr(ra, "create_table_artifact", lambda rows, key, description: made.update(table=(key, rows)))
    monkeypatch.setattr(ra, "create_markdown_artifact", lambda md, key, description: made.update(md=(key, md)))
    rep = fabricated_report(bench_cfg())
    rep["uri"] = "file:///store/benchmark/abc"
    ra.publish(report_shown(rep))
    key, rows = made["table"]
    assert key == "benchmark" and rows == report_table_rows(rep)
    key, md = made["md"]
    assert key == "benchmark-report" and "file:///store/benchmark/abc" in md
    b64 = md.split("data:image/png;base64,", 1)[1].split(")", 1)[0]
    assert base64.b64decode(b64).startswith(PNG_MAGIC)
    assert "benchmark-heads" not in ra.publish(report_shown(rep))  # one head: its figures are the table above


def test_several_heads_get_their_own_table_in_the_ui(monkeypatch):
    """train.heads: the UI shows every head against the one baseline, an offline-only head with vLLM's error."""
    import flows.report_artifacts as ra
    from tasks.benchmark.shown import report_shown

    tables = {}
    monkeypatch.setattr(ra, "create_table_artifact", lambda rows, key, description: tables.update({key: rows}))
    monkeypatch.setattr(ra, "create_markdown_artifact", lambda md, key, description: None)
    rep = fabricated_report(bench_cfg())
    ks = [str(k) for k in rep["settings"]["num_speculative_tokens"]]
    rep["heads"] = {
        "eagle3": {"kind": "eagle3", "benchmark": rep["benchmark"], "simulated_by_k": dict.fromkeys(ks, 1.5),
                   "errors": {}},
        "dflash": {"kind": "dflash", "benchmark": {}, "simulated_by_k": dict.fromkeys(ks, 1.3),
                   "errors": dict.fromkeys(ks, "RuntimeError: no dflash here")}}
    ra.publish(report_shown(rep))
    rows = tables["benchmark-heads"]
    evals, batches = len(rep["evals"]), len(rep["settings"]["batch_sizes"])
    assert len([r for r in rows if r["head"] == "eagle3"]) == evals * len(ks) * batches
    offline = [r for r in rows if r["head"] == "dflash"]
    assert len(offline) == evals * len(ks)
    assert all(r["measured_in"] == "offline only" and "no dflash" in r["error"] for r in offline)
    measured = next(r for r in rows if r["head"] == "eagle3")
    assert isinstance(measured["per_position_acceptance"], str)  # a list shown as text in Prefect's table


# --------------------------------------------------------------------------- store, prompts, caching

def commit(store: Store, stage: str, digest: str, files: dict[str, bytes], stats: dict | None = None,
           run: dict | None = None):
    with store.write(stage, digest, "v", {}) as w:
        for name, data in files.items():
            w.write_bytes(name, data)
        return w.commit(stats or {}, run=run).ref()


def heldout_parquet(convs: list[list[dict]]) -> bytes:
    from tasks.data.prepare import Sample, parquet_bytes

    return parquet_bytes([Sample(f"s{i}", "chitchat", m, np.array([1, 2], np.int32), np.array([0, 1], np.int8))
                          for i, m in enumerate(convs)])


def test_find_and_load_report_by_digest_uri_and_run_id(store):
    rep = fabricated_report(bench_cfg())
    ref = commit(store, "benchmark", "d" * 32, {"report.json": json.dumps(rep).encode()}, run={"flow_run_id": "run-123"})
    assert load_report(store, ref)["measured_by"]["flow_run_id"] == "run-123"
    assert find_report(store, "d" * 32) == rep
    assert find_report(store, ref.uri) == rep
    assert find_report(store, "dddddddd") == rep
    assert find_report(store, "run-123") == rep
    assert find_report(store, "no-such-run") is None


def test_cached_benchmark_returns_without_starting_an_engine(tmp_path):
    store = Store(f"file://{tmp_path}/store")
    cfg = bench_cfg()
    trained = commit(store, "train", "t" * 32, {"draft/config.json": b"{}", "draft/model.safetensors": b"x"})
    data = commit(store, "prepare", "p" * 32, {"heldout.parquet": heldout_parquet([])})
    d = digests.benchmark(cfg, trained, data)
    commit(store, "benchmark", d, {"report.json": b"{}"})

    def no_engine(*a, **k):
        raise AssertionError("a committed benchmark must not start an engine")

    ref = run_benchmark(cfg, store, trained, data, engine_factory=no_engine)
    assert ref.digest == d


def test_heldout_prompts_are_first_user_turns_with_the_generation_prompt(tmp_path):
    from tasks.data.prepare import make_masker

    store = Store(f"file://{tmp_path}/store")
    cfg = bench_cfg()
    convs = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "answer"},
              {"role": "user", "content": "second turn"}] for i in range(5)]
    data = commit(store, "prepare", "p" * 32, {"heldout.parquet": heldout_parquet(convs)})
    masker = make_masker(cfg)
    ev = load_eval_prompts(cfg, store, data, EvalConfig(name="heldout", num_prompts=2), masker.prompt_ids)
    assert len(ev.prompts) == 2 and ev.sample_ids == ["s0", "s2"]
    text = masker.tok.decode(ev.prompts[0])
    assert "question 0" in text and "second turn" not in text and "answer" not in text
    assert text.rstrip().endswith("assistant")  # generation prompt
    mt = load_eval_prompts(cfg, store, data, EvalConfig(name="mt", source=SourceConfig(preset="mtbench"),
                                                        num_prompts=8), masker.prompt_ids)
    assert len(mt.prompts) == 8 and mt.available == 80


def test_the_anchors_evals_load_offline_as_benchmark_prompts(tmp_path):
    """HumanEval, GSM8K (GSM-Symbolic) and Math500 (CHAMP): the sets the published drafts are quoted on, from
    the packages that ship them, rendered like MT-Bench; the same prompts every time."""
    store = Store(f"file://{tmp_path}/store")
    cfg = bench_cfg()
    data = commit(store, "prepare", "p" * 32, {"heldout.parquet": heldout_parquet([])})
    texts = {}
    for preset, available, needle in (("humaneval", 164, "def has_close_elements"),
                                      ("gsm8k", 100, "\\boxed{}"), ("math", 270, "\\boxed{}")):
        seen: list[str] = []
        ev = load_eval_prompts(cfg, store, data, EvalConfig(name=preset, source=SourceConfig(preset=preset),
                                                            num_prompts=4),
                               lambda m: seen.append(m[-1]["content"]) or [1] * len(m[-1]["content"]))
        assert ev.available == available and len(ev.prompts) == 4, (preset, ev.available)
        assert needle in seen[0] and len(set(seen)) == len(seen)
        texts[preset] = seen
        again = load_eval_prompts(cfg, store, data, EvalConfig(name=preset, source=SourceConfig(preset=preset),
                                                               num_prompts=4), lambda m: [1])
        assert again.sample_ids == ev.sample_ids
    assert "How long will it take her to peel and saute" in texts["gsm8k"][0]  # GSM8K's wording, GSM-Symbolic's numbers
    import sys as _sys
    assert "reasoning_gym" not in _sys.modules  # its package, stood in for while loading, is not left behind


def test_the_report_states_its_counting(tmp_path):
    """A figure set beside a published one needs its counting: AL includes the bonus token (1 + accepted /
    drafts), k, block size of a block head, temperature, thinking, batch sizes: in report.md and the terminal."""
    from rich.console import Console

    cfg = bench_cfg()
    rep = fabricated_report(cfg, draft_info={"draft_vocab_size": 8, "block_size": 8})
    c = rep["settings"]["counting"]
    assert c["bonus_token_included"] and c["block_size"] == 8 and c["num_speculative_tokens"] == [1, 3]
    # the k=1 figure is 1 + 45 accepted / 100 drafts: the bonus token is in it
    assert rep["benchmark"]["mtbench"]["1"]["mean_acceptance_length"] == pytest.approx(1.45)
    md = report_markdown(rep)
    line = next(x for x in md.splitlines() if x.startswith("Counting:"))
    for part in ("plus 1 for the bonus token (included)", "k = [1, 3]", "block size 8", "temperature 0.0",
                 "thinking on", "batch sizes [1, 4]"):
        assert part in line, part
    cfg.regenerate.thinking = False
    assert "thinking off," in report_markdown(fabricated_report(cfg))
    cfg.regenerate.enabled = False  # prompts rendered without enable_thinking
    assert "thinking the chat template's default" in report_markdown(fabricated_report(cfg))
    console = Console(record=True, width=400)
    render_terminal(rep["benchmark"], console, rep)
    assert "bonus token (included)" in console.export_text()


def test_bad_inputs_name_the_fix(tmp_path):
    store = Store(f"file://{tmp_path}/store")
    cfg = bench_cfg()
    no_heldout = commit(store, "prepare", "q" * 32, {"shard-00000.parquet": b"x"})
    with pytest.raises(BenchmarkError, match="data.heldout > 0"):
        load_eval_prompts(cfg, store, no_heldout, EvalConfig(name="heldout"), lambda m: [1])
    half = commit(store, "train", "h" * 32, {"metrics.json": b"{}"})
    with pytest.raises(BenchmarkError, match="re-run the train stage"):
        with draft_folder(store.open("train", half.digest)):
            pass
    with pytest.raises(BenchmarkError, match="max_model_len"):
        data = commit(store, "prepare", "r" * 32, {"heldout.parquet": heldout_parquet(
            [[{"role": "user", "content": "hi"}]])})
        load_eval_prompts(cfg, store, data, EvalConfig(name="heldout"), lambda m: [1] * 5000)


def test_check_draft_rejects_a_draft_for_another_target(tmp_path):
    from types import SimpleNamespace

    conf = {"speculators_model_type": "eagle3", "draft_vocab_size": 8, "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
            "transformer_layer_config": {"hidden_size": 64, "vocab_size": 100, "num_hidden_layers": 1}}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    ok = SimpleNamespace(hidden_size=64, vocab_size=100)
    assert check_draft(str(tmp_path), ok)["layer_ids"] == [1, 2, 3]
    with pytest.raises(BenchmarkError, match="another target"):
        check_draft(str(tmp_path), SimpleNamespace(hidden_size=576, vocab_size=100))


# --------------------------------------------------------------------------- a real run (slow)

def make_random_draft(model: str, out: Path, two_words: bool = False, **norms: bool) -> None:
    """An untrained EAGLE-3 head for the target (acceptance near zero, but the whole chain is real).

    `norms`: speculators' EAGLE-3.1 options (norm_before_fc or fc_norm, norm_output), as vLLM reads them.
    `two_words`: its vocabulary is target ids 200..1223 (every d2t offset 200) and its lm_head proposes " the" or
    " a" by the sign of one random direction of its own output: accepted wherever the target writes the word it
    picked, so which drafts vLLM accepts depends on the maps, the layers and the norms."""
    import torch
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoConfig

    conf = AutoConfig.from_pretrained(model)
    n = conf.num_hidden_layers
    conf.num_hidden_layers = 1  # the draft's own depth: from_training_args copies the verifier's config
    v, k = conf.vocab_size, 1024
    skip = 200 if two_words else 0
    d2t, t2d = build_vocab_mappings_from_distribution({i: v - i for i in range(skip, v)}, k, v)
    torch.manual_seed(0)
    m = Eagle3DraftModel.from_training_args(conf, t2d=t2d, d2t=d2t, draft_vocab_size=k, norm_before_residual=True,
                                            ttt_steps=3, verifier_name_or_path=model, draft_attn_impl="sdpa",
                                            target_layer_ids=[2, n // 2, n - 3], **norms)
    if two_words:  # SmolLM2's " the" is 260 and " a" 253: draft ids 60 and 53
        assert int(d2t[0]) == skip and bool(t2d[260]) and bool(t2d[253])
        r = torch.randn(m.lm_head.weight.shape[1])
        with torch.no_grad():
            m.lm_head.weight.zero_()
            m.lm_head.weight[260 - skip] = 10 * r
            m.lm_head.weight[253 - skip] = -10 * r
    m.to(torch.bfloat16).save_pretrained(out)
    # as draftline's own writer leaves it (tasks/train/loop.py save_draft): data only, no auto_map and no copied
    # module (speculators' save_pretrained writes both; the benchmark refuses a draft that names code)
    conf_file = out / "config.json"
    conf_file.write_text(json.dumps({k: v for k, v in json.loads(conf_file.read_text()).items() if k != "auto_map"}))
    for py in out.glob("*.py"):
        py.unlink()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_real_benchmark_baseline_and_eagle3(tmp_path):
    from tasks.engine.target import resolve_model

    store = Store(f"file://{tmp_path}/store")
    cfg = bench_cfg(evals=[EvalConfig(name="mtbench", source=SourceConfig(preset="mtbench"), num_prompts=3),
                           # a long-context eval: the held-out conversations, answers included, as one history
                           EvalConfig(name="heldout", source="heldout", num_prompts=2, context_tokens=520)],
                    num_speculative_tokens=[2], batch_sizes=[1, 3], max_tokens=24)
    cfg.target.max_model_len = 1024
    # float32 on every CPU: with bf16 (native on AMX CPUs) vLLM's batched verification rounds differently
    # from plain decoding, and greedy outputs may part at near-ties; token identity is checked exactly here.
    cfg.target.dtype = "float32"
    cfg.extract.kv_cache_gib = 1
    model = resolve_model(cfg.target)
    # EAGLE-3.1 with per-layer norms before the fc (train's drafts use norm_before_fc, the other 3.1 option,
    # and reach vLLM in tests/e2e/test_e2e.py): vLLM's CPU build must load and decode with it.
    make_random_draft(model, tmp_path / "draft", two_words=True, fc_norm=True, norm_output=True)
    files = {f"draft/{p.name}": p.read_bytes() for p in (tmp_path / "draft").iterdir() if p.is_file()}
    trained = commit(store, "train", "t" * 32, files, stats={"val_acc_per_pos": [0.3, 0.1, 0.05]})
    convs = [[{"role": "user", "content": q}, {"role": "assistant", "content": a * 12}] for q, a in (
        ("How are you today?", "I am well, thank you for asking; the sun is out and the garden is green. " * 2),
        ("What is your favourite food?", "Bread baked at home, with butter and a little salt on top of it. " * 2),
        ("Tell me about your weekend.", "We walked by the river on Saturday and cooked for friends on Sunday. " * 2))]
    # the training data's lengths as prepare records them: nothing as long as the long eval's contexts
    data = commit(store, "prepare", "p" * 32, {"heldout.parquet": heldout_parquet(convs)},
                  stats={"length_buckets": {"<512": 3}, "longest": 300, "max_length": 512})
    logs: list[str] = []
    ref = run_benchmark(cfg, store, trained, data, flow_run_id="slow-test", on_log=logs.append)
    rep = load_report(store, ref)
    art = store.open("benchmark", ref.digest, checksums=True)
    assert set(art.files()) == {"report.json", "report.md", "report.png"}
    assert art.read_bytes("report.png").startswith(PNG_MAGIC)
    for ev in ("mtbench", "heldout"):
        f = rep["benchmark"][ev]["2"]
        assert f["batch_size"] == 3
        for bs, g in f["by_batch_size"].items():
            assert g["mean_acceptance_length"] >= 1.0
            assert g["drafts"] > 0 and len(g["per_position_acceptance"]) == 2
            assert g["speedup"] > 0 and g["output_tokens_per_s"] > 0 and g["tpot_ms"] > 0 and g["ttft_ms"] > 0
            assert g["token_identical"] is True and g["greedy_identity"] == "identical", (ev, bs, g)
        # the control: the baseline decoded the same prompts once more at the largest batch size; in float32
        # the baseline agrees with itself across batch shapes (in bf16 batch 1 parts: docs/BENCHMARK.md)
        control = rep["greedy_identity"]["control"][ev]
        assert control["decodes"] == ["batch 1", "batch 3", "batch 3 (repeat)"]
        assert [(p["a"], p["b"], p["differing"]) for p in control["pairs"]] == [
            ("batch 1", "batch 3", 0), ("batch 3", "batch 3 (repeat)", 0)], control["pairs"]
    # acceptance by context length from vLLM's own per-request steps: every draft of the counters is in a bucket
    for ev, bucket in (("mtbench", "<512"), ("heldout", "512-2K")):
        assert rep["evals"][ev]["prompt_tokens_min"] >= (520 if ev == "heldout" else 1)
        for bs, g in rep["benchmark"][ev]["2"]["by_batch_size"].items():
            assert list(g["by_length"]) == [bucket], (ev, bs, g["by_length"])
            assert g["by_length"][bucket]["drafts"] == g["drafts"]
            assert g["by_length"][bucket]["accepted_tokens"] == g["accepted_tokens"]
        assert 0 < rep["evals"][ev]["draft_vocab_coverage"] <= 1
    assert any("eval heldout's contexts reach" in w and "no training sample in 512-2K" in w for w in rep["warnings"])
    assert rep["measured_by"]["flow_run_id"] == "slow-test"
    assert (rep["draft"]["fc_norm"], rep["draft"]["norm_output"], rep["draft"]["norm_before_fc"]) == (True, True, False)
    # the two-word draft's " the" / " a" was accepted somewhere: the draft-by-draft comparison below is not vacuous
    assert sum(rep["benchmark"][ev]["2"]["by_batch_size"]["1"]["accepted_tokens"] for ev in ("mtbench", "heldout")) > 0
    # the offline replay ran on the same outputs: an untrained draft gets (almost) nothing accepted either way
    assert "error" not in rep["replay"], rep["replay"]
    for ev in ("mtbench", "heldout"):
        r = rep["replay"]["by_eval"][ev]["2"]
        assert r["replayed_drafts"] > 0 and 1.0 <= r["replayed"] < 1.5 and 1.0 <= r["position_average"] < 1.5
        # the draft vLLM serves proposes what the training-side model (speculators' Eagle3DraftModel, loaded from the
        # same folder with its d2t) proposes: vLLM accepted, draft by draft, what the replay predicts, every request
        assert r["compared"] == rep["evals"][ev]["prompts"] and r["same_steps_as_vllm"] == r["compared"], r
    md = art.read_bytes("report.md").decode()
    assert "Where the acceptance goes" in md and "## Greedy identity" in md and "batch 3 (repeat)" in md
    assert "## Acceptance by context length" in md and re.search(r"\| [^|]+ \| heldout \| 2 \| 512-2K \|", md)
    assert find_report(store, "slow-test")["digest"] == ref.digest
    print(json.dumps({ev: {bs: {k: g[k] for k in ("mean_acceptance_length", "output_tokens_per_s", "speedup",
                                                  "tpot_ms", "ttft_ms")}
                           for bs, g in rep["benchmark"][ev]["2"]["by_batch_size"].items()}
                      for ev in rep["benchmark"]}, indent=1), rep["timing"], file=sys.stderr)
    # a second call finds the committed artifact
    assert run_benchmark(cfg, store, trained, data).digest == ref.digest


def test_an_engine_that_fails_to_start_is_reported_with_its_root_cause_not_vllms_rethrow():
    """On the lent H100 a benchmark engine died with vLLM's generic "Engine core initialization failed. See root
    cause above"; the report must carry the child's own exception line (here the CUDA out-of-memory), the log
    tail's shape as vLLM 0.26 writes it."""
    from tasks.benchmark.stage import engine_error_text
    from tasks.engine.process import EngineError

    rethrow = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    tail = "\n".join([
        "(EngineCore pid=2812)     mask_logits = torch.empty_like(logits)",
        "(EngineCore pid=2812) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 192.00 MiB.",
        "Traceback (most recent call last):",
        '  File "/tmp/site/vllm/v1/engine/utils.py", line 1272, in wait_for_engine_startup',
        "    raise RuntimeError(",
        rethrow])
    text = engine_error_text(EngineError(f"baseline failed while starting: {rethrow}", tail))
    assert text.startswith("EngineError: baseline failed while starting: RuntimeError: Engine core")
    assert text.endswith("| root cause: (EngineCore pid=2812) torch.OutOfMemoryError: CUDA out of memory. "
                         "Tried to allocate 192.00 MiB.")
    # nothing beyond the message: no root-cause suffix
    assert engine_error_text(EngineError(f"x failed while starting: {rethrow}", rethrow)) == \
        f"EngineError: x failed while starting: {rethrow}"


def test_the_by_length_table_sets_each_buckets_training_estimate_beside_vllms():
    """report.md's by-length table: the held-out split's estimate of the same bucket (train stats' val_by_length,
    carried into report['simulated']['by_length']); a bucket the held-out split has no token in shows the estimate
    over every length, marked *."""
    from tasks.benchmark.report import lengths_markdown

    cfg = bench_cfg()
    rep = fabricated_report(cfg)
    by_length = {"<512": {"mean_acceptance_length": 1.8, "drafts": 10, "accepted_tokens": 8},
                 "2K-8K": {"mean_acceptance_length": 1.2, "drafts": 5, "accepted_tokens": 1}}
    ev = next(iter(rep["benchmark"]))
    rep["benchmark"][ev]["3"]["by_length"] = by_length
    rep["simulated"]["by_length"] = {"<512": {"val_tokens": 90, "by_k": {"3": 2.25}}}
    rows = [ln for ln in lengths_markdown(rep) if f"| {ev} | 3 |" in ln]
    overall = rep["benchmark"][ev]["3"]["simulated_acceptance_length"]
    assert rows == [f"| - | {ev} | 3 | <512 | 1.80 | 10 | - | ? | 2.25 |",
                    f"| - | {ev} | 3 | 2K-8K | 1.20 | 5 | - | ? | {overall:.2f}* |"]
