"""The gradient rule, in one place.

Every rank of a sequence group returns the global loss of the full batch. The backward of a rank
leaves **P times its share** of each parameter's gradient (P = ``sp.size``, the ranks of one
sequence group): its shares over the group add up to the unpatched model's gradient, so the
*mean* of the group's gradients is that gradient. Every engine averages a gradient over the ranks
it reduces over: DistributedDataParallel (its default hook), FSDP2 ``fully_shard`` and HSDP,
FSDP1, DeepSpeed ZeRO 0-3. Over ranks that cover whole sequence groups, that average is the
unpatched gradient averaged over the data-parallel replicas, which is what one-process training
on the replicas' batches computes. A raw loop does the same by hand: average every gradient over
all ranks (all-reduce, then divide by the world size). This is torchtitan's and axolotl's way
(the backward scaled so that the engine's plain average comes out right) instead of a reduction
of ringseq's own per engine.

The factor enters where a rank's share of a loss begins (``scaled``): the losses of
``ringseq.loss``, a MoE model's router loss and ``ringseq.gather``'s backward (TRL's fused head
and a user's own loss over gathered tensors). What an engine must do for the rule to hold, and
what ringseq refuses, is in ``ringseq.engines``.
"""
from __future__ import annotations

import torch


def factor(sp) -> int:
    """P: what a rank's share of each gradient is multiplied by (the ranks of one sequence group)."""
    return sp.size


class _Scaled(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by ``times``."""

    @staticmethod
    def forward(ctx, x, times: int):
        ctx.times = times
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.times, None


def scaled(x: torch.Tensor, sp) -> torch.Tensor:
    """``x`` itself, whose gradient is multiplied by ``factor(sp)`` on its way back: where a rank's
    share of a loss begins."""
    times = factor(sp)
    if times == 1 or not (x.requires_grad and torch.is_grad_enabled()):
        return x
    return _Scaled.apply(x, times)


def covers(ranks, sp) -> bool:
    """Whether ``ranks`` (global) hold every rank of each sequence group they touch, this rank's
    included: an average over them then sums each group's shares whole."""
    ranks = set(ranks)
    return set(sp.ranks) <= ranks and all(set(g) <= ranks or ranks.isdisjoint(g) for g in sp.sequence_groups)
