"""prepare: sources, formats, bad rows, and the assistant-only loss mask on real tokenizers.

The masks are checked the way a user would: decode the masked runs and compare
them with the assistant answers; decode the rest and find every system/user
text there.
"""

from __future__ import annotations

import copy
import io
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tasks.address import digests
from tasks.core.config import RunConfig, SourceConfig, TargetConfig
from tasks.core.config_load import load_config
from tasks.core.errors import ConfigError
from tasks.data.sources import DataSourceError, load_source, normalize_row, BadRow
from tasks.data.prepare import (
    HELDOUT,
    ChatMasker,
    ChatTemplateError,
    PrepareError,
    SampleDropped,
    read_samples,
    run_prepare,
    shard_name,
)
from tasks.store.artifacts import Store

# --------------------------------------------------------------------------- templates

# Llama-3 style: system block with an injected date header, <|eot_id|> ends each turn, `| trim`.
LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

# Mistral v0.3 style: the system prompt is folded into the LAST user turn (not prefix-stable),
# roles must alternate, no generation prompt, the answer is ' ' + content + eos.
MISTRAL = """{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}
{%- if message['role'] == 'user' %}
{%- if loop.last and system_message is defined %}{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}
{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token }}
{%- endif %}
{%- endfor %}"""

# Qwen3 style: reasoning kept only in the last assistant turn, dropped from the history.
QWEN3 = """{%- for message in messages %}
{%- if message.role == "system" %}{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "user" %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{%- set content = message.content %}{%- set reasoning_content = '' %}
{%- if '</think>' in content %}{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{%- if loop.last and reasoning_content %}{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}
{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# ChatML with {% generation %} markers: transformers' return_assistant_tokens_mask path.
GENERATION_TAGS = """{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}{%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# A header that changes every turn: the cheap header search fails, incremental renders must work.
NUMBERED = """{%- for message in messages %}{{- '### ' + message['role'] + ' #' + loop.index|string + ':\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '### assistant #' + (messages|length + 1)|string + ':\\n' }}{%- endif %}"""

# Templates no mask can be placed with: content rewritten, answers never rendered.
UPPER = """{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | upper + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
PROMPT_ONLY = """{{- '<|im_start|>user\\n' + messages[0]['content'] + '<|im_end|>\\n<|im_start|>assistant\\n' }}"""

EXTRA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "[INST]", "[/INST]"]

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant. Never say 'banana'."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "And how many people live there?"},
    {"role": "assistant", "content": "About 2.1 million people live in Paris proper."},
    {"role": "user", "content": "Thanks! One more: the capital of Japan?"},
    {"role": "assistant", "content": "Tokyo."},
]


@pytest.fixture(scope="session")
def smol_tok():
    from tasks.engine.target import load_tokenizer

    return load_tokenizer(TargetConfig())


def with_template(tok, template: str, specials: bool = True):
    tok = copy.deepcopy(tok)
    if specials:
        tok.add_special_tokens({"additional_special_tokens": EXTRA_SPECIALS})
    tok.chat_template = template
    return tok


def masked_runs(tok, ids, mask) -> list[str]:
    runs, cur = [], []
    for i, m in zip(list(ids), list(mask)):
        if m:
            cur.append(int(i))
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def unmasked_text(tok, ids, mask) -> str:
    return tok.decode([int(i) for i, m in zip(ids, mask) if not m], skip_special_tokens=False)


def assert_mask(tok, ids, mask, messages, end_of_turn: str, answers: list[str] | None = None):
    answers = answers or [m["content"] for m in messages if m["role"] == "assistant"]
    runs = masked_runs(tok, ids, mask)
    assert len(runs) == len(answers), runs
    for run, answer in zip(runs, answers):
        assert run.strip() == answer + end_of_turn, (run, answer)
    rest = unmasked_text(tok, ids, mask)
    for m in messages:
        if m["role"] == "user":
            assert m["content"].strip() in rest


# --------------------------------------------------------------------------- masks on real templates

def test_smollm2_chatml_masks_every_assistant_turn(smol_tok):
    masker = ChatMasker(smol_tok, model="smollm2")
    ids, mask = masker.encode(CONVERSATION)
    assert_mask(smol_tok, ids, mask, CONVERSATION, "<|im_end|>")
    assert CONVERSATION[0]["content"] in unmasked_text(smol_tok, ids, mask)
    # role headers and the newline after <|im_end|> are context, not targets
    assert "<|im_start|>assistant" in unmasked_text(smol_tok, ids, mask)
    assert ids == smol_tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]


def test_smollm2_default_system_prompt_is_not_masked(smol_tok):
    """SmolLM2's template injects its own system prompt when none is given: context, never a target."""
    masker = ChatMasker(smol_tok, model="smollm2")
    convo = CONVERSATION[1:]
    ids, mask = masker.encode(convo)
    assert_mask(smol_tok, ids, mask, convo, "<|im_end|>")
    assert "named SmolLM" in unmasked_text(smol_tok, ids, mask)


def test_llama3_style_template_with_system_prompt_and_three_turns(smol_tok):
    tok = with_template(smol_tok, LLAMA3)
    masker = ChatMasker(tok, model="llama3-style")
    assert masker.terminator == "<|eot_id|>"
    ids, mask = masker.encode(CONVERSATION)
    assert_mask(tok, ids, mask, CONVERSATION, "<|eot_id|>")
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    # exactly one end-of-turn per answer is a target; the system's and users' are not
    assert sum(1 for i, m in zip(ids, mask) if i == eot and m) == 3
    assert sum(1 for i in ids if i == eot) == 7
    assert "Cutting Knowledge Date" in unmasked_text(tok, ids, mask)
    assert CONVERSATION[0]["content"] in unmasked_text(tok, ids, mask)


def test_mistral_style_template_moves_system_prompt_but_masks_stay_right(smol_tok):
    tok = with_template(smol_tok, MISTRAL)
    masker = ChatMasker(tok, model="mistral-style")
    ids, mask = masker.encode(CONVERSATION)
    assert_mask(tok, ids, mask, CONVERSATION, tok.eos_token)
    # the prompt of the first answer holds the system prompt, the full conversation does not
    assert CONVERSATION[0]["content"] in masker.render(CONVERSATION[:2], True)
    assert CONVERSATION[0]["content"] not in masker.render(CONVERSATION, False)
    # the template refuses non-alternating roles: that one conversation is dropped, not the run
    with pytest.raises(SampleDropped) as exc:
        masker.encode([CONVERSATION[1], CONVERSATION[1], CONVERSATION[2]])
    assert exc.value.reason == "template_error"


def test_reasoning_template_drops_history_thinking(smol_tok):
    tok = with_template(smol_tok, QWEN3, specials=False)
    masker = ChatMasker(tok, model="qwen3-style")
    convo = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nsimple sum\n</think>\n\n4."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "<think>\nalso simple\n</think>\n\n6."},
    ]
    ids, mask = masker.encode(convo)
    runs = [r.strip() for r in masked_runs(tok, ids, mask)]
    # the history's reasoning is not in the input (the template dropped it), the last turn's is a target
    assert runs == ["4.<|im_end|>", "<think>\nalso simple\n</think>\n\n6.<|im_end|>"]
    assert "simple sum" not in tok.decode(ids)


