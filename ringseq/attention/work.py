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

from ringseq.layouts import owner

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


def per_rank(info: TokenInfo, layout: str, S: int, P: int, window: int | None = None,
             causal: bool = True) -> list[int]:
    """Visible pairs of each ring rank's queries, summed over the batch (all samples)."""
    counts = visible_keys(info, S, window, causal).sum(0)
    return torch.bincount(_owners(layout, S, P), weights=counts.double(), minlength=P).long().tolist()


@functools.lru_cache(maxsize=4)
def _owners(layout: str, S: int, P: int) -> torch.Tensor:
    """The ring rank of every global index (the same for every batch of one length)."""
    return owner(layout, S, P, torch.arange(S))
