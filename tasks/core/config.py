"""The run's typed configuration: one pydantic model per section, `RunConfig` holding them all.

Every section is strict (unknown keys are errors) so a typo never silently falls back to a default.
tasks/core/config_load.py reads one from YAML (with `--set a.b=c` overrides) and says what is wrong with a bad
one, field by field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tasks.core.stages import stage_names

STAGES = stage_names()  # the stages in the order the flow runs them (tasks/core/stages.py, the registry)


def check_unique(names: list[str], what: str, fix: str = "") -> None:
    """Refuse NAMES that repeat, naming them: `WHAT must be unique, [...] appear more than once[; FIX]`."""
    twice = sorted({x for x in names if names.count(x) > 1})
    if twice:
        raise ValueError(f"{what} must be unique, {twice} appear more than once" + (f"; {fix}" if fix else ""))


def check_layer_ids(v: list[int] | None, too_few: str, at_least: int) -> list[int] | None:
    """The one layer-id rule (extract.layer_ids, a head's layer_ids): distinct, ascending, from 1 (vLLM's
    numbering: id k is the output of decoder layer k-1), at least `at_least` of them."""
    if v is None:
        return v
    if len(v) < at_least:
        raise ValueError(too_few)
    if sorted(set(v)) != v:
        raise ValueError(f"layer ids must be distinct and ascending, got {v}")
    if v[0] < 1:
        raise ValueError(f"layer ids start at 1 (id k = output of decoder layer k-1), got {v}")
    return v


def with_scheme(uri: str) -> str:
    """A store uri with its scheme: a bare folder is `file://FOLDER` (the config's and the Store's one rule)."""
    return uri if "://" in uri else "file://" + uri


def canonical_uri(uri: str) -> str:
    """One store, one URI, however it is written: a bare folder gets `file://`; a file:// folder is made absolute
    (relative to the current folder, `~` expanded, symlinks resolved); no trailing slash. `file://.draftline/store`,
    `file:///CHECKOUT/.draftline/store/` and `.draftline/store` run from the checkout are one store. Every comparison
    of store URIs compares these (the Store's own `uri` is one)."""
    scheme, rest = with_scheme(uri).split("://", 1)
    if scheme == "file":
        return f"file://{Path(rest).expanduser().resolve()}"
    return f"{scheme}://{rest.rstrip('/')}"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TargetConfig(Section):
    """The verifier model the draft is trained for."""

    model: str = Field(
        "smollm2-135m-instruct",
        description="Hub id, local folder, or the offline preset 'smollm2-135m-instruct'.",
    )
    revision: str | None = Field(None, description="Hub revision (commit, tag or branch).")
    trust_remote_code: bool = Field(
        False, description="Run the model repository's own Python code. Only when you trust it."
    )
    chat_template: str | None = Field(
        None, description="Path to a Jinja chat template that replaces the tokenizer's own."
    )
    max_model_len: int = Field(2048, ge=64, description="Longest sequence (tokens) any stage feeds the target.")
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"


# user turns only: someone (regenerate, benchmark) answers them. humaneval, gsm8k and math are the anchors' evals
# (tasks/data/eval_sets.py says which offline set stands for each)
PROMPT_ONLY_PRESETS = ("mtbench", "instruct", "humaneval", "gsm8k", "math")


class SourceConfig(Section):
    """One data source. Exactly one of `preset`, `path`, `hub` names it."""

    name: str | None = Field(None, description="Label stored in the `source` column; defaults to the source id.")
    preset: Literal["chitchat", "mtbench", "instruct", "humaneval", "gsm8k", "math"] | None = None
    path: str | None = Field(None, description="Local (or fsspec) JSONL, JSON or Parquet file.")
    hub: str | None = Field(None, description="Hugging Face dataset id.")
    split: str = "train"
    subset: str | None = None
    revision: str | None = None
    format: Literal["auto", "sharegpt", "messages", "perfectblend", "prompt_response"] = "auto"
    weight: float = Field(1.0, gt=0, description="Relative share of this source in the mix.")
    max_samples: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_origin(self) -> "SourceConfig":
        given = [k for k in ("preset", "path", "hub") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(
                f"a source needs exactly one of preset/path/hub, got {given or 'none'}; "
                "e.g. `{preset: chitchat}` or `{path: data.jsonl}` or `{hub: org/dataset}`"
            )
        return self

    @property
    def label(self) -> str:
        return self.name or self.preset or self.hub or Path(self.path or "").stem

    @property
    def prompt_only(self) -> bool:
        """Prompts without answers (an offline preset of questions): usable for training only when the
        regenerate stage has the target answer them."""
        return self.preset in PROMPT_ONLY_PRESETS

    @property
    def keeps_prompts(self) -> bool:
        """A user's own file or hub dataset: its rows without an answer are kept as prompts when the regenerate
        stage answers them (most teams bring prompts only). The built-in presets keep their fixed contents
        (chitchat's one-speaker rows stay dropped)."""
        return self.preset is None


class DataConfig(Section):
    sources: list[SourceConfig] = Field(default_factory=lambda: [SourceConfig(preset="chitchat")])
    max_samples: int | None = Field(None, ge=1, description="Cap on training samples after mixing.")
    max_length: int = Field(1024, ge=16, description="Longest sample in tokens.")
    overflow: Literal["truncate", "drop"] = "truncate"
    num_shards: int = Field(4, ge=1)
    heldout: int = Field(32, ge=0, description="Samples kept out of training for in-distribution evaluation.")
    dedupe: bool = True
    seed: int = 0
    keep_thinking: bool = True
    system_prompt: str | None = None
    workers: int | None = Field(
        None, ge=1,
        description="Processes that encode the conversations (chat template, tokens, verified loss mask); 1 encodes "
                    "in prepare's own process. Default: one per core this process may use, at most 32, and at most one "
                    "per 2,000 conversations to encode (a worker's start costs ~6 CPU-seconds: benchmarks/RESULTS.md). "
                    "Scheduling only: the artifact and its address are the same at any count (tasks/data/encoding.py).")


class RegenerateConfig(Section):
    enabled: bool = True
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    thinking: bool = Field(True, description="Keep the target's reasoning in regenerated answers.")
    batch_size: int = Field(64, ge=1, description="Prompts per engine call (checkpointed per shard).")
    max_turns: int = Field(
        1, ge=1,
        description="User turns answered per conversation, in order (later turns of the source are dropped: "
                    "they reply to the original answer, not to the target's).",
    )


class VocabConfig(Section):
    draft_vocab_size: int = Field(32000, ge=16)


class ExtractConfig(Section):
    backend: Literal["vllm", "transformers"] = "vllm"
    layer_ids: list[int] | None = Field(
        None, description="Auxiliary layer ids (vLLM numbering); default = EAGLE-3 convention."
    )
    tensor_parallel_size: int = Field(1, ge=1)
    gpus: int | None = Field(None, ge=0, description="GPUs to use; default all visible (0 = CPU).")
    cpu_groups: int = Field(
        1, ge=1,
        description="On a CPU (no GPU in use): engines side by side, each pinned to its own share of the cores, "
                    "through the same pool that runs one engine per GPU group on a GPU node (regeneration and "
                    "extraction alike).",
    )
    nodes: int = Field(
        1, ge=1,
        description="Nodes of a work pool the run's regeneration shards, then its extraction shards, spread over "
                    "(docs/DEPLOY.md): the run's own node runs one slice, child flow runs of extract.deployment the "
                    "others, all on the shared store.",
    )
    deployment: str | None = Field(
        None,
        description="With extract.nodes > 1: the deployment the child flow runs (regeneration and extraction "
                    "slices) go to (draftline-extract/NAME, or "
                    "NAME). Default: draftline-extract/ plus the name of the run's own deployment.",
    )
    storage_dtype: Literal["bf16", "fp8"] = "bf16"
    batch_tokens: int = Field(16384, ge=64, description="Tokens per engine call.")
    part_tokens: int = Field(
        262144, ge=64,
        description="Tokens per safetensors part (whole samples). batch_tokens > part_tokens: at most part_tokens "
                    "(a single longer sample alone); else a part closes after the engine batch that brings it to "
                    "part_tokens: at most part_tokens - 1 + batch_tokens (tasks.extract.stage.part_rule).")
    kv_cache_gib: float = Field(
        2.0, gt=0,
        description="KV cache of every vLLM engine on a CPU (VLLM_CPU_KVCACHE_SPACE, whole GiB rounded up). vLLM on a "
                    "GPU ignores it: there the KV cache is what gpu_memory_utilization leaves (or kv_cache_memory_bytes); "
                    "set those in engines.engine_args.")
    enforce_eager: bool = Field(
        True, description="Extraction engines without CUDA graphs / torch.compile (starts faster; on a CPU compiling "
                          "gains nothing). The decoding engines have their own: engines.regenerate/benchmark.")
    write_overlap: bool = Field(
        True,
        description="Write parts (serialize, sha256, upload) on a background thread while the engine computes "
                    "the next batches; false writes each part inline (serial; for comparison and debugging).",
    )
    write_queue: int = Field(
        2, ge=1, le=8,
        description="Finished parts waiting for or in the background writers, at most; hidden states in RAM are "
                    "bounded by write_queue + 1 parts (plus the engine call in flight).",
    )
    write_workers: int = Field(
        2, ge=1, le=8,
        description="Background threads writing parts at once (each serializes, hashes and uploads one part; "
                    "one stream does ~1 GB/s, less than a GPU extracts). At most write_queue are used.",
    )
    verify_positions: int = Field(
        64, ge=0,
        description="Positions per part the extraction check tests (tasks/extract/verify.py): the target's own final "
                    "norm and lm_head over the STORED last layer (fp8 dequantized) must give the engine's own next "
                    "token; the last position of up to this many samples per part, spread over it. 0 turns it off.")
    verify_min_agreement: float = Field(
        0.85, ge=0, le=1,
        description="The extraction check's threshold: a shard whose top-1 agreement over its checked positions is "
                    "confidently lower (its upper bound at verify_confidence is below it) is not committed and "
                    "fails, naming the likely causes; shards too small to decide alone are judged pooled before the "
                    "stage is assembled (docs/ARTIFACTS.md: the measured agreement of correct extractions it is set "
                    "below).")
    verify_confidence: float = Field(
        0.999, ge=0.5, lt=1,
        description="The extraction check's one-sided confidence: a shard (or the pooled stage) fails only when the "
                    "Wilson upper bound of its top-1 agreement at this confidence is below verify_min_agreement, so "
                    "that a small shard's few positions (4 of 5 agree) cannot fail it by chance.")

    @field_validator("layer_ids")
    @classmethod
    def _ascending(cls, v: list[int] | None) -> list[int] | None:
        return check_layer_ids(v, "give at least one auxiliary id plus the last layer, e.g. [2, 15, 27, 30]", 2)


DFLASH_ONLY = ("block_size", "max_anchors", "mask_token_id", "attention_window")
BLOCK_KINDS = ("dflash", "dspark")  # heads that draft a block of mask tokens in one pass (the DFlash family)
DFLASH_BLOCK_SIZE = 8  # speculators' DFlashSpeculatorConfig default
DFLASH_MAX_ANCHORS = 512  # speculators' training default


class HeadConfig(Section):
    """One draft head trained from the stored hidden states (train.heads). Keys left unset take the train
    section's values; a head set to anything but the defaults gets its own train address."""

    kind: Literal["eagle3", "eagle3.1", "eagle3-mla", "dflash", "dspark"] = Field(
        "eagle3", description="eagle3: speculators' EAGLE-3 recipe (norm_before_fc: one RMSNorm over the "
        "concatenated target layers, norm_output). eagle3.1: EAGLE-3.1's per-layer fc_norm with norm_output. "
        "eagle3-mla: eagle3.1 with the target's MLA attention (MLA targets only: DeepSeek-V3, Kimi-K2.5), "
        "loaded by vLLM's eagle3 method as Eagle3DeepseekV3ForCausalLM. "
        "dflash: speculators' DFlash (a block of mask tokens drafted in one forward pass; vLLM method dflash). "
        "dspark: speculators' DSpark (DFlash plus a Markov logit-bias head over the previous token and a "
        "confidence head; vLLM method dspark).")
    name: str | None = Field(None, description="Label in task names and the benchmark table; default the kind. "
                                                "Not part of the address.")
    layer_ids: list[int] | None = Field(
        None, description="Auxiliary target layers this head reads (vLLM numbering), a subset of those the extract "
        "stage stores; default all of them. A head that needs others: add them to extract.layer_ids.")
    num_layers: int | None = Field(None, ge=1, description="Draft decoder layers; default train.num_layers.")
    max_steps: int | None = Field(None, ge=1, description="Training steps; default train.max_steps.")
    loss: Literal["default", "lk", "lk_alpha"] | None = Field(
        None, description="The training objective of this head; default train.loss.")
    block_size: int | None = Field(
        None, ge=2, description="dflash, dspark: tokens per drafted block, the anchor plus block_size - 1 mask "
        "tokens (vLLM's num_speculative_tokens at most block_size - 1). Default 8, speculators' default.")
    max_anchors: int | None = Field(
        None, ge=1, description="dflash, dspark: blocks trained per packed batch (sampled anchor positions). "
        "Default 512.")
    attention_window: int | None = Field(
        None, ge=1, description="dflash, dspark: a sliding window over the context the draft attends to: each "
        "block sees the target's hidden states of at most this many tokens before its anchor (z-lab's long-context "
        "DFlash drafts use 4096). Written into the draft's config as every layer's `sliding_attention` with this "
        "`sliding_window`, which vLLM's DFlash and DSpark models serve as sliding-window attention. Default: the "
        "whole context.")
    early_check_min_acceptance: float | None = Field(
        None, ge=1, description="This head's threshold for the early check (train.early_check_step); default "
        "train.early_check_min_acceptance. Not part of the address.")
    mask_token_id: int | None = Field(
        None, ge=0, description="dflash, dspark: the token fed at masked positions. Default: resolved from the target's "
        "tokenizer as speculators does (its mask token, else a new <|MASK|> in a free embedding row, else pad/eos).")

    @field_validator("layer_ids")
    @classmethod
    def _aux_ids(cls, v: list[int] | None) -> list[int] | None:
        return check_layer_ids(v, "give at least one auxiliary id, e.g. [2, 15]", 1)

    @model_validator(mode="after")
    def _kind_keys(self) -> "HeadConfig":
        stray = [k for k in DFLASH_ONLY if getattr(self, k) is not None and not self.drafts_blocks]
        if stray:
            raise ValueError(f"{', '.join(stray)} apply to {' and '.join(BLOCK_KINDS)} heads only; this head is "
                             f"{self.kind}")
        return self

    @property
    def label(self) -> str:
        return self.name or self.kind

    @property
    def drafts_blocks(self) -> bool:
        """A DFlash-family head (BLOCK_KINDS): a block of mask tokens drafted in one forward pass."""
        return self.kind in BLOCK_KINDS

    def recipe(self) -> dict[str, Any]:
        """What this head adds to the train address beyond the train section: nothing for the default
        EAGLE-3 head (so drafts stored before heads existed keep their addresses)."""
        out = self.model_dump(mode="json", exclude_defaults=True,
                              exclude={"name", "num_layers", "max_steps", "loss", "early_check_min_acceptance"})
        if self.drafts_blocks:  # unset and written-out defaults: one address
            out.update({k: v for k, v in self.dflash_settings().items() if k != "mask_token_id"})
        return out

    def dflash_settings(self) -> dict[str, Any]:
        """block_size, max_anchors, mask_token_id (None: resolve from the tokenizer) with defaults applied."""
        return {"block_size": self.block_size or DFLASH_BLOCK_SIZE, "max_anchors": self.max_anchors or
                DFLASH_MAX_ANCHORS, "mask_token_id": self.mask_token_id}


class TrainConfig(Section):
    heads: list[HeadConfig] = Field(
        default_factory=lambda: [HeadConfig()],
        description="Draft heads trained from the same stored hidden states, one cached train task each, all "
        "measured in one benchmark table. Default: one EAGLE-3 head.")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_steps: int = Field(200, ge=1)
    max_minutes: float | None = Field(None, gt=0, description="Stop at this wall-clock budget (still exports).")
    batch_tokens: int = Field(4096, ge=16, description="Packed tokens per step per device.")
    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    ttt_steps: int = Field(3, ge=1)
    ttt_step_loss_decay: float = Field(1.0, gt=0)
    num_layers: int = Field(1, ge=1)
    attn_impl: Literal["auto", "sdpa", "flex_attention", "eager"] = Field(
        "auto", description="Draft attention kernel (the same attention either way, so not part of the artifact's "
        "address). auto: flex_attention on a GPU where it compiles (else sdpa, with the reason in the log), sdpa on "
        "a CPU (flex_attention has no backward pass there).")
    gpus: int | None = Field(
        None, ge=1, description="Training ranks started on this node by torch's elastic launcher (torchrun), one "
        "per GPU: default every visible GPU, 1 on a CPU. On a CPU, N > 1 starts N gloo ranks. batch_tokens is per "
        "rank. Not part of the artifact's address: a retry may resume on another count.")
    nodes: int = Field(
        1, ge=1, description="Nodes of the work pool training runs on (docs/DEPLOY.md): torch's elastic launcher on "
        "the run's own node and on N-1 child flow runs of extract.deployment, one c10d rendezvous hosted by the "
        "run's node, train.gpus ranks on each. A retry runs on the nodes there are. Not part of the artifact's "
        "address.")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="Matmul precision of the training step: bf16 autocast (weights and optimizer stay "
        "float32) or float32. auto: bf16 on GPUs and on CPUs with native bf16 (AMX, AVX512-BF16), else fp32.")
    checkpoint_every: int = Field(100, ge=1)
    eval_batches: int = Field(4, ge=0)
    early_check_step: int = Field(
        1000, ge=0, description="The early check: at this step the held-out split is evaluated once (the simulated "
        "acceptance length, 1 + the sum of the per-position accuracy products, the estimate speculators' "
        "full_acc_k counts; the final evaluation's figure) and the run's log shows it, with a warning when it is "
        "under early_check_min_acceptance. 0: off. Not part of the address.")
    early_check_min_acceptance: float | None = Field(
        None, ge=1, description="The early check's threshold (a head's early_check_min_acceptance overrides it); "
        "unset: the figure is shown, no warning. Not part of the address.")
    seed: int = 0
    prefetch: int = Field(2, ge=0, description="Parts fetched ahead of the training loop.")
    cache_gib: float | None = Field(
        None, ge=0, description="Cap of the node-local part cache (GiB) that an s3:// store's parts are read "
        "through, so each byte crosses the network once per node (folder: DRAFTLINE_CACHE_DIR, default "
        "parts/ under DRAFTLINE_HOME or ~/.cache/draftline). Default: DRAFTLINE_CACHE_GIB, else 90% of that "
        "disk's free space. 0: no cache. Not part of the artifact's address.")
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept on the store; older ones are deleted.")
    loss: Literal["default", "lk", "lk_alpha"] = Field(
        "default", description="The training objective, speculators' loss functions. default: each head's own (EAGLE-3 "
        "and DSpark: KL divergence to the target's distribution; DFlash: cross-entropy to its argmax). lk: the "
        "LK^lambda loss of arXiv 2602.23881, which targets the acceptance rate: per position lambda * KL + (1 - "
        "lambda) * TV with lambda = exp(-3 * alpha), alpha = sum min(p, q) the acceptance rate, not differentiated. "
        "lk_alpha: that paper's LK^alpha, -log(alpha). Position weights, TTT decay and DSpark's confidence head "
        "are unchanged. Enters the train address only when not default.")
    loss_impl: Literal["eager", "fused"] = Field(
        "eager", description="speculators' loss kernels: eager (any device) or fused (Triton, GPU only)."
    )
    init_from: str | None = Field(
        None, description="A published EAGLE-3 draft (a local folder as `draftline export` writes it, or a hub "
        "id) whose weights start training instead of a fresh draft. It seeds every head of train.heads, and each "
        "must be of the draft's own kind (eagle3, eagle3.1 or eagle3-mla; dflash and dspark heads start fresh "
        "only): `draftline run` refuses any other head before work starts. Its hidden size, target vocabulary, "
        "depth and auxiliary layer ids must match this run's (refused with the reason otherwise); another draft "
        "vocabulary is remapped (lm_head rows of tokens in both are copied). Its content digest, not its path, "
        "enters the train address.")

    @field_validator("heads")
    @classmethod
    def _distinct_heads(cls, v: list[HeadConfig]) -> list[HeadConfig]:
        if not v:
            raise ValueError("train.heads needs at least one head, e.g. [{kind: eagle3}]")
        check_unique([h.label for h in v], "head labels", "give them a name")
        return v

    def for_head(self, head: HeadConfig) -> "TrainConfig":
        """This section as one head trains it: the head's overrides applied, `heads` = [head]."""
        update: dict[str, Any] = {"heads": [head]}
        if head.num_layers is not None:
            update["num_layers"] = head.num_layers
        if head.max_steps is not None:
            update["max_steps"] = head.max_steps
        if head.loss is not None:
            update["loss"] = head.loss
        if head.early_check_min_acceptance is not None:
            update["early_check_min_acceptance"] = head.early_check_min_acceptance
        return self.model_copy(update=update)

    @property
    def head(self) -> HeadConfig:
        """The one head of a per-head section (`for_head`); a section with several has none."""
        if len(self.heads) != 1:
            raise ValueError(f"train has {len(self.heads)} heads; train each through train.for_head(head)")
        return self.heads[0]


class EvalConfig(Section):
    name: str
    source: SourceConfig | Literal["heldout"] = "heldout"
    num_prompts: int = Field(16, ge=1)
    context_tokens: int = Field(
        0, ge=0,
        description="0: each prompt is a conversation's first user turn. N > 0: a long-context eval: each prompt "
        "is whole conversations of the source (every turn, answers included) one after another as one chat, then "
        "the next conversation's first user turn, grown until it holds at least N tokens (at most "
        "target.max_model_len - benchmark.max_tokens). `{name: long, source: heldout, context_tokens: 4096}` "
        "asks the target's own regenerated answers back as a long history.")


class DraftConfig(Section):
    """A draft measured beside the trained heads (benchmark.drafts): a published one, or one exported earlier."""

    name: str = Field(..., description="Its label in every report table.")
    model: str = Field(..., description="A local draft folder (config.json + model.safetensors) or a hub id.")


class BenchmarkConfig(Section):
    enabled: bool = True
    evals: list[EvalConfig] = Field(
        default_factory=lambda: [
            EvalConfig(name="mtbench", source=SourceConfig(preset="mtbench")),
            EvalConfig(name="heldout", source="heldout"),
        ]
    )
    num_speculative_tokens: list[int] = Field(default_factory=lambda: [1, 3, 5])
    temperature: float = Field(0.0, ge=0)
    max_tokens: int = Field(128, ge=1)
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 16])
    mismatch_threshold: float = Field(0.15, ge=0)
    length_buckets: list[int] | None = Field(
        None, description="Upper bounds (tokens, ascending) of the context-length buckets of report.md's "
        "'Acceptance by context length' table, e.g. [1024, 4096, 8192, 12288] for <1K, 1K-4K, 4K-8K, 8K-12K and "
        ">12K; only the buckets that hold drafts are shown, each with its requests. Default: the buckets the "
        "training data's stats use (512, 2K, 8K, 32K), which also show the training samples of each bucket.")
    offline_replay: bool = Field(
        True,
        description="At temperature 0, also replay the draft offline (transformers) on the baseline's own "
        "outputs: splits a measured/simulated acceptance gap into distribution shift, draft-start sampling "
        "and engine effects.",
    )
    drafts: list[DraftConfig] = Field(
        default_factory=list,
        description="Other drafts (published, or exported by an earlier run) measured in the same session against "
        "the same baseline as the trained heads, a row each in every report table. Their content digests enter "
        "the benchmark address.")
    replay_backend: Literal["auto", "vllm", "transformers"] = Field(
        "auto",
        description="Engine that computes the replay's hidden states. auto: transformers on a machine without "
        "GPUs (cheaper to start than another vLLM engine), else the extract stage's backend.",
    )

    @model_validator(mode="after")
    def _evals(self) -> "BenchmarkConfig":
        if self.enabled and not self.evals:
            raise ValueError("benchmark.evals is empty: add e.g. {name: mtbench, source: {preset: mtbench}}, or "
                             "set benchmark.enabled: false")
        check_unique([e.name for e in self.evals], "benchmark.evals names")
        return self

    @field_validator("drafts")
    @classmethod
    def _distinct_drafts(cls, v: list[DraftConfig]) -> list[DraftConfig]:
        check_unique([d.name for d in v], "benchmark.drafts names")
        return v

    @field_validator("length_buckets")
    @classmethod
    def _bounds(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or min(v) < 1 or any(a >= b for a, b in zip(v, v[1:]))):
            raise ValueError(f"need ascending positive token counts, e.g. [1024, 4096, 8192], got {v}")
        return v

    @field_validator("num_speculative_tokens", "batch_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or min(v) < 1:
            raise ValueError(f"need a non-empty list of positive integers, got {v}")
        return sorted(set(v))


def head_config(cfg: "RunConfig", head: HeadConfig) -> "RunConfig":
    """The run's config as one head's train task (and its ranks) sees it."""
    return cfg.model_copy(update={"train": cfg.train.for_head(head)})


class StoreConfig(Section):
    uri: str = Field(
        "file://.draftline/store", validate_default=True,
        description="file://FOLDER or s3://BUCKET/PREFIX, canonical once loaded (a file:// folder absolute, from the "
        "current folder; no trailing slash). Credentials come from the environment, never from here.",
    )
    endpoint_url: str | None = Field(
        None, description="S3 endpoint for non-AWS servers (or env AWS_ENDPOINT_URL). Not a secret."
    )
    region: str | None = None
    credentials_block: str | None = Field(
        None, description="Name of a prefect-aws AwsCredentials block holding the keys."
    )
    upload_part_mb: int = Field(16, ge=5, le=5120, description=(
        "S3: a file is uploaded in parts of this many MiB (S3 allows 5 to 5120), upload_concurrency of them at once. "
        "s3fs's own writer (a whole write as one part, parts one at a time) reached 0.50-0.78x a bare multipart "
        "upload of the same bytes; these parts 1.03x (benchmarks/RESULTS.md, issue 47)."))
    upload_concurrency: int = Field(8, ge=1, le=64, description=(
        "S3: parts of one file uploaded at once (each holds upload_part_mb of memory while in flight)."))

    @field_validator("uri")
    @classmethod
    def _scheme(cls, v: str) -> str:
        v = with_scheme(v)
        scheme = v.split("://", 1)[0]
        if scheme not in ("file", "s3", "memory"):
            raise ValueError(f"store uri must start with file:// or s3://, got {scheme}://")
        if scheme == "s3" and "@" in v[len("s3://"):].split("/", 1)[0]:
            raise ValueError("credentials must not be embedded in the store uri; use AWS_* environment variables")
        return canonical_uri(v)  # once, here: every comparison and every Store reads this one


class DecodeEngineConfig(Section):
    """One decoding purpose's vLLM engines (regeneration, the benchmark's)."""

    enforce_eager: bool | None = Field(
        None, description="null: CUDA graphs on a GPU (as engines are served), eager on a CPU (compiling there costs "
                          "minutes and gains nothing); true/false forces it.")
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="vllm.EngineArgs for this purpose's engines, over engines.engine_args.")


