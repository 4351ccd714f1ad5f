"""Full tensor <-> this rank's shard, by the layout of a ``SequenceParallel``.

``shard`` needs no communication; ``gather`` all-gathers over the sequence group. Both are
differentiable:

- ``shard`` backward places the incoming gradient at this rank's positions, zeros elsewhere;
- ``gather`` backward keeps this rank's slice of the incoming gradient (no communication),
  times the gradient rule's factor P (``ringseq.gradients``): every rank computes the same
  function of the gathered tensor, so the slices summed over the group give the full gradient
  exactly once, and their mean (what the engines take) gives it after the factor. A gather is
  where a loss over the whole sequence begins, as ``ringseq.loss`` is.

The gather has its own autograd function because ``torch.distributed.nn.functional``
collectives crash in backward on gloo subgroups that do not contain global rank 0.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import lockstep
from .errors import RingSeqError
from .gradients import factor
from .layouts import check_length, gather_order, layout_code, segments, sp_positions
from .topology import check_sp


def _dim(x, dim) -> int:
    """``dim`` as a non-negative index of x's dimensions; out of range is an error, not a wrap."""
    if not torch.is_tensor(x):
        raise RingSeqError(f"expected a torch.Tensor, got {type(x).__name__} (stack lists with torch.stack)")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise RingSeqError(f"dim={dim!r} is not a dimension of a {x.dim()}-D tensor of shape {tuple(x.shape)}: "
                           f"pass an integer in [{-x.dim()}, {x.dim() - 1}] (the sequence dimension)")
    return dim % x.dim()


def shard_tensor(x: torch.Tensor, dim: int, layout: str, P: int, r: int, U: int = 1) -> torch.Tensor:
    """Sequence rank r's slice of the full tensor ``x`` along ``dim`` (P ring x U Ulysses
    ranks; no communication, no autograd function needed: slicing is differentiable)."""
    dim = _dim(x, dim)
    S = x.size(dim)
    s = check_length(layout, S, P, U)
    runs = segments(layout, s, P, r) if U == 1 else None
    if runs is None:  # striped, or pieces of ring shards
        return x.index_select(dim, sp_positions(layout, S, P, U, r).to(x.device))
    parts = [x.narrow(dim, start, n) for start, n in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _all_gather(local: torch.Tensor, dim: int, sp) -> torch.Tensor:
    local = local.contiguous()
    pieces = [torch.empty_like(local) for _ in range(sp.size)]
    work = dist.all_gather(pieces, local, group=sp.group, async_op=True)
    lockstep.wait(work, sp, f"the all-gather of a {tuple(local.shape)} shard (ringseq.gather)", peer=None)
    return torch.cat(pieces, dim)


class _Gather(torch.autograd.Function):
    """Forward: all-gather over the sequence group. Backward: keep this rank's slice, times the
    gradient rule's factor (``ringseq.gradients``: every rank computes the same loss of the whole
    tensor, and the engines average the ranks' gradients)."""

    @staticmethod
    def forward(ctx, local, dim, sp, layout):
        P, U, r = sp.ring_size, sp.ulysses_size, sp.rank
        ctx.meta, ctx.sp = (dim, layout, P, r, U), sp
        S = local.size(dim) * P * U
        joined = _all_gather(local, dim, sp)
        return joined.index_select(dim, gather_order(layout, S, P, U).to(local.device))

    @staticmethod
    def backward(ctx, grad):
        dim, layout, P, r, U = ctx.meta
        return shard_tensor(grad, dim, layout, P, r, U) * factor(ctx.sp), None, None, None


def shard(x: torch.Tensor, dim: int, sp) -> torch.Tensor:
    """Full tensor -> this rank's slice along ``dim`` by ``sp.layout``.

    Raises ``RingSeqError`` if the length along ``dim`` cannot be split by the layout.
    """
    check_sp(sp)
    return shard_tensor(x, _dim(x, dim), sp.layout, sp.ring_size, sp.rank, sp.ulysses_size)


def gather(local: torch.Tensor, dim: int, sp, layout=None) -> torch.Tensor:
    """This rank's slice -> the full tensor, in global order (inverse of ``shard``). ``layout``:
    a batch's own (``ShardedBatch.order``) instead of ``sp.layout``; ``ShardedBatch.gather`` passes it."""
    check_sp(sp)
    try:
        dim = _dim(local, dim)
    except RingSeqError as err:  # refused in the call's agreement: every rank raises in this gather, in step
        lockstep.refuse(sp, "gather", err)
    if sp.size == 1:
        return local
    shape = (list(local.shape) + [-1] * 4)[:4]
    layout = sp.layout if layout is None else layout
    lockstep.agree(sp, "gather", {"dim": dim, "dims": local.dim(), "dtype": lockstep.dtype_code(local),
                                  "layout": layout_code(layout), **{f"shape[{i}]": n for i, n in enumerate(shape)}})
    return _Gather.apply(local, dim, sp, layout)
