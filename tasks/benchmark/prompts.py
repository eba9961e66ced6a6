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
    short_of_context: int = 0  # long-context evals: prompts the source or max_model_len kept under context_tokens

    def summary(self) -> dict[str, Any]:
        lens = [len(p) for p in self.prompts]
        return {"source": self.source, "prompts": len(self.prompts), "requested": self.requested,
                "available": self.available,
                "dropped_too_long": self.too_long,
                "prompt_tokens_mean": round(sum(lens) / max(1, len(lens)), 1), "prompt_tokens_max": max(lens, default=0),
                "prompt_tokens_min": min(lens, default=0), "short_of_context": self.short_of_context,
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
    if ev.context_tokens:
        return long_prompts(ev, label, convs, render, limit)
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


def whole_turns(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """A conversation's user/assistant turns (system messages out), cut after its last answer; [] when it has none."""
    turns = [m for m in messages if m["role"] in ("user", "assistant")]
    while turns and turns[-1]["role"] != "assistant":
        turns.pop()
    return turns if turns and turns[0]["role"] == "user" else []


def long_prompts(ev: EvalConfig, label: str, convs: list[tuple[str, list[dict]]],
                 render: Callable[[list[dict]], list[int]], limit: int) -> EvalPrompts:
    """A long-context eval (`context_tokens`): each prompt is whole conversations as one chat history, then the
    next conversation's first user turn, grown conversation by conversation until it holds `context_tokens`
    tokens, without passing `limit`. Prompts start at conversations spread evenly over the source."""
    history = [(sid, t) for sid, m in convs if (t := whole_turns(m))]
    questions = [(sid, q) for sid, m in convs if (q := [x for x in first_turn(m) if x["role"] == "user"])]
    if not history or not questions:
        raise BenchmarkError(f"eval {ev.name!r}: a long-context eval (context_tokens) needs conversations with "
                             f"answers to build a history from; {label} has {len(history)} (use source: heldout, "
                             "whose answers are the target's own, or a source with assistant turns)")
    want = min(ev.context_tokens, limit)
    prompts: list[list[int]] = []
    ids: list[str] = []
    short = 0
    for start in select_evenly(len(questions), ev.num_prompts):
        qid, question = questions[start]
        turns: list[dict[str, str]] = []
        best = render(question)
        used = 0
        for j in range(len(history)):  # the conversations after the question's own, wrapping round
            sid, t = history[(start + 1 + j) % len(history)]
            if sid == qid:
                continue
            ids_now = render(turns + t + question)
            if len(ids_now) > limit:
                break
            turns, best, used = turns + t, ids_now, used + 1
            if len(best) >= want:
                break
        if len(best) > limit:
            continue
        short += len(best) < want
        prompts.append(best)
        ids.append(f"{qid} (+{used} conversations before it)")
    if not prompts:
        raise BenchmarkError(f"eval {ev.name!r}: no question fits target.max_model_len - benchmark.max_tokens = "
                             f"{limit} tokens")
    return EvalPrompts(ev.name, f"{label}, {ev.context_tokens}-token contexts", prompts, ids, len(questions), 0,
                       ev.num_prompts, short)
