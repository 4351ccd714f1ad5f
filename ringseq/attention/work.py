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

import torch

from ringseq.layouts import global_positions

from .masks import TokenInfo


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
        lo = torch.maximum(lo, info.doc_start(i))
        hi = torch.minimum(hi, info.doc_end(i))
    if info.valid is None:
        return (hi - lo).clamp(min=0)
    prefix = torch.nn.functional.pad(info.valid.long().cumsum(1), (1, 0))  # [B, S + 1]
    lo, hi = lo.expand_as(info.valid), hi.expand_as(info.valid)
    return (prefix.gather(1, hi.clamp(min=0)) - prefix.gather(1, lo.clamp(max=S))).clamp(min=0)


def per_rank(info: TokenInfo, layout: str, S: int, P: int, window: int | None = None,
             causal: bool = True) -> list[int]:
    """Visible pairs of each ring rank's queries, summed over the batch (all samples)."""
    counts = visible_keys(info, S, window, causal).sum(0)
    return [int(counts[global_positions(layout, S, P, r)].sum()) for r in range(P)]
