"""Masks inside the ring: packed documents, padding, sliding windows and bidirectional blocks (``ringseq.shapes``).

Which key a query may see depends on a few integers per token, so every rank keeps them for
the *whole* sequence (``TokenInfo``: S ints per sample, all-gathered once per forward, not per
ring step). The schedule (``ringseq.attention.schedule``) decides from them which calls are
hidden, fully visible or partly visible; a partly visible call gets a ``RowMask``, which
builds the visibility of a slab of rows at a time (never S x S) by slicing.

Visibility of query i by key j (global token indices) is the conjunction of
``j <= i`` (causal), ``0 <= i - j < window`` (transformers' sliding window),
``doc[i] == doc[j]`` (a document starts where ``position_ids[i] != position_ids[i-1] + 1``,
transformers' rule) and ``valid[j]`` (padding keys never contribute). Bidirectional blocks (Gemma
3's image tokens, ``block[i] == block[j] >= 0``) widen the causal term: a token sees every token of
its own block, later ones too (``(j <= i or same block) and window and document and valid``, as
transformers composes them).
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, eq=False)
class TokenInfo:
    """Per-token facts of the whole sequence, identical on every rank of a sequence group."""

    doc: torch.Tensor | None = None
    """[B, S] integer document id by global index, non-decreasing; None: one document (CPU)."""
    valid: torch.Tensor | None = None
    """[B, S] bool, False for padding tokens; None: no padding (CPU)."""
    block: torch.Tensor | None = None
    """[B, S] int32 id of the bidirectional block of each token (-1: none; a block is one run of
    tokens); None: no blocks (CPU)."""
    layout: dataclasses.InitVar[object] = None
    """The batch's own layout (a ``ringseq.layouts.Runs``: packed documents balanced by work,
    made by ``ringseq.shard_batch``); None: the sequence group's layout."""

    def __post_init__(self, layout):  # planning reads these integers: keep them on the CPU
        # The layout, and the schedules and prefix tables derived from this batch (``_cache``: ``rank_schedule``,
        # ``valid_count``), are attributes, not fields: where a batch enters a compiled checkpointed region,
        # torch 2.9's dynamo walks its frozen dataclass fields whole and guards on every value it finds there (the
        # layout's runs, the cached tables' sizes: a new packing, a new graph). What the traced code reads
        # (the tensors) stays in fields; the rest is read only by the ops, outside the graph.
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "_cache", {})
        for name in ("doc", "valid", "block"):
            value = getattr(self, name)
            if value is not None and value.device.type != "cpu":
                object.__setattr__(self, name, value.cpu())

    @property
    def trivial(self) -> bool:
        return self.doc is None and self.valid is None and self.block is None

    def reach(self, index: torch.Tensor) -> torch.Tensor:
        """[B, n] one past the last key that token ``index`` [n] sees causally or through its
        block (non-decreasing along a row)."""
        if "reach" not in self._cache:
            B, S = self.block.shape
            here = torch.arange(1, S + 1).expand(B, S)
            starts = torch.ones(B, S, dtype=torch.bool)
            starts[:, 1:] = self.block[:, 1:] != self.block[:, :-1]
            run = starts.long().cumsum(1) - 1  # [B, S] run of equal block ids
            end = torch.zeros(B, S, dtype=torch.long).scatter_reduce(1, run, here, "amax")
            self._cache["reach"] = torch.where(self.block >= 0, end.gather(1, run), here)
        return self._cache["reach"][:, index]

    def same_block(self, qi: slice, ki: slice) -> torch.Tensor:
        """[B, n, m] bool: query ``qi`` and key ``ki`` (slices of global indices) share a block."""
        bq, bk = self.block[:, qi, None], self.block[:, None, ki]
        return (bq == bk) & (bq >= 0)

    def doc_start(self, index: torch.Tensor) -> torch.Tensor:
        """[B, n] global index of the first token of the document of each token ``index`` [n]
        (a binary search per token: document ids never decrease along a row)."""
        return torch.searchsorted(self.doc, self.doc[:, index].contiguous())

    def doc_end(self, index: torch.Tensor) -> torch.Tensor:
        """[B, n] global index one past the last token of the document of each token ``index``."""
        return torch.searchsorted(self.doc, self.doc[:, index].contiguous(), right=True)

    def longest_document(self) -> int:
        """The most tokens of any one document, over the batch."""
        B, S = self.doc.shape
        starts = torch.ones(B, S, dtype=torch.bool)
        starts[:, 1:] = self.doc[:, 1:] != self.doc[:, :-1]
        first = starts.flatten().nonzero().squeeze(1)
        return int(torch.diff(first, append=torch.tensor([B * S])).max())

    def valid_count(self, first: torch.Tensor, last: torch.Tensor, step: int) -> torch.Tensor:
        """[B, n] valid tokens among first, first + step, ..., last (global indices, tensors [n]),
        from prefix sums per residue class mod ``step`` (made once per batch and step)."""
        key = ("valid_prefix", step)
        if key not in self._cache:
            B, S = self.valid.shape
            counts = self.valid.long().reshape(B, S // step, step).cumsum(1)
            self._cache[key] = torch.cat([counts.new_zeros(B, 1, step), counts], 1)
        prefix = self._cache[key]
        res = first % step
        return prefix[:, last // step + 1, res] - prefix[:, first // step, res]


def documents(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] position ids in global order -> [B, S] int32 document ids (transformers' rule:
    a document starts where position_ids[i] != position_ids[i-1] + 1). int32: half the memory
    and time of int64 for a table of S entries per sample."""
    starts = torch.diff(position_ids, dim=1) != 1
    doc = torch.zeros(position_ids.shape, dtype=torch.int32, device=position_ids.device)
    torch.cumsum(starts, dim=1, dtype=torch.int32, out=doc[:, 1:])
    return doc


class RowMask:
    """The visibility of one call's query rows against its keys, built a slab at a time.

    ``q``/``k`` are the call's ``Span``s (global indices, increasing). ``key_range`` bounds the
    columns a slab of rows can see at all, so kernels skip the rest: a window or short
    documents then cost O(rows x (rows + window)), not O(rows x keys).
    """

    def __init__(self, q, k, info: TokenInfo, window: int | None, causal: bool, B: int, device=None):
        self.q, self.k, self.info, self.window, self.causal, self.B = q, k, info, window, causal, B
        self.device = device  # where the kernels want the mask; the integers stay on the CPU

    def key_range(self, a: int, b: int) -> tuple[int, int]:
        """The smallest column range [lo, hi) that query rows a..b may see."""
        first, last = self.q.at(a), self.q.at(b - 1)
        lo_pos, hi_pos = None, last if self.causal else None
        if self.causal and self.info.block is not None:
            hi_pos = int(self.info.reach(torch.tensor([last])).max()) - 1
        if self.window is not None:
            lo_pos = first - self.window + 1
        if self.info.doc is not None:
            doc_lo = int(self.info.doc_start(torch.tensor([first])).min())
            lo_pos = doc_lo if lo_pos is None else max(lo_pos, doc_lo)
            if not self.causal:
                hi_pos = int(self.info.doc_end(torch.tensor([last])).max()) - 1
        lo = 0 if lo_pos is None else self.k.first_at_or_after(lo_pos)
        hi = self.k.n if hi_pos is None else self.k.count_at_or_before(hi_pos)
        return lo, max(lo, hi)

    def rows(self, a: int, b: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """bool [B, b-a, hi-lo]: True where query row a..b of the call sees key column lo..hi."""
        hi = self.k.n if hi is None else hi
        qi, kp = self.q.positions(a, b)[:, None], self.k.positions(lo, hi)[None, :]
        vis = kp <= qi if self.causal else torch.ones(b - a, hi - lo, dtype=torch.bool)
        if self.causal and self.info.block is not None:
            vis = vis | self.info.same_block(self.q.slice(a, b), self.k.slice(lo, hi))
        if self.window is not None:
            vis = vis & (qi - kp < self.window)
        vis = vis.expand(self.B, -1, -1) if vis.dim() == 3 else vis.unsqueeze(0).expand(self.B, -1, -1)
        if self.info.doc is not None:
            doc = self.info.doc
            vis = vis & (doc[:, self.q.slice(a, b), None] == doc[:, None, self.k.slice(lo, hi)])
        if self.info.valid is not None:
            vis = vis & self.info.valid[:, None, self.k.slice(lo, hi)]
        return vis if self.device is None else vis.to(self.device, non_blocking=True)
