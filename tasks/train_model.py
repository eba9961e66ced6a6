"""The draft model training builds: speculators' Eagle3DraftModel for the target's layer type, its
attention kernel (flex_attention where it compiles, else sdpa), precision, and FLOPs per token for MFU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from tasks.config import TargetConfig, TrainConfig
from tasks.target import load_verifier_weights, text_config
from tasks.train_common import TrainError, log

def _draft_arch(tc: Any) -> str:
    """vLLM runs EAGLE-3 drafts with Llama or Qwen3 layers; Qwen3 targets get Qwen3 layers."""
    return "qwen3" if str(getattr(tc, "model_type", "")).startswith("qwen3") else "llama"


def draft_layer_config(train: TrainConfig, target: TargetConfig, target_path: str, hf_config: Any) -> Any:
    """The draft decoder layer's config: the target's layer type and attention shape."""
    from speculators.train.cli import create_transformer_layer_config

    tc = text_config(hf_config)
    layer_cfg = create_transformer_layer_config(
        verifier_name_or_path=target_path, num_layers=train.num_layers, draft_arch=_draft_arch(tc),
        hidden_act=None, sliding_window=int(getattr(tc, "max_position_embeddings", 4096) or 4096),
        full_attention_indices=list(range(train.num_layers)), trust_remote_code=target.trust_remote_code)
    if getattr(tc, "kv_lora_rank", None):
        # MLA targets (DeepSeek-V3, Kimi-K2.5): their `head_dim` is the rotary part only (64), which would give
        # the Llama draft layer a narrow attention (64 heads x 64 for a 7168 hidden). Use the value head width.
        layer_cfg.head_dim = int(getattr(tc, "v_head_dim", 0) or int(tc.hidden_size) // int(tc.num_attention_heads))
    return layer_cfg


def attention_shape(layer_cfg: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of a draft layer's attention."""
    heads = int(layer_cfg.num_attention_heads)
    kv_heads = int(getattr(layer_cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(layer_cfg, "head_dim", None) or int(layer_cfg.hidden_size) // heads)
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


def build_draft_model(train: TrainConfig, target: TargetConfig, target_path: str, hf_config: Any,
                      layer_ids: list[int], d2t: torch.Tensor, t2d: torch.Tensor, attn_impl: str | None = None):
    """speculators' Eagle3DraftModel for this target, seeded, verifier weights loaded.

    The decoder follows speculators' EAGLE-3 recipe (`speculators train` defaults:
    norm before residual, norm before fc, normed output fed back across TTT steps),
    with full attention in every draft layer and the target's layer type. `attn_impl`
    (sdpa, flex_attention, eager) is the resolved `train.attn_impl` (auto means sdpa here).
    """
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    tc = text_config(hf_config)
    layer_cfg = draft_layer_config(train, target, target_path, hf_config)
    impl = attn_impl or (train.attn_impl if train.attn_impl != "auto" else "sdpa")
    layer_cfg._attn_implementation = "simple_flex_attention" if impl == "flex_attention" else impl
    k = int(d2t.shape[0])
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_cfg, draft_vocab_size=k, norm_before_residual=True, norm_before_fc=True,
        norm_output=True, eagle_aux_hidden_state_layer_ids=list(layer_ids[:-1]),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=train.ttt_steps)],
            verifier=VerifierConfig(name_or_path=target_path, architectures=list(hf_config.architectures or []))))
    torch.manual_seed(train.seed)
    model = Eagle3DraftModel(config)
    if k != int(t2d.shape[0]):
        model.load_vocab_mappings(t2d, d2t)

    tie = bool(getattr(tc, "tie_word_embeddings", False) or getattr(hf_config, "tie_word_embeddings", False))
    w = load_verifier_weights(target_path, tie)
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
    from tasks.engine import cpu_has_fast_bf16

    return "bf16" if cpu_has_fast_bf16() else "fp32"


def trainable_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def flops_per_token(model: Any, ttt_steps: int) -> float:
    """Training FLOPs per token (estimate; matmuls only, attention scores left out):
    fc once (fwd+bwd: 6 per weight), the decoder layers per TTT step (6 per weight),
    the frozen draft lm_head per step (fwd + input-grad: 4*H*K), the verifier head once (2*H*K)."""
    hk = model.hidden_size * model.draft_vocab_size
    fc = sum(p.numel() for p in model.fc.parameters())
    layers = sum(p.numel() for p in model.layers.parameters())
    return 6.0 * fc + ttt_steps * (6.0 * layers + 4.0 * hk) + 2.0 * hk
