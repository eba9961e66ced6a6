"""Hidden states that prove themselves: each extraction shard checks, on a sample of positions of every part it
writes, that the target's own final norm and lm_head over the STORED last layer (as a reader gets it: bf16, fp8
dequantized) give the engine's own next token (its greedy choice after the whole prompt: vLLM's one sampled token
at temperature 0, the transformers engine's argmax of its own logits). A shard whose agreement is confidently
below `extract.verify_min_agreement` is not committed: a wrong layer id, a wrapper's layer offset, a norm applied
twice or values cut on the way reproduce the target's choice far less often than the storage rounding does.

The verdict does not depend on how many positions a shard has (so not on data.num_shards): a shard fails only
when the Wilson upper bound of its top-1 agreement, at `extract.verify_confidence` (one-sided), is below the
threshold. A large shard then decides alone as the bare figure would (at 64 positions a bad extraction's bound is
far below it); a small one cannot be failed by one unlucky position (4 of 5 agree: the bound is 98%), and one of
fewer than MIN_ALONE positions is decided only with the others: the stage's artifact is assembled only when the bound of the agreement pooled over every
shard reaches the threshold (`pooled_failure`). No position is checked beyond those sampled before: the bound
costs nothing on the GPU nodes.

Recorded in the shard's manifest (`verify`): positions checked, top-1 agreement, and the mean logit gap (the
reconstructed logit of the reconstruction's argmax minus that of the engine's token: 0 where they agree, the
divergence's size where they do not). The norm and lm_head are training's own (tasks/engine/target.py
`VerifierHead`: speculators' norm class, the target's weights).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

from tasks.extract.shards import ExtractError


DEFAULT_CONFIDENCE = 0.999  # extract.verify_confidence's default (tasks/core/config.py)
# Fewer checked positions than this and a shard is judged only pooled with the others: at 2 positions, a correct
# extraction agreeing at 94% misses both in 1 shard of 280, and a run of many tiny shards would meet that.
MIN_ALONE = 8

_heads: dict[str, Any] = {}
_heads_lock = threading.Lock()


def verifier_head(model_path: str, hf_config: Any) -> Any:
    """The target's norm and lm_head, loaded once per process (every shard of every engine group shares it)."""
    with _heads_lock:
        if model_path not in _heads:
            from tasks.engine.target import VerifierHead

            _heads.clear()  # one target per run: a 1T target's lm_head is 2.3 GB
            _heads[model_path] = VerifierHead(model_path, hf_config)
        return _heads[model_path]


def sample_rows(n: int, k: int) -> list[int]:
    """Up to k of n indices, spread evenly over them (first and last included)."""
    if k <= 0 or n <= 0:
        return []
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)}) if k > 1 else [n - 1]


def upper_bound(agree: int, positions: int, confidence: float) -> float:
    """The Wilson score upper bound of a proportion agree/positions at one-sided CONFIDENCE: the highest true
    agreement the sample leaves plausible. 1.0 with no positions (nothing speaks against the states)."""
    if positions <= 0:
        return 1.0
    from statistics import NormalDist

    z = NormalDist().inv_cdf(confidence)
    p, n = agree / positions, positions
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z * z / n))


def refuses(agree: int, positions: int, threshold: float, confidence: float) -> bool:
    """The check's verdict on AGREE of POSITIONS: the agreement is confidently below THRESHOLD."""
    return positions > 0 and upper_bound(agree, positions, confidence) < threshold


