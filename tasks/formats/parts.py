"""The hidden-state part format: large safetensors files of many samples (docs/ARTIFACTS.md).

Extraction writes them (`PartBuffer`, streamed with `write_safetensors_stream`, optionally fp8 with a
per-token, per-layer scale: `quantize_fp8`); training reads them (`load_part`).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any, BinaryIO

from tasks.core.errors import DraftlineError


class PartFormatError(DraftlineError, RuntimeError):
    """Hidden states or a part file that do not fit the part format (a bug upstream, or a damaged file)."""

_ST_DTYPES = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float32": "F32", "int32": "I32",
              "uint8": "U8", "int64": "I64"}


def _tensor_bytes(t: Any) -> memoryview:
    import torch

    t = t.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")


def write_safetensors_stream(fh: BinaryIO, tensors: list[tuple[str, str, list[int], list[Any]]],
                             metadata: dict[str, str]) -> int:
    """Write a safetensors file from chunks, without concatenating them in memory.

    tensors: (name, torch dtype name, shape, chunks); the chunks of one tensor, in
    order, make up its row-major data. Returns the bytes written.
    """
    import torch

    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, chunks in tensors:
        nbytes = sum(c.numel() * c.element_size() for c in chunks)
        elem = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        if nbytes != math.prod(shape) * elem:
            raise ValueError(f"{name}: chunks hold {nbytes} bytes, shape {shape} of {dtype} needs "
                             f"{math.prod(shape) * elem}")
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    fh.write(struct.pack("<Q", len(raw)))
    fh.write(raw)
    for _name, _dtype, _shape, chunks in tensors:
        for c in chunks:
            fh.write(_tensor_bytes(c))
    return 8 + len(raw) + offset


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(hidden: Any) -> tuple[Any, Any]:
    """[T, L, H] -> (float8_e4m3fn [T, L, H], float32 scales [T, L]); x ~= q * scale."""
    import torch

    x = hidden.float()
    scale = (x.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: Any, scale: Any, rows: int = 4096) -> Any:
    """bf16 of q * scale, on q's device, `rows` rows at a time (so the float32 temporary stays small when a
    whole batch of Kimi-wide states is dequantized on a GPU)."""
    import torch

    if q.shape[0] <= rows:
        return (q.float() * scale.float().unsqueeze(-1)).to(torch.bfloat16)
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    for a in range(0, q.shape[0], rows):
        out[a:a + rows] = q[a:a + rows].float() * scale[a:a + rows].float().unsqueeze(-1)
    return out


def _copy_into(dst: Any, src: Any) -> None:
    """dst[...] = src for contiguous tensors of one dtype, on this thread only (numpy's copy, which
    releases the GIL). torch's copy_ runs on all the process's intra-op threads, and on the H200's
    host, while the engine process computed the next batch, those parallel copies were held up to
    the engine's pace (8 x 2048 tokens of SmolLM2 shape: 4.5 ms alone, 42 ms beside the engine)."""
    import numpy as np
    import torch

    np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())


