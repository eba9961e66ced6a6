"""The draft model training builds: speculators' Eagle3DraftModel for the target's layer type (or, for an
eagle3-mla head, with DeepSeek's MLA attention layer), DFlashDraftModel and DSparkDraftModel, its attention
kernel (flex_attention where it compiles, else sdpa), precision, and FLOPs per token for MFU. What a head kind
asks of its target, and its passes per token, are tasks/train/head_kinds.py's (no torch).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from tasks.core.config import BLOCK_KINDS, HeadConfig, TargetConfig, TrainConfig
from tasks.engine.target import draft_arch, text_config, verifier_weights
from tasks.train import TrainError, log
from tasks.train.head_kinds import head_target_problem, is_mla


# An MLA draft layer copies these keys of the target's DeepSeek-V3 text config: its attention shape (query
# heads, the q and kv LoRA ranks, the decoupled RoPE head, the value head), its RoPE, norms and dense MLP width
MLA_LAYER_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                  "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "hidden_act",
                  "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_interleave", "attention_bias")


def mla_layer_config(train: TrainConfig, tc: Any, model: str = "?") -> Any:
    """An eagle3-mla head's decoder layer config: a DeepSeek-V3 config with the target's MLA attention
    (MLA_LAYER_KEYS) and `train.num_layers` dense layers (first_k_dense_replace past them: vLLM's
    deepseek_eagle3 builds a dense MLP, never MoE) of the target's dense MLP width."""
    problem = head_target_problem(train.head, tc, model)
    if problem:
        raise TrainError(problem)
    from transformers import DeepseekV3Config

    _register_mla_layers()
    keys = {k: getattr(tc, k) for k in MLA_LAYER_KEYS if getattr(tc, k, None) is not None}
    return DeepseekV3Config(**keys, num_hidden_layers=train.num_layers, first_k_dense_replace=train.num_layers,
                            tie_word_embeddings=False)


def _register_mla_layers() -> None:
    """Give speculators' Eagle3DraftModel DeepSeek-V3 layers (it builds Llama and Qwen3 ones): the first
    layer is speculators' EAGLE-3 first layer over transformers' DeepseekV3DecoderLayer, whose MLA input
    projections (q_a_proj or q_proj, kv_a_proj_with_mqa) read [embeddings, hidden] (2 x hidden), as vLLM's
    deepseek_eagle3 builds them; the other layers are DeepseekV3DecoderLayer as it is."""
    from speculators.models.base_components import ModelComponents
    from speculators.models.eagle3 import model_definitions
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    if "deepseek_v3" in model_definitions.model_classes:
        return

    class DeepseekV3DecoderEagle3FirstLayer(model_definitions.Eagle3FirstLayerMixin, ds.DeepseekV3DecoderLayer):
        def __init__(self, config: Any, layer_idx: int, norm_before_residual: bool = False):
            super().__init__(config, layer_idx)
            self.norm_before_residual = norm_before_residual
            self.hidden_norm = ds.DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            attn, wide = self.self_attn, 2 * config.hidden_size
            if attn.q_lora_rank is None:
                attn.q_proj = torch.nn.Linear(wide, attn.num_heads * attn.qk_head_dim, bias=False)
            else:
                attn.q_a_proj = torch.nn.Linear(wide, attn.q_lora_rank, bias=config.attention_bias)
            attn.kv_a_proj_with_mqa = torch.nn.Linear(wide, attn.kv_lora_rank + attn.qk_rope_head_dim,
                                                      bias=config.attention_bias)

    model_definitions.model_classes["deepseek_v3"] = ModelComponents(
        DeepseekV3DecoderEagle3FirstLayer, ds.DeepseekV3DecoderLayer, ds.DeepseekV3RMSNorm,
        ds.DeepseekV3RotaryEmbedding)