class ExtractEngineConfig(Section):
    """The extraction engines' vLLM settings (their CUDA-graph switch is extract.enforce_eager)."""

    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="vllm.EngineArgs for the extraction engines, over engines.engine_args.")


class EnginesConfig(Section):
    """vLLM engine arguments passed through as given (names of vllm.EngineArgs; checked against the installed
    vLLM). They change where and how fast engines run, never what is stored: no artifact address holds them."""

    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="vllm.EngineArgs for every vLLM engine of the run, e.g. "
        "{gpu_memory_utilization: 0.9, max_num_seqs: 256}. Keys draftline sets itself are refused with the key to use.")
    regenerate: DecodeEngineConfig = Field(default_factory=DecodeEngineConfig)
    extract: ExtractEngineConfig = Field(default_factory=ExtractEngineConfig)
    benchmark: DecodeEngineConfig = Field(default_factory=DecodeEngineConfig)
    serve_host: str = Field(
        "127.0.0.1", description="The address the printed `vllm serve` line binds (--host): this machine only by "
        "default, since vLLM's API has no authentication. `draftline export --host` overrides it for one export.")


class RunConfig(Section):
    name: str = "draftline"
    target: TargetConfig = Field(default_factory=TargetConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig)
    vocab: VocabConfig = Field(default_factory=VocabConfig)
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    benchmark: BenchmarkConfig = Field(default_factory=BenchmarkConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    engines: EnginesConfig = Field(default_factory=EnginesConfig)

    @model_validator(mode="after")
    def _prompts_need_answers(self) -> "RunConfig":
        prompt_only = [s.label for s in self.data.sources if s.prompt_only]
        if prompt_only and not self.regenerate.enabled:
            raise ValueError(
                f"data source(s) {prompt_only} hold prompts without answers, and regenerate is off: nothing "
                "to train on. Set regenerate.enabled: true (the target answers them) or use sources with answers")
        return self
