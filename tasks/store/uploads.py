"""Writing one store file: on S3, a multipart upload whose parts go up several at a time.

s3fs's own writer (`fs.open(key, "wb")`, s3fs 2026.7) uploads a file's parts one after the other on the
writing thread, and a large write becomes one part as large as the write: an extraction part's hidden
states arrive in one `write` of up to a few GB, so they went up as ONE request of that size. On SeaweedFS
the part writers reached 0.50-0.78x a bare multipart upload of the same bytes in 16 MiB parts that way, and
1.03x through this module (benchmarks/RESULTS.md, "The extraction write path against the medium's own rate").
`S3MultipartFile` cuts what it is given into
`store.upload_part_mb` parts and keeps up to `store.upload_concurrency` of them in flight on s3fs's event
loop while the caller goes on writing (and hashing, `ArtifactWriter.open`); a file smaller than one part is
one PUT. The file appears on the store only when it is closed without error; an error aborts the upload.

Other stores (file://, memory://) are written with fsspec's own `open`.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections import deque
from concurrent.futures import Future
from typing import IO, Any, Iterator

MAX_PARTS = 10_000  # S3's limit on the parts of one upload


def upload_options(part_mb: int, concurrency: int) -> dict[str, int]:
    """s3fs storage options for `store.upload_part_mb` / `store.upload_concurrency` (S3FileSystem's own names,
    which `S3MultipartFile` reads back from the filesystem)."""
    return {"default_block_size": int(part_mb) << 20, "max_concurrency": int(concurrency)}


@contextlib.contextmanager
def open_for_write(fs: Any, path: str) -> Iterator[IO[bytes]]:
    """A binary file to write `path` on `fs`: concurrent multipart parts on S3, fsspec's `open` elsewhere."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "s3" not in protocols or not hasattr(fs, "_call_s3"):
        with fs.open(path, "wb") as fh:
            yield fh
        return
    f = S3MultipartFile(fs, path, int(fs.default_block_size), int(fs.max_concurrency))
    try:
        yield f  # type: ignore[misc]
    except BaseException:
        f.abort()
        raise
    f.close()


class S3MultipartFile(io.RawIOBase):
    """A write-only S3 object: `part_bytes` parts, at most `concurrency` uploading at once.

    Each part is copied once, from the caller's buffer into one of concurrency + 1 reused part buffers (the
    caller may reuse its memory as soon as `write` returns); the copy runs in numpy, which releases the GIL.
    `write` returns once its bytes are copied, waiting only while `concurrency` parts are already in flight.
    """

    def __init__(self, fs: Any, path: str, part_bytes: int, concurrency: int):
        super().__init__()
        if part_bytes < 5 << 20:
            raise ValueError(f"store.upload_part_mb must be at least 5 (S3's smallest part), got {part_bytes >> 20}")
        self.fs, self.path = fs, path
        self.bucket, self.key, _ = fs.split_path(path)
        self.part_bytes, self.concurrency = part_bytes, max(1, concurrency)
        self.bytes = 0
        self._buf = bytearray(part_bytes)
        self._n = 0  # bytes held in _buf
        self._spare: list[bytearray] = []
        self._inflight: deque[tuple[int, Future, bytearray]] = deque()
        self._etags: dict[int, str] = {}
        self._upload_id: str | None = None
        self._done = False

    def writable(self) -> bool:
        return True

    def _call(self, method: str, **kw: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(self.fs._call_s3(method, Bucket=self.bucket, Key=self.key, **kw),
                                                self.fs.loop)

    def write(self, b: Any) -> int:  # type: ignore[override]
        import numpy as np

        mv = memoryview(b).cast("B")
        pos, size = 0, mv.nbytes
        while pos < size:
            k = min(self.part_bytes - self._n, size - pos)
            np.copyto(np.frombuffer(self._buf, np.uint8, k, self._n), np.frombuffer(mv[pos:pos + k], np.uint8))
            self._n += k
            pos += k
            if self._n == self.part_bytes:
                self._send_part()
        self.bytes += size
        return size

    def _send_part(self) -> None:
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload").result()["UploadId"]
        number = len(self._etags) + len(self._inflight) + 1
        if number > MAX_PARTS:
            raise ValueError(f"{self.path}: more than {MAX_PARTS} parts of {self.part_bytes >> 20} MiB; raise "
                             "store.upload_part_mb")
        while len(self._inflight) >= self.concurrency:
            self._reap()
        body = self._buf if self._n == self.part_bytes else self._buf[:self._n]
        self._inflight.append((number, self._call("upload_part", PartNumber=number, UploadId=self._upload_id,
                                                  Body=body), self._buf))
        self._buf = self._spare.pop() if self._spare else bytearray(self.part_bytes)
        self._n = 0

    def _reap(self) -> None:
        number, fut, buf = self._inflight.popleft()
        self._etags[number] = fut.result()["ETag"]
        self._spare.append(buf)

    def close(self) -> None:
        """Send what is left and complete the upload (or PUT a file smaller than one part)."""
        if self._done:
            return
        if self._upload_id is None:
            self._call("put_object", Body=bytes(memoryview(self._buf)[:self._n])).result()
        else:
            if self._n:
                self._send_part()
            while self._inflight:
                self._reap()
            parts = [{"PartNumber": n, "ETag": e} for n, e in sorted(self._etags.items())]
            self._call("complete_multipart_upload", UploadId=self._upload_id,
                       MultipartUpload={"Parts": parts}).result()
        self._done = True
        self.fs.invalidate_cache(self.path)
        super().close()

    def abort(self) -> None:
        """Drop the upload: wait for the parts in flight, then abort it (best effort: `draftline gc` and the
        bucket's lifecycle rule remove what is left)."""
        if self._done:
            return
        self._done = True
        for _, fut, _ in self._inflight:
            with contextlib.suppress(BaseException):
                fut.result()
        self._inflight.clear()
        if self._upload_id is not None:
            with contextlib.suppress(Exception):
                self._call("abort_multipart_upload", UploadId=self._upload_id).result()
        super().close()
