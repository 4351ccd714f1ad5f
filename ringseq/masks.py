"""Masks inside the ring: packed documents, padding and sliding windows (``ringseq.shapes``).

Which key a query may see depends on a few integers per token, so every rank keeps them for
the *whole* sequence (``TokenInfo``: S ints per sample, all-gathered once per forward, not per
ring step). From them each rank decides, for every (query rank, key rank) pair, whether a
kernel call is hidden (skipped), fully visible (no mask) or partly visible (a mask built a
slab of rows at a time, never S x S). Because the decision is the same on every rank, all
ranks also agree how many ring steps are needed at all: with a window shorter than a shard
under the contiguous layout, or documents that never cross a shard boundary, the ring stops
after the neighbour exchange.

Visibility of query i by key j (global token indices) is the conjunction of
``j <= i`` (causal), ``0 <= i - j < window`` (transformers' sliding window),
``doc[i] == doc[j]`` (a document starts where ``position_ids[i] != position_ids[i-1] + 1``,
transformers' rule) and ``valid[j]`` (padding keys never contribute).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .layouts import global_positions
from .plan import Call, block_plan, run_calls


@dataclasses.dataclass(frozen=True, eq=False)  # not slots: doc_start caches on the instance
class TokenInfo:
    """Per-token facts of the whole sequence, identical on every rank of a sequence group."""

    doc: torch.Tensor | None = None
    """[B, S] int64 document id by global index, non-decreasing; None: one document (CPU)."""
    valid: torch.Tensor | None = None
    """[B, S] bool, False for padding tokens; None: no padding (CPU)."""
    _plans: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self):  # planning reads these integers one by one: keep them on the CPU
        for name in ("doc", "valid"):
            value = getattr(self, name)
            if value is not None and value.device.type != "cpu":
                object.__setattr__(self, name, value.cpu())

    @property
    def trivial(self) -> bool:
        return self.doc is None and self.valid is None

    @functools.cached_property
    def doc_start(self) -> torch.Tensor:
        """[B, S] global index of the first token of each token's document."""
        S = self.doc.size(1)
        starts = torch.ones_like(self.doc, dtype=torch.bool)
        starts[:, 1:] = self.doc[:, 1:] != self.doc[:, :-1]
        index = torch.arange(S).expand_as(self.doc)
        return torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values


def documents(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] position ids in global order -> [B, S] document ids (transformers' rule)."""
    starts = position_ids[:, 1:] != position_ids[:, :-1] + 1
    doc = torch.zeros_like(position_ids, dtype=torch.int64)
    doc[:, 1:] = torch.cumsum(starts.long(), dim=1)
    return doc


@dataclasses.dataclass(frozen=True)
class MaskedCall:
    """A kernel call and whether it needs an explicit mask (``Call`` otherwise)."""

    call: Call
    masked: bool


class RowMask:
    """Builds the visibility of a call's query rows against its keys, a slab at a time.

    ``qpos``/``kpos`` are the global indices of the call's rows and columns, each increasing
    (calls with masks always span one run per side). ``key_range`` bounds the columns a slab of
    rows can see at all, so kernels skip the rest: a window or short documents then cost
    O(rows x (rows + window)), not O(rows x sk).
    """

    def __init__(self, qpos, kpos, info: TokenInfo, window: int | None, causal: bool, B: int, device=None):
        self.qpos, self.kpos, self.info, self.window, self.causal, self.B = qpos, kpos, info, window, causal, B
        self.device = device  # where the kernels want the mask; the integers stay on the CPU

    def key_range(self, a: int, b: int) -> tuple[int, int]:
        """The smallest column range [lo, hi) that query rows a..b may see."""
        first, last = self.qpos[a].item(), self.qpos[b - 1].item()
        lo_pos, hi_pos = None, last if self.causal else None
        if self.window is not None:
            lo_pos = first - self.window + 1
        if self.info.doc is not None:
            doc_lo = int(self.info.doc_start[:, first].min())
            lo_pos = doc_lo if lo_pos is None else max(lo_pos, doc_lo)
        lo = 0 if lo_pos is None else int(torch.searchsorted(self.kpos, lo_pos))
        hi = len(self.kpos) if hi_pos is None else int(torch.searchsorted(self.kpos, hi_pos, right=True))
        return lo, max(lo, hi)

    def rows(self, a: int, b: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """bool [B, b-a, hi-lo]: True where query row a..b of the call sees key column lo..hi."""
        qi, kp = self.qpos[a:b, None], self.kpos[lo:hi]
        vis = kp[None, :] <= qi if self.causal else torch.ones(len(qi), len(kp), dtype=torch.bool)
        if self.window is not None:
            vis = vis & (qi - kp[None, :] < self.window)
        vis = vis.unsqueeze(0).expand(self.B, -1, -1)
        if self.info.doc is not None:
            doc = self.info.doc
            vis = vis & (doc[:, self.qpos[a:b], None] == doc[:, None, kp])
        if self.info.valid is not None:
            vis = vis & self.info.valid[:, None, kp]
        return vis if self.device is None else vis.to(self.device, non_blocking=True)


def _status(qpos, kpos, info: TokenInfo, window: int | None) -> str | None:
    """None if no (query, key) pair of the call is visible; 'full' if all causal pairs are;
    'masked' otherwise. Range tests are exact for runs and conservative across runs."""
    needs_mask = False
    if window is not None:
        if qpos.min() - kpos.max() >= window:
            return None
        needs_mask |= bool(qpos.max() - kpos.min() >= window)
    if info.doc is not None:
        qd, kd = info.doc[:, qpos], info.doc[:, kpos]
        lo = torch.maximum(qd.min(1).values, kd.min(1).values)
        hi = torch.minimum(qd.max(1).values, kd.max(1).values)
        if bool((lo > hi).all()):
            return None
        needs_mask |= not bool(((qd.min(1).values == kd.max(1).values)
                                & (qd.max(1).values == kd.min(1).values)).all())
    if info.valid is not None:
        kv = info.valid[:, kpos]
        if not bool(kv.any()):
            return None
        needs_mask |= not bool(kv.all())
    return "masked" if needs_mask else "full"


def masked_plan(layout, S, P, r, j, causal, info: TokenInfo, window):
    """Calls of rank r's queries against rank j's keys, with masks only where needed."""
    s = S // P
    if info.trivial and window is None:
        return tuple(MaskedCall(c, False) for c in block_plan(layout, s, P, r, j, causal))
    qall, kall = global_positions(layout, S, P, r), global_positions(layout, S, P, j)
    out = []
    for call in run_calls(layout, s, P, r, j, causal):
        qpos, kpos = qall[call.q_rows], kall[call.k_rows]
        status = _status(qpos, kpos, info, window)
        if status is not None:
            out.append(MaskedCall(call, status == "masked"))
    return tuple(out)


def ring_schedule(layout: str, S: int, P: int, causal: bool, info: TokenInfo, window: int | None):
    """For every rank r and ring step t, the calls against rank (r - t) mod P, and the number
    of ring steps T that any rank needs (the same on all ranks). Cached on ``info``."""
    key = (layout, S, P, causal, window)
    if key not in info._plans:
        plans = [[masked_plan(layout, S, P, r, (r - t) % P, causal, info, window) for t in range(P)]
                 for r in range(P)]
        steps = 1 + max((t for r in range(P) for t in range(P) if plans[r][t]), default=0)
        info._plans[key] = (plans, steps)
    return info._plans[key]
