"""prepare: chat data -> tokenized Parquet shards with a verified assistant-only loss mask.

    sources (data_sources) -> normalized messages -> dedupe -> weighted, seeded mix
      -> chat template + loss mask (verified per sample) -> length limit
      -> seeded shuffle -> held-out split -> S Parquet shards on the store

The loss mask is 1 on the tokens the target would generate in every assistant
turn: the answer's content and the end-of-turn token that closes it
(`<|im_end|>`, `<|eot_id|>`, `</s>`; the draft must learn to predict the stop
too), and 0 on everything else (system, user, role headers, the whitespace a
template puts after an end-of-turn token).

How the mask is found (`ChatMasker`), for any template:
1. templates with `{% generation %}` markers: transformers'
   `return_assistant_tokens_mask`;
2. otherwise the conversation is rendered once and each answer is located in
   it by character offsets (a fast tokenizer maps characters to tokens): right
   after the previous user turn's content, with exactly the template's own
   user->assistant header in between (learned from a probe render; whitespace
   and empty `<think></think>` aside), followed by its end-of-turn marker. This
   also covers templates that are not prefix-stable (reasoning templates that
   drop the history's `<think>` blocks, templates that move the system prompt
   into the last user turn);
3. where that fails (headers that change per turn, repeated texts), two
   incremental renders per turn: the text between the render of the turns
   before assistant turn j (with the generation prompt) and the render through
   turn j is that turn's answer plus its end-of-turn marker.
Every sample is then VERIFIED: the masked tokens of each turn must decode to
that turn's content (whitespace-insensitive; the history's reasoning may be
dropped by the template) plus, optionally, the end-of-turn marker. A sample
that fails is dropped (`mask_unverified`); a template that fails on a probe
conversation, or on every sample, is a `ChatTemplateError` that says how to
supply a template. There is no all-ones fallback.
"""

from __future__ import annotations

import io
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np

from tasks.config import DataConfig, RunConfig
from tasks.data_sources import (
    Conversation,
    LoadedSource,
    allocate,
    has_thinking,
    load_sources,
    strip_thinking,
)
from tasks.digest import VERSIONS
from tasks.digest import prepare as _prepare_digest
from tasks.store import Artifact, ArtifactRef, Store

STAGE = "prepare"
HELDOUT = "heldout.parquet"
COLUMNS = ("sample_id", "source", "messages", "input_ids", "loss_mask")
_GEN_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_WS = re.compile(r"\s+")
_GAP_NOISE = re.compile(r"\s+|</?think>")
_PROBE_ANSWER = "Zebra quartz probe answer 7."


class PrepareError(ValueError):
    """Bad input to prepare (config, sources, sizes); the message says what to change."""


class ChatTemplateError(PrepareError):
    """The chat template cannot yield a verified assistant-only loss mask."""


