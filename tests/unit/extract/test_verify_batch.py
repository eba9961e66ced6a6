"""The extraction check scores its sampled rows in batches (one lm_head pass per `batch_rows`, not per part): the
figures are those of scoring each part on its own, the rows survive their buffer's reuse, and a token outside the
lm_head still fails the shard."""

from __future__ import annotations

import pytest
import torch

from tasks.engine.target import VerifierHead
from tasks.extract.shards import ExtractError
from tasks.extract.verify import StateCheck
from tasks.formats.parts import PartBuffer

H, V = 32, 50


def head() -> VerifierHead:
    g = torch.Generator().manual_seed(0)
    h = VerifierHead.__new__(VerifierHead)
    h.norm = torch.nn.RMSNorm(H, eps=1e-6)
    h.lm_head = torch.randn(V, H, generator=g).to(torch.bfloat16)
    return h


def fill(buf: PartBuffer, part: int, samples: int = 5, n: int = 7) -> None:
    """Even samples' next token is the head's own choice (they agree), odd ones' a random token."""
    g = torch.Generator().manual_seed(100 + part)
    for s in range(samples):
        hs = torch.randn(n, 2, H, generator=g).to(torch.bfloat16)
        token = (int(head().logits(hs[-1:, -1]).argmax()) if s % 2 == 0
                 else int(torch.randint(0, V, (1,), generator=g)))
        buf.add(f"p{part}-s{s}", list(range(n)), [1] * n, hs, next_token=token)


def run(batch_rows: int, parts: int = 4, positions: int = 4) -> tuple[dict, list]:
    check = StateCheck(head(), positions, 0.5, batch_rows=batch_rows)
    buf = PartBuffer([1, 2], H, "bf16", 64)  # one buffer, refilled part after part as the writers do
    for p in range(parts):
        fill(buf, p)
        check.add_part(buf)
        buf.reset()
    return check.stats(), check.parts


@pytest.mark.parametrize("batch_rows", [2, 512])  # a flush every part or so, and one at the end
def test_batched_scoring_gives_the_per_part_figures(batch_rows):
    want_stats, want_parts = run(batch_rows=1)  # each part scored at once: how every part was checked before
    got_stats, got_parts = run(batch_rows)
    strip = lambda s: {k: v for k, v in s.items() if k != "seconds"}  # noqa: E731
    assert strip(got_stats) == strip(want_stats) and got_stats["positions"] == 4 * 4
    assert got_parts == want_parts and len(got_parts) == 4
    assert 0 < got_stats["top1_agreement"] < 1  # random states against random tokens: the rows differ per part


def test_a_token_outside_the_lm_head_still_fails():
    check = StateCheck(head(), 2, 0.5)
    buf = PartBuffer([1, 2], H, "bf16", 64)
    buf.add("s", [1, 2, 3], [1, 1, 1], torch.zeros(3, 2, H, dtype=torch.bfloat16), next_token=V + 5)
    check.add_part(buf)
    with pytest.raises(ExtractError, match=f"next token {V + 5} is outside the target's lm_head of {V} rows"):
        check.failure(0, [1, 2], "bf16", None)
