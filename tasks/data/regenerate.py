"""regenerate: the target answers the prepared prompts itself, so the draft learns what it says.

For each training shard of the prepare artifact: take every conversation's
system prompt and its first `regenerate.max_turns` user turns, let the target
answer them through the engine (vLLM; greedy by default), re-apply the chat
template and the verified loss mask of prepare, and commit the shard as its
own small artifact (`regenerate-shard/DIGEST`). A crash loses at most the shard
in flight: a re-run finds the committed shards and only generates the rest.
The final `regenerate` artifact has prepare's layout and Parquet schema.
The flow (flows/pipeline.py) runs each shard as its own task (`regenerate_shard`) over the node's engine
groups and, with `extract.nodes` > 1, over several nodes, then `assemble_regenerate`.

Multi-turn: turn t of every conversation in the shard is generated in one
batched pass (batches of `regenerate.batch_size`), then turn t+1 with the
target's own answers in the history. Only the first turn by default
(`max_turns: 1`): a source's later user turns reply to the ORIGINAL answer, so
after a regenerated answer they are off-topic or contradictory (chit-chat
especially), and each extra turn costs a full generation pass. Prompt sets
whose turns stand alone (MT-Bench's two turns) can raise it.

Thinking: `regenerate.thinking` is passed to the template as `enable_thinking`
(Qwen3-style templates honour it, others ignore it); when off, `<think>` blocks
are also stripped from the answers.

Prompts that do not fit `target.max_model_len` are dropped BEFORE generating
(one overlong prompt fails a whole vLLM batch); a prompt that fits but leaves
less than `max_tokens` room gets a shorter budget: such prompts are sorted by length and batched, each batch
with the room its longest prompt leaves.

The held-out split is copied unchanged: its prompts are what benchmark asks.
Rows keep the `sample_id` of the prepared conversation they answer.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from tasks.core.errors import DraftlineError
from tasks.core.config import RunConfig
from tasks.data.sources import Conversation, strip_thinking, user_turns
from tasks.address import digests
from tasks.core.digest import VERSIONS
from tasks.data.chat import ChatMasker, SampleDropped, encode_sample, make_masker
from tasks.formats.acceptance import merge_counts
from tasks.formats.samples import HELDOUT, Sample, parquet_bytes, read_samples, shard_name, token_stats
from tasks.store.stats import data_stats
from tasks.store.artifacts import ArtifactRef, Store
from tasks.store.reader import Artifact
from tasks.store.stages import ShardedStage, ShardPlan

STAGE = "regenerate"
SHARD_STAGE = digests.REGENERATE_SHARD
SHARD_FILE = "shard.parquet"


class Engine(Protocol):
    def start(self) -> None: ...
    def generate(self, prompt_token_ids: list[list[int]], sampling: dict) -> list[dict]: ...
    def close(self) -> None: ...


class RegenerateError(DraftlineError, RuntimeError):
    pass


@dataclass
class _Dialog:
    sample: Sample
    users: list[str]
    messages: list[dict[str, str]] = field(default_factory=list)
    answered: int = 0
    done: bool = False
    stop: str = ""  # why the dialog ended before its last user turn


def _sampling(cfg: RunConfig, max_tokens: int) -> dict[str, Any]:
    r = cfg.regenerate
    out: dict[str, Any] = {"max_tokens": int(max_tokens), "temperature": r.temperature, "top_p": r.top_p}
    if r.temperature > 0:  # a per-request seed makes vLLM sample request by request: only when it matters
        out["seed"] = cfg.data.seed
    return out


def regenerate_samples(cfg: RunConfig, masker: ChatMasker, engine: Engine, samples: list[Sample]) -> tuple[
        list[Sample], dict[str, Any]]:
    """Answer `samples`' prompts with the engine; returns new samples and counters."""
    r, limit = cfg.regenerate, cfg.target.max_model_len
    dialogs = []
    for s in samples:
        system, users = user_turns(s.messages)
        d = _Dialog(sample=s, users=users[: r.max_turns])
        if system is not None:
            d.messages.append({"role": "system", "content": system})
        dialogs.append(d)
    counts: Counter = Counter()
    generated = 0
    for turn in range(r.max_turns):
        todo: list[tuple[_Dialog, list[int]]] = []
        for d in dialogs:
            if d.done or turn >= len(d.users):
                continue
            messages = d.messages + [{"role": "user", "content": d.users[turn]}]
            try:
                ids = masker.prompt_ids(messages)
            except Exception:  # the template refused this conversation
                d.done, d.stop = True, "template_error"
                continue
            if len(ids) >= limit:  # filtered BEFORE generating: one overlong prompt fails a vLLM batch
                d.done, d.stop = True, "prompt_too_long"
                continue
            d.messages = messages
            todo.append((d, ids))
        # Prompts with room for max_tokens go in full batches; the rest (long prompts: a long-context source)
        # in batches of similar length, sorted, each with the room its longest prompt leaves (one at a time, a
        # source of 8K-token prompts would decode a sequence per engine call).
        roomy = [(d, ids) for d, ids in todo if len(ids) + r.max_tokens <= limit]
        tight = sorted((x for x in todo if len(x[1]) + r.max_tokens > limit), key=lambda x: len(x[1]))
        calls = [(roomy[i:i + r.batch_size], r.max_tokens) for i in range(0, len(roomy), r.batch_size)]
        calls += [(tight[i:i + r.batch_size], limit - len(tight[min(i + r.batch_size, len(tight)) - 1][1]))
                  for i in range(0, len(tight), r.batch_size)]
        for batch, budget in calls:
            outs = engine.generate([ids for _, ids in batch], _sampling(cfg, budget))
            if len(outs) != len(batch):
                raise RegenerateError(f"the engine returned {len(outs)} answers for {len(batch)} prompts")
            for (d, _), out in zip(batch, outs):
                generated += len(out.get("token_ids") or [])
                text = out.get("text") or ""
                if not r.thinking:
                    text = strip_thinking(text)
                text = text.strip()
                if out.get("finish_reason") == "length":
                    counts["answers_cut"] += 1
                if not text:
                    d.messages.pop()  # the unanswered user turn
                    d.done, d.stop = True, "empty_answer"
                    continue
                d.messages.append({"role": "assistant", "content": text})
                d.answered += 1
    out_samples: list[Sample] = []
    dropped: Counter = Counter()
    per_source: dict[str, dict[str, Any]] = {}
    truncated = 0
    for d in dialogs:
        src = per_source.setdefault(d.sample.source, {"prompts": 0, "samples": 0, "dropped": Counter()})
        src["prompts"] += 1
        reason = None
        if d.answered == 0:
            reason = d.stop or "no_user"
        else:
            if d.stop:
                counts["turns_cut"] += 1
            conv = Conversation(messages=d.messages, source=d.sample.source, sample_id=d.sample.sample_id)
            try:
                sample, cut = encode_sample(masker, conv, cfg.data)
                truncated += cut
                out_samples.append(sample)
                src["samples"] += 1
            except SampleDropped as drop:
                reason = drop.reason
        if reason is not None:
            dropped[reason] += 1
            src["dropped"][reason] += 1
    for src in per_source.values():
        src["dropped"] = dict(sorted(src["dropped"].items()))
    return out_samples, {"dropped": dict(sorted(dropped.items())), "generated_tokens": generated,
                         "truncated": truncated, "per_source": per_source, **dict(counts)}


