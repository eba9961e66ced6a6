"""Drafts that did not come out of this run: a published EAGLE-3 draft (a local folder or a hub id), read,
identified by its content, checked against this run's target, and used as a warm start.

    folder = draft_folder_of("AQ-MedAI/Kimi-K2-Instruct-eagle3")   # a local folder (hub ids are downloaded)
    content_digest(folder)                                         # sha256 of config.json + model.safetensors
    warm_start(model, folder, layer_ids, d2t, t2d, num_layers)     # train.init_from: weights in, vocab remapped

A draft's identity is its content, never its path: the same files under another folder (or fetched again
from the hub) give the same digest, so `train.init_from` and `benchmark.drafts` address artifacts by what
the draft IS. The on-disk format is speculators' (tasks/train/loop.py save_draft): `config.json`
(`speculators_model_type`, `eagle_aux_hidden_state_layer_ids`, `draft_vocab_size`,
`transformer_layer_config`) and `model.safetensors` with the draft's weights plus `d2t` (draft index i ->
target id i + d2t[i]) and `t2d` (a bool mask over the target vocabulary).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tasks.core.errors import DraftlineError

DRAFT_FILES = ("config.json", "model.safetensors")


class DraftError(DraftlineError, ValueError):
    """A draft that cannot be used here; the message says why and what to do."""


# Drafts are data, never code. What draftline writes (tasks/train/loop.py save_draft) and vLLM loads natively:
# speculators' config (its model_type, or none) of an EAGLE-3, DFlash or DSpark model, or the flat DeepSeek-V2 config
# of an MLA EAGLE-3 head (MLA_DRAFT_*, below). Anything else could send transformers or vLLM, under the target's
# trust_remote_code, to a module in the draft's folder or repository.
DRAFT_MODEL_TYPES = ("speculator_model", "eagle3", "dflash", "dspark", "deepseek_v2")
DRAFT_ARCHITECTURES = ("Eagle3DraftModel", "DFlashDraftModel", "DSparkDraftModel", "Eagle3DeepseekV2ForCausalLM")
DRAFT_DATA_SUFFIXES = (".json", ".safetensors")  # the files of a draft folder handed on: never code


def _nested(conf: Any, path: str = "") -> Any:
    """(path, mapping) of every mapping in a config, itself included."""
    if isinstance(conf, dict):
        yield path, conf
        for k, v in conf.items():
            yield from _nested(v, f"{path}.{k}" if path else str(k))
    elif isinstance(conf, list):
        for i, v in enumerate(conf):
            yield from _nested(v, f"{path}[{i}]")


def refuse_code(conf: dict[str, Any], where: str) -> None:
    """A DraftError unless the draft's config.json names only what loads without code: no `auto_map` anywhere,
    a draft model type and architecture draftline trains, and nested layer configs of model types transformers
    knows itself."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    fix = ("draftline loads drafts as data only (EAGLE-3, DFlash or DSpark drafts in speculators' format, as "
           "`draftline export` writes them); re-export the draft, or remove it from the store")
    for path, m in _nested(conf):
        if "auto_map" in m:
            raise DraftError(f"{where}: the draft's config.json has an auto_map{f' in {path}' if path else ''} "
                             f"(code to import from the draft's folder); refused: {fix}")
        kind = m.get("model_type")
        if path and kind is not None and kind not in CONFIG_MAPPING_NAMES:
            raise DraftError(f"{where}: the draft's config.json has a {path} of model_type {kind!r}, which "
                             f"transformers does not know (it would need code from elsewhere); refused: {fix}")
    kind, archs = conf.get("model_type"), conf.get("architectures") or []
    if kind is not None and kind not in DRAFT_MODEL_TYPES:
        raise DraftError(f"{where}: the draft's config.json has model_type {kind!r}, not a draft type draftline "
                         f"trains ({', '.join(DRAFT_MODEL_TYPES)}); refused: {fix}")
    odd = [a for a in (archs if isinstance(archs, list) else [archs]) if a not in DRAFT_ARCHITECTURES]
    if odd:
        raise DraftError(f"{where}: the draft's config.json names architectures {odd}, not a draft draftline trains "
                         f"({', '.join(DRAFT_ARCHITECTURES)}); refused: {fix}")