def test_generation_tag_template_uses_assistant_token_mask(smol_tok):
    tok = with_template(smol_tok, GENERATION_TAGS, specials=False)
    masker = ChatMasker(tok, model="tagged")
    assert masker.mode == "generation_tags"
    ids, mask = masker.encode(CONVERSATION)
    assert_mask(tok, ids, mask, CONVERSATION, "<|im_end|>")


def test_per_turn_headers_fall_back_to_incremental_renders(smol_tok):
    tok = with_template(smol_tok, NUMBERED, specials=False)
    masker = ChatMasker(tok, model="numbered")
    ids, mask = masker.encode(CONVERSATION)
    assert_mask(tok, ids, mask, CONVERSATION, "<|im_end|>")
    assert masker.modes["prefix"] >= 2


@pytest.mark.parametrize("template", [UPPER, PROMPT_ONLY], ids=["rewrites-content", "drops-answers"])
def test_template_that_cannot_mask_is_an_error(smol_tok, template):
    with pytest.raises(ChatTemplateError) as exc:
        ChatMasker(with_template(smol_tok, template, specials=False), model="bad")
    assert "target.chat_template" in str(exc.value)


def test_tokenizer_without_template_is_an_error(smol_tok):
    tok = copy.deepcopy(smol_tok)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatMasker(tok, model="plain")