class RegenerateShard(ShardPlan):
    """One regeneration shard: shard `shard` of the prepare artifact `prepared`, committed at
    `regenerate-shard/DIGEST` (a flow task's argument, like extraction's plans)."""

    prepared: ArtifactRef


def regenerate_address(cfg: RunConfig, prepared: ArtifactRef) -> str:
    """The regenerate artifact's digest (its shards' are made from it): the flow's `STAGE_DEF.address`, and
    `assemble_regenerate`'s without one."""
    return digests.regenerate(cfg, prepared)


def plan_regenerate(cfg: RunConfig, prepared: ArtifactRef) -> list[RegenerateShard]:
    """The shards of the prepare artifact `prepared`, each with its own address (tasks/address/digests.py)."""
    stage = regenerate_address(cfg, prepared)
    return [RegenerateShard(shard=i, digest=digests.regenerate_shard(stage, i), prepared=prepared)
            for i in range(data_stats(prepared).num_shards)]


def regenerate_shard(cfg: RunConfig, store: Store, plan: RegenerateShard, engine: Engine) -> ArtifactRef:
    """Answer one shard's prompts with `engine` (started) and commit them at `plan.digest`; the committed
    shard if it is there."""
    return store.found_or_compute(SHARD_STAGE, plan.digest, lambda: _regenerate_shard(cfg, store, plan, engine))


def _regenerate_shard(cfg: RunConfig, store: Store, plan: RegenerateShard, engine: Engine) -> ArtifactRef:
    t0 = time.time()
    prepared = plan.prepared
    prep_art = store.open(prepared.stage, prepared.digest, only=shard_name(plan.shard))  # its file, not all N
    masker = make_masker(cfg, template_kwargs={"enable_thinking": bool(cfg.regenerate.thinking)})
    samples = read_samples(prep_art, shard_name(plan.shard))
    new, info = regenerate_samples(cfg, masker, engine, samples)
    stats = {**token_stats(new), **info, "shard": plan.shard, "prompts": len(samples),
             "seconds": round(time.time() - t0, 2)}
    if getattr(engine, "name", None):
        stats["engine"] = engine.name
    config = {"regenerate": cfg.regenerate.model_dump(mode="json")}
    inputs = {prepared.stage: prepared.digest, "shard": str(plan.shard)}
    with store.write(SHARD_STAGE, plan.digest, VERSIONS[STAGE], inputs, config) as w:
        w.write_bytes(SHARD_FILE, parquet_bytes(new))
        return w.commit(stats).ref()


