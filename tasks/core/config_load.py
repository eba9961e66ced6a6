"""Reading a config: a YAML file over its `base:` preset, then $DRAFTLINE_STORE_URI, then `--set a.b=c`
overrides, validated into a `RunConfig` (tasks/core/config.py) with one line per problem naming the field and the
fix (`ConfigError`), then the checks across sections that would otherwise fail a stage hours in (`fit_problems`).
"""

from __future__ import annotations

import json
import os
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tasks.core.config import RunConfig
from tasks.core.errors import ConfigError, closest
from tasks.core.secrets import SecretInValue, mask, refuse_secrets

_HINTS = {
    "extra_forbidden": "remove it or check the spelling (see `draftline config show` for valid keys)",
    "missing": "add it",
    "literal_error": "use one of the allowed values",
    "int_parsing": "use a whole number",
    "int_from_float": "use a whole number",
    "float_parsing": "use a number",
    "bool_parsing": "use true or false",
    "list_type": "use a YAML list, e.g. [1, 3, 5]",
    "greater_than_equal": "raise the value",
    "greater_than": "raise the value",
    "less_than_equal": "lower the value",
    "model_type": "use a mapping (key: value lines) here",
}


def _section_fields(loc: tuple) -> list[str]:
    """The keys valid where LOC's last key sits (RunConfig's fields, a section's, a list item's)."""
    model: Any = RunConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        todo, model = [field.annotation], None
        while todo:  # unwrap Optional[...], list[...], unions: the first model class inside
            t = todo.pop(0)
            if isinstance(t, type) and issubclass(t, BaseModel):
                model = t
                break
            todo += list(typing.get_args(t))
        if model is None:
            return []
    return list(getattr(model, "model_fields", {}))


