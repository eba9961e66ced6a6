"""`resolve(cfg, store)` (tasks/store/resolve.py): the address of every stage a config produces, found on the
store as far as the artifacts an address is made of are committed, and the first stage that is not."""

from __future__ import annotations

from tasks.address import digests
from tasks.data.prepare import run_prepare
from tasks.data.vocab import run_vocab
from tasks.store.resolve import resolve
from train_data import tiny_chat_run


def test_resolve_finds_what_is_committed_and_stops_at_the_first_stage_that_is_not(tmp_path):
    store, cfg = tiny_chat_run(tmp_path, regenerate={"enabled": False})
    found = resolve(cfg, store)  # nothing committed: the first stage's address, no later one
    assert found.missing == "prepare" and found.of("prepare").digest == digests.prepare(cfg)
    assert found.ref("prepare") is None and found.of("vocab") is None and found.ref("data") is None

    prep = run_prepare(cfg, store)
    vocab = run_vocab(cfg, store, prep)
    found = resolve(cfg, store, until="vocab")
    assert found.missing is None and found.skipped == ["regenerate"]  # regeneration is off: the data is prepare's
    assert (found.ref("prepare").digest, found.ref("data").digest, found.ref("vocab").digest) == (
        prep.digest, prep.digest, vocab.digest)
    assert list(found.addresses) == ["prepare", "vocab"]  # nothing after UNTIL

    other = cfg.model_copy(update={"vocab": cfg.vocab.model_copy(update={"draft_vocab_size": 64})})
    found = resolve(other, store, until="vocab")  # another vocabulary of the same data: its address, not found
    assert found.missing == "vocab" and found.ref("prepare").digest == prep.digest
    assert found.of("vocab").artifact is None and found.of("vocab").digest == digests.vocab(other, prep)