class PartBuffer:
    """Samples collected for one part, copied into preallocated tensors; flushed as one safetensors file.

    A buffer is reused from part to part (`_PartWriter` hands written ones back), so a shard
    allocates at most write_queue + 1 of them and its resident memory stays flat. (Reuse alone
    did not speed up collecting on the H200: the cost there was the multi-threaded copy, see
    `_copy_into`.) `capacity` tokens are allocated on first use and grown (doubling) if a part
    outgrows them.
    """

    def __init__(self, layer_ids: list[int], hidden_size: int, storage_dtype: str, capacity: int = 0):
        self.layer_ids = layer_ids
        self.hidden_size = hidden_size
        self.storage_dtype = storage_dtype
        self.capacity = 0
        self._want = max(1, capacity)
        self._hidden: Any = None  # [capacity, L, H] in the storage dtype
        self._scales: Any = None  # fp8: float32 [capacity, L]
        self._ids: Any = None  # int32 [capacity]
        self._mask: Any = None  # uint8 [capacity]
        self.reset()

    def reset(self) -> None:
        """Empty the buffer; its memory is kept for the next part."""
        self.sample_ids: list[str] = []
        self.lengths: list[int] = []
        self.next_tokens: list[int | None] = []  # the engine's next token after each sample (checked, not written)
        self.tokens = 0

    def _reserve(self, tokens: int) -> None:
        import torch

        if tokens <= self.capacity:
            return
        cap = max(tokens, self._want, 2 * self.capacity)
        n_l, h, t = len(self.layer_ids), self.hidden_size, self.tokens
        fp8 = self.storage_dtype == "fp8"
        hidden = torch.empty(cap, n_l, h, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
        scales = torch.empty(cap, n_l, dtype=torch.float32) if fp8 else None
        ids, mask = torch.empty(cap, dtype=torch.int32), torch.empty(cap, dtype=torch.uint8)
        if t:  # outgrown mid-part: keep what it holds
            hidden[:t].copy_(self._hidden[:t])
            ids[:t].copy_(self._ids[:t])
            mask[:t].copy_(self._mask[:t])
            if fp8:
                scales[:t].copy_(self._scales[:t])
        self._hidden, self._scales, self._ids, self._mask, self.capacity = hidden, scales, ids, mask, cap

    def add(self, sample_id: str, input_ids: Any, loss_mask: Any, hidden: Any, next_token: int | None = None) -> None:
        """Copies `hidden` [T, L, H] in (it may live in memory the engine reuses: extract(ring=True));
        `next_token`: the engine's own next token after the sample, for the extraction check."""
        import torch

        n = int(hidden.shape[0])
        if len(input_ids) != n or len(loss_mask) != n:
            raise PartFormatError(f"sample {sample_id}: {n} hidden states for {len(input_ids)} input_ids and "
                               f"{len(loss_mask)} loss_mask values")
        self._reserve(self.tokens + n)
        a, b = self.tokens, self.tokens + n
        if self.storage_dtype == "fp8":
            q, s = quantize_fp8(hidden)
            self._hidden[a:b].copy_(q)
            self._scales[a:b].copy_(s)
        elif hidden.dtype == torch.bfloat16 and hidden.is_contiguous():
            _copy_into(self._hidden[a:b], hidden)
        else:
            self._hidden[a:b].copy_(hidden)  # casts to bf16 if the engine returned another dtype
        self._ids[a:b].copy_(torch.as_tensor(input_ids, dtype=torch.int32))
        self._mask[a:b].copy_(torch.as_tensor(loss_mask, dtype=torch.uint8))
        self.sample_ids.append(sample_id)
        self.lengths.append(n)
        self.next_tokens.append(next_token)
        self.tokens = b

    def stored_rows(self, rows: list[int], slot: int = -1) -> Any:
        """The stored hidden states of layer slot `slot` at token rows `rows`, as a reader gets them: bf16, fp8
        dequantized with its scales ([len(rows), H])."""
        import torch

        idx = torch.as_tensor(rows, dtype=torch.long)
        h = self._hidden[idx, slot]
        if self.storage_dtype == "fp8":
            return dequantize_fp8(h[:, None], self._scales[idx, slot][:, None])[:, 0]
        return h

    def write(self, fh: BinaryIO) -> int:
        import torch

        t, n_l, h = self.tokens, len(self.layer_ids), self.hidden_size
        offsets = torch.zeros(len(self.lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(self.lengths, dtype=torch.int64).cumsum(0)
        def rows(x: Any) -> list[Any]:  # the filled rows, as one chunk (none before the first add)
            return [x[:t]] if t else []

        tensors = [("hidden_states", "float8_e4m3fn" if self.storage_dtype == "fp8" else "bfloat16",
                    [t, n_l, h], rows(self._hidden))]
        if self.storage_dtype == "fp8":
            tensors.append(("hidden_scales", "float32", [t, n_l], rows(self._scales)))
        tensors += [("input_ids", "int32", [t], rows(self._ids)),
                    ("loss_mask", "uint8", [t], rows(self._mask)),
                    ("offsets", "int64", [len(self.lengths) + 1], [offsets])]
        meta = {"sample_ids": json.dumps(self.sample_ids), "layer_ids": json.dumps(self.layer_ids),
                "storage_dtype": self.storage_dtype, "hidden_size": str(h), "format": "draftline-extract-v1"}
        return write_safetensors_stream(fh, tensors, meta)


def load_part(path: str, dequantize: bool = True) -> dict[str, Any]:
    """One part as {"hidden_states" bf16 [T, L, H], "input_ids" int32 [T], "loss_mask" uint8 [T],
    "offsets" int64 [N+1], "sample_ids" list[str], "layer_ids" list[int], "storage_dtype" str}.
    fp8 parts are dequantized with their per-token-per-layer scales; with dequantize=False they stay
    float8_e4m3fn and "hidden_scales" (float32 [T, L]) comes along (the training stream dequantizes on
    the device). The tensors map the file (safetensors' mmap): no copy is made until they are read."""
    import torch
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        meta = f.metadata() or {}
        names = set(f.keys())
        missing = {"hidden_states", "input_ids", "loss_mask", "offsets"} - names
        if missing:
            raise PartFormatError(f"{path} is not an extraction part: it lacks {sorted(missing)}")
        hs = f.get_tensor("hidden_states")
        if hs.dtype == torch.float8_e4m3fn:
            if "hidden_scales" not in names:
                raise PartFormatError(f"{path}: fp8 hidden_states without hidden_scales; the part is corrupt")
            scales = f.get_tensor("hidden_scales")
            if dequantize:
                hs = dequantize_fp8(hs, scales)
        else:
            hs, scales = hs.to(torch.bfloat16), None
        out = {
            "hidden_states": hs,
            "input_ids": f.get_tensor("input_ids"),
            "loss_mask": f.get_tensor("loss_mask"),
            "offsets": f.get_tensor("offsets"),
        }
        if hs.dtype == torch.float8_e4m3fn:
            out["hidden_scales"] = scales
    out["sample_ids"] = json.loads(meta.get("sample_ids", "[]"))
    out["layer_ids"] = json.loads(meta.get("layer_ids", "[]"))
    out["storage_dtype"] = meta.get("storage_dtype", "bf16")
    return out