def test_bad_template_file_fails_the_stage_and_commits_nothing(tmp_path, chat_jsonl):
    tpl = tmp_path / "upper.jinja"
    tpl.write_text(UPPER)
    cfg = _cfg(chat_jsonl, target={"chat_template": str(tpl)})
    store = Store(f"file://{tmp_path}/store")
    with pytest.raises(ChatTemplateError, match="cannot|verbatim"):
        run_prepare(cfg, store)
    assert store.list() == []


# --------------------------------------------------------------------------- sources, formats, bad rows

GOOD = [
    {"conversations": [{"from": "human", "value": f"Question number {i}?"},
                       {"from": "gpt", "value": f"Answer number {i}."}]}
    for i in range(3)
] + [
    {"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi there"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
                  {"role": "assistant", "content": "Goodbye!"}]},
    {"prompt": "Name a color.", "response": "Blue."},
    {"instruction": "Translate to French", "input": "cat", "output": "chat"},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "ok?"}]},
                  {"role": "assistant", "content": "Parts are fine."}]},
]

BAD = {
    "not_a_mapping": [["a", "list"], "a string"],
    "unknown_format": [{"text": "plain pretraining text"}],
    "bad_conversation_type": [{"conversations": "human: hi"}],
    "bad_turn_type": [{"conversations": ["hi", "hello"]}],
    "missing_role": [{"messages": [{"content": "who am I"}, {"role": "assistant", "content": "x"}]}],
    "unknown_role": [{"conversations": [{"from": "narrator", "value": "Once"}, {"from": "gpt", "value": "upon"}]},
                     {"messages": [{"role": 7, "content": "hi"}, {"role": "assistant", "content": "x"}]}],
    "non_string_content": [{"messages": [{"role": "user", "content": 42}, {"role": "assistant", "content": "x"}]},
                           {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
                           {"messages": [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": {"text": "nested"}}]}],
    "empty_content": [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "   "}]},
                      {"prompt": "", "response": "nothing asked"}],
    "misplaced_system": [{"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"},
                                       {"role": "assistant", "content": "x"}]}],
    "no_user": [{"messages": [{"role": "assistant", "content": "I talk alone"}]}],
    "no_assistant": [{"messages": [{"role": "user", "content": "anyone?"}]}, {"prompt": "unanswered"}],
}


