"""``ringseq.ring_attention``: exact softmax attention over a sequence split across ranks."""
from __future__ import annotations

import math

import torch

from .errors import RingSeqError
from .layouts import multiple
from .ring import RingAttention, RingOptions


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sp) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise RingSeqError(f"q, k, v must be 4-D [B, heads, s, D]; got shapes {tuple(q.shape)}, "
                           f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise RingSeqError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    (B, H, s, D), (Bk, K, sk, Dk) = q.shape, k.shape
    if (B, s, D) != (Bk, sk, Dk):
        raise RingSeqError(f"q [B,H,s,D]={tuple(q.shape)} and k/v [B,K,s,D]={tuple(k.shape)} must agree "
                           f"on batch, local length and head dim")
    if K == 0 or H % K:
        raise RingSeqError(f"query heads H={H} must be a multiple of kv heads K={K} (GQA/MQA)")
    if not (q.dtype == k.dtype == v.dtype):
        raise RingSeqError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if (s * sp.ring_size) % multiple(sp.layout, sp.ring_size):
        raise RingSeqError(f"local length {s} cannot come from layout {sp.layout!r} over "
                           f"{sp.ring_size} ranks: shard the sequence with ringseq.shard")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sp, causal: bool = True,
                   scale: float | None = None, position_ids=None, window=None, softcap=None,
                   sinks=None, kernel: str | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries over the whole (global) sequence.

    q [B,H,s,D], k/v [B,K,s,D] (H % K == 0; K/V cross the wire at K heads), each this rank's
    shard by ``sp.layout``. Returns [B,H,s,D] in q's dtype; differentiable in q, k and v.
    ``kernel`` forces a block backend (``cpu_flash``, ``cuda_flash``, ``torch``); by default
    the fastest one that applies is chosen.
    """
    _check_shapes(q, k, v, sp)
    unsupported = {"position_ids": position_ids, "window": window, "softcap": softcap, "sinks": sinks}
    named = [name for name, value in unsupported.items() if value is not None]
    if named:
        raise RingSeqError(f"{', '.join(named)} is not supported by this ringseq version; "
                           f"leave it unset or upgrade ringseq")
    if sp.ulysses_size > 1:
        raise RingSeqError("ulysses_size > 1 is not supported by this ringseq version; "
                           "use ringseq.init(sp_size=..., ulysses_size=1)")
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else float(scale)
    opts = RingOptions(group=sp.ring_group, ranks=sp.ring_ranks, r=sp.ring_rank,
                       layout=sp.layout, causal=bool(causal), scale=scale, kernel=kernel)
    return RingAttention.apply(q, k, v, opts)
