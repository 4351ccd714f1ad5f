"""Argument checks of ``ring_attention``: every problem a ``RingSeqError`` that names the fix."""
from __future__ import annotations

import torch

from ringseq.errors import RingSeqError
from ringseq.layouts import multiple

from .masks import TokenInfo


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sp) -> None:
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
        raise RingSeqError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype} (under torch.autocast "
                           f"ring_attention casts them to the autocast dtype itself)")
    if (s * sp.size) % multiple(sp.layout, sp.ring_size, sp.ulysses_size):
        raise RingSeqError(f"local length {s} cannot come from layout {sp.layout!r} over "
                           f"{sp.size} ranks: shard the sequence with ringseq.shard")


def check_features(q, causal, window, softcap, sinks) -> None:
    if window is not None:
        if not causal:
            raise RingSeqError("window (sliding-window attention) is defined for causal attention "
                               "only (query i sees key j when 0 <= i - j < window); pass causal=True")
        if int(window) != window or window < 1:
            raise RingSeqError(f"window must be a positive integer, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise RingSeqError(f"softcap must be a positive number, got {softcap!r}")
    if sinks is not None and tuple(sinks.shape) != (q.size(1),):
        raise RingSeqError(f"sinks must hold one logit per query head, shape [{q.size(1)}]; "
                           f"got {tuple(sinks.shape)}")


def check_token_info(info: TokenInfo, B: int, S: int) -> None:
    for name in ("doc", "valid"):
        value = getattr(info, name)
        if value is not None and (value.dim() != 2 or value.size(1) != S or value.size(0) not in (1, B)):
            raise RingSeqError(f"token_info.{name} has shape {tuple(value.shape)} but the sequence group holds "
                               f"batch {B} x {S} tokens; build it with ringseq.token_info from this batch's "
                               f"position_ids/attention_mask shards")
