"""The prompts a benchmark decodes: each eval's conversations (MT-Bench first turns, held-out
samples of the training mix, any source), chosen evenly and tokenized with the target's chat template."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tasks.benchmark import BenchmarkError
from tasks.core.config import EvalConfig, RunConfig
from tasks.store.artifacts import ArtifactRef, Store


def select_evenly(available: int, want: int) -> list[int]:
    """`want` indices spread evenly over `available` items (MT-Bench is ordered by category)."""
    if want >= available:
        return list(range(available))
    return [(i * available) // want for i in range(want)]


@dataclass
class EvalPrompts:
    name: str
    source: str
    prompts: list[list[int]]
    sample_ids: list[str]
    available: int
    too_long: int = 0
    requested: int = 0

    def summary(self) -> dict[str, Any]:
        lens = [len(p) for p in self.prompts]
        return {"source": self.source, "prompts": len(self.prompts), "requested": self.requested,
                "available": self.available,
                "dropped_too_long": self.too_long,
                "prompt_tokens_mean": round(sum(lens) / max(1, len(lens)), 1), "prompt_tokens_max": max(lens, default=0),
                "sample_ids": self.sample_ids}


def first_turn(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The system message (if any) and the first user turn: what every eval asks the target."""
    out = []
    for m in messages:
        if m["role"] == "system" and not out:
            out.append(m)
        elif m["role"] == "user":
            out.append(m)
            return out
    return []


def load_eval_prompts(cfg: RunConfig, store: Store, data: ArtifactRef, ev: EvalConfig,
                      render: Callable[[list[dict]], list[int]]) -> EvalPrompts:
    """Token ids of the first user turn of `ev.num_prompts` conversations, chat-templated with the
    generation prompt. 'heldout' reads the data artifact's heldout.parquet; a source is loaded like
    training data (prompt-only rows allowed)."""
    convs: list[tuple[str, list[dict]]]
    if ev.source == "heldout":
        from tasks.formats.samples import read_samples

        art = store.open(data.stage, data.digest)
        if "heldout.parquet" not in art.files():
            raise BenchmarkError(f"eval {ev.name!r}: {art.uri} has no heldout.parquet; set data.heldout > 0 "
                                 "or drop the 'heldout' eval from benchmark.evals")
        convs = [(s.sample_id, s.messages) for s in read_samples(art, "heldout.parquet")]
        label = f"heldout of {data.stage}/{data.digest[:8]}"
        if not convs:
            raise BenchmarkError(f"eval {ev.name!r}: heldout.parquet is empty; set data.heldout > 0 "
                                 "or drop the 'heldout' eval from benchmark.evals")
    else:
        from tasks.data.sources import load_source

        loaded = load_source(ev.source, keep_thinking=cfg.data.keep_thinking, require_assistant=False,
                             system_prompt=cfg.data.system_prompt, seen=None)
        convs = [(c.sample_id, c.messages) for c in loaded.conversations]
        label = ev.source.label
    limit = cfg.target.max_model_len - cfg.benchmark.max_tokens
    usable: list[tuple[str, list[int]]] = []
    too_long = 0
    for sid, messages in convs:
        turn = first_turn(messages)
        if not turn:
            continue
        ids = render(turn)
        if len(ids) > limit:
            too_long += 1
            continue
        usable.append((sid, ids))
    if not usable:
        raise BenchmarkError(
            f"eval {ev.name!r}: none of {len(convs)} conversations gives a usable prompt ({too_long} longer than "
            f"target.max_model_len - benchmark.max_tokens = {limit} tokens)")
    picked = [usable[i] for i in select_evenly(len(usable), ev.num_prompts)]
    return EvalPrompts(ev.name, label, [p for _, p in picked], [s for s, _ in picked], len(usable), too_long,
                       ev.num_prompts)
