"""Which kernel calls each ring step needs, and how many ring steps there are (``ringseq.shapes``).

At ring step t, rank r holds its own queries and the keys/values of rank j = (r - t) mod P.

``block_plan`` lists the kernel calls that cover exactly the causally visible (query, key)
pairs of that block, as ``Call(q_rows, k_rows, causal)`` with local slices; fully hidden
sub-blocks produce no call, so under zigzag every off-diagonal step computes exactly half a
block on every rank and the diagonal step one causal block.

With documents, padding or a window (``TokenInfo``, ``window``) ``rank_schedule`` plans *this
rank's* calls only: one call per (query run, key run) pair (``run_calls``), each side an
arithmetic run of global indices (``Span``), whose status - hidden (skipped), fully visible
(no mask) or partly visible (a ``RowMask``) - follows from the run's end points: document ids
never decrease along a run and the valid keys of a run are a difference of prefix sums. The
number of ring steps every rank runs, ``steps_needed``, follows from the farthest key each
query run can see, for all ranks at once in a few vectorised operations. Planning costs
O(P) per rank, not O(P^2) or O(S) per call. Bidirectional blocks (``TokenInfo.block``) make a
causal schedule plan every (query run, key run) pair: a pair whose keys all come after its
queries is hidden unless one block spans the gap between them, and the causal part of every
call goes into its mask.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ringseq.layouts import Runs, check_length, owner, runs, segments

from .masks import TokenInfo


@dataclasses.dataclass(frozen=True)
class Call:
    q_rows: slice
    """Local query rows of this call."""
    k_rows: slice
    """Local key/value rows of this call."""
    causal: bool
    """Top-left causal mask inside the call (only on square calls)."""


@dataclasses.dataclass(frozen=True)
class Span:
    """Global token indices start, start + step, ..., n of them (one side of a call)."""

    start: int
    step: int
    n: int

    def at(self, i: int) -> int:
        return self.start + i * self.step

    def slice(self, a: int = 0, b: int | None = None) -> slice:
        """The slice of a global-order tensor that selects items a..b of the span."""
        return slice(self.at(a), self.at(self.n if b is None else b), self.step)

    def positions(self, a: int = 0, b: int | None = None) -> torch.Tensor:
        return torch.arange(self.at(a), self.at(self.n if b is None else b), self.step)

    def first_at_or_after(self, x: int) -> int:
        return min(max(-((self.start - x) // self.step), 0), self.n)

    def count_at_or_before(self, x: int) -> int:
        return min(max((x - self.start) // self.step + 1, 0), self.n)


@dataclasses.dataclass(frozen=True)
class PlannedCall:
    """A kernel call, whether it needs a mask, and (for masked calls) its global spans."""

    call: Call
    masked: bool
    q: Span | None = None
    k: Span | None = None


@dataclasses.dataclass(frozen=True)
class RankSchedule:
    steps: int
    """Ring steps every rank of the ring runs (the same number on all of them)."""
    calls: tuple[tuple[PlannedCall, ...], ...]
    """This rank's calls at each ring step t < steps, against rank (r - t) mod P."""


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
    if q_runs == k_runs:
        # Own block: local order is global order, so one local causal call is exact when
        # every pair of runs is either identical or fully ordered.
        return (Call(slice(0, sum(n for _, n in q_runs)), slice(0, sum(n for _, n in k_runs)), True),)
    spans = []  # per query run: the contiguous range of key runs it sees entirely
    for q_run in q_runs:
        row = [_relation(q_run, k_run) for k_run in k_runs]
        if "causal" in row:
            raise AssertionError("causal sub-block off the diagonal")
        full = [b for b, x in enumerate(row) if x == "full"]
        if full and full != list(range(full[0], full[-1] + 1)):
            raise AssertionError("visible key runs are not contiguous")
        spans.append((full[0], full[-1]) if full else None)
    calls, i = [], 0
    while i < len(q_runs):  # query runs that see the same key runs share one call
        span, first = spans[i], i
        while i + 1 < len(q_runs) and spans[i + 1] == span:
            i += 1
        if span is not None:
            qa, qb = starts_q[first], starts_q[i] + q_runs[i][1]
            ka, kb = starts_k[span[0]], starts_k[span[1]] + k_runs[span[1]][1]
            calls.append(Call(slice(qa, qb), slice(ka, kb), False))
        i += 1
    return tuple(calls)


