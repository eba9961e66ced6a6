"""Extraction-like data for training tests and benchmarks, without the extract stage.

A target runs under transformers with forward hooks: aux layer id k = output of
decoder layer k-1 (`hidden_states[k]`), the last slot = the last decoder layer's
output BEFORE the final norm. Parts and manifests follow docs/ARTIFACTS.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as st_save

from tasks.core.config import RunConfig
from tasks.core.digest import VERSIONS, stage_digest
from tasks.store.artifacts import ArtifactRef, Store


def make_tiny_target(folder: str | Path, layers: int = 4, hidden: int = 64, vocab: int = 256,
                     arch: str = "llama", seed: int = 0) -> str:
    """A random-init decoder saved as a HF folder (config.json + model.safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls_cfg, cls_model = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    cfg = cls_cfg(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = cls_model(cfg)
    model.save_pretrained(str(folder))
    return str(folder)


@torch.no_grad()
def generate_samples(model_path: str, n: int, prompt_len: int = 8, new_tokens: int = 24, seed: int = 0,
                     prompts: list[list[int]] | None = None) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) pairs: a prompt (mask 0) and the target's own greedy answer (mask 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = prompts[i] if prompts else rng.integers(3, vocab, size=prompt_len).tolist()
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=None)[0].tolist()
        out.append((gen, [0] * len(prompt) + [1] * (len(gen) - len(prompt))))
    return out


@torch.no_grad()
def hidden_states(model, ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """[T, L, H] bf16: hidden_states[k] for the aux ids, the last layer's pre-norm output last."""
    captured = {}
    last_layer = model.model.layers[len(model.model.layers) - 1]

    def hook(_m, _inp, output):
        captured["last"] = output[0] if isinstance(output, tuple) else output

    handle = last_layer.register_forward_hook(hook)
    try:
        out = model(torch.tensor([ids], device=model.device), output_hidden_states=True)
    finally:
        handle.remove()
    slots = [out.hidden_states[k][0] for k in layer_ids[:-1]] + [captured["last"][0]]
    return torch.stack(slots, dim=1).to(torch.bfloat16).cpu()


def write_extract(store: Store, model_path: str, samples: list[tuple[list[int], list[int]]], layer_ids: list[int],
                  shards: int = 2, part_samples: int = 4, tag: str = "test", device: str = "cpu",
                  dtype: torch.dtype = torch.float32) -> list[ArtifactRef]:
    """One extract artifact per shard (samples dealt round-robin), parts of `part_samples` samples."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    hidden = model.config.hidden_size
    refs = []
    for shard in range(shards):
        mine = samples[shard::shards]
        digest = stage_digest("extract", {"tag": tag, "layer_ids": layer_ids}, {"shard": str(shard)})
        with store.write("extract", digest, VERSIONS["extract"], {"shard": str(shard)}) as w:
            parts, tokens = [], 0
            for p in range(0, len(mine), part_samples):
                chunk = mine[p:p + part_samples]
                hs = [hidden_states(model, ids, layer_ids) for ids, _ in chunk]
                lengths = [len(ids) for ids, _ in chunk]
                offsets = torch.zeros(len(chunk) + 1, dtype=torch.int64)
                offsets[1:] = torch.tensor(lengths).cumsum(0)
                name = f"part-{p // part_samples:05d}.safetensors"
                sample_ids = [f"s{shard}-{p + i}" for i in range(len(chunk))]
                w.write_bytes(name, st_save({
                    "hidden_states": torch.cat(hs), "offsets": offsets,
                    "input_ids": torch.tensor([t for ids, _ in chunk for t in ids], dtype=torch.int32),
                    "loss_mask": torch.tensor([m for _, mask in chunk for m in mask], dtype=torch.uint8),
                }, metadata={"sample_ids": json.dumps(sample_ids), "layer_ids": json.dumps(layer_ids),
                             "storage_dtype": "bf16", "hidden_size": str(hidden)}))
                parts.append({"name": name, "tokens": sum(lengths)})
                tokens += sum(lengths)
            art = w.commit({"shard": shard, "samples": len(mine), "tokens": tokens, "layer_ids": layer_ids,
                            "hidden_size": hidden, "storage_dtype": "bf16", "parts": parts})
        refs.append(art.ref())
    return refs


def write_vocab(store: Store, samples: list[tuple[list[int], list[int]]], vocab: int, k: int,
                tag: str = "test") -> ArtifactRef:
    """Top-k masked tokens (ties by id), d2t as offsets, t2d as a mask; the vocab stage's layout."""
    counts = np.zeros(vocab, dtype=np.int64)
    for ids, mask in samples:
        for t, m in zip(ids, mask):
            counts[t] += m
    chosen = np.sort(np.lexsort((np.arange(vocab), -counts))[:k])
    d2t = chosen - np.arange(k)
    t2d = np.zeros(vocab, dtype=bool)
    t2d[chosen] = True
    digest = stage_digest("vocab", {"tag": tag, "k": k}, {})
    with store.write("vocab", digest, VERSIONS["vocab"], {}) as w:
        w.write_bytes("vocab.safetensors", st_save({"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d),
                                                    "token_counts": torch.from_numpy(counts)}))
        art = w.commit({"draft_vocab_size": k, "target_vocab_size": vocab})
    return art.ref()


def extract_stage(store: Store, refs: list[ArtifactRef]) -> ArtifactRef:
    """The extract stage's artifact naming the shard artifacts REFS (what `run_train` takes), committed as the
    flow commits it (tasks/extract/stage.py assemble_extract)."""
    from tasks.core.config import RunConfig
    from tasks.extract.stage import assemble_extract

    return assemble_extract(RunConfig(), store, refs, time.time(), 0)


def tiny_chat_run(tmp_path: Path, **sections: dict) -> tuple[Store, RunConfig]:
    """Twelve short chats as a JSONL source, a file:// store under TMP_PATH, and a config of 2 shards that
    prepares them (SECTIONS: whole config sections to add, e.g. regenerate={"enabled": False})."""
    src = Path(tmp_path) / "chats.jsonl"
    src.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                                      {"role": "assistant", "content": f"It is {2 * i}."}]})
                             for i in range(12)))
    store = Store(f"file://{tmp_path}/store")
    cfg = RunConfig.model_validate({"store": {"uri": store.uri}, "target": {"max_model_len": 256}, **sections,
                                    "data": {"sources": [{"path": str(src)}], "heldout": 2, "num_shards": 2,
                                             "max_length": 256}})
    return store, cfg