def draft_data_files(names: list[str]) -> list[str]:
    """The files of a draft folder that are handed on (to vLLM, to an export): its data, never code."""
    return [n for n in names if n.endswith(DRAFT_DATA_SUFFIXES)]


def draft_folder_of(spec: str) -> str:
    """A local folder holding config.json + model.safetensors: `spec` itself, or a hub id's snapshot (only
    those two files are fetched, as a target's files would be, through huggingface_hub and its cache)."""
    p = Path(spec).expanduser()
    if p.exists() or spec.startswith((".", "/", "~")):
        if not p.is_dir():
            raise DraftError(f"draft {spec!r}: no such folder; give a folder with config.json and "
                             "model.safetensors, or a hub id")
        missing = [f for f in DRAFT_FILES if not (p / f).is_file()]
        if missing:
            raise DraftError(f"draft {spec!r} has no {', '.join(missing)}: an EAGLE-3 draft folder holds "
                             "config.json and model.safetensors (what `draftline export` writes)")
        return str(p.resolve())
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(spec, allow_patterns=list(DRAFT_FILES))
    except Exception as exc:  # noqa: BLE001 - offline, a typo, a gated repo: one clear message
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise DraftError(f"draft {spec!r} is neither a local folder nor a hub id this machine can download "
                         f"({first}); give a local draft folder, or fetch it first with "
                         f"`huggingface-cli download {spec}`") from None
    return draft_folder_of(folder)