@functools.lru_cache(maxsize=4096)
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


@functools.lru_cache(maxsize=4096)
def run_calls(layout: str, s: int, P: int, r: int, j: int, causal: bool) -> tuple[Call, ...]:
    """Like ``block_plan`` but one call per (query run, key run) pair, never merged, so that
    each side of a call is one arithmetic run of global indices (masks bound it tightly)."""
    if layout == "striped":
        return block_plan(layout, s, P, r, j, causal)
    q_runs, k_runs = segments(layout, s, P, r), segments(layout, s, P, j)
    calls, qa = [], 0
    for q_run in q_runs:
        ka = 0
        for k_run in k_runs:
            rel = _relation(q_run, k_run) if causal else "full"
            if rel != "none":
                calls.append(Call(slice(qa, qa + q_run[1]), slice(ka, ka + k_run[1]), rel == "causal"))
            ka += k_run[1]
        qa += q_run[1]
    return tuple(calls)


def _span(rank_runs, rows: slice) -> Span:
    """The global span of local ``rows`` (which lie inside one run of the rank)."""
    offset = 0
    for start, n, step in rank_runs:
        if offset <= rows.start < offset + n:
            assert rows.stop <= offset + n, "a call side crosses runs"
            return Span(start + (rows.start - offset) * step, step, rows.stop - rows.start)
        offset += n
    raise AssertionError(f"rows {rows} outside the rank's runs")


