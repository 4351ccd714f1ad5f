"""Which kernel calls a ring step needs: the causal block plan (shapes: ``ringseq.shapes``).

At ring step t, rank r holds its own queries and the keys/values of rank j = (r - t) mod P.
``block_plan`` lists the kernel calls that cover exactly the visible (query, key) pairs of
that block, as ``Call(q_rows, k_rows, causal)`` with local slices. Fully hidden sub-blocks
produce no call at all, so under zigzag every off-diagonal step computes exactly half a
block on every rank, and the diagonal step one causal block.
"""
from __future__ import annotations

import dataclasses
import functools

from .layouts import segments


@dataclasses.dataclass(frozen=True)
class Call:
    q_rows: slice
    """Local query rows of this call."""
    k_rows: slice
    """Local key/value rows of this call."""
    causal: bool
    """Top-left causal mask inside the call (only on square calls)."""


def _relation(q_run, k_run) -> str:
    """How one run of queries sees one run of keys under a causal mask."""
    (qa, n), (ka, m) = q_run, k_run
    if ka + m - 1 <= qa:
        return "full"
    if ka >= qa + n:
        return "none"
    if (qa, n) == (ka, m):
        return "causal"
    raise AssertionError(f"runs {q_run} and {k_run} straddle each other")  # layouts never do this


def _runs_plan(q_runs, k_runs) -> tuple[Call, ...]:
    starts_q = [sum(n for _, n in q_runs[:i]) for i in range(len(q_runs))]
    starts_k = [sum(n for _, n in k_runs[:i]) for i in range(len(k_runs))]
    rel = [[_relation(qr, kr) for kr in k_runs] for qr in q_runs]
    if q_runs == k_runs:
        # Own block: local order is global order, so one local causal call is exact when
        # every pair of runs is either identical or fully ordered.
        return (Call(slice(0, sum(n for _, n in q_runs)), slice(0, sum(n for _, n in k_runs)), True),)
    calls = []
    # Group query runs that see the same contiguous span of key runs into one call.
    spans = []
    for i, row in enumerate(rel):
        if "causal" in row:
            raise AssertionError("causal sub-block off the diagonal")
        full = [b for b, x in enumerate(row) if x == "full"]
        if full and full != list(range(full[0], full[-1] + 1)):
            raise AssertionError("visible key runs are not contiguous")
        spans.append((full[0], full[-1]) if full else None)
    i = 0
    while i < len(q_runs):
        span, first = spans[i], i
        while i + 1 < len(q_runs) and spans[i + 1] == span:
            i += 1
        if span is not None:
            qa, qb = starts_q[first], starts_q[i] + q_runs[i][1]
            ka, kb = starts_k[span[0]], starts_k[span[1]] + k_runs[span[1]][1]
            calls.append(Call(slice(qa, qb), slice(ka, kb), False))
        i += 1
    return tuple(calls)


@functools.lru_cache(maxsize=1024)
def block_plan(layout: str, s: int, P: int, r: int, j: int, causal: bool) -> tuple[Call, ...]:
    """Kernel calls for rank r's queries against rank j's keys (both of local length s)."""
    whole = slice(0, s)
    if not causal:
        return (Call(whole, whole, False),)
    if layout == "striped":
        # Query a of rank r is global a*P + r; key b of rank j is b*P + j. Visible when b < a,
        # or b == a and j <= r: a causal square, shifted by one row when j > r.
        if j <= r:
            return (Call(whole, whole, True),)
        return (Call(slice(1, s), slice(0, s - 1), True),) if s > 1 else ()
    return _runs_plan(segments(layout, s, P, r), segments(layout, s, P, j))


@functools.lru_cache(maxsize=1024)
def run_calls(layout: str, s: int, P: int, r: int, j: int, causal: bool) -> tuple[Call, ...]:
    """Like ``block_plan`` but one call per (query run, key run) pair, never merged, so that
    each call spans one contiguous range of global indices on each side (masks use this to
    bound the visible pairs tightly)."""
    if layout == "striped" or not causal:
        return block_plan(layout, s, P, r, j, causal)
    q_runs, k_runs = segments(layout, s, P, r), segments(layout, s, P, j)
    calls, qa = [], 0
    for q_run in q_runs:
        ka = 0
        for k_run in k_runs:
            rel = _relation(q_run, k_run)
            if rel != "none":
                calls.append(Call(slice(qa, qa + q_run[1]), slice(ka, ka + k_run[1]), rel == "causal"))
            ka += k_run[1]
        qa += q_run[1]
    return tuple(calls)
