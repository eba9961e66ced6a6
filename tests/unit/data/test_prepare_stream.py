"""prepare streams its samples through a local spill file (tasks/data/spill.py) and writes exactly what the
in-memory prepare wrote: the same rows in the same shards in the same order, and the same manifest stats.

The pinned fingerprints below were taken from the in-memory prepare (commit 6ecec96, before streaming) on these
synthetic sources, at two counts; the encoding fanned out over worker processes (data.workers,
tasks/data/encoding.py) writes them too, at the same address."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

import pytest

from tasks.address import digests
from tasks.core.config import RunConfig
from tasks.data.prepare import PrepareError, run_prepare
from tasks.formats.samples import HELDOUT, read_samples, shard_name
from tasks.store.artifacts import Store


def _sources(tmp_path: Path, n: int) -> tuple[Path, Path]:
    """Two sources of N rows: ShareGPT chats with duplicates (within and across sources), bad rows and answers
    too long for max_length; prompt/response pairs of varied lengths."""
    chats = []
    for i in range(n):
        answer = f"Fact {i}: {i * 7} is {'even' if i % 2 == 0 else 'odd'}." + (" and so on" * 40 if i % 9 == 4 else "")
        chats.append({"conversations": [{"from": "human", "value": f"Tell me about {i}."},
                                        {"from": "gpt", "value": answer}]})
        if i % 7 == 3:
            chats.append(chats[-1])  # a duplicate
        if i % 11 == 5:
            chats.append({"conversations": [{"from": "human", "value": "no answer"}]})  # no_assistant
    pairs = [{"prompt": f"Say {i} {'please ' * (i % 5)}", "response": f"{i}!"} for i in range(n)]
    pairs.append({"prompt": "Tell me about 3.", "response": "Fact 3: 21 is odd."})  # a chat's twin
    a, b = tmp_path / f"chats-{n}.jsonl", tmp_path / f"pairs-{n}.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in chats))
    b.write_text("".join(json.dumps(r) + "\n" for r in pairs))
    return a, b


def _cfg(a: Path, b: Path, n: int, overflow: str, workers: int | None = None) -> RunConfig:
    return RunConfig.model_validate({"regenerate": {"enabled": False}, "data": {
        "sources": [{"path": str(a), "weight": 1}, {"path": str(b), "name": "pairs", "weight": 2}],
        "max_samples": n, "heldout": 3, "num_shards": 4, "max_length": 96, "overflow": overflow,
        "seed": 5, "workers": workers}})


def _fingerprint(store: Store, ref) -> dict:
    """Per file, a hash of its rows in order (id, source, messages, token ids, mask); and the stats."""
    art = store.open("prepare", ref.digest)
    files = {}
    for name in [HELDOUT] + [shard_name(i) for i in range(ref.stats["num_shards"])]:
        h = hashlib.sha256()
        for s in read_samples(art, name):
            h.update(json.dumps([s.sample_id, s.source, s.messages]).encode())
            h.update(s.input_ids.astype("<i4").tobytes() + s.loss_mask.astype("i1").tobytes())
        files[name] = h.hexdigest()[:16]
    stats = {k: v for k, v in ref.stats.items() if k not in ("seconds", "samples_per_s")}
    return {"files": files, "stats": hashlib.sha256(json.dumps(stats, sort_keys=True).encode()).hexdigest()[:16],
            "samples": stats["samples"], "shard_samples": stats["shard_samples"], "dropped": stats["dropped"]}


# from the in-memory prepare (commit 6ecec96) on these sources
PINNED = {
    30: {"files": {"heldout.parquet": "be7eb3331062b5c6", "shard-00000.parquet": "9e9e39e50986b976",
                   "shard-00001.parquet": "937782ec164b98cf", "shard-00002.parquet": "c895836451b0c65e",
                   "shard-00003.parquet": "ecbf4cb8b6d7150c"},
         "stats": "d544d9d9f5012ec1", "samples": 30, "shard_samples": [8, 8, 7, 7],
         "dropped": {"duplicate": 5, "no_assistant": 3}},
    150: {"files": {"heldout.parquet": "e61732a3b971ef1e", "shard-00000.parquet": "d69c9d82a05b817a",
                    "shard-00001.parquet": "2b87422b814cf06a", "shard-00002.parquet": "9fbbf40d64f6dcbc",
                    "shard-00003.parquet": "d9591bb94ee12726"},
          "stats": "576b72c4e59b1eed", "samples": 150, "shard_samples": [38, 38, 37, 37],
          "dropped": {"duplicate": 22, "no_assistant": 14, "too_long": 2}},
}


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("n,overflow", [(30, "truncate"), (150, "drop")])
def test_streamed_prepare_writes_what_the_in_memory_one_wrote(tmp_path, n, overflow, workers):
    """In this process (workers 1) and on two encoding processes: the same rows in the same files, the same stats
    (drop counts, per-source counts, mask mode), the same manifest config and the same address."""
    a, b = _sources(tmp_path, n)
    store = Store(f"file://{tmp_path}/store")
    cfg = _cfg(a, b, n, overflow, workers)
    ref = run_prepare(cfg, store)
    assert _fingerprint(store, ref) == PINNED[n]
    assert ref.digest == digests.prepare(_cfg(a, b, n, overflow))  # the address of the config without workers
    assert "workers" not in store.manifest("prepare", ref.digest).config["data"]


def test_the_spill_stays_in_a_local_scratch_folder_deleted_after_success_and_failure(tmp_path, monkeypatch):
    """The spill files live in an owned temp folder of this process (never the store) and are gone after the
    stage, also when it fails after spilling (here: more shards than samples, found after every encoding)."""
    from tasks.core import owners
    from tasks.data import prepare

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.mkdir(tmp_path / "tmp")
    seen: list[tuple[str, list[str]]] = []
    real = owners.owned_temporary_directory

    @contextlib.contextmanager
    def spy(kind, dir=None):
        with real(kind, dir) as path:
            try:
                yield path
            finally:
                seen.append((path, sorted(os.listdir(path))))

    monkeypatch.setattr(prepare.owners, "owned_temporary_directory", spy)
    a, b = _sources(tmp_path, 30)
    store = Store(f"file://{tmp_path}/store")
    ref = run_prepare(_cfg(a, b, 30, "truncate"), store)
    (path, files), = seen
    assert os.path.dirname(path) == str(tmp_path / "tmp") and files == [".draftline-owner.json",
                                                                           "conversations.arrow", "samples.arrow"]
    assert not os.listdir(tmp_path / "tmp")
    assert sorted(store.open("prepare", ref.digest).files()) == [HELDOUT] + [shard_name(i) for i in range(4)]

    bad = _cfg(a, b, 30, "truncate")
    bad.data.num_shards = 31
    with pytest.raises(PrepareError, match="num_shards \\(31\\) is larger than the number of training samples \\(30\\)"):
        run_prepare(bad, store)
    assert len(seen) == 2 and not os.listdir(tmp_path / "tmp")


def test_per_source_counts_add_up_with_dedupe_off_and_duplicate_rows(tmp_path):
    """Each encoded sample is counted once, as training, held out or unused, even when rows repeat (dedupe off):
    the in-memory prepare counted by sample id, so an unused copy of a used row counted as used."""
    p = tmp_path / "thrice.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"Say {i}", "response": f"{i}!"}) + "\n" for i in range(20)) * 3)
    cfg = RunConfig.model_validate({"regenerate": {"enabled": False}, "data": {
        "sources": [{"path": str(p)}], "dedupe": False, "max_samples": 10, "heldout": 2, "num_shards": 2}})
    ref = run_prepare(cfg, Store(f"file://{tmp_path}/store"))
    e = ref.stats["per_source"]["thrice"]
    assert (e["samples"], e["heldout"], e["unused"]) == (10, 2, 48), e
