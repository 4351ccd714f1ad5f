"""Property tests (hypothesis) of the layouts, shard/gather index math and padding: any ring x
Ulysses shape, any splittable length, any tensor dimension (no process group)."""
import types

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringseq import LAYOUTS
from ringseq.batch import pad_to_layout
from ringseq.layouts import gather_order, multiple, owner, sp_positions
from ringseq.loss import IGNORE
from ringseq.sharding import shard_tensor

shapes = st.tuples(st.sampled_from(LAYOUTS), st.integers(1, 6), st.sampled_from([1, 2, 4]), st.integers(1, 5))


@settings(max_examples=150, deadline=None)
@given(shapes, st.integers(0, 2), st.integers(1, 3))
def test_shards_partition_and_gather_inverts(shape, dim, width):
    layout, R, U, blocks = shape
    S = multiple(layout, R, U) * blocks
    sizes = [width] * 3
    sizes[dim] = S
    x = torch.arange(torch.Size(sizes).numel()).reshape(sizes)
    P = R * U
    pieces = [shard_tensor(x, dim, layout, R, r, U) for r in range(P)]
    assert all(p.size(dim) == S // P for p in pieces)
    positions = torch.cat([sp_positions(layout, S, R, U, r) for r in range(P)])
    assert sorted(positions.tolist()) == list(range(S))  # every token on exactly one rank
    joined = torch.cat(pieces, dim).index_select(dim, gather_order(layout, S, R, U))
    assert torch.equal(joined, x)  # what gather computes from the all-gathered pieces


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(LAYOUTS), st.integers(1, 8), st.integers(1, 6))
def test_owner_agrees_with_the_shards(layout, R, blocks):
    S = multiple(layout, R) * blocks
    for r in range(R):
        index = sp_positions(layout, S, R, 1, r)
        assert torch.equal(owner(layout, S, R, index), torch.full_like(index, r))


def _sp(layout, R, U):
    return types.SimpleNamespace(layout=layout, ring_size=R, ulysses_size=U, size=R * U, rank=0)


@settings(max_examples=100, deadline=None)
@given(shapes, st.integers(1, 40), st.integers(1, 3), st.booleans())
def test_padding_makes_any_length_splittable_and_keeps_the_real_tokens(shape, S, B, with_mask):
    layout, R, U, _ = shape
    ids = torch.arange(B * S).reshape(B, S) % 97 + 1
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(S).expand(B, S)}
    if with_mask:
        batch["attention_mask"] = torch.ones(B, S, dtype=torch.long)
    padded, pad = pad_to_layout(batch, _sp(layout, R, U))
    total = S + pad
    assert total % multiple(layout, R, U) == 0 and 0 <= pad < multiple(layout, R, U)
    assert torch.equal(padded["input_ids"][:, :S], ids) and torch.equal(padded["labels"][:, :S], ids)
    assert bool((padded["labels"][:, S:] == IGNORE).all())
    assert torch.equal(padded["position_ids"], torch.arange(total).expand(B, total))  # positions continue
    if with_mask:
        assert padded["attention_mask"][:, S:].sum() == 0 and bool(padded["attention_mask"][:, :S].all())