@pytest.fixture
def chat_jsonl(tmp_path) -> Path:
    """40 distinct two-turn conversations in ShareGPT format."""
    p = tmp_path / "chats.jsonl"
    rows = [
        {"conversations": [
            {"from": "system", "value": "You are helpful."},
            {"from": "human", "value": f"Tell me fact number {i} about the number {i * 7}."},
            {"from": "gpt", "value": f"Fact {i}: {i * 7} is {'even' if i % 2 == 0 else 'odd'}."},
            {"from": "human", "value": "And its square?"},
            {"from": "gpt", "value": f"Its square is {'very ' * i}much {(i * 7) ** 2}."},  # lengths vary
        ]}
        for i in range(40)
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def _cfg(path: Path, target: dict | None = None, regenerate: bool = True, **data) -> RunConfig:
    d = {"sources": [{"path": str(path)}], "heldout": 4, "num_shards": 3, "max_length": 512}
    d.update(data)
    return RunConfig.model_validate({"target": target or {}, "data": d, "regenerate": {"enabled": regenerate}})


def test_every_format_normalizes_to_messages():
    expected = [{"role": "user", "content": "Question number 0?"}, {"role": "assistant", "content": "Answer number 0."}]
    assert normalize_row(GOOD[0]) == expected
    assert normalize_row(GOOD[0], "perfectblend") == expected
    assert normalize_row({"messages": [{"role": "user", "content": "Question number 0?"},
                                       {"role": "assistant", "content": "Answer number 0."}]}) == expected
    assert normalize_row({"prompt": "Question number 0?", "response": "Answer number 0."}) == expected
    assert normalize_row(GOOD[5])[0]["content"] == "Translate to French\n\ncat"
    assert normalize_row(GOOD[6])[0]["content"] == "parts ok?"
    # prompt-only rows (MT-Bench) are fine when no answer is needed
    assert normalize_row({"turns": ["a?", "b?"]}, require_assistant=False) == [
        {"role": "user", "content": "a?"}, {"role": "user", "content": "b?"}]


def test_thinking_kept_or_dropped():
    row = {"messages": [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "<think>plan a greeting</think>\n\nHello!"}]}
    assert normalize_row(row, keep_thinking=True)[1]["content"] == "<think>plan a greeting</think>\n\nHello!"
    assert normalize_row(row, keep_thinking=False)[1]["content"] == "Hello!"
    sep = {"messages": [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "Hello!", "reasoning_content": "plan a greeting"}]}
    assert normalize_row(sep, keep_thinking=True)[1]["content"] == "<think>\nplan a greeting\n</think>\n\nHello!"
    assert normalize_row(sep, keep_thinking=False)[1]["content"] == "Hello!"
    only = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>hmm</think>"}]}
    with pytest.raises(BadRow) as exc:
        normalize_row(only, keep_thinking=False)
    assert exc.value.reason == "empty_content"


def test_bad_rows_are_dropped_and_counted_by_reason(tmp_path):
    p = tmp_path / "mixed.jsonl"
    lines = [json.dumps(r) for r in GOOD] + [json.dumps(r) for rows in BAD.values() for r in rows]
    lines += ["{not json", json.dumps(GOOD[0])]  # a broken line and a duplicate
    p.write_text("\n".join(lines) + "\n")
    loaded = load_source(SourceConfig(path=str(p)), seen=set())
    expected = Counter({k: len(v) for k, v in BAD.items()})
    expected.update({"invalid_json": 1, "duplicate": 1})
    assert loaded.dropped == expected
    assert len(loaded.conversations) == len(GOOD)
    assert loaded.rows == len(lines)
    for conv in loaded.conversations:  # nothing half-fixed slipped in
        assert {m["role"] for m in conv.messages} <= {"system", "user", "assistant"}
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in conv.messages)
        assert conv.messages[-1]["role"] == "assistant"


def test_bad_rows_accounted_in_the_manifest(tmp_path):
    p = tmp_path / "mixed.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in GOOD + [r for rows in BAD.values() for r in rows]) + "\n")
    store = Store(f"file://{tmp_path}/store")
    ref = run_prepare(_cfg(p, regenerate=False, heldout=1, num_shards=2), store)
    assert ref.stats["dropped"] == {k: len(v) for k, v in sorted(BAD.items())}
    assert ref.stats["samples"] + ref.stats["heldout"] == len(GOOD)
    # with regenerate on, the rows without an answer are prompts the target answers: kept, nothing else changes
    kept = run_prepare(_cfg(p, heldout=1, num_shards=2), store)
    assert kept.stats["dropped"] == {k: len(v) for k, v in sorted(BAD.items()) if k != "no_assistant"}
    assert kept.stats["samples"] + kept.stats["heldout"] == len(GOOD) + len(BAD["no_assistant"])
    assert ref.stats["per_source"]["mixed"]["rows"] == len(GOOD) + sum(len(v) for v in BAD.values())


