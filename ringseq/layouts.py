"""Which global tokens each rank of the ring holds (shapes: see ``ringseq.shapes``).

Three ring layouts, all with S / P tokens per ring rank, kept in increasing global order:

``contiguous``  rank r holds tokens [r*s, (r+1)*s).
``zigzag``      the sequence is cut into 2P chunks of c = S / 2P; rank r holds chunks r and
                2P-1-r, so under a causal mask every rank does the same work (default).
``striped``     token i lives on rank i mod P (striped attention); also balanced.

A batch of packed documents gets a layout of its own (``Runs``, made by ``ringseq.balance`` for
the zigzag layout): each ring rank holds S / P tokens as a few contiguous runs chosen so that
every rank does about the same attention work. Every function here takes a layout name or a
``Runs``; a ``Runs`` keeps what is derived from it (positions, owners) on itself, so nothing of
one batch outlives it in a module cache.

With Ulysses (``ulysses_size`` U > 1) each ring rank's tokens are further cut into U
contiguous pieces, one per rank of its Ulysses group, so the all-to-all inside the group
reassembles exactly the ring shard (``sp_positions``).

The pure functions here are the single source of truth for the index math; sharding,
gathering and the ring's block plan all read them.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from . import lengths
from .errors import RingSeqError
from .lengths import LAYOUTS, check_layout, multiple  # noqa: F401 - the layouts' interface


@dataclasses.dataclass(frozen=True, eq=False)
class Runs:
    """The layout of one batch: ring rank r holds the contiguous runs ``segments[r]``
    (``(global_start, length)``, increasing), S / P tokens on every rank, together all of [0, S)."""

    S: int
    P: int
    segments: tuple[tuple[tuple[int, int], ...], ...]
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self):
        s = self.S // self.P
        cover = sorted(run for rank in self.segments for run in rank)
        ends = [a + n for a, n in cover]
        if (len(self.segments) != self.P or any(sum(n for _, n in rank) != s for rank in self.segments)
                or any(list(rank) != sorted(rank) for rank in self.segments)
                or [a for a, _ in cover] != [0, *ends[:-1]] or ends[-1] != self.S or any(n < 1 for _, n in cover)):
            raise AssertionError(f"runs {self.segments} do not split {self.S} tokens into {self.P} equal shards")

    def _memo(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def table(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every run in global order: (starts, lengths, ring ranks), int64 [n] each."""
        def make():
            rows = sorted((a, n, r) for r, rank in enumerate(self.segments) for a, n in rank)
            return tuple(torch.tensor(col, dtype=torch.long) for col in zip(*rows))
        return self._memo("table", make)

    def checksum(self) -> int:
        """One integer for the whole table (what the ranks compare in a lockstep record)."""
        def make():
            total = 0
            for r, rank in enumerate(self.segments):
                for a, n in rank:
                    total = (total * 1000003 + a * 31 + n * 7 + r) % 2**61
            return total
        return self._memo("checksum", make)


def layout_code(layout) -> int:
    """A layout as one integer for a lockstep record: its name's index, or a ``Runs``' checksum."""
    return layout.checksum() if isinstance(layout, Runs) else LAYOUTS.index(layout)


def check_length(layout, S: int, P: int, U: int = 1) -> int:
    """The local length S / (P U), or ``RingSeqError`` if the layout cannot split S."""
    if isinstance(layout, Runs):
        if (S, P) != (layout.S, layout.P) or S // P % U:
            raise RingSeqError(f"a batch's layout splits {layout.S} tokens over {layout.P} ring ranks, not {S} over "
                               f"{P} x {U}: shard and gather a batch's tensors with its own ShardedBatch")
        return S // (P * U)
    return lengths.check_length(layout, S, P, U)


def segments(layout, s: int, P: int, r: int) -> list[tuple[int, int]] | None:
    """Rank r's tokens as contiguous runs ``(global_start, length)`` in local order.

    None for ``striped``, whose tokens form no runs (every P-th token).
    """
    if isinstance(layout, Runs):
        return list(layout.segments[r])
    if layout == "contiguous":
        return [(r * s, s)]
    if layout == "zigzag":
        c = s // 2
        return [(r * c, c), ((2 * P - 1 - r) * c, c)]
    return None


def runs(layout, S: int, P: int, r: int) -> list[tuple[int, int, int]]:
    """Rank r's tokens as arithmetic runs ``(global_start, length, step)`` in local order:
    one or two contiguous runs (step 1), or for ``striped`` one run of step P."""
    s = check_length(layout, S, P)
    if layout == "striped":
        return [(r, s, P)]
    return [(start, n, 1) for start, n in segments(layout, s, P, r)]


def owner(layout, S: int, P: int, index: torch.Tensor) -> torch.Tensor:
    """The ring rank that holds each global token ``index`` (int64 tensor)."""
    s = check_length(layout, S, P)
    if isinstance(layout, Runs):
        starts, _, ranks = layout.table()
        return ranks[torch.searchsorted(starts, index, right=True) - 1]
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


def global_positions(layout, S: int, P: int, r: int) -> torch.Tensor:
    """Global indices (int64 [s]) of the tokens rank r holds, in its local order."""
    if isinstance(layout, Runs):
        check_length(layout, S, P)
        return layout._memo(("positions", r), lambda: torch.cat([torch.arange(a, a + n)
                                                                 for a, n in layout.segments[r]]))
    return _positions(layout, S, P, r)


def sp_positions(layout, S: int, P: int, U: int, rank: int) -> torch.Tensor:
    """Global indices held by sequence rank ``rank`` = ring rank x U + Ulysses rank."""
    if isinstance(layout, Runs):
        check_length(layout, S, P, U)
        return global_positions(layout, S, P, rank // U).chunk(U)[rank % U]
    return _sp_positions(layout, S, P, U, rank)


@functools.lru_cache(maxsize=64)
def _sp_positions(layout: str, S: int, P: int, U: int, rank: int) -> torch.Tensor:
    check_length(layout, S, P, U)
    return global_positions(layout, S, P, rank // U).chunk(U)[rank % U]


def gather_order(layout, S: int, P: int, U: int = 1) -> torch.Tensor:
    """Permutation that turns the concatenated shards of sequence ranks 0..PU-1 into global
    order: ``full = cat(shards)[gather_order]``."""
    if isinstance(layout, Runs):
        return layout._memo(("gather_order", U), lambda: _order(layout, S, P, U))
    return _gather_order(layout, S, P, U)


@functools.lru_cache(maxsize=64)
def _gather_order(layout: str, S: int, P: int, U: int) -> torch.Tensor:
    return _order(layout, S, P, U)


def _order(layout, S: int, P: int, U: int) -> torch.Tensor:
    return torch.argsort(torch.cat([sp_positions(layout, S, P, U, r) for r in range(P * U)]))
