"""vocab: counts over loss-masked tokens, top-K maps identical to speculators', coverage."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tasks.core.config import RunConfig
from tasks.data.prepare import HELDOUT, read_samples, run_prepare, shard_name
from tasks.store.artifacts import Store
from tasks.data.vocab import FILE, build_maps, run_vocab
from tasks.formats.vocab_maps import VocabError, draft_size
from tasks.formats.vocab_maps import read_maps


def speculators_maps(counts: np.ndarray, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    freq = {int(i): int(counts[i]) for i in np.nonzero(counts)[0]}
    return build_vocab_mappings_from_distribution(freq, k, counts.shape[0])


@pytest.mark.parametrize("k,seen", [(64, 500), (64, 40), (300, 300), (10, 10)])
def test_maps_match_speculators_on_the_same_counts(k, seen):
    rng = np.random.default_rng(k * 1000 + seen)
    v = 1000
    counts = np.zeros(v, dtype=np.int64)
    ids = rng.choice(v, size=seen, replace=False)
    counts[ids] = rng.integers(1, 6, size=seen)  # many ties: the id breaks them
    d2t, t2d = build_maps(counts, k)
    ref_d2t, ref_t2d = speculators_maps(counts, k)
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_
    assert torch.equal(torch.from_numpy(d2t), ref_d2t)
    assert torch.equal(torch.from_numpy(t2d), ref_t2d)
    # the layout vLLM applies: target id = draft index + d2t[draft index]
    targets = np.arange(k) + d2t
    assert (targets == np.nonzero(t2d)[0]).all()


def test_draft_size_default_is_capped_explicit_oversize_is_an_error():
    assert draft_size(32000, 49152) == 32000
    assert draft_size(32000, 1000) == 1000  # the default on a small target
    assert draft_size(8192, 49152) == 8192
    with pytest.raises(VocabError, match=r"draft_vocab_size \(60000\) is larger than the target's vocabulary \(49152\)"):
        draft_size(60000, 49152)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    src = root / "chats.jsonl"
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda",
             "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega"]
    src.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": f"Please list {i} Greek letters."},
        {"role": "assistant", "content": " ".join(words[j % 24] for j in range(i + 1))},
    ]}) for i in range(30)))
    cfg = RunConfig.model_validate({"data": {"sources": [{"path": str(src)}], "heldout": 5, "num_shards": 2,
                                             "max_length": 256}, "vocab": {"draft_vocab_size": 64}})
    store = Store(f"file://{root}/store")
    return cfg, store, run_prepare(cfg, store)


def test_run_vocab_counts_loss_masked_training_tokens(prepared):
    cfg, store, ref = prepared
    vref = run_vocab(cfg, store, ref)
    art = store.open("vocab", vref.digest, checksums=True)
    assert art.files() == [FILE]
    maps = read_maps(store, vref)
    assert maps["d2t"].dtype == torch.int64 and list(maps["d2t"].shape) == [64]
    assert maps["t2d"].dtype == torch.bool and list(maps["t2d"].shape) == [49152]
    assert int(maps["t2d"].sum()) == 64

    # recount by hand from the shards: masked tokens only, held-out excluded
    data = store.open("prepare", ref.digest)
    expected = np.zeros(49152, dtype=np.int64)
    for i in range(2):
        for s in read_samples(data, shard_name(i)):
            np.add.at(expected, s.input_ids[s.loss_mask == 1], 1)
    assert np.array_equal(maps["token_counts"].numpy(), expected)
    assert vref.stats["masked_tokens"] == ref.stats["masked_tokens"] == int(expected.sum())

    d2t, t2d = speculators_maps(expected, 64)
    assert torch.equal(maps["d2t"], d2t) and torch.equal(maps["t2d"], t2d)
    # few distinct answer tokens: 64 cover them all; the prompt's words ("Please", "list") are never counted
    assert vref.stats["coverage"] == 1.0
    from tasks.data.prepare import make_masker

    tok = make_masker(cfg).tok
    assert expected[tok.encode(" Please", add_special_tokens=False)[0]] == 0
    assert "Coverage" in vref.stats["summary_md"] and "64" in vref.stats["summary_md"]
    assert 0 < vref.stats["heldout_coverage"] <= 1
    held = read_samples(data, HELDOUT)
    assert held and held[0].sample_id not in {s.sample_id for s in read_samples(data, shard_name(0))}
    # committed work is reused
    assert run_vocab(cfg, store, ref).attempt == vref.attempt


def test_coverage_below_one_when_the_vocab_is_small(prepared):
    cfg, store, ref = prepared
    small = cfg.model_copy(deep=True)
    small.vocab.draft_vocab_size = 16
    vref = run_vocab(small, store, ref)
    counts = read_maps(store, vref)["token_counts"].numpy()
    top16 = np.sort(counts)[::-1][:16].sum()
    assert vref.stats["coverage"] == pytest.approx(top16 / counts.sum(), abs=1e-6)
    assert vref.stats["coverage"] < 1.0


def test_oversized_vocab_is_an_error_and_commits_nothing(prepared):
    cfg, store, ref = prepared
    big = cfg.model_copy(deep=True)
    big.vocab.draft_vocab_size = 50000
    with pytest.raises(VocabError, match="larger than the target's vocabulary"):
        run_vocab(big, store, ref)
    assert all(m.config.get("vocab", {}).get("draft_vocab_size") != 50000 for m in store.list("vocab"))


def test_maps_that_are_not_the_top_k_of_their_counts_are_refused(tmp_path):
    """d2t/t2d agree with each other AND with the token counts they came from: a map holding a rare token in
    place of a frequent one (an edited file, ids that drifted) is refused before training reads it."""
    from safetensors.torch import save

    from tasks.core.digest import VERSIONS, stage_digest
    from tasks.formats.vocab_maps import VocabFormatError, read_vocab

    store = Store(f"file://{tmp_path}/store")
    counts = np.zeros(100, dtype=np.int64)
    counts[[5, 17, 40, 41, 90]] = [50, 40, 30, 20, 10]

    def commit(name: str, d2t: np.ndarray, t2d: np.ndarray):
        with store.write("vocab", stage_digest("vocab", {"t": name}), VERSIONS["vocab"]) as w:
            w.write_bytes(FILE, save({"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d),
                                      "token_counts": torch.from_numpy(counts)}))
            return w.commit({}).ref()

    d2t, t2d = build_maps(counts, 3)
    assert torch.equal(read_vocab(store, commit("good", d2t, t2d), 100)[1], torch.from_numpy(t2d))
    drifted = np.array([5, 17, 90])  # 90 (10 times) in place of 40 (30 times); d2t consistent with t2d
    t2d_bad = np.zeros(100, dtype=bool)
    t2d_bad[drifted] = True
    with pytest.raises(VocabFormatError, match="leaves out target id 40 .counted 30 times. but holds id 90 "
                                               ".counted 10.: t2d/d2t are not the top-K of token_counts"):
        read_vocab(store, commit("drifted", drifted - np.arange(3), t2d_bad), 100)
