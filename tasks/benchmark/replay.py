"""The benchmark's offline replay: the draft run on the baseline's own greedy outputs with hidden states
from the extraction engine, to separate what the draft predicts from what vLLM's speculation realises.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from tasks.core.errors import DraftlineError
from tasks.core.config import RunConfig
from tasks.engine.process import engine_dtype
from tasks.engine.settings import on_gpu_here


class ReplayError(DraftlineError, ValueError):
    """The draft cannot be replayed offline (the benchmark records the error and goes on)."""

def chain_lengths(preds: list[list[int]], seq: list[int], k: int) -> list[int]:
    """Tokens a draft started at t would get accepted, for every t (greedy verification).

    A draft started at t sees the hidden state of position t and token seq[t+1] (what vLLM gives
    the draft right after the target produced seq[t+1]); step j proposes seq[t+2+j]. `preds[j][t]`
    is step j's proposal in target ids; acceptance stops at the first wrong step.
    """
    out = []
    n = len(seq)
    for t in range(n - 2):
        a = 0
        while a < k and t + 2 + a < n and preds[a][t] == seq[t + 2 + a]:
            a += 1
        out.append(a)
    return out


def walk(chain: list[int], first: int) -> list[tuple[int, int]]:
    """(start, accepted tokens) of every draft when drafts start where vLLM starts them: at `first` (the first
    output token), then after every accepted run plus its bonus token."""
    out = []
    t = first
    while t < len(chain):
        out.append((t, chain[t]))
        t += chain[t] + 1
    return out


def replay(chain: list[int], first: int) -> tuple[int, int]:
    """(drafts, accepted tokens) of `walk`."""
    steps = walk(chain, first)
    return len(steps), sum(a for _, a in steps)


def same_steps(chain: list[int], first: int, seq_len: int, k: int, measured: list[int]) -> bool:
    """Whether vLLM accepted, draft by draft, what the draft replayed offline predicts on the same greedy text:
    every draft with room for all k tokens before the text ends (vLLM may cap the last ones at max_tokens)."""
    full = [(t, a) for t, a in walk(chain, first) if t + k + 1 < seq_len]
    return len(measured) >= len(full) and all(a == b for (_, a), b in zip(full, measured))


def position_average(chains: list[tuple[list[int], int]], k: int) -> dict[str, Any]:
    """Acceptance if a draft started at EVERY output position (what a validation average measures)."""
    starts = [a for chain, first in chains for a in chain[first:]]
    if not starts:
        return {"mean_acceptance_length": None, "per_position_acceptance": [], "starts": 0}
    return {"mean_acceptance_length": 1.0 + sum(starts) / len(starts),
            "per_position_acceptance": [sum(1 for a in starts if a > j) / len(starts) for j in range(k)],
            "starts": len(starts)}


def replay_average(chains: list[tuple[list[int], int]]) -> dict[str, Any]:
    drafts = accepted = 0
    for chain, first in chains:
        d, a = replay(chain, first)
        drafts += d
        accepted += a
    return {"mean_acceptance_length": 1.0 + accepted / drafts if drafts else None, "drafts": drafts}


def load_draft_for_replay(draft_dir: str, model_path: str, dtype: str) -> tuple[Any, Any]:
    """(Eagle3DraftModel on CPU/GPU in eval mode, d2t offsets or None) from an exported draft folder."""
    import torch
    from safetensors.torch import load_file
    from speculators.models.eagle3.config import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    conf = Eagle3SpeculatorConfig.from_pretrained(draft_dir)
    conf.transformer_layer_config._attn_implementation = "sdpa"  # flex attention is GPU-oriented
    model = Eagle3DraftModel(conf)
    state = load_file(str(Path(draft_dir, "model.safetensors")))
    missing, _ = model.load_state_dict(state, strict=False)
    if "embed_tokens.weight" in missing:  # a draft that borrows the verifier's embeddings
        from tasks.engine.target import load_verifier_weights

        tie = bool(getattr(conf.transformer_layer_config, "tie_word_embeddings", False))
        model.embed_tokens.weight.data.copy_(load_verifier_weights(model_path, tie)["embed_tokens"])
    needed = [m for m in missing if not m.startswith(("verifier_", "embed_tokens"))]
    if needed:
        raise ReplayError(f"{draft_dir}/model.safetensors lacks {needed[:5]}: not a complete EAGLE-3 draft")
    # float16 matmuls are slow or missing on CPUs; bfloat16 mirrors what vLLM runs
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float32, "float32": torch.float32}[dtype]
    model = model.to(torch_dtype).eval()
    d2t = state.get("d2t")
    return model, d2t


def draft_predictions(model: Any, d2t: Any, hidden: Any, seq: list[int], k: int) -> list[list[int]]:
    """Step j's proposal (target ids) for a draft started at every position, teacher-forced."""
    import torch

    n = len(seq)
    dtype = next(model.parameters()).dtype
    hs = hidden[:-1].reshape(1, n - 1, -1).to(dtype)
    ids = torch.tensor(seq[1:], dtype=torch.long).unsqueeze(0)
    with torch.inference_mode():
        steps = model(hidden_states=hs, input_ids=ids, document_ids=torch.zeros_like(ids),
                      position_ids=torch.arange(1, n, dtype=torch.long).unsqueeze(0), ttt_steps=k)
    out = []
    for d in steps:
        d = d.reshape(-1).to(torch.long)
        if d2t is not None:
            d = d + d2t.to(torch.long)[d]
        out.append(d.tolist())
    return out