def test_source_with_only_bad_rows_is_an_error_naming_it(tmp_path):
    p = tmp_path / "junk.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in BAD["no_assistant"] + BAD["unknown_role"]) + "\n")
    with pytest.raises(DataSourceError, match="'junk'.*no usable rows"):
        load_source(SourceConfig(path=str(p)))


def test_missing_file_and_unreachable_hub_are_clear_errors(tmp_path):
    with pytest.raises(DataSourceError, match="not found"):
        load_source(SourceConfig(path=str(tmp_path / "nope.jsonl")))
    with pytest.raises(DataSourceError, match="hub='nobody/no-such-dataset'.*could not be loaded"):
        load_source(SourceConfig(hub="nobody/no-such-dataset", split="train"))


def test_json_and_parquet_files(tmp_path):
    import pyarrow as pa

    rows = GOOD[:3]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    (tmp_path / "b.json").write_text(json.dumps({"data": rows}))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    got = [[c.messages for c in load_source(SourceConfig(path=str(tmp_path / n))).conversations]
           for n in ("a.json", "b.json", "c.parquet")]
    assert got[0] == got[1] == got[2] and len(got[0]) == 3


def test_offline_presets():
    mt = load_source(SourceConfig(preset="mtbench"), require_assistant=False)
    assert mt.rows == 80 and len(mt.conversations) == 80
    assert [m["role"] for m in mt.conversations[0].messages] == ["user", "user"]
    chit = load_source(SourceConfig(preset="chitchat"), seen=set())
    assert chit.rows == 7168
    # one-message chats have nobody answering: dropped and counted, not crashing
    assert chit.dropped["no_assistant"] > 0 and len(chit.conversations) > 3000
    roles = [m["role"] for m in chit.conversations[0].messages]
    assert roles[0] == "user" and roles[-1] == "assistant"
    assert all(a != b for a, b in zip(roles, roles[1:]))


def test_instruct_preset_is_prompt_only_english_and_needs_regenerate(tmp_path, chat_jsonl):
    ins = load_source(SourceConfig(preset="instruct"), require_assistant=False)
    assert ins.rows == 541 + 750 and ins.dropped["not_english"] > 100  # Arena-Hard's Chinese/Russian prompts
    assert len(ins.conversations) > 1000
    assert all([m["role"] for m in c.messages] == ["user"] for c in ins.conversations)
    mt = {c.messages[0]["content"] for c in load_source(SourceConfig(preset="mtbench"),
                                                         require_assistant=False).conversations}
    assert not mt & {c.messages[0]["content"] for c in ins.conversations}  # MT-Bench stays held out

    with pytest.raises(ConfigError, match="prompts without answers.*regenerate.enabled: true"):
        load_config(None, ["data.sources=[{preset: instruct}]", "regenerate.enabled=false"])

    # prepare keeps prompt-only samples (masked out) for regenerate to answer, beside real answers
    cfg = _cfg(chat_jsonl, sources=[{"path": str(chat_jsonl)}, {"preset": "instruct", "max_samples": 5}])
    art = Store(f"file://{tmp_path}/s").open("prepare", run_prepare(cfg, Store(f"file://{tmp_path}/s")).digest)
    per = art.stats["per_source"]["instruct"]
    assert per["samples"] + per["heldout"] == 5
    rows = [r for n in art.files() if n.endswith(".parquet") for r in _rows(art, n).to_pylist()
            if r["source"] == "instruct"]
    assert len(rows) == 5 and all(not any(r["loss_mask"]) and r["input_ids"] for r in rows)


