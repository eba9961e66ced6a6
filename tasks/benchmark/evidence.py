"""One verdict before the money is spent: the evidence a store holds that a trained draft is what it claims
(`draftline check`). Read from the manifests of the draft's own inputs, nothing recomputed:

- states: every extraction shard's self-check (tasks/extract/verify.py: the target's final norm and lm_head over
  the stored last layer against the engine's own next token), shard by shard;
- maps: the vocab artifact's d2t/t2d consistent with each other and with the token counts they were chosen from,
  and the draft's own maps equal to them byte for byte;
- coverage: the share of the training answers' tokens, and of the held-out split's, inside the draft vocabulary
  (a token outside it can never be proposed: it bounds acceptance), and of the target's output on each benchmark eval;
- lengths: the longest context each benchmark eval served (its longest prompt + new tokens) against the training
  data's length distribution (samples per bucket, the longest; data.max_length for data stored before those were
  recorded): acceptance falls at lengths a draft never trained on;
- trained / measured: the run's training figures and its benchmark's acceptance beside the offline estimate.

Each finding is (check, status, evidence, fix) with status ok | warn | fail | missing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tasks.formats.vocab_file import VocabFormatError
from tasks.store.artifacts import ArtifactMissing, ArtifactRef, Store

LOW_COVERAGE = 0.90  # held-out coverage below this bounds acceptance visibly (docs/BENCHMARK.md)


@dataclass
class Finding:
    check: str
    status: str  # ok | warn | fail | missing
    evidence: str
    fix: str = ""


def _manifest(store: Store, stage: str, digest: str | None):
    return store.manifest(stage, digest) if digest else None


def states(store: Store, extract_digests: list[str]) -> Finding:
    """Every extraction shard the draft trained on, and its stored self-check."""
    from tasks.extract.verify import summarize

    checked, unchecked, missing = [], [], []
    found = store.manifests("extract", extract_digests)  # all at once: a hero run trains on 512 shards
    for d in extract_digests:
        m = found[d]
        if m is None:
            missing.append(d)
        elif (m.stats.get("verify") or {}).get("positions"):
            checked.append(m.stats)
        else:
            unchecked.append(str(m.stats.get("shard", d[:8])))
    if missing:
        return Finding("states", "fail", f"{len(missing)} of {len(extract_digests)} extraction shards the draft trained "
                       f"on are not on the store ({', '.join(x[:8] for x in missing[:4])})",
                       "the store lost them: re-run `draftline run` (the shards are recomputed)")
    s = summarize(checked)
    if unchecked:
        return Finding("states", "warn", f"{len(unchecked)} of {len(extract_digests)} shards were stored unchecked "
                       f"(before extraction checked itself, or with extract.verify_positions 0: shards "
                       f"{', '.join(unchecked[:8])}): nothing proves their states "
                       "are the target's" + (f"; the {len(checked)} others: {_agreement(s)}" if s else ""),
                       "re-extract them to check them (draftline ls --stage extract; delete those shards and re-run)")
    if not s:
        return Finding("states", "missing", "the draft lists no extraction shards", "train it with draftline run")
    return Finding("states", "ok", f"{s['shards']} of {len(extract_digests)} shards checked: {_agreement(s)}; lowest "
                   f"shard {s['min_shard_agreement']:.1%} (threshold {s['threshold']:.0%})")


def _agreement(s: dict[str, Any]) -> str:
    return (f"the target's lm_head over the stored last layer picks the engine's own next token at "
            f"{s.get('top1_agreement', 0):.1%} of {s.get('positions')} positions")


def maps(store: Store, train_digest: str, vocab_digest: str | None, vocab_size: int | None) -> Finding:
    """The vocab artifact's maps checked, and the draft's own equal to them."""
    from tasks.benchmark.serve import ExportError, same_maps_as_training

    if not vocab_digest:
        return Finding("maps", "ok", "the draft predicts the whole target vocabulary (no d2t/t2d)")
    art = store.open("train", train_digest)
    if "draft/model.safetensors" not in art.files("draft/"):
        return Finding("maps", "fail", f"train/{train_digest} holds no draft/model.safetensors (its files: "
                       f"{', '.join(art.files()) or 'none'}): not a trained draft", "re-run the train stage")
    try:
        if vocab_size:  # checked against the target's vocabulary: torch, heavy (seconds), only here
            from tasks.formats.vocab_maps import read_vocab

            read_vocab(store, ArtifactRef(stage="vocab", digest=vocab_digest, uri=""), vocab_size)  # raises if off
        from tasks.formats.drafts import draft_data_files

        with art.local_folder("draft/", names=draft_data_files(art.files("draft/"))) as folder:  # data only
            not_compared = same_maps_as_training(store, art, folder)
    except (VocabFormatError, ExportError) as exc:
        return Finding("maps", "fail", str(exc), "re-run the vocab and train stages")
    except ArtifactMissing:
        return Finding("maps", "fail", f"vocab/{vocab_digest} is not on the store", "re-run `draftline run`")
    return Finding("maps", "ok", f"d2t/t2d consistent with each other{' and the top-K of their counts' if vocab_size else ''}"
                   + ("; the draft's maps equal training's byte for byte" if not_compared is None
                      else f"; no map to compare: {not_compared}"))


def coverage(store: Store, vocab_digest: str | None, report: dict[str, Any] | None = None) -> Finding:
    m = _manifest(store, "vocab", vocab_digest)
    if m is None:
        return Finding("coverage", "ok" if not vocab_digest else "missing",
                       "the whole target vocabulary" if not vocab_digest else "no vocab artifact")
    c, h = m.stats.get("coverage"), m.stats.get("heldout_coverage")
    k = m.stats.get("draft_vocab_size")
    text = f"a {k:,}-token draft vocabulary holds {c:.1%} of the training answers' tokens" if c is not None else "?"
    if h is not None:
        text += f" and {h:.1%} of the held-out split's"
    evals = {n: e["draft_vocab_coverage"] for n, e in ((report or {}).get("evals") or {}).items()
             if e.get("draft_vocab_coverage") is not None}
    if evals:
        text += "; of the target's output on each benchmark eval: " + ", ".join(f"{n} {v:.1%}" for n, v in evals.items())
    low = h if h is not None else c
    if low is not None and low < LOW_COVERAGE:
        return Finding("coverage", "warn", text + f": below {LOW_COVERAGE:.0%}, a token in {1 / max(1e-9, 1 - low):.0f} "
                       "can never be proposed", "raise vocab.draft_vocab_size (or train on data closer to the serving mix)")
    return Finding("coverage", "ok", text)


def lengths(store: Store, data_digest: str | None, report: dict[str, Any] | None) -> Finding:
    """The training data's length distribution (samples per context-length bucket, its longest sample; data.max_length
    for data stored before those were recorded) against the longest context each eval of the benchmark served."""
    from tasks.benchmark.results import LENGTH_FIX, length_gap, served_length, training_lengths

    m = _manifest(store, "regenerate", data_digest) or _manifest(store, "prepare", data_digest)
    if m is None:
        return Finding("lengths", "missing", "no data artifact for the draft", "re-run `draftline run`")
    prep = _manifest(store, "prepare", m.inputs.get("prepare")) if m.stage == "regenerate" else m
    train = training_lengths({**m.stats, "max_length": (prep.stats if prep else m.stats).get("max_length")})
    samples = max(1, int(m.stats.get("samples") or 1))
    mean = float(m.stats.get("tokens") or 0) / samples
    buckets = train.get("length_buckets") or {}
    text = (f"training samples: {mean:,.0f} tokens on average, "
            + (f"the longest {train['longest']:,}" + (f" ({', '.join(f'{b}: {n}' for b, n in buckets.items())})"
                                                     if buckets else "")
               if train.get("longest") else f"at most {train.get('max_length') or 0:,} (data.max_length)"))
    if not report:
        return Finding("lengths", "ok", text + "; no benchmark yet to compare with")
    new = int((report.get("settings") or {}).get("max_tokens") or 0)
    served = {ev: served_length(report, ev) for ev in (report.get("evals") or {})}
    if not served:
        return Finding("lengths", "ok", text)
    ev, longest = max(served.items(), key=lambda kv: kv[1])
    text += f"; the benchmark served up to {longest:,} ({ev}: its longest prompt + {new} new tokens)"
    gaps = [g for e, n in served.items() if (g := length_gap(train, n, f"eval {e}'s contexts"))]
    if gaps:
        return Finding("lengths", "warn", text + ". " + "; ".join(gaps) + ": acceptance falls where a draft never "
                       "trained (report.md: Acceptance by context length)", LENGTH_FIX)
    return Finding("lengths", "ok", text)


def trained(train_stats: dict[str, Any], report: dict[str, Any] | None) -> list[Finding]:
    acc = train_stats.get("val_acc_per_pos") or []
    sim = train_stats.get("simulated_acceptance_length")
    out = [Finding("trained", "ok" if train_stats.get("steps") else "missing",
                   f"{train_stats.get('steps')} steps ({train_stats.get('stopped_reason', '?')}); held-out accuracy per "
                   f"position {', '.join(f'{a:.2f}' for a in acc) or '?'}; offline estimate of acceptance length "
                   f"{sim if sim is not None else '?'}")]
    if report is None:
        out.append(Finding("measured", "missing", "no benchmark of this draft in the store",
                           "run the benchmark stage (draftline run, benchmark.enabled: true)"))
        return out
    figs = []
    for ev, ks in (report.get("benchmark") or {}).items():
        for k, f in ks.items():
            figs.append(f"{ev} k={k}: {f.get('mean_acceptance_length', 0):.2f}")
    shift = [w for w in report.get("warnings", []) if "differs from the offline estimate" in w]
    out.append(Finding("measured", "warn" if shift else "ok", "acceptance length in vLLM: " + "; ".join(figs)
                       + (f" (the estimate said {sim})" if sim is not None else ""),
                       "see `draftline report`: the measured figure differs from the estimate" if shift else ""))
    return out


def gather(store: Store, train_digest: str, report: dict[str, Any] | None,
           vocab_size: int | None = None) -> list[Finding]:
    """Every finding for one trained draft (a train digest on `store`), with its benchmark report if any."""
    m = store.manifest("train", train_digest)
    if m is None:
        raise ArtifactMissing(f"train/{train_digest} is not committed on {store.uri}")
    extract = [d for d in (m.inputs.get("extract") or "").split(",") if d]
    vocab = m.inputs.get("vocab")
    first = _manifest(store, "extract", extract[0] if extract else None)  # every shard reads the same data artifact
    data = first.inputs.get("data") if first else None
    return [states(store, extract), maps(store, train_digest, vocab, vocab_size), coverage(store, vocab, report),
            lengths(store, data, report), *trained(m.stats, report)]


def as_rows(findings: list[Finding]) -> list[dict[str, str]]:
    return [asdict(f) for f in findings]