def assemble_regenerate(cfg: RunConfig, store: Store, prepared: ArtifactRef, shards: list[ArtifactRef],
                        t0: float, reused: int, *, digest: str | None = None) -> ArtifactRef:
    """The `regenerate` artifact (prepare's layout) from every shard's artifact, in shard order, at DIGEST
    (the flow's address for it; default `regenerate_address`); `reused`: how many of them were on the store
    before this run, `t0`: when this run's stage began (its `wall_seconds`: engine starts, every shard on
    every group and node, and this assembly)."""
    digest = digest or regenerate_address(cfg, prepared)
    return store.found_or_compute(STAGE, digest, lambda: _assemble(
        cfg, store, prepared, [store.open(SHARD_STAGE, r.digest) for r in shards], t0, reused, digest))


def _assemble(cfg: RunConfig, store: Store, prepared: ArtifactRef, shard_arts: list[Artifact], t0: float,
              reused: int, digest: str) -> ArtifactRef:
    prep_art = store.open(prepared.stage, prepared.digest)
    n = data_stats(prep_art.ref()).num_shards
    shard_arts = sorted(shard_arts, key=lambda a: int(a.stats.get("shard", 0)))
    if [int(a.stats.get("shard", -1)) for a in shard_arts] != list(range(n)):
        raise RegenerateError(f"the regenerate artifact needs shards 0..{n - 1}, got "
                              f"{[a.stats.get('shard') for a in shard_arts]}")
    inputs = {prepared.stage: prepared.digest}

    totals: Counter = Counter()
    dropped: Counter = Counter()
    per_source: dict[str, dict[str, Any]] = {}
    for art in shard_arts:
        s = art.stats
        for k in ("samples", "tokens", "masked_tokens", "generated_tokens", "prompts", "truncated",
                  "answers_cut", "turns_cut"):
            totals[k] += int(s.get(k, 0))
        dropped.update(s.get("dropped", {}))
        for label, entry in s.get("per_source", {}).items():
            acc = per_source.setdefault(label, {"prompts": 0, "samples": 0, "heldout": 0, "dropped": Counter()})
            acc["prompts"] += entry["prompts"]
            acc["samples"] += entry["samples"]
            acc["dropped"].update(entry["dropped"])
    for label, entry in per_source.items():
        entry["heldout"] = int(prep_art.stats.get("per_source", {}).get(label, {}).get("heldout", 0))
        entry["dropped"] = dict(sorted(entry["dropped"].items()))
    if totals["samples"] == 0:
        raise RegenerateError(
            f"no regenerated sample survived (dropped: {dict(dropped)}); check target.max_model_len, "
            "regenerate.max_tokens and data.max_length"
        )
    stats: dict[str, Any] = {
        **{k: totals[k] for k in ("samples", "tokens", "masked_tokens")},
        "length_buckets": merge_counts(*(a.stats.get("length_buckets") for a in shard_arts)),
        "longest": max((int(a.stats.get("longest") or 0) for a in shard_arts), default=0),
        "dropped": dict(sorted(dropped.items())),
        "num_shards": n,
        "heldout": data_stats(prep_art.ref()).heldout,
        "heldout_tokens": data_stats(prep_art.ref()).heldout_tokens,
        "per_source": dict(sorted(per_source.items())),
        "prompts": totals["prompts"],
        "generated_tokens": totals["generated_tokens"],
        "answers_cut": totals["answers_cut"],
        "turns_cut": totals["turns_cut"],
        "truncated": totals["truncated"],
        "max_turns": cfg.regenerate.max_turns,
        "shard_samples": [int(a.stats.get("samples", 0)) for a in shard_arts],
        "shards_reused": reused,
        "seconds": round(sum(float(a.stats.get("seconds", 0)) for a in shard_arts), 2),
    }
    with store.write(STAGE, digest, VERSIONS[STAGE], {**inputs, **{f"shard-{i}": a.digest for i, a in
                                                                    enumerate(shard_arts)}},
                     {"regenerate": cfg.regenerate.model_dump(mode="json")}) as w:
        for i, art in enumerate(shard_arts):
            w.write_bytes(shard_name(i), art.read_bytes(SHARD_FILE))
        w.write_bytes(HELDOUT, prep_art.read_bytes(HELDOUT))
        stats["wall_seconds"] = round(time.time() - t0, 2)  # the stage: engine starts, every shard, copying
        return w.commit(stats).ref()


# the stage as the flow runs it (tasks/store/stages.py)
STAGE_DEF = ShardedStage(
    name=STAGE, inputs=("prepare",), store_stage=STAGE, shard_stage=SHARD_STAGE, plan=plan_regenerate,
    address=lambda cfg, data, plans: regenerate_address(cfg, data), shard=regenerate_shard,
    assemble=assemble_regenerate, copies_shards=True, label="regeneration", title="Regeneration",
    tokens="generated_tokens", rate="generated tok/s", enabled=lambda cfg: cfg.regenerate.enabled)
