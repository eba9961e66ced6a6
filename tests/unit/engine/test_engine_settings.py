"""Every engine a run starts (regeneration, extraction, the benchmark's decoders) is built from one set
of rules (tasks/engine/settings.py). Each test here failed on the three copies those rules lived in
before: regeneration dropped `target.revision`, only extraction chose the reference MLA backend for a
float32 MLA target on a CPU, and the benchmark and regeneration rounded the KV cache down.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.benchmark.stage import default_engine_factory
from tasks.engine.settings import benchmark_kwargs
from tasks.core.config import RunConfig
from tasks.engine.settings import engine_for_group
from train_data import make_tiny_target


def engines(cfg: RunConfig, model: str) -> dict[str, tuple[dict, dict]]:
    """(llm kwargs, environment) of each vLLM engine a run of `cfg` would start, built as the run does."""
    bench = default_engine_factory(cfg, model)("baseline", benchmark_kwargs(cfg, None, model))
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


# ---------------------------------------------------------------------------- engines as they are served


def test_extraction_on_gpus_uses_vllms_asynchronous_connector_and_ours_without_cuda(tiny):
    """On a GPU group, vLLM's own ExampleHiddenStatesConnector (by its registered name: copy stream, pinned
    memory, writer threads); on a CPU, ours by module path. Same files either way (test_vllm_connector.py)."""
    cfg = cfg_for(tiny)
    gpu = engine_for_group(cfg, tiny, [0, 1]).llm_kwargs["kv_transfer_config"]
    cpu = engine_for_group(cfg, tiny, []).llm_kwargs["kv_transfer_config"]
    assert gpu == {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                   "kv_connector_extra_config": {}}
    assert cpu == {"kv_connector": "SyncHiddenStatesConnector", "kv_connector_module_path": "tasks.engine.vllm_connector",
                   "kv_role": "kv_producer", "kv_connector_extra_config": {}}


def purposes(cfg: RunConfig, model: str, on_gpu: bool) -> dict[str, dict]:
    from tasks.engine.settings import PURPOSES, vllm_kwargs

    return {p: vllm_kwargs(cfg, model, on_gpu=on_gpu, purpose=p) for p in PURPOSES}


def test_decoding_engines_run_with_cuda_graphs_on_a_gpu_and_extraction_follows_its_own_switch(tiny):
    cfg = cfg_for(tiny)  # extract.enforce_eager: true (the default)
    assert {p: kw["enforce_eager"] for p, kw in purposes(cfg, tiny, on_gpu=True).items()} == {
        "regenerate": False, "extract": True, "benchmark": False}
    assert {p: kw["enforce_eager"] for p, kw in purposes(cfg, tiny, on_gpu=False).items()} == {
        "regenerate": True, "extract": True, "benchmark": True}  # compiling on a CPU costs minutes, gains nothing
    forced = cfg.model_copy(update={"engines": type(cfg.engines).model_validate(
        {"benchmark": {"enforce_eager": True}, "regenerate": {"enforce_eager": False}})})
    forced.extract.enforce_eager = False
    assert {p: kw["enforce_eager"] for p, kw in purposes(forced, tiny, on_gpu=False).items()} == {
        "regenerate": False, "extract": False, "benchmark": True}


def test_engine_args_pass_through_shared_then_per_purpose(tiny):
    cfg = RunConfig.model_validate({
        "target": {"model": tiny, "dtype": "float32"}, "extract": {"backend": "vllm", "layer_ids": [1, 2, 3, 4]},
        "engines": {"engine_args": {"gpu_memory_utilization": 0.9, "max_num_seqs": 64},
                    "regenerate": {"engine_args": {"max_num_seqs": 512}},
                    "extract": {"engine_args": {"max_num_batched_tokens": 32768}}}})
    got = {name: kw for name, (kw, _) in engines(cfg, tiny).items()}
    assert {n: (kw["gpu_memory_utilization"], kw["max_num_seqs"], kw.get("max_num_batched_tokens"))
            for n, kw in got.items()} == {"regenerate-cpu": (0.9, 512, None), "extract-cpu": (0.9, 64, 32768),
                                          "baseline": (0.9, 64, None)}
    assert got["extract-cpu"]["speculative_config"]["method"] == "extract_hidden_states"  # the stage's own, kept


@pytest.fixture(scope="module")
def vision_language(tmp_path_factory) -> str:
    """Kimi-K2.5's config shape (a text decoder plus a vision tower): only the config matters here."""
    from transformers.models.kimi_k25 import Kimi_K25Config

    folder = Path(tmp_path_factory.mktemp("settings") / "kimi")
    Kimi_K25Config(text_config={"model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 64,
                                "num_hidden_layers": 4, "num_attention_heads": 4, "kv_lora_rank": 32},
                   vision_config={"hidden_size": 32, "num_hidden_layers": 1}).save_pretrained(folder)
    return str(folder)


def test_text_only_engines_of_a_vision_language_target_skip_the_vision_tower(vision_language, tiny):
    from tasks.core.engine_args import vllm_engine_arg_names

    assert "language_model_only" in vllm_engine_arg_names()  # vLLM 0.32 (CPU) and 0.33 both have it
    got = engines(cfg_for(vision_language), vision_language)
    assert {name: kw.get("language_model_only") for name, (kw, _) in got.items()} == {
        "regenerate-cpu": True, "extract-cpu": True, "baseline": True}
    assert all("language_model_only" not in kw for kw, _ in engines(cfg_for(tiny), tiny).values())