def steps_needed(layout: str, S: int, P: int, causal: bool, info: TokenInfo, window: int | None) -> int:
    """Ring steps T that every rank runs: one more than the farthest ring distance between a
    query and a key it may see, over all ranks (computed identically on every rank)."""
    if P == 1:
        return 1
    if info.trivial and window is None:
        return P
    s = check_length(layout, S, P)
    if isinstance(layout, Runs):
        return _runs_steps(layout, S, P, causal, info, window)
    if layout == "striped":
        return _striped_steps(S, P, causal, info, window)
    chunk = s if layout == "contiguous" else s // 2
    starts = torch.arange(0, S, chunk)  # one query run per chunk; its rank is the chunk's owner
    rank = owner(layout, S, P, starts)
    lo, hi = _key_bounds(starts, starts + chunk, S, causal, info, window)
    chunks = torch.arange(S // chunk)
    seen = (chunks[None] >= (lo // chunk)[:, None]) & (chunks[None] <= ((hi - 1) // chunk)[:, None])
    if info.valid is not None:  # a chunk of padding only is seen by no one
        seen &= info.valid.reshape(info.valid.size(0), -1, chunk).any(2).any(0)[None]
    distance = (rank[:, None] - owner(layout, S, P, chunks * chunk)[None]) % P
    return 1 + int(distance[seen].max()) if bool(seen.any()) else 1


def _runs_steps(layout: Runs, S: int, P: int, causal: bool, info: TokenInfo, window) -> int:
    """``steps_needed`` for a batch's own runs: every run of every rank against every other."""
    starts, lengths, rank = layout.table()
    ends = starts + lengths
    lo, hi = _key_bounds(starts, ends, S, causal, info, window)
    seen = (starts[None] < hi[:, None]) & (ends[None] > lo[:, None])  # [query run, key run]
    if info.valid is not None:  # a run of padding only is seen by no one
        seen &= (info.valid_count(starts, ends - 1, 1) > 0).any(0)[None]
    distance = (rank[:, None] - rank[None]) % P
    return 1 + int(distance[seen].max()) if bool(seen.any()) else 1


def _key_bounds(first: torch.Tensor, end: torch.Tensor, S: int, causal: bool, info: TokenInfo, window):
    """[lo, hi): the global keys that any query of the runs [first, end) may see, over the batch."""
    lo = torch.zeros_like(first)
    if window is not None:
        lo = (first - window + 1).clamp(min=0)
    if info.doc is not None:
        lo = torch.maximum(lo, info.doc_start(first).min(0).values)
    if causal:
        hi = end if info.block is None else torch.maximum(end, info.reach(end - 1).max(0).values)
    elif info.doc is not None:
        hi = info.doc_end(end - 1).max(0).values
    else:
        hi = torch.full_like(first, S)
    return lo, hi


def _striped_steps(S: int, P: int, causal: bool, info: TokenInfo, window) -> int:
    """Token i lives on rank i mod P, so a key d places back is d ring steps back (mod P). A
    causal query reaches back at most window - 1 tokens and to its document's first token, so
    the farthest distance is min(window, longest document) - 1. Without causality a document of
    two tokens already looks one step *ahead*, which is P - 1 steps round the ring."""
    reach = S
    if info.doc is not None:
        reach = info.longest_document()
    if not causal or info.block is not None:  # a block reaches ahead: a key one place on is P - 1 steps back
        return P if reach > 1 else 1
    if window is not None:
        reach = min(reach, window)
    return min(P, reach)


def _status(calls, info: TokenInfo, window: int | None, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """For planned (q span, k span) pairs: (hidden [n], masked [n]) bool. Exact for a run pair
    (the run's end points decide, documents being non-decreasing) except that a pair whose
    visible part is empty only through the combination of window, documents and padding of
    different samples may be called masked rather than hidden: its mask then hides everything.
    ``causal``: the calls are unmasked by causality (the bidirectional-block plan), so the
    causal term is decided here: keys all after the queries are hidden unless one block holds
    the last query and the first key (a block is a run: it then spans the gap, and conversely)."""
    qa = torch.tensor([q.start for _, q, _ in calls])
    qz = torch.tensor([q.at(q.n - 1) for _, q, _ in calls])
    ka = torch.tensor([k.start for _, _, k in calls])
    kz = torch.tensor([k.at(k.n - 1) for _, _, k in calls])
    n_keys = torch.tensor([k.n for _, _, k in calls])
    return _status_of(qa, qz, ka, kz, n_keys, calls[0][2].step, info, window, causal)


def _status_of(qa, qz, ka, kz, n_keys, step: int, info: TokenInfo, window, causal: bool):
    """``_status`` of pairs given by their spans' first and last indices (tensors [n])."""
    hidden = torch.zeros(qa.numel(), dtype=torch.bool)[None]
    full = torch.ones(qa.numel(), dtype=torch.bool)[None]
    if causal:
        b = info.block
        bridged = (b[:, qz] == b[:, ka]) & (b[:, qz] >= 0)  # [B, n]
        hidden = hidden | ((ka > qz)[None] & ~bridged)
        full = full & (kz <= qa)[None]
    if window is not None:
        hidden = hidden | (qa - kz >= window)[None]
        full = full & (qz - ka < window)[None]
    if info.doc is not None:
        d = info.doc
        dqa, dqz, dka, dkz = d[:, qa], d[:, qz], d[:, ka], d[:, kz]  # [B, n]
        hidden = hidden | (dkz < dqa) | (dka > dqz)
        full = full & (dqa == dqz) & (dka == dkz) & (dqa == dka)
    if info.valid is not None:
        count = info.valid_count(ka, kz, step)  # [B, n]
        hidden = hidden | (count == 0)
        full = full & (count == n_keys[None])
    return hidden.all(0), ~full.all(0)


def rank_schedule(layout: str, S: int, P: int, r: int, causal: bool, info: TokenInfo,
                  window: int | None) -> RankSchedule:
    """Rank r's calls at every ring step, and the step count all ranks share. Cached on ``info``
    (built once per batch, shared by every layer with the same options)."""
    key = (layout, S, P, r, causal, window)
    if key in info._cache:
        return info._cache[key]
    s = check_length(layout, S, P)
    T = steps_needed(layout, S, P, causal, info, window)
    if isinstance(layout, Runs):
        calls = _runs_schedule(layout, r, T, causal, info, window)
    elif info.trivial and window is None:
        calls = tuple(tuple(PlannedCall(c, False) for c in block_plan(layout, s, P, r, (r - t) % P, causal))
                      for t in range(T))
    else:
        mine = runs(layout, S, P, r)
        blocks = causal and info.block is not None  # every run pair planned, causality in the masks
        cand = []
        for t in range(T):
            j = (r - t) % P
            theirs = runs(layout, S, P, j)
            cand += [(t, c, _span(mine, c.q_rows), _span(theirs, c.k_rows))
                     for c in run_calls(layout, s, P, r, j, causal and not blocks)]
        per_step = [[] for _ in range(T)]
        if cand:
            hidden, masked = _status([(c, q, k) for _, c, q, k in cand], info, window, blocks)
            for (t, c, q, k), h, m in zip(cand, hidden.tolist(), masked.tolist()):
                if not h:
                    per_step[t].append(PlannedCall(c, m, q, k) if m else PlannedCall(c, False))
        calls = tuple(tuple(step) for step in per_step)
    plan = RankSchedule(steps=T, calls=calls)
    info._cache[key] = plan
    return plan


def _runs_schedule(layout: Runs, r: int, T: int, causal: bool, info: TokenInfo, window) -> tuple:
    """``rank_schedule``'s calls for a batch's own runs: one call per (query run, key run) pair,
    every pair of the T steps decided at once in tensors and only the visible ones made calls
    (a batch of many documents has many runs, most pairs hidden)."""
    P = layout.P
    mine = layout.segments[r]
    qa = torch.tensor([a for a, _ in mine])
    qn = torch.tensor([n for _, n in mine])
    q_local = torch.cumsum(qn, 0) - qn
    ks, kt, kloc = [], [], []  # key runs of the ranks r - t, t < T
    for t in range(T):
        theirs = layout.segments[(r - t) % P]
        ks += theirs
        kt += [t] * len(theirs)
        kloc += [sum(n for _, n in theirs[:i]) for i in range(len(theirs))]
    ka = torch.tensor([a for a, _ in ks])
    kn = torch.tensor([n for _, n in ks])
    i, j = (x.flatten() for x in torch.meshgrid(torch.arange(len(mine)), torch.arange(len(ks)), indexing="ij"))
    same = (torch.tensor(kt)[j] == 0) & (qa[i] == ka[j])
    blocks = causal and info.block is not None  # every pair planned, causality in the masks
    keep = torch.ones_like(i, dtype=torch.bool) if not causal or blocks else ka[j] < qa[i] + qn[i]
    i, j, same = i[keep], j[keep], same[keep]
    per_step = [[] for _ in range(T)]
    if i.numel():
        q0, q1, k0, k1 = qa[i], qa[i] + qn[i] - 1, ka[j], ka[j] + kn[j] - 1
        hidden, masked = _status_of(q0, q1, k0, k1, kn[j], 1, info, window, blocks)
        # causality inside the plan: the own run is a causal square, keys wholly before the queries are full
        causal_call = same & torch.tensor(causal and not blocks)
        live = (~hidden).nonzero().flatten().tolist()
        rows = zip(i[live].tolist(), j[live].tolist(), masked[live].tolist(), causal_call[live].tolist())
        for a, b, m, c in rows:
            call = Call(slice(int(q_local[a]), int(q_local[a] + qn[a])), slice(kloc[b], kloc[b] + int(kn[b])), c)
            spans = (Span(int(qa[a]), 1, int(qn[a])), Span(int(ka[b]), 1, int(kn[b])))
            per_step[kt[b]].append(PlannedCall(call, m, *spans) if m else PlannedCall(call, False))
    return tuple(tuple(step) for step in per_step)
