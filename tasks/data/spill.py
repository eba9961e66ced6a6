"""A local spill file: rows appended one at a time, then read back one at a time by their index, in any order.

prepare streams its data through two of these (the conversations as read, the samples as encoded) so that its
memory does not grow with the sample count: it keeps only indices and token counts, shuffles the indices (a
seeded shuffle depends only on the count), and gathers each shard's rows by index when it writes the shard.

The file is an Arrow IPC file with one record batch per row (an IPC file's footer lists every batch, so any row
is read alone), LZ4-compressed (cheaper per row than zstd), without Arrow's thread pool (its hand-offs cost more
than one row's work), in a local folder the caller owns and deletes (never the store). Rows are written by this
process and read back by it or by its own worker processes (prepare's encoders open a finished file with
`Spill.open`): nothing read from it is executed or unpickled.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np

from tasks.core.errors import DraftlineError, full_disk_as

if TYPE_CHECKING:
    import pyarrow as pa


class SpillFull(DraftlineError, OSError):
    """The local disk under a spill file is full (or the process is over a file-size limit)."""


def _local_space(path: str) -> contextlib.AbstractContextManager[None]:
    """A full local disk while a spill file is written becomes a SpillFull that names the folder and the fix."""
    return full_disk_as(lambda exc: SpillFull(
        f"writing the local spill file {path} failed: {os.strerror(exc.errno)} (the disk of {os.path.dirname(path)} "
        "is full or over a size limit); nothing was committed to the store: free space there, or set TMPDIR to a "
        "folder on a bigger local disk (prepare spills ~18 KB per sample: docs/DEPLOY.md), then retry the run "
        "(finished work is reused)"))


class Spill:
    """Rows of SCHEMA in the Arrow IPC file PATH: `append` while writing, then `get` (the first `get` ends the
    writing). List columns are given and read back as NumPy arrays; the others as Python values."""

    def __init__(self, path: str | os.PathLike, schema: "pa.Schema", *, write: bool = True):
        import pyarrow as pa

        self.path, self.schema, self.count = str(path), schema, 0
        self._sink: Any = None
        self._writer: Any = None
        if write:
            with _local_space(self.path):
                self._sink = pa.OSFile(self.path, "wb")
                self._writer = pa.ipc.new_file(self._sink, schema,
                                               options=pa.ipc.IpcWriteOptions(compression="lz4", use_threads=False))
        self._lists = [pa.types.is_list(f.type) for f in schema]
        self._source: Any = None
        self._reader: Any = None

    @classmethod
    def open(cls, path: str | os.PathLike, schema: "pa.Schema") -> "Spill":
        """A spill file written and finished (`finish`) by another process, for reading only."""
        spill = cls(path, schema, write=False)
        spill.count = spill._open_reader().num_record_batches
        return spill

    def append(self, row: dict[str, Any]) -> int:
        """Write one row; returns its index."""
        import pyarrow as pa

        if self._writer is None:
            raise RuntimeError(f"spill {self.path} is closed for writing")
        cols = []
        for f, is_list in zip(self.schema, self._lists):
            v = row[f.name]
            if is_list:
                values = pa.array(np.asarray(v), f.type.value_type)
                cols.append(pa.ListArray.from_arrays(pa.array([0, len(values)], pa.int32()), values))
            else:
                cols.append(pa.array([v], f.type))
        with _local_space(self.path):
            self._writer.write_batch(pa.record_batch(cols, schema=self.schema))
        self.count += 1
        return self.count - 1

    def get(self, i: int) -> dict[str, Any]:
        """Row I, as it was appended."""
        batch = self._open_reader().get_batch(i)
        return {f.name: (batch.column(k)[0].values.to_numpy(zero_copy_only=False).copy() if is_list
                         else batch.column(k)[0].as_py())
                for k, (f, is_list) in enumerate(zip(self.schema, self._lists))}

    def _open_reader(self) -> Any:
        import pyarrow as pa

        if self._reader is None:
            self.finish()
            self._source = pa.OSFile(self.path, "rb")
            self._reader = pa.ipc.open_file(self._source, options=pa.ipc.IpcReadOptions(use_threads=False))
        return self._reader

    def rows(self, indices: Iterable[int], decode: Callable[[dict[str, Any], int], Any]) -> "SpillRows":
        """A view of the rows at INDICES, each given to DECODE (row, index) when it is read."""
        return SpillRows(self, list(indices), decode)

    def finish(self) -> None:
        """End the writing (the file's footer written): from here on other processes may `open` it."""
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                with _local_space(self.path):
                    writer.close()
            finally:
                self._sink.close()

    def close(self) -> None:
        self.finish()
        if self._source is not None:
            self._source.close()
            self._source = self._reader = None

    def __enter__(self) -> "Spill":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class SpillRows(Sequence):
    """Some rows of a spill, in a given order, each decoded when it is read."""

    def __init__(self, spill: Spill, indices: list[int], decode: Callable[[dict[str, Any], int], Any]):
        self.spill, self.indices, self.decode = spill, indices, decode

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return SpillRows(self.spill, self.indices[k], self.decode)
        i = self.indices[k]
        return self.decode(self.spill.get(i), i)

    def take(self, order: Iterable[int]) -> "SpillRows":
        """These rows in ORDER (positions in this view)."""
        return SpillRows(self.spill, [self.indices[k] for k in order], self.decode)


def take(rows: Sequence, order: Iterable[int]) -> Sequence:
    """ROWS reordered by ORDER (a list stays a list; spilled rows stay on disk)."""
    return rows.take(order) if isinstance(rows, SpillRows) else [rows[k] for k in order]
