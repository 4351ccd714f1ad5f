"""The varlen runs of masked calls (``ringseq.attention.kernels.runs``) against the schedule.

For every masked call of random schedules (the cases of ``test_schedule``), the runs - when
they exist - must let each packed query row see exactly the keys its ``RowMask`` shows, by
flash-attn's own rule for cumulative lengths and one window pair; and the inputs the fine-tuning
families send (documents, left padding, windows, one sample) must be runs, so that on CUDA they
get the varlen kernel rather than FlexAttention.
"""
import torch
from hypothesis import given, settings

from ringseq.attention.kernels.runs import runs, visible
from ringseq.attention.masks import RowMask, TokenInfo
from ringseq.attention.schedule import rank_schedule

from .test_schedule import cases


def _check_call(pc, info, window, causal, B):
    """True when the call is runs (and they are right), False when it is not runs."""
    r = runs(pc.q, pc.k, info, window, causal, B)
    if r is None:
        return False
    n, m = pc.q.n, pc.k.n
    assert int(r.cu_q[-1]) == B * n and int(r.cu_k[-1]) == B * m, (r, n, m)
    assert bool((r.cu_q.diff() >= 0).all()) and bool((r.cu_k.diff() >= 0).all())
    want = torch.zeros(B * n, B * m, dtype=torch.bool)
    rows = RowMask(pc.q, pc.k, info, window, causal, B).rows(0, n)
    for b in range(B):
        want[b * n:(b + 1) * n, b * m:(b + 1) * m] = rows[b]
    assert torch.equal(visible(r), want), (pc, r)
    return True


@settings(max_examples=300, deadline=None)
@given(cases())
def test_runs_show_each_row_exactly_its_visible_keys(case):
    layout, P, S, B, causal, window, doc, valid = case
    info = TokenInfo(doc=doc, valid=valid)
    for rank in range(P):
        for step in rank_schedule(layout, S, P, rank, causal, info, window).calls:
            for pc in step:
                if pc.masked:
                    _check_call(pc, info, window, causal, B)


def _masked_calls(layout, S, P, info, window, B=1):
    return [(pc, B) for r in range(P) for step in rank_schedule(layout, S, P, r, True, info, window).calls
            for pc in step if pc.masked]


def test_documents_padding_and_windows_are_runs():
    S, P = 64, 4
    pos = torch.tensor([list(range(10)) + list(range(30)) + list(range(24))])
    doc = torch.cumsum(torch.diff(pos, prepend=pos[:, :1] + 1) != 1, 1)
    left_pad = torch.ones(2, S, dtype=torch.bool)
    left_pad[0, :5], left_pad[1, :12] = False, False
    right_pad = torch.ones(2, S, dtype=torch.bool)  # the same number of pads in every sample, as
    right_pad[:, -13:] = False                      # the patched forward adds to fit the layout
    for layout in ("zigzag", "contiguous", "striped"):
        for info, window, B in [(TokenInfo(doc=doc), None, 1), (TokenInfo(doc=doc), 7, 1),
                                (TokenInfo(valid=left_pad), None, 2), (TokenInfo(), 5, 1),
                                (TokenInfo(doc=doc, valid=left_pad[:1]), 9, 1),
                                (TokenInfo(valid=right_pad), None, 2)]:
            calls = _masked_calls(layout, S, P, info, window, B)
            assert calls, (layout, window)
            for pc, b in calls:
                assert _check_call(pc, info, window, True, b), (layout, info, window, pc)


def test_a_hole_of_padding_inside_a_document_is_not_runs():
    valid = torch.ones(1, 16, dtype=torch.bool)
    valid[0, 5] = False  # a padding key between valid keys of the one document
    info = TokenInfo(valid=valid)
    (pc, B), = [c for c in _masked_calls("contiguous", 16, 1, info, None)]
    assert runs(pc.q, pc.k, info, None, True, B) is None
