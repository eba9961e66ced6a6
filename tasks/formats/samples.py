"""The sample format every data stage writes and every later stage reads (docs/ARTIFACTS.md).

A prepare or regenerate artifact holds `shard-NNNNN.parquet` files and `heldout.parquet`, one row per
sample: `sample_id`, `source`, `messages` (JSON), `input_ids` (int32 list), `loss_mask` (int8 list).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from tasks.formats.acceptance import length_counts
from tasks.store.reader import Artifact

HELDOUT = "heldout.parquet"


COLUMNS = ("sample_id", "source", "messages", "input_ids", "loss_mask")


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.parquet"


@dataclass
class Sample:
    sample_id: str
    source: str
    messages: list[dict[str, str]]
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # int8 [T]

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def masked(self) -> int:
        return int(self.loss_mask.sum())


def parquet_bytes(samples: list[Sample]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = pa.ListArray.from_arrays(
        pa.array(np.cumsum([0] + [s.tokens for s in samples], dtype=np.int32)),
        pa.array(np.concatenate([s.input_ids for s in samples]) if samples else np.zeros(0, np.int32), pa.int32()),
    )
    mask = pa.ListArray.from_arrays(
        pa.array(np.cumsum([0] + [s.tokens for s in samples], dtype=np.int32)),
        pa.array(np.concatenate([s.loss_mask for s in samples]) if samples else np.zeros(0, np.int8), pa.int8()),
    )
    table = pa.table({
        "sample_id": pa.array([s.sample_id for s in samples], pa.string()),
        "source": pa.array([s.source for s in samples], pa.string()),
        "messages": pa.array([json.dumps(s.messages, ensure_ascii=False) for s in samples], pa.string()),
        "input_ids": ids,
        "loss_mask": mask,
    })
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=1024)
    return buf.getvalue()


def read_samples(art: Artifact, name: str) -> list[Sample]:
    """All rows of one shard (or heldout.parquet) of a prepare/regenerate artifact."""
    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(art.read_bytes(name)))
    out = []
    cols = {c: table.column(c) for c in COLUMNS}
    for i in range(table.num_rows):
        out.append(Sample(
            sample_id=cols["sample_id"][i].as_py(),
            source=cols["source"][i].as_py(),
            messages=json.loads(cols["messages"][i].as_py()),
            input_ids=np.asarray(cols["input_ids"][i].values, dtype=np.int32),
            loss_mask=np.asarray(cols["loss_mask"][i].values, dtype=np.int8),
        ))
    return out


def iter_token_batches(art: Artifact, names: Iterable[str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, loss_mask) flat arrays per Parquet row group, shard after shard: constant memory."""
    import pyarrow.parquet as pq

    for name in names:
        with art.local_copy(name) as path:
            pf = pq.ParquetFile(path)
            for batch in pf.iter_batches(columns=["input_ids", "loss_mask"], batch_size=1024):
                ids = batch.column(0).flatten().to_numpy(zero_copy_only=False)
                mask = batch.column(1).flatten().to_numpy(zero_copy_only=False)
                yield ids, mask


def token_stats(samples: list[Sample]) -> dict[str, Any]:
    """Counts of a sample split, with its length distribution: samples per context-length bucket
    (tasks/formats/acceptance.py) and the longest, which `draftline check`, the benchmark report and
    `draftline plan` set against the lengths served."""
    return length_stats([s.tokens for s in samples], [s.masked for s in samples])


def length_stats(tokens: Sequence[int], masked: Sequence[int]) -> dict[str, Any]:
    """`token_stats` from each sample's token count and masked-token count (what prepare keeps of a sample)."""
    return {"samples": len(tokens), "tokens": sum(tokens), "masked_tokens": sum(masked),
            "length_buckets": length_counts(tokens), "longest": max(tokens, default=0)}