# --------------------------------------------------------------------------- the stage

def _rows(art, name):
    t = pq.read_table(io.BytesIO(art.read_bytes(name)))
    return t


def test_run_prepare_writes_verified_shards(tmp_path, chat_jsonl, smol_tok):
    store = Store(f"file://{tmp_path}/store")
    cfg = _cfg(chat_jsonl)
    ref = run_prepare(cfg, store)
    assert ref.digest == digests.prepare(cfg)
    art = store.open("prepare", ref.digest, checksums=True)
    assert sorted(art.files()) == [HELDOUT] + [shard_name(i) for i in range(3)]
    t = _rows(art, shard_name(0))
    assert t.schema.field("input_ids").type.value_type.bit_width == 32
    assert t.schema.field("loss_mask").type.value_type.bit_width == 8
    assert {"sample_id", "source", "messages", "input_ids", "loss_mask"} <= set(t.column_names)
    shards = [read_samples(art, shard_name(i)) for i in range(3)]
    held = read_samples(art, HELDOUT)
    train = [s for sh in shards for s in sh]
    assert [len(s) for s in shards] == [12, 12, 12] and len(held) == 4
    assert len({s.sample_id for s in train + held}) == 40  # every conversation once, none in both splits
    for s in train + held:  # every row: the masked runs are exactly its answers
        assert_mask(smol_tok, s.input_ids, s.loss_mask, s.messages, "<|im_end|>")
    st = ref.stats
    assert st["samples"] == 36 and st["heldout"] == 4 and st["num_shards"] == 3
    assert st["tokens"] == sum(s.tokens for s in train)
    assert st["masked_tokens"] == sum(int(s.loss_mask.sum()) for s in train)
    assert st["per_source"]["chats"]["samples"] == 36
    # finished work is never recomputed: same digest, same attempt
    again = run_prepare(cfg, store)
    assert again.attempt == ref.attempt


def test_shuffle_is_seeded(tmp_path, chat_jsonl):
    a = run_prepare(_cfg(chat_jsonl, seed=1), Store(f"file://{tmp_path}/s1"))
    b = run_prepare(_cfg(chat_jsonl, seed=1), Store(f"file://{tmp_path}/s2"))
    c = run_prepare(_cfg(chat_jsonl, seed=2), Store(f"file://{tmp_path}/s3"))
    ids = []
    for ref, root in ((a, "s1"), (b, "s2"), (c, "s3")):
        art = Store(f"file://{tmp_path}/{root}").open("prepare", ref.digest)
        ids.append([s.sample_id for s in read_samples(art, shard_name(0))])
    assert ids[0] == ids[1] and ids[0] != ids[2]


