"""Each stage's address: one function per stage, used by the stage itself and by the flow's task that asks the
store for it (flows/caching.py), so both always agree on where an artifact lives. Scheduling-only keys (devices,
prefetch, batch sizes that do not change the bytes) are left out on purpose. The hashing itself, and the
stage versions, are tasks/core/digest.py's `stage_digest` and `VERSIONS`.
"""

from __future__ import annotations

import hashlib
from typing import Any

from tasks.core.digest import VERSIONS, stage_digest
from tasks.core.stages import stage, stage_folders


def target_identity(cfg) -> dict[str, Any]:
    """What the target IS, not where it sits: the content fingerprint of its folder or hub snapshot
    (tasks/engine/weights.py: config, tokenizer, weight index, each weight file's sha256), so the same model at two
    paths, or a hub snapshot and a copy of it, share every address. The offline preset keeps the identity it
    was stored with (its name): the demo's addresses never change."""
    from tasks.engine.weights import PRESETS

    t = cfg.target
    if t.model in PRESETS:
        ident: dict[str, Any] = {"model": t.model, "revision": t.revision, "max_model_len": t.max_model_len}
    else:
        from tasks.engine.weights import target_fingerprint

        ident = {"fingerprint": target_fingerprint(t), "max_model_len": t.max_model_len}
    if t.chat_template:
        from pathlib import Path

        p = Path(t.chat_template)
        ident["chat_template_sha256"] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else t.chat_template
    return ident


def prepare(cfg) -> str:
    """The data by content (tasks/address/data.py): a file edited in place is new data, a copy elsewhere is not."""
    from tasks.address.data import data_identity

    section: dict[str, Any] = {"target": target_identity(cfg), "data": data_identity(cfg.data)}
    if cfg.regenerate.enabled and any(s.keeps_prompts for s in cfg.data.sources):
        section["prompts"] = "kept"  # a user's prompt-only rows are kept (tasks/data/sources.py keep_prompts)
    return stage_digest("prepare", section)


def regenerate(cfg, prepared) -> str:
    return stage_digest("regenerate", {"target": target_identity(cfg), "regenerate": cfg.regenerate},
                        {"data": prepared.digest})


REGENERATE_SHARD = stage("regenerate").shard_folder  # "regenerate-shard"


def regenerate_shard(regenerate_digest: str, shard: int) -> str:
    """One regenerated shard, committed on its own so a crash loses at most one shard."""
    return stage_digest(REGENERATE_SHARD, {"shard": shard}, {"regenerate": regenerate_digest},
                        version=VERSIONS["regenerate"])


def vocab(cfg, data) -> str:
    return stage_digest("vocab", cfg.vocab, {"data": data.digest})


# Extract keys that change where and how fast hidden states are made, not their bytes.
EXTRACT_SCHEDULING_KEYS = {"gpus", "cpu_groups", "kv_cache_gib", "batch_tokens", "tensor_parallel_size",
                           "enforce_eager", "write_overlap", "write_queue", "write_workers", "nodes", "deployment",
                           # the extraction check reads what is stored, it changes no byte of it
                           "verify_positions", "verify_min_agreement", "verify_confidence"}


def extract_section(cfg, layer_ids: list[int]) -> dict[str, Any]:
    """The extract section minus scheduling-only keys, with the layer ids resolved
    (so `layer_ids: null` and the same ids written out share a digest)."""
    section = cfg.extract.model_dump(mode="json", exclude=EXTRACT_SCHEDULING_KEYS)
    section["layer_ids"] = list(layer_ids)
    return section


def extract_shard(cfg, layer_ids: list[int], data_digest: str, shard: int) -> str:
    return stage_digest("extract", extract_section(cfg, layer_ids), {"data": data_digest, "shard": str(shard)})


EXTRACT_STAGE = stage("extract").store_folder  # "extract-stage"


def extract_stage(shard_digests: list[str]) -> str:
    """The extract stage's artifact: the set of its shards (their addresses, in shard order), nothing else, so
    the same shards are always the same stage artifact. The train address stays made of the shards
    themselves (`train_inputs`), as it was before the stage artifact existed."""
    return stage_digest(EXTRACT_STAGE, {}, {f"shard-{i}": d for i, d in enumerate(shard_digests)},
                        version=VERSIONS["extract"])


# Where each stage's artifacts are on the store: its own artifact's folder, then its shards' (`draftline ls --stage`)
STAGE_FOLDERS: dict[str, tuple[str, ...]] = stage_folders()