class SampleDropped(Exception):
    """One conversation that cannot become a training row; `reason` keys the `dropped` stats."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.parquet"


def _template_help(model: str) -> str:
    return (
        f"Supply a template with `target.chat_template: path/to/template.jinja` (for {model}) that renders each "
        "assistant turn's content verbatim between a role header and an end-of-turn marker, ideally wrapped in "
        "{% generation %}...{% endgeneration %}; the tokenizer's own template is used otherwise"
    )


# =========================================================================== the loss mask

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
    return _WS.sub("", text)


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
            raise ChatTemplateError(f"the tokenizer of {model} has no chat template. {_template_help(model)}")
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
                f"({type(exc).__name__}: {exc}). {_template_help(self.model)}"
            ) from None
        at = rendered.rfind(_PROBE_ANSWER)
        if at < 0:
            raise ChatTemplateError(
                f"the chat template of {self.model} does not render an assistant turn's content verbatim "
                f"(probe answer {_PROBE_ANSWER!r} not found in {rendered[-200:]!r}), so no loss mask can be "
                f"placed on it. {_template_help(self.model)}"
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
            f"(probe conversation: {last}). {_template_help(self.model)}"
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

        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        offsets = enc["offset_mapping"]
        mask = [0] * len(ids)
        starts = np.fromiter((a for a, _ in offsets), dtype=np.int64, count=len(offsets))
        ends = np.fromiter((b for _, b in offsets), dtype=np.int64, count=len(offsets))
        for span in spans:
            picked: list[int] = []
            for s, e in span.ranges():
                hit = np.nonzero((starts < e) & (ends > s))[0]
                picked.extend(int(i) for i in hit)
            picked = sorted(set(picked))
            for i in picked:
                mask[i] = 1
            term = full[span.term_start:span.term_end]
            self._verify([ids[i] for i in picked], [span.expected], term)
        return ids, mask

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
        text = _ws_free(self.tok.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))
        terms = [terminator] if terminator is not None else [self.terminator, ""]
        for v in variants:
            for t in terms:
                if text == _ws_free(v + (t or "")):
                    return
        raise SampleDropped("mask_unverified", f"masked tokens decode to {text[:60]!r}, expected {variants[0][:60]!r}")


# =========================================================================== samples and shards

@dataclass
class Sample:
    sample_id: str
    source: str
    messages: list[dict[str, str]]
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # int8 [T]

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def masked(self) -> int:
        return int(self.loss_mask.sum())


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


def parquet_bytes(samples: list[Sample]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = pa.ListArray.from_arrays(
        pa.array(np.cumsum([0] + [s.tokens for s in samples], dtype=np.int32)),
        pa.array(np.concatenate([s.input_ids for s in samples]) if samples else np.zeros(0, np.int32), pa.int32()),
    )
    mask = pa.ListArray.from_arrays(
        pa.array(np.cumsum([0] + [s.tokens for s in samples], dtype=np.int32)),
        pa.array(np.concatenate([s.loss_mask for s in samples]) if samples else np.zeros(0, np.int8), pa.int8()),
    )
    table = pa.table({
        "sample_id": pa.array([s.sample_id for s in samples], pa.string()),
        "source": pa.array([s.source for s in samples], pa.string()),
        "messages": pa.array([json.dumps(s.messages, ensure_ascii=False) for s in samples], pa.string()),
        "input_ids": ids,
        "loss_mask": mask,
    })
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=1024)
    return buf.getvalue()


def read_samples(art: Artifact, name: str) -> list[Sample]:
    """All rows of one shard (or heldout.parquet) of a prepare/regenerate artifact."""
    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(art.read_bytes(name)))
    out = []
    cols = {c: table.column(c) for c in COLUMNS}
    for i in range(table.num_rows):
        out.append(Sample(
            sample_id=cols["sample_id"][i].as_py(),
            source=cols["source"][i].as_py(),
            messages=json.loads(cols["messages"][i].as_py()),
            input_ids=np.asarray(cols["input_ids"][i].values, dtype=np.int32),
            loss_mask=np.asarray(cols["loss_mask"][i].values, dtype=np.int8),
        ))
    return out


def iter_token_batches(art: Artifact, names: Iterable[str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, loss_mask) flat arrays per Parquet row group, shard after shard: constant memory."""
    import pyarrow.parquet as pq

    for name in names:
        with art.local_copy(name) as path:
            pf = pq.ParquetFile(path)
            for batch in pf.iter_batches(columns=["input_ids", "loss_mask"], batch_size=1024):
                ids = batch.column(0).flatten().to_numpy(zero_copy_only=False)
                mask = batch.column(1).flatten().to_numpy(zero_copy_only=False)
                yield ids, mask


def split_shards(samples: list[Sample], num_shards: int) -> list[list[Sample]]:
    if num_shards > len(samples):
        raise PrepareError(
            f"data.num_shards ({num_shards}) is larger than the number of training samples ({len(samples)}); "
            f"lower data.num_shards to at most {len(samples)} or add data"
        )
    base, extra = divmod(len(samples), num_shards)
    out, at = [], 0
    for i in range(num_shards):
        n = base + (1 if i < extra else 0)
        out.append(samples[at:at + n])
        at += n
    return out


def token_stats(samples: list[Sample]) -> dict[str, int]:
    return {"samples": len(samples), "tokens": sum(s.tokens for s in samples),
            "masked_tokens": sum(s.masked for s in samples)}


def write_split(w: Any, train: list[Sample], heldout: list[Sample], num_shards: int) -> list[int]:
    """heldout.parquet + shard-*.parquet into an artifact writer; returns samples per shard."""
    shards = split_shards(train, num_shards)
    w.write_bytes(HELDOUT, parquet_bytes(heldout))
    for i, part in enumerate(shards):
        w.write_bytes(shard_name(i), parquet_bytes(part))
    return [len(p) for p in shards]


_MASKERS: dict[str, ChatMasker] = {}


def make_masker(cfg: RunConfig, template_kwargs: dict | None = None) -> ChatMasker:
    """The target's tokenizer + template, checked; cached per process (loading takes seconds)."""
    from tasks.digest import _target_identity
    from tasks.target import load_tokenizer

    key = json.dumps([_target_identity(cfg), cfg.target.trust_remote_code, template_kwargs], sort_keys=True)
    if key not in _MASKERS:
        _MASKERS[key] = ChatMasker(load_tokenizer(cfg.target), model=cfg.target.model,
                                   template_kwargs=template_kwargs)
    masker = _MASKERS[key]
    masker.modes.clear()
    return masker


# =========================================================================== the stage

def prepare_key(cfg: RunConfig) -> str:
    """The prepare artifact's digest: the target's identity (model, revision, template) + the data section."""
    return _prepare_digest(cfg)


@dataclass
class _Mix:
    """Per-source progress while filling the mix."""

    loaded: LoadedSource
    weight: float
    cursor: int = 0
    samples: list[Sample] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    truncated: int = 0

    @property
    def left(self) -> int:
        return len(self.loaded.conversations) - self.cursor


