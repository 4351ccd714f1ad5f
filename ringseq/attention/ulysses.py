"""Ulysses: trade heads for sequence inside a group of U adjacent ranks (``ringseq.shapes``).

``seq_to_heads`` turns [B, U*h, s, D] (all heads, this rank's s tokens) into [B, h, U*s, D]
(this rank's h heads, the U*s tokens of the whole Ulysses group, in sequence order) with one
``all_to_all_single``; ``heads_to_seq`` is its inverse, and each is the other's backward.
The ring then runs across groups on the reassembled ring shard.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ringseq import lockstep
from ringseq.errors import RingSeqError


def _all_to_all(x: torch.Tensor, sp) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)  # after contiguous(): empty_like keeps a permuted input's strides
    work = dist.all_to_all_single(out, x, group=sp.ulysses_group, async_op=True)
    lockstep.wait(work, sp, f"the Ulysses all-to-all of {tuple(x.shape)}", peer=None)
    return out


def _seq_to_heads(x, sp):
    U = sp.ulysses_size
    B, HU, s, D = x.shape
    parts = x.reshape(B, U, HU // U, s, D).transpose(0, 1)      # [U, B, h, s, D]: part u goes to rank u
    got = _all_to_all(parts, sp)                                 # [U, B, h, s, D]: part u came from rank u
    return got.permute(1, 2, 0, 3, 4).reshape(B, HU // U, U * s, D)


def _heads_to_seq(y, sp):
    U = sp.ulysses_size
    B, h, Us, D = y.shape
    parts = y.reshape(B, h, U, Us // U, D).permute(2, 0, 1, 3, 4)  # [U, B, h, s, D]: tokens of rank u
    got = _all_to_all(parts, sp)                                    # [U, B, h, s, D]: heads of rank u
    return got.transpose(0, 1).reshape(B, U * h, Us // U, D)


class SeqToHeads(torch.autograd.Function):
    """Forward: all-to-all sequence -> heads. Backward: all-to-all heads -> sequence."""

    @staticmethod
    def forward(ctx, x, sp):
        ctx.sp = sp
        return _seq_to_heads(x, sp)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.sp), None


class HeadsToSeq(torch.autograd.Function):
    """Forward: all-to-all heads -> sequence. Backward: all-to-all sequence -> heads."""

    @staticmethod
    def forward(ctx, y, sp):
        ctx.sp = sp
        return _heads_to_seq(y, sp)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.sp), None


def kv_replicas(H: int, K: int, U: int) -> int:
    """How many times each kv head must be copied so U ranks each get whole GQA groups:
    1 when K % U == 0, U / K when K < U divides U; otherwise the split is impossible."""
    if H % U:
        raise RingSeqError(f"{H} query heads cannot be split over ulysses_size {U}: choose a "
                           f"ulysses_size that divides {H}")
    if K % U == 0:
        return 1
    if U % K == 0:
        return U // K
    raise RingSeqError(f"{K} kv heads cannot be split over ulysses_size {U}: choose a ulysses_size "
                       f"that divides {K} or is a multiple of it")