@functools.lru_cache(maxsize=32)
def _digest_of(folder: str, stamp: tuple) -> str:
    h = hashlib.sha256()
    for name in DRAFT_FILES:
        h.update(name.encode() + b"\0")
        with open(os.path.join(folder, name), "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
    return h.hexdigest()


def content_digest(spec: str) -> str:
    """sha256 over config.json and model.safetensors of the draft `spec` names (its address, not its path)."""
    folder = draft_folder_of(spec)
    stamp = tuple((os.stat(os.path.join(folder, n)).st_size, os.stat(os.path.join(folder, n)).st_mtime_ns)
                  for n in DRAFT_FILES)
    return _digest_of(folder, stamp)


def read_config(folder: str) -> dict[str, Any]:
    return json.loads(Path(folder, "config.json").read_text())


# vLLM's speculators loader builds EAGLE-3 drafts of Llama and Qwen3 layers only; one of DeepSeek's MLA layers loads
# through vLLM's plain EAGLE path (method eagle3; model_executor/models/deepseek_eagle3.py, registered as
# Eagle3DeepseekV2ForCausalLM and Eagle3DeepseekV3ForCausalLM) from a flat config.json. Its model_type is
# deepseek_v2: vLLM turns any deepseek_v3 draft config into DeepSeek's MTP module (SpeculativeConfig's
# hf_config_override: `Model architectures ['Eagle3DeepSeekMTPModel'] are not supported`). DeepSeek-V2's config
# has the same MLA keys, and deepseek_eagle3 builds the same layer from either.
MLA_DRAFT_ARCHITECTURE, MLA_DRAFT_MODEL_TYPE = "Eagle3DeepseekV2ForCausalLM", "deepseek_v2"


def mla_draft_config(conf: dict[str, Any]) -> dict[str, Any]:
    """An MLA EAGLE-3 draft's config.json as vLLM loads it: speculators' config (`conf`, an Eagle3DraftModel's
    whose transformer_layer_config is DeepSeek-V3's) flattened, the layer's keys at the top (model_type
    MLA_DRAFT_MODEL_TYPE: kv_lora_rank, q_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, ...), with the
    EAGLE-3 keys deepseek_eagle3 reads (draft_vocab_size, eagle_aux_hidden_state_layer_ids and their count,
    norm_before_residual, fc_norm, norm_output). No `speculators_config` (it would send vLLM to its speculators
    loader, which refuses DeepSeek layers); `speculators_model_type` stays for draftline's readers."""
    layer = dict(conf["transformer_layer_config"])
    aux = list(conf["eagle_aux_hidden_state_layer_ids"])
    eagle = {k: conf[k] for k in ("draft_vocab_size", "norm_before_residual", "fc_norm", "norm_output",
                                  "speculators_model_type", "dtype", "torch_dtype") if k in conf}
    return {**layer, **eagle, "architectures": [MLA_DRAFT_ARCHITECTURE], "model_type": MLA_DRAFT_MODEL_TYPE,
            "eagle_aux_hidden_state_layer_ids": aux, "num_aux_hidden_states": len(aux)}


# vLLM 0.26's DSpark loader sizes a speculators DSpark draft's fc by its own draft layers, not by the target layers it
# reads. Its speculators reader (transformers_utils/configs/speculators/algos.py, update_dspark) builds the draft's
# HF config from `transformer_layer_config` and puts `target_layer_ids = [i - 1 for i in aux_layer_ids]` at its top;
# the DFlash backbone DSpark reuses (model_executor/models/qwen3_dflash.py, DFlashQwen3Model.__init__) counts the fc's
# input features from `eagle_config` + `dflash_config` only:
#     drafter_config = getattr(self.config, "eagle_config", {})
#     drafter_config.update(getattr(self.config, "dflash_config", {}))
#     num_features_to_use = self.config.num_hidden_layers
#     if "target_layer_ids" in drafter_config: num_features_to_use = len(drafter_config["target_layer_ids"])
# so a one-layer draft reading three layers got an fc of hidden x hidden and failed at weight load ("Tried to load
# weights of size [576, 1728] to a parameter of size [576, 576]", SmolLM2-135M on the lent H100). speculators writes
# no dflash_config; draftline writes one inside transformer_layer_config, which vLLM copies into the HF config as
# is, holding only `target_layer_ids` in vLLM's own i - 1 numbering. It changes nothing on 0.32 and 0.33: their fc
# is sized from the auxiliary layers (_get_dflash_fc_input_size, get_eagle3_aux_layers_from_config, which reads
# `eagle_aux_hidden_state_layer_ids` first, set by update_dspark); `dflash_config.target_layer_ids` is read there
# only by the Qwen3-Omni DSpark check (config/speculative.py), with the same values as the top-level key; the keys
# of dflash_config that steer a DFlash/DSpark draft (causal, use_swa, swa_window_size, attention_sink_bias,
# attention_value_scale, mask_token_id, use_aux_hidden_state, sample_from_anchor) stay unset, so each falls back
# to what it was without the block (tests/unit/train/test_heads.py reads vLLM 0.32's own functions on both configs).


def dspark_vllm_config(conf: dict[str, Any]) -> dict[str, Any]:
    """A DSpark draft's config.json (speculators' `conf`) with the `dflash_config` vLLM 0.26 sizes its fc from
    (see above): `transformer_layer_config.dflash_config.target_layer_ids`, the auxiliary layers minus one."""
    layer = dict(conf["transformer_layer_config"])
    layer["dflash_config"] = {**(layer.get("dflash_config") or {}),
                              "target_layer_ids": [int(i) - 1 for i in conf["aux_hidden_state_layer_ids"]]}
    return {**conf, "transformer_layer_config": layer}


def draft_layer(conf: dict[str, Any]) -> dict[str, Any]:
    """A draft's decoder layer config: speculators' transformer_layer_config, or the config itself for an MLA
    draft (flat, `mla_draft_config`)."""
    return conf.get("transformer_layer_config") or conf


def draft_kind(conf: dict[str, Any]) -> str | None:
    """The train.heads kind a draft's config.json was written by: its speculators_model_type (dflash, dspark),
    and for an EAGLE-3 draft eagle3-mla (MLA keys), eagle3.1 (per-layer fc_norm) or eagle3; None if not a draft."""
    algo = conf.get("speculators_model_type")
    if algo != "eagle3":
        return algo
    return "eagle3-mla" if draft_layer(conf).get("kv_lora_rank") else "eagle3.1" if conf.get("fc_norm") else "eagle3"


# A warm start copies a draft's weights into a head of the same kind: the EAGLE-3 kinds, whose Eagle3DraftModel
# names its weights as the exported draft does. DFlash and DSpark heads start fresh.
WARM_START_KINDS = ("eagle3", "eagle3.1", "eagle3-mla")


def warm_start_problem(conf: dict[str, Any], kind: str, label: str | None = None) -> str | None:
    """Why the draft `conf` cannot seed a head of `kind` (None if its kind allows it)."""
    head = f"head {label!r} ({kind})" if label else f"this head ({kind})"
    if kind not in WARM_START_KINDS:
        return (f"{head} cannot start from a draft: a warm start seeds {', '.join(WARM_START_KINDS)} heads only; "
                "remove train.init_from or train that head in a run without it")
    theirs = draft_kind(conf)
    if theirs != kind:
        fix = (f"set the head's kind: {theirs}, or give an {kind} draft" if theirs in WARM_START_KINDS
               else f"give an {kind} draft")
        return (f"the draft's kind is {theirs or 'unknown (no speculators_model_type)'}, {head} is another: a "
                f"warm start needs a draft of the head's own kind ({fix})")
    return None


def layer_ids_of(conf: dict[str, Any]) -> list[int] | None:
    ids = conf.get("eagle_aux_hidden_state_layer_ids") or conf.get("aux_hidden_state_layer_ids")
    return list(ids) if ids else None


# =========================================================================== warm start (train.init_from)

def check_compatible(conf: dict[str, Any], spec: str, *, hidden: int, vocab: int, layer_ids: list[int],
                     num_layers: int, kind: str) -> None:
    """Refuse, with the reason, a draft whose weights cannot seed this run's: another hidden size or target
    vocabulary (another target), another depth, other auxiliary layers (its fc reads other hidden states),
    another architecture."""
    problems = []
    wrong_kind = warm_start_problem(conf, kind)
    if wrong_kind:
        problems.append(wrong_kind)
    layer = draft_layer(conf)
    if layer.get("hidden_size") != hidden:
        problems.append(f"its hidden size is {layer.get('hidden_size')}, the target's {hidden}: it was trained "
                        "for another target model")
    if layer.get("vocab_size") != vocab:
        problems.append(f"it maps a {layer.get('vocab_size')}-token target vocabulary, the target has {vocab}: "
                        "it was trained for another target model (another tokenizer)")
    if layer.get("num_hidden_layers") != num_layers:
        problems.append(f"it has {layer.get('num_hidden_layers')} decoder layer(s), this run trains "
                        f"{num_layers}: set train.num_layers: {layer.get('num_hidden_layers')}")
    theirs = layer_ids_of(conf)
    if theirs != list(layer_ids[:-1]):
        problems.append(f"it reads target layers {theirs}, this run feeds {list(layer_ids[:-1])}: its fc weights "
                        f"belong to those layers; set extract.layer_ids: {(theirs or []) + [layer_ids[-1]]}")
    if problems:
        raise DraftError(f"train.init_from {spec!r} cannot seed this draft: " + "; ".join(problems))


def remap_rows(old_d2t: Any, old_t2d: Any, new_d2t: Any, vocab: int) -> tuple[Any, Any]:
    """For each row of the new draft vocabulary: the row of the old one holding the same target token (or
    -1). A draft without maps (draft vocabulary = target vocabulary) maps row i to token i."""
    import torch

    def tokens(d2t: Any, size: int) -> Any:
        return torch.arange(size, dtype=torch.long) + (d2t.long() if d2t is not None else 0)

    new_tokens = tokens(new_d2t, int(new_d2t.shape[0]) if new_d2t is not None else vocab)
    old_size = int(old_d2t.shape[0]) if old_d2t is not None else vocab
    old_row = torch.full((vocab,), -1, dtype=torch.long)
    old_row[tokens(old_d2t, old_size)] = torch.arange(old_size, dtype=torch.long)
    rows = old_row[new_tokens]
    return rows, new_tokens


def warm_start(model: Any, spec: str, *, layer_ids: list[int], kind: str, num_layers: int) -> dict[str, Any]:
    """Load the draft `spec` names into `model` (built for this run: its d2t/t2d, the target's verifier
    weights), after `check_compatible`. Every draft weight of the same name and shape is copied. The vocabulary
    maps stay this run's: with the same maps lm_head is copied whole; with another draft vocabulary the rows of
    tokens in both are copied and the rest keep a fresh draft's values (the target's lm_head rows). Returns
    what was done, for the logs and the train artifact's stats."""
    import torch
    from safetensors.torch import load_file

    folder = draft_folder_of(spec)
    conf = read_config(folder)
    check_compatible(conf, spec, hidden=int(model.hidden_size), vocab=int(model.verifier_vocab_size),
                     layer_ids=layer_ids, num_layers=num_layers, kind=kind)
    theirs = load_file(os.path.join(folder, "model.safetensors"))
    old_d2t, old_t2d = theirs.pop("d2t", None), theirs.pop("t2d", None)
    own = dict(model.named_parameters())
    frozen_from_target = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight", "lm_head.weight"}
    wanted = [n for n in own if n not in frozen_from_target]
    missing = [n for n in wanted if n not in theirs]
    wrong = [f"{n} {list(theirs[n].shape)} vs {list(own[n].shape)}" for n in wanted
             if n in theirs and tuple(theirs[n].shape) != tuple(own[n].shape)]
    if missing or wrong:
        raise DraftError(f"train.init_from {spec!r} cannot seed this draft: "
                         + (f"it lacks {missing[:6]} (another EAGLE-3 variant: norms before the fc differ, check "
                            "train.heads' kind)" if missing else "")
                         + ("; " if missing and wrong else "") + (f"shapes differ: {wrong[:6]}" if wrong else ""))
    vocab = int(model.verifier_vocab_size)
    new_d2t = model.d2t.detach().cpu() if model.use_draft_vocab else None
    rows, _ = remap_rows(old_d2t, old_t2d, new_d2t, vocab)
    same_maps = (old_d2t is None and new_d2t is None) or (
        old_d2t is not None and new_d2t is not None and old_d2t.shape == new_d2t.shape
        and bool(torch.equal(old_d2t.long(), new_d2t.long())))
    with torch.no_grad():
        for n in wanted:
            own[n].copy_(theirs[n].to(own[n].dtype))
        if "lm_head.weight" in theirs:
            lm = theirs["lm_head.weight"].to(model.lm_head.weight.dtype)
            hit = rows >= 0
            model.lm_head.weight[hit.to(lm.device)] = lm[rows[hit]].to(model.lm_head.weight.device)
    kept = int((rows >= 0).sum())
    size = int(rows.shape[0])
    return {"source": spec, "digest": content_digest(spec), "weights": len(wanted),
            "vocab": "same" if same_maps else "remapped", "draft_vocab_rows_copied": kept,
            "draft_vocab_size": size,
            "note": ("the same draft vocabulary: every weight copied" if same_maps else
                     f"another draft vocabulary: lm_head rows of the {kept} of {size} tokens in both copied, "
                     f"the other {size - kept} initialised as a fresh draft's (the target's lm_head rows)")}
