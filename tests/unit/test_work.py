"""Attention work per rank (``ringseq.attention.work``) against the dense reference mask."""
import pytest
import torch

from ringseq.attention.masks import TokenInfo, documents
from ringseq.attention.work import chunk_work, per_rank, visible_keys
from ringseq.layouts import global_positions
from ringseq.reference import visibility


def _case(seed: int, B: int, S: int):
    g = torch.Generator().manual_seed(seed)
    pos = []
    for _ in range(B):
        row = []
        while len(row) < S:
            row.extend(range(int(torch.randint(1, S // 2, (1,), generator=g))))
        pos.append(row[:S])
    pos = torch.tensor(pos)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, : int(torch.randint(1, S // 3, (1,), generator=g))] = 0
    blocks = torch.full((B, S), -1)
    blocks[:, S // 2 - 2:S // 2 + 3] = 0
    return pos, mask, blocks


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("parts", ["docs", "pad", "blocks", "docs+pad+blocks", "none"])
def test_visible_keys_match_the_dense_mask(seed, window, parts):
    B, S = 2, 48
    pos, mask, blocks = _case(seed, B, S)
    info = TokenInfo(doc=documents(pos) if "docs" in parts else None,
                     valid=mask.bool() if "pad" in parts else None,
                     block=blocks.int() if "blocks" in parts else None)
    dense = visibility(S, causal=True, window=window, position_ids=pos if "docs" in parts else None,
                       attention_mask=mask if "pad" in parts else None,
                       blocks=blocks if "blocks" in parts else None).expand(B, S, S)
    assert torch.equal(visible_keys(info, S, window).expand(B, S), dense.sum(-1))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "striped"])
def test_per_rank_sums_each_ranks_queries(layout):
    S, P = 64, 4
    pos, mask, _ = _case(7, 2, S)
    info = TokenInfo(doc=documents(pos), valid=mask.bool())
    dense = visibility(S, causal=True, position_ids=pos, attention_mask=mask).sum(-1).sum(0)  # per query
    work = per_rank(info, layout, S, P)
    assert work == [int(dense[global_positions(layout, S, P, r)].sum()) for r in range(P)]
    assert sum(work) == int(dense.sum())
    one = per_rank(TokenInfo(), "zigzag", S, P)  # one causal sequence: zigzag balances it exactly
    assert len(set(one)) == 1 and sum(one) == S * (S + 1) // 2


@pytest.mark.parametrize("parts", ["docs", "none", "docs+pad", "docs+blocks"])
def test_chunk_work_sums_the_dense_mask_by_chunk(parts):
    B, S, c = 2, 48, 6
    pos, mask, blocks = _case(3, B, S)
    info = TokenInfo(doc=documents(pos) if "docs" in parts else None, valid=mask.bool() if "pad" in parts else None,
                     block=blocks.int() if "blocks" in parts else None)
    dense = visibility(S, causal=True, position_ids=pos if "docs" in parts else None,
                       attention_mask=mask if "pad" in parts else None,
                       blocks=blocks if "blocks" in parts else None).expand(B, S, S)
    rows = dense.sum(-1).sum(0) if "docs" in parts or "pad" in parts or "blocks" in parts else dense[0].sum(-1)
    assert torch.equal(chunk_work(info, S, c), rows.reshape(-1, c).sum(1))
