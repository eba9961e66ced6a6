"""The chat template and the assistant-only loss mask: one conversation -> (token ids, loss mask).

The loss mask is 1 on the tokens the target would generate in every assistant turn: the answer's
content and the end-of-turn token that closes it (`<|im_end|>`, `<|eot_id|>`, `</s>`; the draft must
learn to predict the stop too), and 0 on everything else (system, user, role headers, the whitespace a
template puts after an end-of-turn token).

How the mask is found (`ChatMasker`), for any template:
1. templates with `{% generation %}` markers: transformers' `return_assistant_tokens_mask`;
2. otherwise the conversation is rendered once and each answer is located in it by character offsets
   (a fast tokenizer maps characters to tokens): right after the previous user turn's content, with
   exactly the template's own user->assistant header in between (learned from a probe render;
   whitespace and empty `<think></think>` aside), followed by its end-of-turn marker. This also covers
   templates that are not prefix-stable (reasoning templates that drop the history's `<think>` blocks,
   templates that move the system prompt into the last user turn);
3. where that fails (headers that change per turn, repeated texts), two incremental renders per turn:
   the text between the render of the turns before assistant turn j (with the generation prompt) and
   the render through turn j is that turn's answer plus its end-of-turn marker.
Every sample is then VERIFIED: the masked tokens of each turn must decode to that turn's content
(whitespace-insensitive; the history's reasoning may be dropped by the template) plus, optionally, the
end-of-turn marker. A sample that fails is dropped (`mask_unverified`); a template that fails on a probe
conversation, or on every sample, is a `ChatTemplateError` that says how to supply a template. There is
no all-ones fallback.

Used by prepare (every sample), regenerate (the target's answers) and benchmark (the eval prompts).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from tasks.core.errors import DraftlineError
from tasks.core.config import DataConfig, RunConfig
from tasks.data.sources import Conversation, has_thinking, strip_thinking
from tasks.formats.samples import Sample

_GEN_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


_GAP_NOISE = re.compile(r"\s+|</?think>")


_PROBE_ANSWER = "Zebra quartz probe answer 7."


class ChatTemplateError(DraftlineError, ValueError):
    """The chat template cannot yield a verified assistant-only loss mask."""


class SampleDropped(DraftlineError):
    """One conversation that cannot become a training row; `reason` keys the `dropped` stats."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


def template_help(model: str) -> str:
    return (
        f"Supply a template with `target.chat_template: path/to/template.jinja` (for {model}) that renders each "
        "assistant turn's content verbatim between a role header and an end-of-turn marker, ideally wrapped in "
        "{% generation %}...{% endgeneration %}; the tokenizer's own template is used otherwise"
    )


@dataclass
class _Span:
    """Character spans of one assistant turn in the rendered text."""

    start: int
    end: int
    term_start: int
    term_end: int
    expected: str  # the content as the template rendered it (full or reasoning-stripped)

    def ranges(self) -> list[tuple[int, int]]:
        out = [(self.start, self.end)]
        if self.term_end > self.term_start:
            out.append((self.term_start, self.term_end))
        return out


def _ws_free(text: str) -> str:
    return "".join(text.split())  # what removing `\s+` leaves (str.split's whitespace is re's `\s`), without re


def _variants(content: str) -> list[str]:
    """What a template may render for an assistant content: as is, or without its reasoning."""
    out = [content.strip()]
    if has_thinking(content):
        stripped = strip_thinking(content).strip()
        if stripped and stripped not in out:
            out.append(stripped)
    return out