def offline_replay(cfg: RunConfig, model_path: str, draft_dir: str, draft_info: dict[str, Any],
                   evals: list[Any], outputs: dict[str, list[list[int]]],
                   log: Callable[[str], None] | None = None,
                   measured: dict[str, dict[int, Any]] | None = None) -> dict[str, Any]:
    """Replay the draft on the baseline's greedy outputs (hidden states from transformers).

    Per eval and k: the position-averaged acceptance length (the quantity a validation accuracy
    estimates, here on the eval's own text) and the replayed one (drafts started where vLLM starts
    them), to set beside vLLM's measured figure. `measured`: per eval and k, vLLM's run at the same batch size;
    where it gave per-request verify steps (`RunResult.spec_steps`), `same_steps_as_vllm` counts the requests
    whose greedy text equals the baseline's and whose every draft vLLM accepted exactly as the replay predicts
    (the served draft proposes what the training-side model proposes), of `compared`.
    """
    from tasks.engine.settings import engine_for_group, gpu_groups
    from tasks.engine.target import load_hf_config, resolve_layer_ids

    t0 = time.time()
    layer_ids = resolve_layer_ids(cfg, load_hf_config(cfg.target, model_path))
    aux = len(layer_ids) - 1
    seqs: dict[str, list[list[int]]] = {ev.name: [p + o for p, o in zip(ev.prompts, outputs[ev.name])]
                                        for ev in evals}
    hidden: dict[str, list[Any]] = {}
    # The extract stage's engine (same layer semantics as the training data), on the chosen backend.
    group = gpu_groups(cfg)[0]
    backend = cfg.benchmark.replay_backend
    if backend == "auto":
        backend = cfg.extract.backend if group else "transformers"
    ecfg = cfg
    if backend != cfg.extract.backend:
        ecfg = cfg.model_copy(deep=True)
        ecfg.extract.backend = backend
    say = log or (lambda msg: None)
    say(f"benchmark: offline replay, hidden states from {backend}")
    with engine_for_group(ecfg, model_path, group) as eng:
        for name, ss in seqs.items():
            hidden[name] = [h[:, :aux] for h in eng.extract(ss, layer_ids)]
    model, d2t = load_draft_for_replay(draft_dir, model_path, engine_dtype(cfg.target.dtype, on_gpu=on_gpu_here()))
    kmax = max(cfg.benchmark.num_speculative_tokens)
    out: dict[str, Any] = {}
    for ev in evals:
        chains_by_k: dict[int, list[tuple[list[int], int]]] = {k: [] for k in cfg.benchmark.num_speculative_tokens}
        agree = {k: [0, 0] for k in chains_by_k}  # k -> [same steps, compared]
        for i, (prompt, seq, hs) in enumerate(zip(ev.prompts, seqs[ev.name], hidden[ev.name])):
            if len(seq) - len(prompt) < 2:
                continue
            preds = draft_predictions(model, d2t, hs, seq, kmax)
            for k in chains_by_k:
                chains_by_k[k].append((chain_lengths(preds, seq, k), len(prompt) - 1))
                run = (measured or {}).get(ev.name, {}).get(k)
                if run is not None and i < len(run.spec_steps) and run.spec_steps[i] is not None \
                        and run.outputs[i] == outputs[ev.name][i]:
                    agree[k][1] += 1
                    agree[k][0] += same_steps(*chains_by_k[k][-1], len(seq), k, run.spec_steps[i])
        out[ev.name] = {}
        for k, chains in chains_by_k.items():
            pos = position_average(chains, k)
            rep = replay_average(chains)
            out[ev.name][str(k)] = {"position_average": pos["mean_acceptance_length"],
                                    "position_average_per_position": pos["per_position_acceptance"],
                                    "replayed": rep["mean_acceptance_length"], "replayed_drafts": rep["drafts"],
                                    "starts": pos["starts"]}
            if agree[k][1]:
                out[ev.name][str(k)].update(same_steps_as_vllm=agree[k][0], compared=agree[k][1])
    say(f"benchmark: offline replay in {time.time() - t0:.1f}s")
    return {"by_eval": out, "seconds": round(time.time() - t0, 1), "backend": backend}
