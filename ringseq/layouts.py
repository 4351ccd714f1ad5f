"""Which global tokens each rank of the ring holds (shapes: see ``ringseq.shapes``).

Three ring layouts, all with S / P tokens per ring rank, kept in increasing global order:

``contiguous``  rank r holds tokens [r*s, (r+1)*s).
``zigzag``      the sequence is cut into 2P chunks of c = S / 2P; rank r holds chunks r and
                2P-1-r, so under a causal mask every rank does the same work (default).
``striped``     token i lives on rank i mod P (striped attention); also balanced.

With Ulysses (``ulysses_size`` U > 1) each ring rank's tokens are further cut into U
contiguous pieces, one per rank of its Ulysses group, so the all-to-all inside the group
reassembles exactly the ring shard (``sp_positions``).

The pure functions here are the single source of truth for the index math; sharding,
gathering and the ring's block plan all read them.
"""
from __future__ import annotations

import functools

import torch

from .lengths import LAYOUTS, check_layout, check_length, multiple  # noqa: F401 - the layouts' interface


def segments(layout: str, s: int, P: int, r: int) -> list[tuple[int, int]] | None:
    """Rank r's tokens as contiguous runs ``(global_start, length)`` in local order.

    None for ``striped``, whose tokens form no runs (every P-th token).
    """
    if layout == "contiguous":
        return [(r * s, s)]
    if layout == "zigzag":
        c = s // 2
        return [(r * c, c), ((2 * P - 1 - r) * c, c)]
    return None


def runs(layout: str, S: int, P: int, r: int) -> list[tuple[int, int, int]]:
    """Rank r's tokens as arithmetic runs ``(global_start, length, step)`` in local order:
    one or two contiguous runs (step 1), or for ``striped`` one run of step P."""
    s = check_length(layout, S, P)
    if layout == "striped":
        return [(r, s, P)]
    return [(start, n, 1) for start, n in segments(layout, s, P, r)]


def owner(layout: str, S: int, P: int, index: torch.Tensor) -> torch.Tensor:
    """The ring rank that holds each global token ``index`` (int64 tensor)."""
    s = check_length(layout, S, P)
    if layout == "striped":
        return index % P
    if layout == "contiguous":
        return index // s
    chunk = index // (s // 2)
    return torch.where(chunk < P, chunk, 2 * P - 1 - chunk)


@functools.lru_cache(maxsize=64)
def _positions(layout: str, S: int, P: int, r: int) -> torch.Tensor:
    s = check_length(layout, S, P)
    if layout == "striped":
        return torch.arange(r, S, P)
    return torch.cat([torch.arange(a, a + n) for a, n in segments(layout, s, P, r)])


def global_positions(layout: str, S: int, P: int, r: int) -> torch.Tensor:
    """Global indices (int64 [s]) of the tokens rank r holds, in its local order."""
    return _positions(layout, S, P, r)


@functools.lru_cache(maxsize=64)
def sp_positions(layout: str, S: int, P: int, U: int, rank: int) -> torch.Tensor:
    """Global indices held by sequence rank ``rank`` = ring rank x U + Ulysses rank."""
    check_length(layout, S, P, U)
    return global_positions(layout, S, P, rank // U).chunk(U)[rank % U]


@functools.lru_cache(maxsize=64)
def gather_order(layout: str, S: int, P: int, U: int = 1) -> torch.Tensor:
    """Permutation that turns the concatenated shards of sequence ranks 0..PU-1 into global
    order: ``full = cat(shards)[gather_order]``."""
    owner_order = torch.cat([sp_positions(layout, S, P, U, r) for r in range(P * U)])
    return torch.argsort(owner_order)
