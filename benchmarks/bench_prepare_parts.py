"""prepare's work per sample, part by part: which parts stay in its own process when workers encode (the serial
part that bounds prepare on a node's many cores) and which the workers share.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_prepare_parts.py ROWS.jsonl [--samples 400] [--target MODEL]

ROWS: a JSONL of conversations (benchmarks/bench_data_scale.py writes one at the Kimi preset's lengths in its
--work folder). The first SAMPLES rows go through the code prepare runs (tasks/data/), one part at a time, each
timed in CPU seconds of this process (time.process_time: a shared machine's other work is not counted):

- the parent reads the rows (JSON, normalize, the conversation id) and spills them;   [parent, serial]
- a worker reads a conversation back from that spill and encodes it (template, tokens, the verified mask);
                                                                                         [workers]
- the parent appends each result to the samples' spill;                                 [parent, serial]
- a worker gathers a shard's samples from the two spills and builds its Parquet bytes,
  which the parent writes to the store (its write is not timed here).                   [workers]

The pool's hand-off of each chunk's results (concurrent.futures pickles them) is not timed here. With
data.workers 1 every part runs in the one process. Until e4a901d the parent built the shards' Parquet bytes
itself (benchmarks/RESULTS.md, "prepare over a node's cores").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rows", type=Path)
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--target", default=None, help="model folder whose tokenizer and template to use (default: the demo's)")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from tasks.core.config import RunConfig
    from tasks.data.chat import make_masker
    from tasks.data.encoding import _encode_one
    from tasks.data.prepare import _Encoded
    from tasks.data.sources import conversation_id, conversation_spill, normalize_row, spilled_conversation
    from tasks.formats.samples import parquet_bytes

    cfg = RunConfig.model_validate({
        "target": {"max_model_len": 12288, **({"model": a.target} if a.target else {})},
        "data": {"sources": [{"path": str(a.rows)}], "max_length": 12287, "num_shards": 1},
        "regenerate": {"enabled": False}})
    masker = make_masker(cfg)
    with open(a.rows) as fh:
        lines = [ln for _, ln in zip(range(a.samples), fh)]
    n = len(lines)
    rows: list[tuple[str, str, float]] = []

    def timed(part: str, where: str, fn):
        t = time.process_time()
        out = fn()
        rows.append((part, where, (time.process_time() - t) / n * 1e3))
        return out

    with tempfile.TemporaryDirectory() as tmp:
        convs = conversation_spill(os.path.join(tmp, "conversations.arrow"))

        def read_rows():
            for ln in lines:
                messages = normalize_row(json.loads(ln), "auto")
                convs.append({"sample_id": conversation_id(messages), "source": "rows",
                              "messages": json.dumps(messages, ensure_ascii=False)})

        timed("read, normalize, id, spill the conversations", "parent", read_rows)
        convs.finish()
        got = timed("read a conversation back from the spill", "worker",
                    lambda: [spilled_conversation(convs.get(i), i) for i in range(n)])
        done = timed("encode (template, tokens, verified mask)", "worker",
                     lambda: [_encode_one(masker, c, cfg.data) for c in got])
        encoded = _Encoded(os.path.join(tmp, "samples.arrow"), convs)
        timed("append to the samples' spill", "parent", lambda: [encoded.add(e) for e in done if e.input_ids is not None])
        encoded.spill.finish()
        kept = encoded.spill.count
        samples = timed("gather a shard's samples from the spills", "worker", lambda: encoded.load(list(range(kept))))
        timed("the shard's Parquet bytes", "worker", lambda: parquet_bytes(samples))
        encoded.spill.close()
        convs.close()

    print(f"{n} rows of {a.rows.name}, {kept} samples kept; CPU milliseconds per row")
    print("| part | where | ms |\n|---|---|---:|")
    for part, where, ms in rows:
        print(f"| {part} | {where} | {ms:.3f} |")
    for where in ("parent", "worker"):
        print(f"| **all of the {where}'s** | {where} | **{sum(ms for _, w, ms in rows if w == where):.3f}** |")


if __name__ == "__main__":
    main()