# Train keys that change how fast or where the draft is made, not the recipe: the number of ranks
# (a retry may resume on another count), kernels computing the same function (attention, loss), and the
# node-local part cache's cap.
TRAIN_SCHEDULING_KEYS = {"device", "gpus", "prefetch", "checkpoint_every", "keep_checkpoints", "loss_impl",
                         "attn_impl", "cache_gib", "nodes", "early_check_step",
                         "early_check_min_acceptance"}


def train_inputs(cfg, vocab_ref, shard_refs) -> dict[str, str]:
    """What a train artifact is made of (its digest's inputs, and its manifest's): the vocabulary, the
    extraction shards in shard order (not completion order), the target."""
    from tasks.store.stats import shard_stats

    refs = sorted(shard_refs, key=lambda r: (shard_stats(r).shard, r.digest))
    from tasks.engine.weights import PRESETS

    t = cfg.target
    if t.model in PRESETS:
        target = t.model + (f"@{t.revision}" if t.revision else "")
    else:
        from tasks.engine.weights import target_fingerprint

        target = "sha256:" + target_fingerprint(t)
    return {"vocab": vocab_ref.digest, "extract": ",".join(r.digest for r in refs), "target": target}


def train(cfg, vocab_ref, shard_refs, head=None) -> str:
    """The train artifact's address of one head (run_train commits there; the flow's train task looks there
    first): `head` of cfg.train.heads, or the only one. The head's own keys (kind, layers, DFlash's block) enter
    only when they differ from the default EAGLE-3 head, and its overrides (max_steps, num_layers) as the
    train keys they replace; `heads` itself never does, so a one-head config keeps its address."""
    t = cfg.train.for_head(head) if head is not None else cfg.train
    section = t.model_dump(mode="json", exclude=TRAIN_SCHEDULING_KEYS | {"heads", "init_from"})
    if t.init_from:  # the warm start's content, not its path (absent: the addresses drafts always had)
        from tasks.formats.drafts import content_digest

        section["init_from"] = content_digest(t.init_from)
    # attn_impl left the address (every kernel trains the same draft), but drafts stored before that were
    # addressed with the then-default "sdpa" in it: the constant keeps their addresses, so none retrains.
    section["attn_impl"] = "sdpa"
    if section.get("loss") == "default":  # the objective drafts were always trained with: their addresses stay
        del section["loss"]
    recipe = t.head.recipe()
    if recipe:
        section["head"] = recipe
    return stage_digest("train", section, train_inputs(cfg, vocab_ref, shard_refs))


BENCHMARK_ENGINE = "benchmark-engine"


def benchmark_engine(cfg, engine: dict[str, Any], measured: dict[str, Any], prompts: str, draft: str | None) -> str:
    """One benchmark engine's measurements (the baseline, or one draft at one k), committed as the engine closes so
    a benchmark run again after a kill starts only the engines it had not finished (tasks/benchmark/engine_runs.py).
    What decides them: the target, the engine's `vllm.LLM` arguments (`engine`, the draft named by its address
    `draft`, not by its folder), `measured` (the sampling, batch sizes, controls, the engine's environment, the
    machine kind and releases), and the eval prompts' digest `prompts`. The benchmark stage's version is theirs."""
    return stage_digest(BENCHMARK_ENGINE, {"target": target_identity(cfg), "engine": engine, **measured},
                        {"prompts": prompts, **({"draft": draft} if draft else {})}, version=VERSIONS["benchmark"])


def benchmark(cfg, trained, data) -> str:
    """`trained`: the train artifact of the one head, or (label, artifact) per head in cfg.train.heads order.
    One head: the address it always had; several: every head's label and artifact enter it."""
    heads = [("", trained)] if not isinstance(trained, (list, tuple)) else list(trained)
    inputs = {"train": heads[0][1].digest, "data": data.digest}
    if len(heads) > 1:
        inputs["heads"] = ",".join(f"{label}={ref.digest}" for label, ref in heads)
    section = cfg.benchmark.model_dump(mode="json", exclude={"drafts"})
    if section.get("length_buckets") is None:  # the default buckets: the address benchmarks had before the option
        section.pop("length_buckets", None)
    for ev in section["evals"]:  # a first-turn eval keeps the address it had before long-context evals existed
        if not ev.get("context_tokens"):
            ev.pop("context_tokens", None)
    if cfg.benchmark.drafts:  # other drafts by content (none: the address a benchmark always had)
        from tasks.formats.drafts import content_digest

        inputs["drafts"] = ",".join(f"{d.name}={content_digest(d.model)}" for d in cfg.benchmark.drafts)
    return stage_digest("benchmark", {"benchmark": section, "target": target_identity(cfg)}, inputs)
