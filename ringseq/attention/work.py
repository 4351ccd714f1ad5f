"""Attention work per rank: the visible (query, key) pairs of each rank's queries.

The slowest rank sets a ring step's pace, and a rank's attention work is the number of keys its
queries see: with packed documents, windows and padding that is far from even under a layout
that balances one long causal sequence. ``visible_keys`` counts, for every query, the keys it
sees (its document, the window, the valid keys, its bidirectional block) from a batch's
``TokenInfo`` in O(S) with no mask built: the visible keys of a query are one interval of global
indices, whose valid keys are a difference of prefix sums. ``per_rank`` sums them over each
rank's queries. The counts are those of a full-attention layer (``window`` for a sliding one).
"""
from __future__ import annotations

import functools

import torch

from ringseq.layouts import Runs, owner

from .masks import TokenInfo


def _document_bounds(doc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S] first index and one past the last index of each token's document (O(S): running
    maxima of the starts from the left and minima of the ends from the right)."""
    B, S = doc.shape
    i = torch.arange(S).expand(B, S)
    starts = torch.ones(B, S, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    first = torch.where(starts, i, 0).cummax(1).values
    ends = torch.zeros(B, S, dtype=torch.bool)
    ends[:, :-1] = starts[:, 1:]
    ends[:, -1] = True
    last = torch.where(ends, i + 1, S).flip(1).cummin(1).values.flip(1)
    return first, last


def visible_keys(info: TokenInfo, S: int, window: int | None = None, causal: bool = True) -> torch.Tensor:
    """[B', S] int64 (B' = 1 without per-sample facts): how many keys each query sees."""
    i = torch.arange(S)
    lo, hi = torch.zeros(1, S, dtype=torch.long), torch.full((1, S), S, dtype=torch.long)
    if causal:
        hi = (i + 1)[None]
        if info.block is not None:  # a block's tokens see its later tokens too
            hi = torch.maximum(hi, info.reach(i))
        if window is not None:
            lo = (i - window + 1).clamp(min=0)[None]
    if info.doc is not None:
        first, last = _document_bounds(info.doc)
        lo, hi = torch.maximum(lo, first), torch.minimum(hi, last)
    if info.valid is None:
        return (hi - lo).clamp(min=0)
    prefix = torch.nn.functional.pad(info.valid.long().cumsum(1), (1, 0))  # [B, S + 1]
    lo, hi = lo.expand_as(info.valid), hi.expand_as(info.valid)
    return (prefix.gather(1, hi.clamp(min=0)) - prefix.gather(1, lo.clamp(max=S))).clamp(min=0)


def chunk_work(info: TokenInfo, S: int, c: int, keys: torch.Tensor | None = None) -> torch.Tensor:
    """[S / c] int64: the visible pairs of the queries of each chunk of c tokens, summed over the
    batch (full causal attention). With documents alone, in closed form from where the documents
    and chunks start (a token at offset k of its document sees k + 1 keys; O(documents +
    chunks) after one pass to find the starts); with padding or blocks, from ``visible_keys``
    (``keys``: its sum over the batch, when already at hand for another chunk size)."""
    if info.valid is not None or info.block is not None:
        keys = visible_keys(info, S).sum(0) if keys is None else keys
        return keys.reshape(-1, c).sum(1)
    total = torch.zeros(S // c, dtype=torch.long)
    for row in ([None] if info.doc is None else info.doc):
        starts = torch.zeros(1, dtype=torch.long)
        if row is not None:
            starts = torch.cat([starts, (row[1:] != row[:-1]).nonzero().flatten() + 1])
        a = torch.unique(torch.cat([starts, torch.arange(0, S, c)]))  # pieces inside one document and one chunk
        e = torch.cat([a[1:], torch.tensor([S])])
        first = starts[torch.searchsorted(starts, a, right=True) - 1]
        n = e - a  # keys a - first + 1 .. e - first: their sum
        total.index_add_(0, a // c, n * (a + e + 1 - 2 * first) // 2)
    return total


def per_rank(info: TokenInfo, layout, S: int, P: int, window: int | None = None,
             causal: bool = True) -> list[int]:
    """Visible pairs of each ring rank's queries, summed over the batch (all samples)."""
    counts = visible_keys(info, S, window, causal).sum(0)
    owners = owner(layout, S, P, torch.arange(S)) if isinstance(layout, Runs) else _owners(layout, S, P)
    return torch.bincount(owners, weights=counts.double(), minlength=P).long().tolist()


@functools.lru_cache(maxsize=4)
def _owners(layout: str, S: int, P: int) -> torch.Tensor:
    """The ring rank of every global index (the same for every batch of one length)."""
    return owner(layout, S, P, torch.arange(S))
