"""Every engine a run starts (regeneration, extraction, the benchmark's decoders) is built from one set
of rules (tasks/engine_settings.py). Each test here failed on the three copies those rules lived in
before: regeneration dropped `target.revision`, only extraction chose the reference MLA backend for a
float32 MLA target on a CPU, and the benchmark and regeneration rounded the KV cache down.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.benchmark import default_engine_factory, engine_kwargs
from tasks.config import RunConfig
from tasks.engine_settings import engine_for_group
from train_data import make_tiny_target


def engines(cfg: RunConfig, model: str) -> dict[str, tuple[dict, dict]]:
    """(llm kwargs, environment) of each vLLM engine a run of `cfg` would start, built as the run does."""
    bench = default_engine_factory(cfg, model)("baseline", engine_kwargs(cfg, None, model))
    ext = engine_for_group(cfg, model, [])
    regen = engine_for_group(cfg, model, [], "regenerate")
    return {e.name: (e.llm_kwargs, e.env) for e in (regen, ext, bench)}


def cfg_for(model: str, **target) -> RunConfig:
    return RunConfig.model_validate({"target": {"model": model, "dtype": "float32", **target},
                                     "extract": {"backend": "vllm", "kv_cache_gib": 1.5, "layer_ids": [1, 2, 3, 4]}})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_target(tmp_path_factory.mktemp("settings") / "llama")


@pytest.fixture(scope="module")
def mla(tmp_path_factory) -> str:
    """A DeepSeek-V3-style (Kimi) MLA config: only its config matters here."""
    from transformers import DeepseekV3Config

    folder = Path(tmp_path_factory.mktemp("settings") / "mla")
    DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512,
                     q_lora_rank=32, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                     n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1).save_pretrained(folder)
    return str(folder)


def test_every_engine_uses_the_pinned_revision(tiny):
    got = engines(cfg_for(tiny, revision="0123abc"), tiny)
    assert {name: kw.get("revision") for name, (kw, _) in got.items()} == {
        "regenerate-cpu": "0123abc", "extract-cpu": "0123abc", "baseline": "0123abc"}


def test_every_engine_on_a_cpu_picks_the_reference_backend_for_a_float32_mla_target(mla, tiny):
    got = engines(cfg_for(mla), mla)
    assert {name: kw.get("attention_backend") for name, (kw, _) in got.items()} == {
        "regenerate-cpu": "CPU_MLA", "extract-cpu": "CPU_MLA", "baseline": "CPU_MLA"}
    assert all("attention_backend" not in kw for kw, _ in engines(cfg_for(tiny), tiny).values())  # not MLA


def test_one_kv_cache_rule_rounds_up_and_the_rest_agrees(tiny):
    got = engines(cfg_for(tiny), tiny)
    assert {name: env["VLLM_CPU_KVCACHE_SPACE"] for name, (_, env) in got.items()} == {
        "regenerate-cpu": "2", "extract-cpu": "2", "baseline": "2"}  # 1.5 GiB asked: never less
    shared = ("max_model_len", "dtype", "trust_remote_code", "enforce_eager", "tensor_parallel_size", "seed")
    assert len({tuple(kw[k] for k in shared) for kw, _ in got.values()}) == 1, got
