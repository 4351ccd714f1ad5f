"""A masked call as variable-length runs for the CUDA varlen kernel (``ringseq.shapes``).

The varlen kernel (``aten._flash_attention_forward`` with cumulative lengths) packs the call's
query rows of all samples as [B*n] and its key rows as [B*m], cuts both into consecutive
*segments* (``cu_q``, ``cu_k``: one pair of segments per entry) and lets query row r' of a
segment see key column c' of the same segment when

    r' + (m_seg - n_seg) - left <= c' <= r' + (m_seg - n_seg) + right

(flash-attn's bottom-right alignment; -1 means no bound), with ONE (left, right) for the whole
call. ``runs`` finds such a description from the call's spans and ``TokenInfo``, or returns None
when none exists (the call then goes to FlexAttention):

* on call-local indices (r, c) the causal and window rules are a band ``A <= c - r <= Bd``
  (spans of one step p: i = qs + r p, j = ks + c p);
* a document present on both sides gives one segment pair: its rows against its *valid* keys,
  which must be one contiguous run (left/right padding is; holes in the middle are not),
  trimmed to the rows that see a key and the keys some row sees;
* rows and keys outside every pair go into segments paired with an empty one (output 0,
  log-sum-exp -inf; no gradient);
* each pair fixes ``right`` exactly where the band's upper edge cuts its rectangle (otherwise
  any value not below n_seg - 1 does), ``left`` likewise; one value must fit every pair.

All of it is integer work on the CPU copies of the token tables, done once per batch and call
(cached on the ``TokenInfo``, shared by every layer); the device gets two small int32 tensors.
"""
from __future__ import annotations

import dataclasses

import torch

NO_BOUND = -1  # flash-attn's "no window on this side"


@dataclasses.dataclass(frozen=True)
class Runs:
    """The varlen description of one call."""

    cu_q: torch.Tensor
    """int32 [segments + 1]: cumulative query rows over the packed [B*n] rows (CPU)."""
    cu_k: torch.Tensor
    """int32 [segments + 1]: cumulative key rows over the packed [B*m] rows (CPU)."""
    max_q: int
    max_k: int
    """At least every segment's key count and each bound + 1 (the kernel's max_seqlen_k)."""
    left: int
    right: int


class _Bound:
    """What one side's window bound may be: exactly ``exact``, or anything >= ``at_least`` (or
    no bound at all)."""

    def __init__(self):
        self.exact, self.at_least = None, 0

    def need(self, value: int) -> bool:
        if self.exact is not None and self.exact != value:
            return False
        self.exact = value
        return True

    def free_above(self, n: int) -> None:
        self.at_least = max(self.at_least, n)

    def value(self) -> int | None:
        """The bound for the kernel, or None when no single one fits."""
        if self.exact is None:
            return NO_BOUND
        return self.exact if self.exact >= self.at_least else None


