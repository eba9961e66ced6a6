"""The sizes the cost model prices (tasks/cost/plan.py): the draft this config would train, built on the meta
device (shapes only: speculators' Eagle3DraftModel from the same layer config as tasks.train.model), its trainable
parameters and training FLOPs per token, each head's cost over it, and the stored bytes per token of an extract
part. No lever of a plan changes them, so `make_plan` builds one `Shape` and reuses it for every lever;
tasks/cost/shape_cache.py keeps its numbers on disk, so each draft's is built once (building imports torch)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.core.config import RunConfig
from tasks.cost.rates import Rate, Target, load_target
from tasks.engine.target import text_config
from tasks.train.head_kinds import passes_per_token


# --------------------------------------------------------------------------- the draft's size

def draft_model(cfg: RunConfig, target: Target, layer_ids: list[int]):
    """The Eagle3DraftModel this config trains, on the meta device (shapes only), built from the same
    layer config as tasks.train.model.build_draft_model."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    from tasks.train.model import draft_layer_config

    layer_cfg = draft_layer_config(cfg.train, cfg.target.model_copy(update={"trust_remote_code": False}),
                                   target.folder, target.hf_config)
    vocab = min(cfg.vocab.draft_vocab_size, int(text_config(target.hf_config).vocab_size))
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_cfg, draft_vocab_size=vocab, norm_before_residual=True,
        norm_before_fc=True, norm_output=True, eagle_aux_hidden_state_layer_ids=list(layer_ids[:-1]),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=cfg.train.ttt_steps)],
            verifier=VerifierConfig(name_or_path=target.folder,
                                    architectures=list(target.hf_config.architectures or []))))
    with torch.device("meta"):
        return Eagle3DraftModel(config)


def trainable_params(model: Any) -> int:
    """What build_draft_model leaves trainable: all but the verifier's embeddings, heads and norm."""
    frozen = {id(p) for m in (model.embed_tokens, model.lm_head, model.verifier_lm_head, model.verifier_norm)
              for p in m.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in frozen)


def hidden_bytes_per_token(layers: int, hidden: int, dtype: str) -> int:
    """Stored bytes per token of an extract part (docs/ARTIFACTS.md): the hidden states of `layers` layers
    (bf16; or fp8 e4m3 plus one f32 scale per token and layer) + int32 token id + loss-mask byte.
    Measured on SmolLM2 (4 x 576): 4,613 bf16, 2,325 fp8 (benchmarks/RESULTS.md)."""
    states = layers * hidden * 2 if dtype == "bf16" else layers * hidden + layers * 4
    return states + 5


@dataclass
class Shape:
    """The target's and the draft's sizes, which no lever of the plan changes."""
    target: Target
    hidden: int
    n_layers: int
    train_flops: float
    trainable: int
    flops_fixed: float = 0.0  # of train_flops: the fc and the verifier head, once per token
    flops_per_pass: float = 0.0  # of train_flops: the decoder layers and the draft head, per pass (TTT step)
    layer_params: int = 0  # of trainable: one decoder layer's (a head's num_layers scales them)

    def head_cost(self, head: Any, train: Any) -> float:
        """A head kind's training FLOPs per token over the EAGLE-3 draft's (`train_flops`): one factor per
        head, from its passes per token (tasks.train.head_kinds.passes_per_token: eagle3, eagle3.1 and eagle3-mla
        train.ttt_steps, 1.0; dflash and dspark block_size x max_anchors / batch_tokens) with the same layers.
        Computed, not measured: DSpark's Markov and confidence heads, the MLA layer's own width and attention
        scores are left out; measured rates per kind replace it once a GPU run has them."""
        passes = passes_per_token(head, train)
        extra = self.extra_layers(head, train)
        if (passes == train.ttt_steps and not extra) or not self.flops_per_pass:
            return 1.0
        per_pass = self.flops_per_pass + 6.0 * extra * self.layer_params  # fwd + bwd of each further layer
        return (self.flops_fixed + passes * per_pass) / self.train_flops

    def extra_layers(self, head: Any, train: Any) -> int:
        """Decoder layers `head` has beyond the draft this shape was built with (train.num_layers)."""
        return (head.num_layers or train.num_layers) - train.num_layers if self.layer_params else 0

    def head_params(self, head: Any, train: Any) -> int:
        """`head`'s trainable parameters: the shape's draft with its own number of decoder layers (its
        checkpoints' size)."""
        return self.trainable + self.extra_layers(head, train) * self.layer_params


def head_cost_rate(head: Any, cost: float, train: Any, mfu_rate: str) -> Rate:
    """A head kind's training cost over the EAGLE-3 draft's (Shape.head_cost), named as the assumption it is:
    computed from FLOPs per token at the EAGLE-3 draft's MFU, never measured per kind on a GPU."""
    left_out = {"dspark": "; DSpark's Markov and confidence heads left out",
                "eagle3-mla": "; the MLA layer's own projections and attention scores left out",
                "eagle3.1": "; its per-layer fc norms left out"}.get(head.kind, "")
    if (head.num_layers or train.num_layers) > train.num_layers:
        left_out += "; its further layers priced as the EAGLE-3 draft's layer (whose attention reads twice the width)"
    return Rate(f"train.head_cost.{head.label}", cost, "x the EAGLE-3 draft's training FLOPs per token",
                "assumption", f"computed (Shape.head_cost): {passes_per_token(head, train):g} decoder passes per "
                f"token of {head.num_layers or train.num_layers} layer(s) against EAGLE-3's {train.ttt_steps} of "
                f"{train.num_layers}, at the EAGLE-3 draft's MFU ({mfu_rate}); {head.kind} "
                f"not measured on a GPU{left_out}")


def make_shape(cfg: RunConfig, rates: dict[str, Any]) -> Shape:
    from tasks.engine.target import configured_layer_ids
    from tasks.train.model import flops_per_token

    with tempfile.TemporaryDirectory() as tmp:
        target = load_target(cfg, rates, Path(tmp))
        tc = text_config(target.hf_config)
        layer_ids = configured_layer_ids(cfg, int(tc.num_hidden_layers))
        draft = draft_model(cfg, target, layer_ids)
        fixed = flops_per_token(draft, 0)
        per_layer = sum(p.numel() for p in draft.layers.parameters()) // max(1, len(draft.layers))
        return Shape(target, int(tc.hidden_size), len(layer_ids), flops_per_token(draft, cfg.train.ttt_steps),
                     trainable_params(draft), fixed, flops_per_token(draft, 1) - fixed, per_layer)