def _fill(mix: _Mix, want: int, masker: ChatMasker, data: DataConfig) -> None:
    """Encode this source's next conversations until `want` more samples or no rows are left."""
    goal = len(mix.samples) + want
    convs = mix.loaded.conversations
    while len(mix.samples) < goal and mix.cursor < len(convs):
        conv = convs[mix.cursor]
        mix.cursor += 1
        try:
            sample, truncated = encode_sample(masker, conv, data)
        except SampleDropped as drop:
            mix.dropped[drop.reason] += 1
            continue
        mix.samples.append(sample)
        mix.truncated += truncated


def build_samples(mixes: list[_Mix], masker: ChatMasker, data: DataConfig) -> None:
    """Fill each source's share of the mix (weights; a short source leaves its share to the others)."""
    if data.max_samples is None:
        for m in mixes:
            _fill(m, m.left, masker, data)
        return
    need = data.max_samples + data.heldout
    while True:
        remaining = need - sum(len(m.samples) for m in mixes)
        left = [m.left for m in mixes]
        if remaining <= 0 or sum(left) == 0:
            return
        for m, want in zip(mixes, allocate(remaining, [m.weight for m in mixes], left)):
            if want:
                _fill(m, want, masker, data)


def run_prepare(cfg: RunConfig, store: Store) -> ArtifactRef:
    """Build (or find) the prepare artifact: `shard-*.parquet` + `heldout.parquet` (docs/ARTIFACTS.md)."""
    digest = prepare_key(cfg)
    hit = store.find(STAGE, digest)
    if hit is not None:
        return hit.ref()
    t0 = time.time()
    data = cfg.data
    if data.max_length > cfg.target.max_model_len:
        raise PrepareError(
            f"data.max_length ({data.max_length}) exceeds target.max_model_len ({cfg.target.max_model_len}): "
            "the target could not read the longest samples; lower data.max_length or raise target.max_model_len"
        )
    masker = make_masker(cfg)
    loaded = load_sources(data.sources, seed=data.seed, keep_thinking=data.keep_thinking,
                          system_prompt=data.system_prompt, dedupe=data.dedupe)
    mixes = [_Mix(ld, src.weight) for ld, src in zip(loaded, data.sources)]
    build_samples(mixes, masker, data)

    everything = [s for m in mixes for s in m.samples]
    for m in mixes:
        if m.loaded.conversations and not m.samples and m.cursor == len(m.loaded.conversations):
            reasons = ", ".join(f"{k}: {v}" for k, v in m.dropped.most_common())
            if m.dropped.get("mask_unverified", 0) + m.dropped.get("template_error", 0) == m.cursor:
                raise ChatTemplateError(
                    f"source {m.loaded.label!r}: no conversation could be masked with the chat template of "
                    f"{cfg.target.model} ({reasons}). {_template_help(cfg.target.model)}"
                )
            raise PrepareError(f"source {m.loaded.label!r}: every conversation was dropped ({reasons}); "
                               "raise data.max_length or use overflow: truncate")
    random.Random(data.seed).shuffle(everything)
    if len(everything) <= data.heldout:
        raise PrepareError(
            f"data.heldout ({data.heldout}) leaves no training samples out of {len(everything)}; "
            "lower data.heldout or add data"
        )
    heldout, train = everything[: data.heldout], everything[data.heldout:]
    if data.max_samples is not None:
        train = train[: data.max_samples]
    held_ids = {s.sample_id for s in heldout}
    train_ids = {s.sample_id for s in train}

    dropped: Counter = Counter()
    per_source: dict[str, Any] = {}
    for m in mixes:
        d = m.loaded.dropped + m.dropped
        dropped.update(d)
        entry = per_source.setdefault(m.loaded.label, {"rows": 0, "samples": 0, "heldout": 0, "unused": 0,
                                                       "truncated": 0, "dropped": {}})
        entry["rows"] += m.loaded.rows
        entry["samples"] += sum(1 for s in m.samples if s.sample_id in train_ids)
        entry["heldout"] += sum(1 for s in m.samples if s.sample_id in held_ids)
        entry["unused"] += m.left + sum(1 for s in m.samples if s.sample_id not in train_ids | held_ids)
        entry["truncated"] += m.truncated
        entry["dropped"] = dict(sorted((Counter(entry["dropped"]) + d).items()))

    stats: dict[str, Any] = {
        **token_stats(train),
        "dropped": dict(sorted(dropped.items())),
        "num_shards": data.num_shards,
        "heldout": len(heldout),
        "heldout_tokens": sum(s.tokens for s in heldout),
        "per_source": per_source,
        "truncated": sum(m.truncated for m in mixes),
        "max_length": data.max_length,
        "mask_mode": masker.mode if masker.generation_tags else "+".join(sorted(masker.modes)) or "offsets",
    }
    config = {"target": cfg.target.model_dump(mode="json"), "data": data.model_dump(mode="json")}
    with store.write(STAGE, digest, VERSIONS[STAGE], {}, config) as w:
        stats["shard_samples"] = write_split(w, train, heldout, data.num_shards)
        stats["seconds"] = round(time.time() - t0, 2)
        stats["samples_per_s"] = round((len(train) + len(heldout)) / max(stats["seconds"], 1e-9), 1)
        art = w.commit(stats)
    return art.ref()