def band(q, k, causal: bool, window: int | None) -> tuple[float, float]:
    """(A, Bd): call-local query row r sees key column c (positions permitting) when A <= c - r <= Bd."""
    assert q.step == k.step, "the two sides of a call step alike"
    d, p = q.start - k.start, q.step
    upper = d // p if causal else float("inf")
    lower = -((window - 1 - d) // p) if window is not None else float("-inf")
    return lower, upper


def _groups(ids: torch.Tensor | None, n: int) -> dict[int, tuple[int, int]]:
    """Document id -> [first, end) of a non-decreasing row of ids (one group without ids)."""
    if ids is None:
        return {0: (0, n)}
    values, counts = torch.unique_consecutive(ids, return_counts=True)
    ends = torch.cumsum(counts, 0).tolist()
    return {v: (e - c, e) for v, c, e in zip(values.tolist(), counts.tolist(), ends)}


def _valid_run(valid: torch.Tensor | None, c0: int, c1: int) -> tuple[int, int] | None:
    """The one contiguous run of valid keys in [c0, c1) ((c0, c0) if none), None if not one run."""
    if valid is None:
        return c0, c1
    idx = valid[c0:c1].nonzero().squeeze(1)
    if len(idx) == 0:
        return c0, c0
    v0, v1 = c0 + int(idx[0]), c0 + int(idx[-1]) + 1
    return (v0, v1) if len(idx) == v1 - v0 else None


def runs(q, k, info, window: int | None, causal: bool, B: int) -> Runs | None:
    """The varlen runs of the call with global spans ``q``/``k`` (see the module docstring);
    None for bidirectional blocks (a block's queries see keys after them: not a band)."""
    if info.block is not None and causal:
        return None
    A, Bd = band(q, k, causal, window)
    n, m = q.n, k.n
    left, right = _Bound(), _Bound()
    seg_q, seg_k = [], []

    def emit(nq: int, nk: int) -> None:
        if nq or nk:
            seg_q.append(nq)
            seg_k.append(nk)

    for b in range(B):
        bi = min(b, info.doc.size(0) - 1) if info.doc is not None else 0
        qdoc = None if info.doc is None else info.doc[bi, q.slice()]
        kdoc = None if info.doc is None else info.doc[bi, k.slice()]
        valid = None if info.valid is None else info.valid[min(b, info.valid.size(0) - 1), k.slice()]
        q_groups, k_groups = _groups(qdoc, n), _groups(kdoc, m)
        qc = kc = 0  # rows / keys of this sample already in segments
        for doc, (r0, r1) in q_groups.items():
            if doc not in k_groups:
                continue
            vr = _valid_run(valid, *k_groups[doc])
            if vr is None:
                return None
            v0, v1 = vr
            R0, R1 = max(r0, v0 - Bd), min(r1, v1 - A)
            if v1 == v0 or R1 <= R0 or A > Bd:
                continue  # these rows see none of these keys
            R0, R1 = int(R0), int(R1)
            C0, C1 = int(max(v0, R0 + A)), int(min(v1, R1 + Bd))
            if R0 + Bd < C1 - 1:  # the upper edge cuts: the first row does not see the last key
                if not right.need(int(Bd) + R1 - C1):
                    return None
            else:
                right.free_above(R1 - R0 - 1)
            if R1 - 1 + A > C0:  # the lower edge cuts: the last row does not see the first key
                if not left.need(C1 - R1 - int(A)):
                    return None
            else:
                left.free_above(C1 - C0 - 1)
            emit(R0 - qc, 0)
            emit(0, C0 - kc)
            emit(R1 - R0, C1 - C0)
            qc, kc = R1, C1
        emit(n - qc, 0)
        emit(0, m - kc)
    lv, rv = left.value(), right.value()
    if lv is None or rv is None or not seg_q:
        return None
    # max_k only bounds the segments' key counts, and the kernel reads a window bound >= max_k as
    # no bound: so max_k also exceeds both bounds (a right bound can cut more rows than keys exist)
    max_q, max_k = max(seg_q), max(seg_k + [lv + 1, rv + 1])
    cu_q = torch.tensor([0] + seg_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + seg_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return Runs(cu_q, cu_k, max_q, max_k, lv, rv)


def visible(r: Runs) -> torch.Tensor:
    """bool [B*n, B*m]: what the kernel lets each packed query row see, from the runs alone
    (flash-attn's rule, written out; for tests and checks of ``runs``)."""
    nq, nk = int(r.cu_q[-1]), int(r.cu_k[-1])
    vis = torch.zeros(nq, nk, dtype=torch.bool)
    for a, b, c, d in zip(r.cu_q[:-1].tolist(), r.cu_q[1:].tolist(), r.cu_k[:-1].tolist(), r.cu_k[1:].tolist()):
        n_seg, m_seg = b - a, d - c
        rr, cc = torch.arange(n_seg)[:, None], torch.arange(m_seg)[None, :]
        off = m_seg - n_seg
        ok = torch.ones(n_seg, m_seg, dtype=torch.bool)
        if r.left != NO_BOUND and r.left < r.max_k:
            ok &= cc >= rr + off - r.left
        if r.right != NO_BOUND and r.right < r.max_k:
            ok &= cc <= rr + off + r.right
        vis[a:b, c:d] = ok
    return vis
