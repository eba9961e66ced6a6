"""Preflight: what can be checked in seconds before a run's work starts, so a typo fails now and not after
hours of earlier stages (each stage checks again). `draftline run` asks `input_problems` before it starts the
flow (local paths, the target's config, layer ids, each head's kind against the target, the draft vocabulary,
drafts from outside the run and the heads a warm start can seed); `draftline plan` asks `head_problems`; the
flow asks `check_head_layers` (the train stage's `check`) before its first sharded stage, regeneration or
extraction; a deployment's run (and `draftline submit`) asks `remote_code_problem` whether the deployment lets
it run the target's own code.
"""

from __future__ import annotations

# The train inputs are imported where used: they import torch, which is heavy (seconds), and `draftline run`
# and `draftline plan` ask these checks before anything heavy is needed (head kinds: tasks/train/head_kinds.py).

from pathlib import Path
from typing import Any

from tasks.core.config import head_config
from tasks.formats.vocab_maps import VocabError, draft_size
from tasks.engine.target import (TargetError, load_hf_config, max_model_len_problem, resolve_layer_ids, resolve_model,
                                 text_config)
from tasks.formats.drafts import DraftError, draft_folder_of, read_config, warm_start_problem
from tasks.train.head_kinds import head_target_problem


def input_problems(cfg: Any) -> list[str]:
    """Every problem found in the config's inputs, each naming the fix; [] when there is none."""
    problems = []
    t = cfg.target
    if t.chat_template and not Path(t.chat_template).expanduser().is_file():
        problems.append(f"target.chat_template {t.chat_template!r} not found; give a path to a .jinja file")
    for i, src in enumerate(cfg.data.sources):
        if src.path and "://" not in src.path and not Path(src.path).expanduser().exists():
            problems.append(f"data.sources[{i}].path {src.path!r} not found (relative paths start at {Path.cwd()}); "
                            "fix the path")
    try:
        text = text_config(load_hf_config(t))  # a hub id: its config only (the weights come before an engine)
    except TargetError as exc:
        problems.append(str(exc))
    except OSError as exc:  # a hub id that cannot be fetched (offline, typo, gated)
        problems.append(f"target.model {t.model!r}: cannot read its config ({str(exc).splitlines()[0][:200]}); "
                        "give a local model folder or a hub id this machine can download")
    else:
        if cfg.extract.layer_ids:  # the default for the target is valid by construction
            try:
                resolve_layer_ids(cfg, text)
            except TargetError as exc:
                problems.append(str(exc))
        problems += head_problems(cfg, text)
        too_long = max_model_len_problem(t, text)
        if too_long:
            problems.append(too_long)
        try:
            draft_size(cfg.vocab.draft_vocab_size, int(text.vocab_size))
        except VocabError as exc:
            problems.append(str(exc))
    for key, spec in [("train.init_from", cfg.train.init_from)] + [
            (f"benchmark.drafts[{d.name}]", d.model) for d in cfg.benchmark.drafts]:
        try:
            if spec:
                folder = draft_folder_of(spec)
                if key == "train.init_from":  # each head it would seed must be of the draft's own kind
                    conf = read_config(folder)
                    problems += [f"train.init_from {spec!r}: {why}" for why in
                                 (warm_start_problem(conf, h.kind, h.label) for h in cfg.train.heads) if why]
        except DraftError as exc:
            problems.append(f"{key}: {exc}")
    return problems


def head_problems(cfg: Any, text: Any) -> list[str]:
    """Each head of train.heads that this target cannot train (an eagle3-mla head on a target without MLA),
    from the target's text config `text`; [] when every head fits."""
    return [p for p in (head_target_problem(h, text, cfg.target.model) for h in cfg.train.heads) if p]


def check_head_layers(cfg: Any) -> None:
    """A head reading layers the extraction will not hold fails now (a TrainError naming extract.layer_ids),
    not after hours of extraction."""
    if not any(h.layer_ids for h in cfg.train.heads):
        return
    from tasks.train.inputs import head_layer_ids

    stored = resolve_layer_ids(cfg, load_hf_config(cfg.target, resolve_model(cfg.target)))
    for head in cfg.train.heads:
        head_layer_ids(head_config(cfg, head), stored)


# The deployment tag that lets a deployment's flow runs set target.trust_remote_code (deployments/prefect.yaml):
# `allow-trust-remote-code:REPO` for the code of one repository (what `draftline deploy --allow-trust-remote-code
# REPO` writes), the bare tag for every repository's.
REMOTE_CODE_TAG = "allow-trust-remote-code"


def remote_code_tag(model: str) -> str:
    """The deployment tag that lets its runs execute the code of the repository MODEL (target.model)."""
    return f"{REMOTE_CODE_TAG}:{model}"


def remote_code_problem(trust: bool, deployment: str | None, tags: list[str], model: str | None = None) -> str | None:
    """Why a flow run may not run the target repository's code: a deployment's run takes its config from
    its parameters, which anyone who can create a flow run sets; only a deployment whose operator allowed this
    repository (the tag `allow-trust-remote-code:REPO`, or the bare tag for every repository) lets them switch
    trust_remote_code on for it. A run outside any deployment (`draftline run`) is its user's own."""
    if not trust or deployment is None or REMOTE_CODE_TAG in tags or (model and remote_code_tag(model) in tags):
        return None
    name = deployment.split("/", 1)[-1]
    allowed = sorted(t.split(":", 1)[1] for t in tags if t.startswith(REMOTE_CODE_TAG + ":"))
    return (f"target.trust_remote_code=true for {model or 'the target'} in a run of deployment {deployment}, which "
            f"does not allow it{' (it allows ' + ', '.join(allowed) + ')' if allowed else ''}: the target "
            "repository's own Python code would run on the node, chosen by a flow-run parameter. Fix: use a model "
            "that needs no remote code, or have the deployment's operator allow this repository's code with "
            f"`draftline deploy --name {name} --allow-trust-remote-code {model or 'REPO'}`")
