"""Balanced packed batches (``ringseq.balance``): every rank's attention work, counted from the
dense reference mask, near the mean on rows packed from real document-length mixes."""
import json
import os
import re

import pytest
import torch

from ringseq.attention.masks import TokenInfo, documents
from ringseq.attention.work import per_rank
from ringseq.balance import balanced
from ringseq.layouts import Runs, global_positions
from ringseq.reference import visibility

MIXES = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "doc_lengths")


def packed_row(mix: str, N: int, seed: int) -> torch.Tensor:
    """[1, N] position ids of documents whose lengths are drawn from a published histogram."""
    with open(os.path.join(MIXES, f"{mix}.json")) as f:
        table = json.load(f)
    buckets = [tuple(int(x) for x in re.findall(r"\d+", k)) for k in table]
    shares = torch.tensor([float(v) for v in table.values()], dtype=torch.float64)
    g, pos = torch.Generator().manual_seed(seed), []
    while len(pos) < N:
        lo, hi = buckets[int(torch.multinomial(shares, 1, generator=g))]
        pos.extend(range(int(torch.randint(max(1, lo), max(2, hi), (1,), generator=g))))
    return torch.tensor(pos[:N])[None]


def ratio(work: list[int]) -> float:
    return max(work) * len(work) / sum(work)


@pytest.mark.parametrize("mix", ["pile", "prolong64k", "prolong512k"])
@pytest.mark.parametrize("P", [2, 4, 8])
def test_real_mixes_balance_within_five_percent(mix, P):
    N = 16384
    for seed in range(3):
        info = TokenInfo(doc=documents(packed_row(mix, N, seed)))
        layout = balanced(info, N, P)
        zigzag = ratio(per_rank(info, "zigzag", N, P))
        got = ratio(per_rank(info, layout, N, P))
        assert got <= 1.05 and got <= zigzag, (mix, P, seed, got, zigzag)
        if isinstance(layout, Runs):  # S / P tokens a rank, in at most 16 runs, global order inside
            for r in range(P):
                pos = global_positions(layout, N, P, r)
                assert pos.numel() == N // P and bool((pos[1:] > pos[:-1]).all())
                assert len(layout.segments[r]) <= 16


def test_work_of_a_batchs_own_layout_matches_the_dense_mask():
    S, P = 96, 4
    pos = torch.tensor([[*range(5), *range(3), *range(40), *range(48)], [*range(60), *range(36)]])
    mask = torch.ones(2, S, dtype=torch.long)
    mask[1, -7:] = 0
    info = TokenInfo(doc=documents(pos), valid=mask.bool())
    layout = balanced(info, S, P)
    assert isinstance(layout, Runs)
    dense = visibility(S, causal=True, position_ids=pos, attention_mask=mask).sum(-1).sum(0)  # keys per query
    work = [int(dense[global_positions(layout, S, P, r)].sum()) for r in range(P)]
    assert per_rank(info, layout, S, P) == work
    assert ratio(work) < ratio(per_rank(info, "zigzag", S, P))


def test_zigzag_where_it_is_already_even():
    S, P = 64, 4
    assert balanced(TokenInfo(), S, P) == "zigzag"  # one document per row: zigzag is exact
    assert balanced(TokenInfo(doc=documents(packed_row("pile", S, 0))), S, 1) == "zigzag"  # a ring of one
    short = torch.arange(S)[None] % 2  # documents of 2 tokens: every chunk the same work
    assert balanced(TokenInfo(doc=documents(short)), S, P) == "zigzag"


def test_every_rank_computes_the_same_layout():
    info = TokenInfo(doc=documents(packed_row("prolong512k", 8192, 3)))
    a, b = balanced(info, 8192, 4), balanced(TokenInfo(doc=info.doc.clone()), 8192, 4)
    assert isinstance(a, Runs) and a.segments == b.segments and a.checksum() == b.checksum()