@dataclass
class StateCheck:
    """The check of one shard: fed every part (`add_part`) before it is written; `failure`/`stats` score what
    is still pending."""

    head: Any
    positions_per_part: int
    threshold: float
    confidence: float = DEFAULT_CONFIDENCE
    positions: int = 0
    agree: int = 0
    gap_sum: float = 0.0
    seconds: float = 0.0  # summed over the part writers' threads it runs on
    parts: list[dict[str, Any]] = field(default_factory=list)
    lock: Any = field(default_factory=threading.Lock, repr=False)
    batch_rows: int = 512  # rows scored per lm_head pass (their float32 logits: 512 x V x 4 bytes)
    _pending: list[tuple[Any, Any]] = field(default_factory=list, repr=False)  # (stored rows, engine tokens) per part
    _pending_rows: int = 0

    def add_part(self, buf: Any) -> None:
        """Take one part's sampled rows for the check (on a part writer's thread, before the part is written;
        thread-safe). The rows are copied out (the buffer is reused once written) and scored `batch_rows` at a
        time: each pass of the lm_head converts all of it to float32 (2.1 GB for an 8B target's, ~1.4 s on 2
        cores), which once per part held the part writers up more than the writes did (benchmarks/RESULTS.md,
        bench_stagewrite)."""
        import time

        import torch

        t0 = time.monotonic()
        have = [i for i, t in enumerate(buf.next_tokens) if t is not None]
        pick = [have[i] for i in sample_rows(len(have), self.positions_per_part)]
        if not pick:
            return
        ends = torch.tensor(buf.lengths, dtype=torch.long).cumsum(0) - 1  # each sample's last token row
        rows = [int(ends[i]) for i in pick]
        want = torch.tensor([int(buf.next_tokens[i]) for i in pick], dtype=torch.long)
        stored = buf.stored_rows(rows, slot=-1).clone()  # a copy: the buffer is refilled after its write
        with self.lock:
            self._pending.append((stored, want))
            self._pending_rows += len(pick)
            self.seconds += time.monotonic() - t0
            full = self._pending_rows >= self.batch_rows
        if full:
            self.flush()

    def flush(self) -> None:
        """Score the rows taken so far: one lm_head pass over all of them, each part's figures kept apart."""
        import time

        import torch

        with self.lock:
            batch, self._pending, self._pending_rows = self._pending, [], 0
        if not batch:
            return
        t0 = time.monotonic()
        logits = self.head.logits(torch.cat([h for h, _ in batch]))
        want_all = torch.cat([w for _, w in batch])
        if int(want_all.max()) >= logits.shape[1]:
            raise ExtractError(f"the engine's next token {int(want_all.max())} is outside the target's lm_head of "
                               f"{logits.shape[1]} rows: the engine runs another model than target.model")
        results, a = [], 0
        for _, want in batch:
            part = logits[a:a + len(want)]
            a += len(want)
            top = part.argmax(-1)
            gap = float((part.gather(1, top[:, None]) - part.gather(1, want[:, None])).sum())
            results.append((len(want), int((top == want).sum()), gap))
        with self.lock:
            for n, agree, gap in results:
                self.positions += n
                self.agree += agree
                self.gap_sum += gap
                self.parts.append({"positions": n, "agreement": round(agree / n, 4)})
            self.seconds += time.monotonic() - t0

    def stats(self) -> dict[str, Any]:
        self.flush()
        return {"positions": self.positions, "agree": self.agree,
                "top1_agreement": round(self.agree / self.positions, 4) if self.positions else None,
                "upper_bound": round(upper_bound(self.agree, self.positions, self.confidence), 4),
                "confidence": self.confidence,
                "mean_logit_gap": round(self.gap_sum / self.positions, 4) if self.positions else None,
                "threshold": self.threshold, "min_part_agreement": min((p["agreement"] for p in self.parts),
                                                                       default=None),
                "seconds": round(self.seconds, 3)}

    def failure(self, shard: int, layer_ids: list[int], storage_dtype: str, layers: str | None) -> str | None:
        """The error of a shard confidently below the threshold, naming the likely causes; None when it passes."""
        self.flush()
        if self.positions < MIN_ALONE or not refuses(self.agree, self.positions, self.threshold, self.confidence):
            return None
        st = self.stats()
        return (f"extract shard {shard}: " + _refusal(st, layer_ids[-1], layers)
                + f" (mean logit gap {st['mean_logit_gap']:.3f}). Nothing was committed. " + causes(layer_ids,
                                                                                                 storage_dtype))


def _refusal(v: dict[str, Any], last: int | None, layers: str | None) -> str:
    where = f" (the engine hooked {layers})" if layers else ""
    return (f"the stored hidden states do not reproduce the target's own next token: the target's final norm and "
            f"lm_head over the stored last layer" + (f" (id {last})" if last is not None else "")
            + f"{where} agree with the engine's greedy choice at {v['top1_agreement']:.1%} of {v['positions']} "
            f"checked positions: at most {v['upper_bound']:.1%} at {v['confidence']:.1%} confidence, below the "
            f"threshold {v['threshold']:.0%} (extract.verify_min_agreement)")


def causes(layer_ids: list[int] | None, storage_dtype: str | None) -> str:
    """The likely causes of a refused extraction, and what to fix."""
    return (f"Likely causes: the layer ids (the last id must be num_hidden_layers = the last decoder layer's output "
            f"BEFORE the final norm; extract.layer_ids {layer_ids}); a wrapper's layer offset (a multimodal wrapper's "
            f"decoder layers counted from the wrong module); the norm (states stored after the final norm, so "
            f"it is applied twice, or a norm missing); the dtype (values cut or saturated on the way: storage_dtype "
            f"{storage_dtype}, the engine's dtype). Fix the extraction, not the threshold.")


