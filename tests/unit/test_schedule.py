"""The ring schedule against brute force: an S x S visibility matrix from the definitions.

Random layouts (also a batch's own runs, as ``ringseq.balance`` makes them), ring sizes, lengths, batches, packed documents, padding and windows
(hypothesis). For every rank, the calls of every ring step - unmasked ones counted whole,
masked ones through their ``RowMask`` - must cover each visible (query, key) pair exactly once
and no hidden pair; every slab's ``key_range`` must contain all the columns it can see; all
ranks must agree on the number of ring steps, which must be the fewest that reach every
visible key (exactly, when there is no padding; padding may only make it larger).
"""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringseq import LAYOUTS
from ringseq.attention.masks import RowMask, TokenInfo
from ringseq.attention.schedule import rank_schedule
from ringseq.balance import chunk_layout
from ringseq.layouts import global_positions, owner


def visibility(S, causal, window, doc, valid, B):
    """[B, S, S] bool from the definitions: causal, window, same document, valid key."""
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    vis = torch.ones(B, S, S, dtype=torch.bool)
    if causal:
        vis &= j <= i
    if window is not None:
        vis &= (i - j) < window
    if doc is not None:
        vis &= doc[:, :, None] == doc[:, None, :]
    if valid is not None:
        vis &= valid[:, None, :]
    return vis


@st.composite
def cases(draw):
    layout = draw(st.sampled_from(LAYOUTS + ("runs",)))
    P = draw(st.integers(1, 5))
    s = draw(st.integers(1, 5)) * (2 if layout == "zigzag" else 1)
    if layout == "runs":  # a batch's own layout (ringseq.balance): m chunks of c tokens a rank, dealt at random
        m, c = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        s = m * c
        layout = chunk_layout(draw(st.permutations([r for r in range(P) for _ in range(m)])), P, c)
    S, B = P * s, draw(st.integers(1, 2))
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, S + 1))) if causal else None
    doc = valid = None
    if draw(st.booleans()):
        starts = torch.tensor(draw(st.lists(st.booleans(), min_size=B * S, max_size=B * S))).reshape(B, S)
        starts[:, 0] = False
        doc = torch.cumsum(starts.long(), 1)
    if draw(st.booleans()):
        valid = torch.tensor(draw(st.lists(st.booleans(), min_size=B * S, max_size=B * S))).reshape(B, S)
    return layout, P, S, B, causal, window, doc, valid


@settings(max_examples=500, deadline=None)
@given(cases())
def test_schedule_covers_exactly_the_visible_pairs(case):
    layout, P, S, B, causal, window, doc, valid = case
    s = S // P
    info = TokenInfo(doc=doc, valid=valid)
    vis = visibility(S, causal, window, doc, valid, B)
    steps = set()
    for r in range(P):
        plan = rank_schedule(layout, S, P, r, causal, info, window)
        steps.add(plan.steps)
        assert len(plan.calls) == plan.steps
        qpos = global_positions(layout, S, P, r)
        covered = torch.zeros(B, s, S, dtype=torch.long)
        for t, calls in enumerate(plan.calls):
            kpos = global_positions(layout, S, P, (r - t) % P)
            for pc in calls:
                qi, ki = torch.arange(s)[pc.call.q_rows], torch.arange(s)[pc.call.k_rows]
                if pc.masked:
                    assert torch.equal(pc.q.positions(), qpos[qi]) and torch.equal(pc.k.positions(), kpos[ki])
                    mask = RowMask(pc.q, pc.k, info, window, causal, B)
                    seen = mask.rows(0, len(qi))
                    for a in range(len(qi)):
                        for b in range(a + 1, len(qi) + 1):
                            lo, hi = mask.key_range(a, b)
                            assert not seen[:, a:b, :lo].any() and not seen[:, a:b, hi:].any(), (a, b, lo, hi)
                            assert torch.equal(mask.rows(a, b, lo, hi), seen[:, a:b, lo:hi])
                else:
                    seen = torch.ones(len(qi), len(ki), dtype=torch.bool)
                    seen = (seen.tril() if pc.call.causal else seen).expand(B, -1, -1)
                covered[:, qi[:, None], kpos[ki][None, :]] += seen.long()
        assert torch.equal(covered, vis[:, qpos].long()), f"rank {r}"
    assert len(steps) == 1, f"ranks disagree on the ring steps: {steps}"
    b, i, j = vis.nonzero(as_tuple=True)
    index = torch.arange(S)
    rank_of = owner(layout, S, P, index)
    fewest = 1 + int(((rank_of[i] - rank_of[j]) % P).max()) if len(i) else 1
    (T,) = steps
    assert T == fewest if valid is None else T >= fewest, (T, fewest)