class ChatMasker:
    """Chat template + assistant-only loss mask for one tokenizer. `encode(messages) -> (ids, mask)`."""

    def __init__(self, tokenizer: Any, *, model: str = "the target", template_kwargs: dict | None = None):
        self.tok = tokenizer
        self.model = model
        self.kwargs = dict(template_kwargs or {})
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # several named templates: the default one renders chats
            template = template.get("default")
        if not template:
            raise ChatTemplateError(f"the tokenizer of {model} has no chat template. {template_help(model)}")
        if not getattr(tokenizer, "is_fast", False):
            raise ChatTemplateError(
                f"the tokenizer of {model} is a slow (Python) tokenizer without character offsets; draftline "
                "needs a fast tokenizer (tokenizer.json) to place the loss mask"
            )
        self.generation_tags = bool(_GEN_TAG.search(template))
        self.mode = "generation_tags" if self.generation_tags else "offsets"
        self.terminator, self.header = self._probe_markers()
        self.modes: Counter = Counter()
        self._check()

    # ------------------------------------------------------------------ rendering
    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                            **self.kwargs)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` followed by the generation prompt (what the engine is given)."""
        text = self.render(messages, True)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def _probe_markers(self) -> tuple[str, str]:
        """From a probe render: the end-of-turn marker after an answer, and the template text between
        a user's content and the answer (whitespace and think tags removed)."""
        question = "Hello there, probe question."
        full = [{"role": "user", "content": question}, {"role": "assistant", "content": _PROBE_ANSWER}]
        try:
            rendered = self.render(full, False)
        except Exception as exc:
            raise ChatTemplateError(
                f"the chat template of {self.model} fails on a plain user/assistant exchange "
                f"({type(exc).__name__}: {exc}). {template_help(self.model)}"
            ) from None
        at = rendered.rfind(_PROBE_ANSWER)
        if at < 0:
            raise ChatTemplateError(
                f"the chat template of {self.model} does not render an assistant turn's content verbatim "
                f"(probe answer {_PROBE_ANSWER!r} not found in {rendered[-200:]!r}), so no loss mask can be "
                f"placed on it. {template_help(self.model)}"
            )
        term = rendered[at + len(_PROBE_ANSWER):].strip()
        if len(term) > 40:  # not an end-of-turn marker but more template: do not guess
            term = ""
        q = rendered.find(question)
        header = _GAP_NOISE.sub("", rendered[q + len(question):at]) if 0 <= q < at else ""
        return term, header

    def _check(self) -> None:
        """Mask a probe conversation (system prompt, two turns); a template that cannot is an error."""
        turns = [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."},
            {"role": "user", "content": "And of Italy?"},
            {"role": "assistant", "content": "Rome is the capital of Italy."},
        ]
        tries = [[{"role": "system", "content": "You answer briefly."}] + turns, turns]
        last: Exception | None = None
        for messages in tries:
            try:
                ids, mask = self.encode(messages)
            except SampleDropped as exc:
                last = exc
                continue
            if sum(mask) == 0 or sum(mask) == len(mask):
                last = SampleDropped("mask_unverified", "the mask covers nothing or everything")
                continue
            self.modes.clear()
            return
        raise ChatTemplateError(
            f"the chat template of {self.model} cannot produce a verified assistant-only loss mask "
            f"(probe conversation: {last}). {template_help(self.model)}"
        )

    # ------------------------------------------------------------------ encoding
    def encode(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """Token ids and loss mask of a whole conversation, or SampleDropped(template_error | mask_unverified)."""
        if self.generation_tags:
            return self._encode_generation_tags(messages)
        return self._encode_offsets(messages)

    def _encode_generation_tags(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        try:
            out = self.tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True, **self.kwargs)
        except Exception as exc:
            raise SampleDropped("template_error", f"{type(exc).__name__}: {exc}") from None
        ids = list(out["input_ids"])
        mask = [1 if m else 0 for m in out["assistant_masks"]]
        runs: list[list[int]] = []
        prev = 0
        for i, m in enumerate(mask):
            if m and not prev:
                runs.append([])
            if m:
                runs[-1].append(ids[i])
            prev = m
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        if len(runs) != len(answers):
            raise SampleDropped("mask_unverified", f"{len(runs)} masked runs for {len(answers)} assistant turns")
        for run, content in zip(runs, answers):
            self._verify(run, _variants(content))
        self.modes["generation_tags"] += 1
        return ids, mask

    def _encode_offsets(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        try:
            full = self.render(messages, False)
        except Exception as exc:
            raise SampleDropped("template_error", f"{type(exc).__name__}: {exc}") from None
        spans: list[_Span] = []
        cursor = 0
        for j, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            variants = _variants(msg["content"])
            # Cheap first: one render, the answer right after the previous turn and the template's header.
            span = self._after_previous(full, messages, j, cursor, variants)
            if span is not None:
                self.modes["header"] += 1
            else:  # exact: incremental renders (two more renders for this turn)
                try:
                    before = self.render(messages[:j], True)
                    through = self.render(messages[: j + 1], False)
                except Exception as exc:
                    raise SampleDropped("template_error", f"{type(exc).__name__}: {exc}") from None
                if through.startswith(before) and full.startswith(through) and len(before) >= cursor:
                    span = self._in_segment(full, len(before), len(through), variants)
                    if span is not None:
                        self.modes["prefix"] += 1
                if span is None and before and full.startswith(before) and len(before) >= cursor:
                    span = self._find(full, len(before), "", variants)
                    if span is not None:
                        self.modes["search"] += 1
            if span is None:
                raise SampleDropped("mask_unverified", f"assistant turn {j} not found in the rendered conversation")
            spans.append(span)
            cursor = max(span.end, span.term_end)

        ids, offsets = self._with_offsets(full)
        bounds = np.array(offsets, dtype=np.int64).reshape(len(ids), 2)
        starts, ends = bounds[:, 0], bounds[:, 1]
        id_array = np.asarray(ids, dtype=np.int64)
        mask = np.zeros(len(ids), dtype=bool)
        for span in spans:
            turn = np.zeros(len(ids), dtype=bool)
            for s, e in span.ranges():  # every token that overlaps the answer or its end-of-turn marker
                turn |= (starts < e) & (ends > s)
            mask |= turn
            term = full[span.term_start:span.term_end]
            self._verify(id_array[turn].tolist(), [span.expected], term)
        return ids, mask.astype(np.int64).tolist()

    def _with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of TEXT (no special tokens added) and each token's character span. The fast tokenizer's
        backend is called directly (transformers' wrapper converts every id and offset in Python: prepare ran
        1.10x the samples per CPU-second without it, benchmarks/RESULTS.md) when it is in the state that wrapper
        would put it in: no truncation, no padding, special tokens split as the tokenizer says."""
        backend = self.tok.backend_tokenizer
        if (backend.truncation is None and backend.padding is None
                and backend.encode_special_tokens == bool(getattr(self.tok, "split_special_tokens", False))):
            enc = backend.encode(text, add_special_tokens=False)
            return enc.ids, enc.offsets
        out = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(out["input_ids"]), list(out["offset_mapping"])

    def _in_segment(self, full: str, s0: int, s1: int, variants: list[str]) -> _Span | None:
        """The answer inside the text turn j added: [header] content [ws] [terminator] [ws]."""
        body_end = s0 + len(full[s0:s1].rstrip())
        t_start = t_end = body_end
        if self.terminator and full[s0:body_end].endswith(self.terminator):
            t_start = body_end - len(self.terminator)
        c_end = s0 + len(full[s0:t_start].rstrip())
        for v in variants:  # exact: anchored at the end of the turn
            if v and full[c_end - len(v):c_end] == v and c_end - len(v) >= s0:
                return _Span(c_end - len(v), c_end, t_start, t_end, v)
        region = full[s0:c_end]
        c_start = s0 + len(region) - len(region.lstrip())
        for v in variants:  # the template re-spaced the content (e.g. a reformatted <think> block)
            if _ws_free(full[c_start:c_end]) == _ws_free(v):
                return _Span(c_start, c_end, t_start, t_end, v)
        return None

    def _after_previous(self, full: str, messages: list[dict], j: int, cursor: int,
                        variants: list[str]) -> _Span | None:
        """The answer right after the previous turn's content, where only the template's own
        user->assistant header (learned from the probe) may sit in between. Works for templates that
        are not prefix-stable too (history reasoning dropped, system prompt moved to the last turn)."""
        if j == 0 or not self.header or messages[j - 1]["role"] != "user":
            return None
        prev = messages[j - 1]["content"].strip()
        at = full.find(prev, cursor)
        if at < 0:
            return None
        return self._find(full, at + len(prev), self.header, variants)

    def _find(self, full: str, anchor: int, header: str, variants: list[str]) -> _Span | None:
        """An answer variant after `anchor`, with exactly `header` (whitespace and think tags aside)
        between them, followed by the end-of-turn marker if the template has one."""
        best: _Span | None = None
        for v in variants:
            pos = full.find(v, anchor) if v else -1
            if pos < 0 or _GAP_NOISE.sub("", full[anchor:pos]) != header:
                continue
            end = pos + len(v)
            rest = full[end:]
            t_start = end + len(rest) - len(rest.lstrip())
            t_end = t_start
            if self.terminator and full.startswith(self.terminator, t_start):
                t_end = t_start + len(self.terminator)
            else:
                t_start = t_end = end
            if best is None or pos < best.start:
                best = _Span(pos, end, t_start, t_end, v)
        return best

    def _verify(self, token_ids: list[int], variants: list[str], terminator: str | None = None) -> None:
        """The masked tokens of one turn must decode to its content (+ its end-of-turn marker)."""
        text = _ws_free(self.tok.backend_tokenizer.decode(token_ids, skip_special_tokens=False))  # no clean-up
        terms = [terminator] if terminator is not None else [self.terminator, ""]
        for v in variants:
            for t in terms:
                if text == _ws_free(v + (t or "")):
                    return
        raise SampleDropped("mask_unverified", f"masked tokens decode to {text[:60]!r}, expected {variants[0][:60]!r}")


def encode_sample(masker: ChatMasker, conv: Conversation, data: DataConfig) -> tuple[Sample, bool]:
    """One conversation -> (Sample, truncated?) under the length rule, or SampleDropped."""
    if not any(m["role"] == "assistant" for m in conv.messages):
        # Prompt-only (SourceConfig.prompt_only): no loss tokens yet; the regenerate stage answers the
        # user turns and encodes the result. Stored as the prompt, masked out.
        ids = masker.prompt_ids(conv.messages)
        if len(ids) > data.max_length:
            raise SampleDropped("too_long", f"prompt of {len(ids)} > {data.max_length} tokens")
        return Sample(conv.sample_id, conv.source, conv.messages, np.asarray(ids, dtype=np.int32),
                      np.zeros(len(ids), dtype=np.int8)), False
    ids, mask = masker.encode(conv.messages)
    truncated = False
    if len(ids) > data.max_length:
        if data.overflow == "drop":
            raise SampleDropped("too_long", f"{len(ids)} > {data.max_length} tokens")
        ids, mask = ids[: data.max_length], mask[: data.max_length]
        truncated = True
    if not any(mask):
        raise SampleDropped("too_long", "no assistant token left after truncation")
    return Sample(conv.sample_id, conv.source, conv.messages,
                  np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.int8)), truncated


_MASKERS: dict[str, ChatMasker] = {}


def make_masker(cfg: RunConfig, template_kwargs: dict | None = None) -> ChatMasker:
    """The target's tokenizer + template, checked; cached per process (loading takes seconds)."""
    from tasks.address.digests import target_identity
    from tasks.engine.target import load_tokenizer

    key = json.dumps([target_identity(cfg), cfg.target.trust_remote_code, template_kwargs], sort_keys=True)
    if key not in _MASKERS:
        _MASKERS[key] = ChatMasker(load_tokenizer(cfg.target), model=cfg.target.model,
                                   template_kwargs=template_kwargs)
    masker = _MASKERS[key]
    masker.modes.clear()
    return masker