def summarize(shard_stats: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run's figure over its extraction shards (the summary's `verified`): shards checked, positions, the
    pooled top-1 agreement and its upper bound (what `pooled_failure` judges), the lowest shard's, the mean logit
    gap; None when no shard was checked."""
    checked = [s["verify"] for s in shard_stats if (s.get("verify") or {}).get("positions")]
    if not checked:
        return None
    positions = sum(v["positions"] for v in checked)
    # a shard checked before the bound existed recorded its agreement only (rounded to 4 places: exact back)
    agree = sum(int(v.get("agree", round(v["top1_agreement"] * v["positions"]))) for v in checked)
    confidence = max(float(v.get("confidence", DEFAULT_CONFIDENCE)) for v in checked)
    return {"shards": len(checked), "unchecked": len(shard_stats) - len(checked), "positions": positions,
            "agree": agree, "top1_agreement": round(agree / positions, 4),
            "upper_bound": round(upper_bound(agree, positions, confidence), 4), "confidence": confidence,
            "min_shard_agreement": min(v["top1_agreement"] for v in checked),
            "mean_logit_gap": round(sum(v["mean_logit_gap"] * v["positions"] for v in checked) / positions, 4),
            "threshold": max(v["threshold"] for v in checked)}


def pooled_failure(verified: dict[str, Any] | None, layer_ids: list[int] | None = None,
                   storage_dtype: str | None = None) -> str | None:
    """The stage's verdict over every shard (`summarize`'s figure): the error when the pooled agreement is
    confidently below the threshold, None when it is not. Shards too small to be failed alone (a few positions
    each: many shards of little data) are judged here, together, before anything trains on them."""
    if not verified or not refuses(verified["agree"], verified["positions"], verified["threshold"],
                                   verified["confidence"]):
        return None
    last = layer_ids[-1] if layer_ids else None
    return (f"the extract stage over its {verified['shards']} shard(s): " + _refusal(verified, last, None)
            + f", pooled over every shard (each too small to be refused alone; lowest shard "
            f"{verified['min_shard_agreement']:.1%}). The stage's artifact was not assembled, so nothing trains on "
            "them. " + causes(layer_ids, storage_dtype))


def summary_line(v: dict[str, Any]) -> str:
    return (f"{v['shards']} shard(s) verified: the target's norm and lm_head over the stored last layer give the "
            f"engine's next token at {v['top1_agreement']:.1%} of {v['positions']} positions (lowest shard "
            f"{v['min_shard_agreement']:.1%}, threshold {v['threshold']:.0%}"
            + (f", upper bound {v['upper_bound']:.1%}" if "upper_bound" in v else "")
            + f", mean logit gap {v['mean_logit_gap']:.3f})"
            + (f"; {v['unchecked']} shard(s) stored without the check" if v["unchecked"] else ""))


def markdown(shard_stats: list[dict[str, Any]], errors: list[str]) -> str:
    """The Prefect UI's view (the extract stage's markdown artifact): a row per shard, then the refused ones."""
    lines = ["# Extraction check: stored hidden states against the engine's next token", "",
             "The target's own final norm and lm_head over each shard's stored last layer (fp8 dequantized), on a "
             "sample of positions of every part, against the engine's greedy next token "
             "(tasks/extract/verify.py; threshold: `extract.verify_min_agreement`).", "",
             "| shard | positions | top-1 agreement | upper bound | lowest part | mean logit gap | threshold |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for s in sorted(shard_stats, key=lambda s: int(s.get("shard", 0))):
        v = s.get("verify") or {}
        if v.get("positions"):
            bound = f"{v['upper_bound']:.1%}" if "upper_bound" in v else ""
            lines.append(f"| {s.get('shard')} | {v['positions']} | {v['top1_agreement']:.1%} | {bound} | "
                         f"{v['min_part_agreement']:.1%} | {v['mean_logit_gap']:.3f} | {v['threshold']:.0%} |")
        else:
            lines.append(f"| {s.get('shard')} | 0 | not checked: {v.get('skipped', 'stored before the check')} | | | | |")
    refused = [e for e in errors if "do not reproduce the target's own next token" in e]
    if refused:
        lines += ["", f"## {len(refused)} shard(s) refused (not committed)", ""] + [f"- {e}" for e in refused]
    return "\n".join(lines) + "\n"