def _format_errors(err: ValidationError, origin: str, overrides: list[str] | None = None) -> str:
    lines = [f"{origin}: {err.error_count()} problem(s) in the config:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        hint = _HINTS.get(e["type"], "")
        if e["type"] == "extra_forbidden" and e["loc"]:
            near = closest(str(e["loc"][-1]), _section_fields(tuple(e["loc"])))
            if near:
                hint = f"rename it to {near}"
                msg += f" (did you mean {near}?)"
        setby = [o for o in overrides or [] if f"{o.split('=', 1)[0].strip()}.".startswith(f"{loc}.")]
        got = e.get("input")
        # an unknown key is named, its value never echoed: a flow run's config_path may name any mapping on the
        # worker (a file of someone else's settings), and the run's error is readable by every Prefect API user
        quiet = isinstance(got, dict) or e["type"] in ("missing", "extra_forbidden")
        got_s = "" if quiet or f"got {got!r}" in msg else f" (got {got!r})"
        got_s = mask(got_s)  # never echo a credential
        from_set = mask(f" (from --set {setby[-1]})") if setby else ""
        lines.append(f"  - {loc}: {msg}{got_s}{from_set}" + (f"; fix: {hint}" if hint else ""))
    return "\n".join(lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=c` -> (['a','b'], value) with the value parsed as YAML (so 3, true, [1,2] work)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.max_steps=50")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        if raw.lstrip()[:1] in ("[", "{", "'", '"'):  # meant as a YAML list, mapping or quoted string
            mark = getattr(exc, "problem_mark", None)
            why = f"{getattr(exc, 'problem', None) or exc}" + (f" at character {mark.column + 1}" if mark else "")
            raise ConfigError(f"--set {item!r}: the value is not valid YAML ({why}); fix: close the brackets or "
                              "quotes, and quote the whole option for the shell: --set 'key=[1, 2]'") from None
        value = raw  # anything else is a plain string (a path, a template with ': ' in it)
    return path, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for p in path[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {item!r}: {p} is not a section")
            node = nxt
        node[path[-1]] = value
    return data


# Set by deployments (job variable `store_uri`): overrides the file's store.uri; --set still wins.
STORE_URI_ENV = "DRAFTLINE_STORE_URI"


def _merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`, section by section (a list or a value replaces; a mapping merges)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# The checkout draftline runs from: a config's `base:` resolves inside it or inside the config's own folder.
CHECKOUT = Path(__file__).resolve().parents[2]


def read_config_file(path: str | os.PathLike, _seen: tuple[Path, ...] = ()) -> dict:
    """A config file's sections, on top of its `base:` file (a path relative to the including file) if it
    names one, recursively: a preset holds only what differs from the one it builds on."""
    p = Path(path)
    if not p.is_file():
        hint = f" (the `base:` of {_seen[-1]})" if _seen else ""
        raise ConfigError(f"config file {p} not found{hint}; pass a YAML file such as configs/demo.yaml")
    if p.resolve() in _seen:
        raise ConfigError(f"{p}: `base:` files include each other ({' -> '.join(map(str, _seen))}); remove the loop")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:  # where and what, never the offending line (the file may not be a config)
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{p}: not valid YAML{at} ({getattr(exc, 'problem', None) or type(exc).__name__}); "
                          "fix the file's syntax") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a text file; pass a YAML config such as configs/demo.yaml") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections (target:, data:, ...)")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{p}: `base:` must be a path to another config file, e.g. base: kimi-k2.5-b300.yaml")
    target = (p.parent / base).resolve()
    roots = (CHECKOUT, (_seen[0] if _seen else p.resolve()).parent)  # the checkout, the top config's folder
    if not any(target == r or r in target.parents for r in roots):
        raise ConfigError(f"{p}: `base: {base}` is outside this checkout and the config's folder; a base is a "
                          "preset next to the config or in the checkout's configs/ (copy the file there)")
    return _merge(read_config_file(p.parent / base, (*_seen, p.resolve())), data)


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> RunConfig:
    data: dict = {}
    origin = "defaults"
    if path is not None:
        origin = str(path)
        data = read_config_file(path)  # the file over its `base:`, then the environment, then --set
    env_uri = os.environ.get(STORE_URI_ENV, "").strip()
    if env_uri:  # a deployment's job variable: above the file, below --set
        if data.get("store") is None:
            data["store"] = {}
        if isinstance(data["store"], dict):  # (anything else fails validation below)
            data["store"]["uri"] = env_uri
            origin += f" (store.uri from ${STORE_URI_ENV})"
    data = apply_overrides(data, overrides or [])
    try:  # before anything prints a value: every field, engine_args, URLs, source paths
        refuse_secrets(data, origin)
    except SecretInValue as exc:
        raise ConfigError(str(exc)) from None
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, origin, overrides)) from None
    problems = fit_problems(cfg)
    if problems:
        raise ConfigError("\n".join([f"{origin}: {len(problems)} problem(s) in the config:", *problems]))
    return cfg


def fit_problems(cfg: RunConfig) -> list[str]:
    """Settings that pass each section's checks but would fail a stage hours in: one line each, with the fix."""
    from tasks.core.engine_args import engine_args_problems

    out = []
    t, d, e = cfg.target, cfg.data, cfg.engines
    for where, args in (("engines.engine_args", e.engine_args), ("engines.regenerate.engine_args",
                        e.regenerate.engine_args), ("engines.extract.engine_args", e.extract.engine_args),
                        ("engines.benchmark.engine_args", e.benchmark.engine_args)):
        out += [f"  - {p}" for p in engine_args_problems(args, where)]
    if d.max_length >= t.max_model_len:
        # Extraction sends a sample as a prompt of max_length tokens and asks for one new token: vLLM needs
        # max_length + 1 <= max_model_len, else every shard holding a sample of max_length tokens fails.
        out.append(f"  - data.max_length: {d.max_length} leaves no room in target.max_model_len ({t.max_model_len}): "
                   f"extraction feeds a sample of up to max_length tokens plus one generated token; fix: lower "
                   f"data.max_length to at most {t.max_model_len - 1}, or raise target.max_model_len to at least "
                   f"{d.max_length + 1} (regeneration also wants room for a prompt plus regenerate.max_tokens)")
    return out


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False)