def draft_layer_config(train: TrainConfig, target: TargetConfig, target_path: str, hf_config: Any,
                       kind: str = "eagle3", window: int | None = None) -> Any:
    """The draft decoder layer's config for a head `kind`: the target's layer type (Qwen3 with silu for
    DFlash and DSpark, the layer vLLM's DFlash model has; DeepSeek-V3's MLA layer for eagle3-mla) and
    attention shape. `window` (a block head's attention_window): every layer `sliding_attention` over that
    many tokens, the fields both speculators' DFlash model and vLLM's read."""
    from speculators.train.cli import create_transformer_layer_config

    tc = text_config(hf_config)
    if kind == "eagle3-mla":
        return mla_layer_config(train, tc, target.model)
    dflash = kind in BLOCK_KINDS
    layer_cfg = create_transformer_layer_config(
        verifier_name_or_path=target_path, num_layers=train.num_layers,
        draft_arch="qwen3" if dflash else draft_arch(tc), hidden_act="silu" if dflash else None,
        sliding_window=window or int(getattr(tc, "max_position_embeddings", 4096) or 4096),
        full_attention_indices=[] if window else list(range(train.num_layers)),
        trust_remote_code=target.trust_remote_code)
    if is_mla(tc):
        # MLA targets (DeepSeek-V3, Kimi-K2.5): their `head_dim` is the rotary part only (64), which would give
        # the Llama draft layer a narrow attention (64 heads x 64 for a 7168 hidden). Use the value head width.
        layer_cfg.head_dim = int(getattr(tc, "v_head_dim", 0) or int(tc.hidden_size) // int(tc.num_attention_heads))
    return layer_cfg


def attention_shape(layer_cfg: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of a draft layer's attention (MLA: the query/key head, its
    no-RoPE part plus the RoPE part, wider than the value head)."""
    heads = int(layer_cfg.num_attention_heads)
    kv_heads = int(getattr(layer_cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(layer_cfg, "head_dim", None) or int(layer_cfg.hidden_size) // heads)
    if is_mla(layer_cfg):
        head_dim = int(layer_cfg.qk_nope_head_dim) + int(layer_cfg.qk_rope_head_dim)
    return heads, kv_heads, head_dim


def flex_attention_compiles(device: torch.device, heads: int, kv_heads: int, head_dim: int,
                            dtype: torch.dtype = torch.bfloat16, seq: int = 256) -> None:
    """Compile flex_attention for this attention shape on `device` and run a forward and a backward
    pass with a causal mask over two packed documents, as a training step does; raises whatever the
    compiler or the kernel raises (no Triton, a head dim the GPU's shared memory cannot hold, ...)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.arange(seq, device=device) // (seq // 2)

    def same_doc_causal(_b, _h, q, k):
        return (q >= k) & (doc[q] == doc[k])

    block = create_block_mask(same_doc_causal, None, None, seq, seq, device=device)
    q = torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv_heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, kv_heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    out = torch.compile(flex_attention)(q, k, v, block_mask=block, enable_gqa=heads != kv_heads)
    out.float().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_attn_impl(requested: str, device: torch.device, probe: Callable[[], None]) -> tuple[str, str | None]:
    """`train.attn_impl` on this device: (implementation, why auto fell back to sdpa or None).

    auto is flex_attention on a GPU when `probe` (flex_attention_compiles for the draft's shape)
    passes, 1.49x faster than sdpa on the H200 (benchmarks/RESULTS.md), and sdpa when it raises;
    on a CPU it is sdpa without a probe (flex_attention has no backward pass there). An explicit
    choice is returned as it is."""
    if requested != "auto":
        return requested, None
    if device.type != "cuda":
        return "sdpa", None
    try:
        probe()
    except Exception as exc:  # noqa: BLE001 - any compiler failure means: use sdpa
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        reason = f"flex_attention does not compile on {device}: {type(exc).__name__}: {first}"
        log.warning("train.attn_impl auto: %s; training with sdpa instead (set train.attn_impl: sdpa to skip "
                    "this check)", reason)
        with contextlib.suppress(Exception):
            torch._dynamo.reset()  # drop what the failed compile left behind
        return "sdpa", reason
    return "flex_attention", None


def speculators_kind(kind: str) -> tuple[Any, Any]:
    """(model class, config class) of a head kind in the installed speculators; a TrainError naming the
    version when it has none (DFlash and DSpark arrived in speculators 0.9)."""
    import importlib

    module, names = {"eagle3": ("speculators.models.eagle3", ("Eagle3DraftModel", "Eagle3SpeculatorConfig")),
                     "eagle3.1": ("speculators.models.eagle3", ("Eagle3DraftModel", "Eagle3SpeculatorConfig")),
                     "eagle3-mla": ("speculators.models.eagle3", ("Eagle3DraftModel", "Eagle3SpeculatorConfig")),
                     "dflash": ("speculators.models.dflash", ("DFlashDraftModel", "DFlashSpeculatorConfig")),
                     "dspark": ("speculators.models.dspark", ("DSparkDraftModel", "DSparkSpeculatorConfig"))}[kind]
    try:
        mod = importlib.import_module(module)
        return getattr(mod, names[0]), getattr(mod, names[1])
    except (ImportError, AttributeError) as exc:
        from importlib.metadata import PackageNotFoundError, version

        try:
            have = version("speculators")
        except PackageNotFoundError:
            have = "(none)"
        raise TrainError(f"train.heads asks for a {kind} head, but the installed speculators {have} has no "
                         f"{module}.{names[0]} ({exc}); install the "
                         "version requirements/cpu.lock pins (speculators 0.9) or drop that head") from None


def dflash_mask_token(head: HeadConfig, target_path: str, vocab_size: int, trust_remote_code: bool) -> int:
    """The token a DFlash-family head feeds at masked positions: `head.mask_token_id`, else speculators' own rule
    (the tokenizer's mask token, a new <|MASK|> in a free embedding row, else pad/eos/unk)."""
    if head.mask_token_id is not None:
        if head.mask_token_id >= vocab_size:
            raise TrainError(f"train.heads: {head.label} mask_token_id {head.mask_token_id} is outside the target's "
                             f"vocabulary of {vocab_size}")
        return head.mask_token_id
    from speculators.train.utils import resolve_mask_token_id

    try:
        return int(resolve_mask_token_id(target_path, vocab_size, None, trust_remote_code=trust_remote_code))
    except (ValueError, ImportError, OSError) as exc:  # it loads the target's whole processor (a VLM's images too)
        raise TrainError(f"train.heads: the {head.label} head needs a mask token, and speculators could not load "
                         f"the target's processor to find one ({type(exc).__name__}: {str(exc)[:300]}); set the "
                         "head's mask_token_id to a reserved or unused token id of the target's vocabulary (public "
                         "DFlash drafts for Kimi K2.6 and K2.7 use 163838)") from None


def build_draft_model(train: TrainConfig, target: TargetConfig, target_path: str, hf_config: Any,
                      layer_ids: list[int], d2t: torch.Tensor, t2d: torch.Tensor, attn_impl: str | None = None):
    """The head of `train` (one of train.heads, see TrainConfig.for_head) for this target, seeded, verifier
    weights loaded: speculators' Eagle3DraftModel, DFlashDraftModel or DSparkDraftModel. `layer_ids`: the
    auxiliary layers it reads, then the last one.

    eagle3 follows speculators' EAGLE-3 recipe (`speculators train` defaults: norm before residual, one
    norm before the fc, normed output fed back across TTT steps); eagle3.1 swaps the one norm for
    EAGLE-3.1's per-layer fc_norm. Both take the target's layer type; eagle3-mla is eagle3.1 with the MLA
    target's own attention (DeepSeek-V3 layers, `mla_layer_config`), what vLLM's deepseek_eagle3 loads.
    dflash takes Qwen3 layers (the only DFlash layer vLLM has) shaped like the target, a block of
    `block_size`; dspark is that backbone with
    speculators' DSpark heads at their defaults (Markov rank 256, vanilla; the confidence head fed the Markov
    embedding). Both keep the anchor as the verifier's bonus token (`sample_from_anchor` false: block_size - 1
    drafted tokens): speculators' DSpark default drafts from the anchor too, but vLLM 0.26's DSpark loader (the
    lent GPU's) decodes every speculators DSpark draft with a bonus anchor. Every draft layer has full
    attention. `attn_impl` (sdpa, flex_attention, eager) is the resolved `train.attn_impl` (auto means sdpa
    here).
    """
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    head = train.head
    model_cls, config_cls = speculators_kind(head.kind)
    tc = text_config(hf_config)
    layer_cfg = draft_layer_config(train, target, target_path, hf_config, kind=head.kind,
                                   window=head.attention_window)
    impl = attn_impl or (train.attn_impl if train.attn_impl != "auto" else "sdpa")
    layer_cfg._attn_implementation = "simple_flex_attention" if impl == "flex_attention" else impl
    k = int(d2t.shape[0])
    verifier = VerifierConfig(name_or_path=target_path, architectures=list(hf_config.architectures or []))
    if head.drafts_blocks:
        s = head.dflash_settings()
        config = config_cls(
            transformer_layer_config=layer_cfg, draft_vocab_size=k, block_size=s["block_size"],
            aux_hidden_state_layer_ids=list(layer_ids[:-1]),
            mask_token_id=dflash_mask_token(head, target_path, int(tc.vocab_size), target.trust_remote_code),
            # speculators trains full-attention layers bidirectionally inside a block whatever this says; vLLM
            # reads it as the block's causality (causal = not it), so true makes vLLM decode what was trained
            sliding_window_non_causal=True, sample_from_anchor=False,
            speculators_config=SpeculatorsConfig(
                algorithm=head.kind, default_proposal_method="greedy",
                proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=s["block_size"] - 1)],
                verifier=verifier))
    else:
        # eagle3-mla takes EAGLE-3.1's per-layer norms: vLLM's deepseek_eagle3 reads fc_norm, not norm_before_fc
        norms = {"fc_norm": True} if head.kind in ("eagle3.1", "eagle3-mla") else {"norm_before_fc": True}
        config = config_cls(
            transformer_layer_config=layer_cfg, draft_vocab_size=k, norm_before_residual=True, norm_output=True,
            eagle_aux_hidden_state_layer_ids=list(layer_ids[:-1]), **norms,
            speculators_config=SpeculatorsConfig(
                algorithm="eagle3", default_proposal_method="greedy",
                proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=train.ttt_steps)],
                verifier=verifier))
    torch.manual_seed(train.seed)
    model = model_cls(config)
    if k != int(t2d.shape[0]):
        model.load_vocab_mappings(t2d, d2t)

    w = verifier_weights(target_path, hf_config)
    head = w["lm_head"][t2d] if model.use_draft_vocab else w["lm_head"]
    expect = {"embed_tokens": model.embed_tokens.weight, "norm": model.verifier_norm.weight}
    for role, param in expect.items():
        if tuple(w[role].shape) != tuple(param.shape):
            raise TrainError(f"{target_path}: verifier {role} has shape {list(w[role].shape)}, the draft expects "
                             f"{list(param.shape)}; the target config and weights disagree")
    with torch.no_grad():
        model.embed_tokens.weight.copy_(w["embed_tokens"])
        model.lm_head.weight.copy_(head)
        model.verifier_lm_head.weight.copy_(head)
        model.verifier_norm.weight.copy_(w["norm"])
    for p in (model.embed_tokens.weight, model.lm_head.weight, model.verifier_lm_head.weight,
              model.verifier_norm.weight):
        p.requires_grad_(False)
    return model


def resolve_precision(requested: str, device: torch.device) -> str:
    """`train.precision` on this device: auto is bf16 autocast on a GPU and on a CPU that multiplies
    bf16 natively (AMX / AVX512-BF16: 1.3-1.4x faster than float32 there, benchmarks/RESULTS.md), float32
    on other CPUs, where bf16 matmuls are emulated and many times slower."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16"
    from tasks.engine.process import cpu_has_fast_bf16

    return "bf16" if cpu_has_fast_bf16() else "fp32"


def trainable_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def flops_per_token(model: Any, ttt_steps: float) -> float:
    """Training FLOPs per token (estimate; matmuls only, attention scores left out):
    fc once (fwd+bwd: 6 per weight), the decoder layers per TTT step (6 per weight),
    the frozen draft lm_head per step (fwd + input-grad: 4*H*K), the verifier head once (2*H*K)."""
    hk = int(model.lm_head.weight.numel())  # hidden x draft vocabulary
    fc = sum(p.numel() for p in model.fc.parameters())
    layers = sum(p.numel() for p in model.layers.parameters())
    return 6.0 * fc + ttt_steps * (6.0 * layers + 4.0 * hk) + 2.0 * hk
