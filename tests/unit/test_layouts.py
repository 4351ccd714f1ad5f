"""Layout index math and the causal block plan, checked by brute force (no process group)."""
import pytest
import torch

from ringseq import LAYOUTS, RingSeqError
from ringseq.layouts import check_length, gather_order, global_positions
from ringseq.attention.schedule import block_plan
from ringseq.sharding import shard_tensor


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_shards_partition_the_sequence_in_order(layout, P):
    S = 12 * P
    shards = [global_positions(layout, S, P, r) for r in range(P)]
    assert sorted(torch.cat(shards).tolist()) == list(range(S))
    for pos in shards:
        assert len(pos) == S // P and torch.all(pos[1:] > pos[:-1])  # increasing global order
    x = torch.arange(S)
    joined = torch.cat([shard_tensor(x, 0, layout, P, r) for r in range(P)])
    assert torch.equal(joined[gather_order(layout, S, P)], x)


def test_zigzag_holds_mirrored_chunks():
    P, S = 4, 16  # chunks of 2
    assert global_positions("zigzag", S, P, 0).tolist() == [0, 1, 14, 15]
    assert global_positions("zigzag", S, P, 1).tolist() == [2, 3, 12, 13]
    assert global_positions("striped", S, P, 1).tolist() == [1, 5, 9, 13]


@pytest.mark.parametrize("layout,S,P", [("zigzag", 6, 2), ("contiguous", 7, 2), ("striped", 10, 4)])
def test_unsplittable_length_is_refused(layout, S, P):
    with pytest.raises(RingSeqError, match="pad the sequence"):
        check_length(layout, S, P)
    with pytest.raises(RingSeqError):
        shard_tensor(torch.zeros(S), 0, layout, P, 0)


def test_unknown_layout_is_refused():
    with pytest.raises(RingSeqError, match="choose one of"):
        check_length("spiral", 8, 2)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_block_plan_covers_exactly_the_visible_pairs(layout, P, causal):
    """Over all ring steps, every visible (query, key) pair is computed exactly once and no
    hidden pair is ever computed."""
    S = 8 * P
    s = S // P
    for r in range(P):
        qpos = global_positions(layout, S, P, r)
        covered = torch.zeros(s, S, dtype=torch.int64)
        for j in range(P):
            kpos = global_positions(layout, S, P, j)
            for call in block_plan(layout, s, P, r, j, causal):
                qi = torch.arange(s)[call.q_rows]
                ki = torch.arange(s)[call.k_rows]
                if call.causal:
                    assert len(qi) == len(ki)
                # causal calls are square and top-left aligned: local key <= local query
                vis = torch.ones(len(qi), len(ki), dtype=torch.bool)
                if call.causal:
                    vis = vis.tril()
                rows, cols = torch.nonzero(vis, as_tuple=True)
                covered[qi[rows], kpos[ki[cols]]] += 1
        want = (torch.arange(S)[None, :] <= qpos[:, None]) if causal else torch.ones(s, S, dtype=torch.bool)
        assert torch.equal(covered, want.long()), f"rank {r}"


def test_zigzag_off_diagonal_steps_are_half_blocks():
    P, s = 4, 8
    for r in range(P):
        for j in range(P):
            calls = block_plan("zigzag", s, P, r, j, True)
            work = sum((c.q_rows.stop - c.q_rows.start) * (c.k_rows.stop - c.k_rows.start) for c in calls)
            assert len(calls) == 1
            assert work == (s * s if j == r else s * s // 2)