def test_dedupe_and_length_limit(tmp_path, chat_jsonl):
    dup = tmp_path / "dup.jsonl"
    dup.write_text(chat_jsonl.read_text() * 2)
    ref = run_prepare(_cfg(dup), Store(f"file://{tmp_path}/a"))
    assert ref.stats["dropped"]["duplicate"] == 40 and ref.stats["samples"] == 36
    kept = run_prepare(_cfg(dup, dedupe=False), Store(f"file://{tmp_path}/b"))
    assert kept.stats["samples"] == 76

    lengths = [s.tokens for s in read_samples(Store(f"file://{tmp_path}/a").open("prepare", ref.digest),
                                              shard_name(0))]
    limit = sorted(lengths)[len(lengths) // 2]  # about half the samples are longer
    cut = run_prepare(_cfg(chat_jsonl, max_length=limit, overflow="truncate"), Store(f"file://{tmp_path}/c"))
    assert cut.stats["truncated"] > 0 and cut.stats["samples"] == 36
    art = Store(f"file://{tmp_path}/c").open("prepare", cut.digest)
    assert max(s.tokens for s in read_samples(art, shard_name(0))) <= limit
    # the length distribution the benchmark report, `draftline check` and `plan` set against the contexts served
    assert cut.stats["longest"] == max(s.tokens for i in range(cut.stats["num_shards"])
                                       for s in read_samples(art, shard_name(i)))
    assert sum(cut.stats["length_buckets"].values()) == cut.stats["samples"]
    drop = run_prepare(_cfg(chat_jsonl, max_length=limit, overflow="drop"), Store(f"file://{tmp_path}/d"))
    assert drop.stats["dropped"]["too_long"] > 0
    assert drop.stats["samples"] + drop.stats["heldout"] + drop.stats["dropped"]["too_long"] == 40


def test_weighted_mix_of_two_sources(tmp_path, chat_jsonl):
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(json.dumps({"prompt": f"Say {i}", "response": f"{i}!"}) for i in range(100)))
    cfg = RunConfig.model_validate({"data": {
        "sources": [{"path": str(chat_jsonl), "weight": 1}, {"path": str(other), "name": "numbers", "weight": 3}],
        "max_samples": 20, "heldout": 4, "num_shards": 2, "max_length": 512}})
    ref = run_prepare(cfg, Store(f"file://{tmp_path}/s"))
    ps = ref.stats["per_source"]
    assert ps["chats"]["samples"] + ps["chats"]["heldout"] == 6
    assert ps["numbers"]["samples"] + ps["numbers"]["heldout"] == 18
    assert ref.stats["samples"] == 20
    # a source too small for its share leaves the rest to the others
    cfg2 = cfg.model_copy(deep=True)
    cfg2.data.max_samples = 136  # numbers gets its 3/4 share (102) capped at 100, chats takes the rest
    ref2 = run_prepare(cfg2, Store(f"file://{tmp_path}/s2"))
    assert ref2.stats["per_source"]["numbers"]["samples"] + ref2.stats["per_source"]["numbers"]["heldout"] == 100
    assert ref2.stats["per_source"]["chats"]["samples"] + ref2.stats["per_source"]["chats"]["heldout"] == 40


def test_size_errors_are_clear(tmp_path, chat_jsonl):
    store = Store(f"file://{tmp_path}/store")
    with pytest.raises(PrepareError, match="num_shards \\(50\\) is larger than the number of training samples \\(36\\)"):
        run_prepare(_cfg(chat_jsonl, num_shards=50), store)
    with pytest.raises(PrepareError, match="heldout"):
        run_prepare(_cfg(chat_jsonl, heldout=40), store)
    with pytest.raises(PrepareError, match="max_model_len"):
        run_prepare(_cfg(chat_jsonl, max_length=4096), store)
    assert store.list() == []


def test_keep_thinking_off_removes_reasoning_from_targets(tmp_path, smol_tok):
    p = tmp_path / "r1.jsonl"
    p.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": f"Is {i} prime?"},
        {"role": "assistant", "content": f"<think>check divisors of {i}</think>\n\nLet me answer: {i}."}]})
        for i in range(12)))
    for keep in (True, False):
        store = Store(f"file://{tmp_path}/{keep}")
        ref = run_prepare(_cfg(p, keep_thinking=keep, heldout=2, num_shards=1), store)
        samples = read_samples(store.open("prepare", ref.digest), shard_name(0))
        text = "".join(masked_runs(smol_tok, samples[0].input_ids, samples[0].loss_mask))
        assert ("check divisors" in text) is keep
        assert "Let me answer" in text


def test_mask_is_never_all_ones(tmp_path, chat_jsonl):
    store = Store(f"file://{tmp_path}/store")
    ref = run_prepare(_cfg(chat_jsonl), store)
    for s in read_samples(store.open("prepare", ref.digest), shard_name(1)):
        assert 0 < int(s.loss_mask.sum()) < s.tokens
        assert s.loss_mask[:5].sum() == 0  # the prompt never is a target
        assert np.isin(s.loss_mask, [0, 1]).all()
