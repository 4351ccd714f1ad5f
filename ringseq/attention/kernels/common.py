"""What every block backend shares: the call's options and a few helpers."""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """The non-tensor options of one kernel call."""

    causal: bool
    """Top-left causal mask inside the call (square calls only); ignored when ``mask`` is given."""
    scale: float
    """Multiplier of q.k (1/sqrt(D) by default)."""
    softcap: float | None = None
    """Scores become softcap * tanh(scores / softcap) before masking."""
    mask: object | None = None
    """A ``RowMask``: the visibility of any slab of rows against any key columns."""
    rows: int | None = None
    """Query rows per slab (bounds scores and masks to rows x keys); None: the backend's default."""


LSE = torch.float64  # log-sum-exp across blocks: [B, H, s] only, so fp64 costs nothing


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype for inputs of t's dtype: fp64 stays fp64, everything else fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def slabs(n: int, size: int) -> list[slice]:
    return [slice(a, min(a + size, n)) for a in range(0, n, size)]
