"""Cross-entropy over a sequence split across ranks.

The rule, stated once: every rank computes the token-loss SUM over its own tokens and divides
by the GLOBAL number of valid tokens (all ranks of the sequence group together). The value a
rank returns is the global loss (the other ranks' sums are added without gradient), and its
backward gives P times that rank's share of each parameter gradient (``ringseq.gradients``): the
mean of a parameter's gradient over the sequence group is the single-device gradient, so every
engine's plain average over all ranks (DDP, FSDP2, DeepSpeed, a raw loop's all-reduce / world
size) gives the single-device gradient averaged over the data-parallel replicas.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules import module as module_hooks
from torch.utils.checkpoint import checkpoint

from . import lockstep
from .errors import RingSeqError
from .gradients import scaled
from .slabs import SLAB_BYTES, slab_tokens  # noqa: F401 - part of this module's interface

IGNORE = -100


def _global_loss(local_sum: torch.Tensor, count, sp, dtype: torch.dtype) -> torch.Tensor:
    """local_sum / count with the value of sum-over-ranks / count and the gradient of the local
    part, times the gradient rule's factor. The sums are float64 (a scalar per rank: free), so the
    loss is the exact mean rounded once to ``dtype``, however the tokens were split. No target at
    all (every label -100) gives NaN, as the unpatched model's mean over no tokens does."""
    total = local_sum.detach().clone()
    if sp.size > 1:
        lockstep.agree(sp, "loss", {"sums": 0, "dtype": lockstep.dtype_code(total)})
        work = dist.all_reduce(total, group=sp.group, async_op=True)
        lockstep.wait(work, sp, "the all-reduce of the loss sums", peer=None)
    count = torch.as_tensor(count, dtype=local_sum.dtype, device=local_sum.device)
    return ((scaled(local_sum, sp) + (total - local_sum.detach())) / count).to(dtype)


def _token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The float64 sum of the token losses (each computed in the logits' dtype, at least fp32)."""
    losses = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE, reduction="none")
    return losses.double().sum()


def count_targets(shift_labels: torch.Tensor, sp) -> torch.Tensor:
    """Targets (labels other than -100) of the whole sequence group, from this rank's shard: one
    all-reduce. A patched model or ``shard_batch`` counts them on the full batch instead
    (``ShardedBatch.count``), with no communication."""
    n = (shift_labels != IGNORE).sum()
    if sp.size > 1:
        lockstep.agree(sp, "loss", {"sums": 1, "dtype": lockstep.dtype_code(n)})
        work = dist.all_reduce(n, group=sp.group, async_op=True)
        lockstep.wait(work, sp, "the all-reduce of the label count", peer=None)
    return n


def cross_entropy(logits: torch.Tensor, shift_labels: torch.Tensor, *, sp, num_items_in_batch=None) -> torch.Tensor:
    """Global mean token loss from this rank's logits [B, s, V] and shifted labels [B, s].

    ``shift_labels`` must be shifted on the full sequence *before* sharding (``shard_batch``
    does that): a rank's last token predicts the next rank's first token. -100 is ignored.
    ``num_items_in_batch`` (as the HF Trainer passes it) replaces the counted tokens.
    """
    logits = _upcast(logits)
    local = _token_sum(logits, shift_labels.to(logits.device))
    count = num_items_in_batch if num_items_in_batch is not None else count_targets(shift_labels, sp)
    return _global_loss(local, count, sp, logits.dtype)


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Logits in at least fp32, as transformers' loss does (fp64 stays fp64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _sum_and_grad(logits: torch.Tensor, labels: torch.Tensor, inplace: bool):
    """(float64 sum of the token losses of logits [n, V], their gradient): softmax minus the
    one-hot label, 0 on ignored rows, written over ``logits`` itself when ``inplace``."""
    valid = (labels != IGNORE)[:, None]
    label = labels.masked_fill(~valid[:, 0], 0)[:, None]
    # log-softmax's own arithmetic (x - max, then minus log sum exp), so the value rounds as the plain loss's
    top = logits.amax(-1, keepdim=True)
    grad = logits.sub_(top) if inplace else logits - top
    picked = grad.gather(-1, label)
    norm = grad.exp_().sum(-1, keepdim=True)
    total = (norm.log() - picked).masked_fill_(~valid, 0).double().sum()
    grad.div_(norm)
    grad.scatter_(-1, label, grad.gather(-1, label) - 1).masked_fill_(~valid, 0)
    return total, grad


class _SlabTokenSum(torch.autograd.Function):
    """``_token_sum`` of one slab's logits [n, V], its gradient formed in forward (``_sum_and_grad``)
    over the logits themselves where nothing else holds them (``inplace``). The backward then
    holds one slab of [n, V], where log-softmax + nll hold three (log-softmax's output, the nll
    gradient, the log-softmax gradient)."""

    @staticmethod
    def forward(ctx, logits, labels, inplace: bool):
        ctx.set_materialize_grads(False)
        total, grad = _sum_and_grad(logits, labels, inplace)
        ctx.save_for_backward(grad)
        if inplace:
            ctx.mark_dirty(logits)
            return total, logits
        return (total,)

    @staticmethod
    def backward(ctx, d_total, *_):
        (grad,) = ctx.saved_tensors
        if d_total is None:
            return None, None, None
        return grad.mul_(d_total.to(grad.dtype)), None, None


class _FusedLinearLoss(torch.autograd.Function):
    """The token-loss sum of ``linear(hidden, weight, bias)`` [n, V] in slabs of ``chunk`` rows,
    every gradient formed in forward: per slab the logits, their gradient over them in place
    (``_sum_and_grad``), the hidden states' rows of gradient and the weight's and bias's
    gradient added into one accumulator each. The backward only scales them by the incoming
    gradient, so no slab's logits are computed twice (the checkpointed slabs compute each twice).
    One slab of logits exists at a time, and beside it the weight-sized accumulator that the
    checkpointed slabs' backward holds as the weight's gradient anyway. The matmuls run under the
    caller's autocast state, as the head's own would."""

    @staticmethod
    def forward(ctx, hidden, labels, weight, bias, chunk: int):
        ctx.set_materialize_grads(False)
        want_h, _, want_w, want_b, _ = ctx.needs_input_grad
        dh = torch.empty_like(hidden) if want_h else None
        dw = torch.zeros_like(weight) if want_w else None
        db = torch.zeros_like(bias) if want_b else None
        total = hidden.new_zeros((), dtype=torch.float64)
        for a in range(0, hidden.size(0), chunk):
            total += _fused_slab(hidden[a:a + chunk], labels[a:a + chunk], weight, bias,
                                 None if dh is None else dh[a:a + chunk], dw, db)
        ctx.grads = (dh, dw, db)
        return total

    @staticmethod
    def backward(ctx, d_total):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RingSeqError("the backward of ringseq's fused chunked loss ran twice (retain_graph); patch with "
                               "chunked_loss=False to backpropagate through the loss more than once")
        if d_total is None:
            return None, None, None, None, None
        dh, dw, db = (None if g is None else g.mul_(d_total.to(g.dtype)) for g in grads)
        return dh, None, dw, db, None


def _fused_slab(h, labels, weight, bias, dh, dw, db) -> torch.Tensor:
    """One slab of ``_FusedLinearLoss``: its token-loss sum; its gradients written into ``dh``
    (the slab's rows) and added into ``dw`` and ``db``. Its logits die when it returns, before
    the next slab's exist."""
    raw = F.linear(h, weight, bias)
    total, grad = _sum_and_grad(_upcast(raw), labels, inplace=True)
    grad = grad.to(raw.dtype)
    del raw
    if dh is not None:
        dh.copy_(grad @ weight)
    if dw is not None and grad.dtype == dw.dtype:
        dw.addmm_(grad.t(), h)
    elif dw is not None:  # autocast: the half-precision product, added into the weight's dtype
        dw.add_(grad.t() @ h)
    if db is not None:
        db.add_(grad.sum(0))
    return total


def _fusable(head, softcap) -> bool:
    """Whether the head is a plain Linear whose forward nothing else takes part in: no hooks
    (ZeRO-3 gathers a partitioned weight in one, PEFT and accelerate wrap theirs) and no softcap."""
    hooks = (head._forward_hooks, head._forward_pre_hooks, module_hooks._global_forward_hooks,
             module_hooks._global_forward_pre_hooks)
    return softcap is None and type(head) is torch.nn.Linear and not hasattr(head.weight, "ds_id") and not any(hooks)


def _slab_loss(hidden, labels, head, softcap, finish=None):
    raw = head(hidden) if finish is None else finish(head(hidden))
    logits = _upcast(raw)
    # over the logits in place only where this function alone holds them: a Linear head's output
    # (saved by nothing) or the fp32 copy of half-precision ones; not under softcap (tanh keeps its output)
    inplace = softcap is None and finish is None and (logits is not raw or type(head) is torch.nn.Linear)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return _SlabTokenSum.apply(logits, labels, inplace)[0]


def chunked_cross_entropy(hidden: torch.Tensor, shift_labels: torch.Tensor, head, *, sp, count,
                          final_softcap: float | None = None, chunk: int | None = None, finish=None) -> torch.Tensor:
    """``cross_entropy`` of ``head(hidden)`` without ever holding the logits of more than
    ``chunk`` tokens (default ``slab_tokens(vocab)``: 64 MiB of fp32 logits, at least 512 tokens).
    ``finish``: what the model does to its head's output before the softcap (a family's logit
    multiplier or divisor), applied in the head's dtype. A plain Linear head (``_fusable``) forms
    every gradient in forward, slab by slab (``_FusedLinearLoss``); any other head (softcap, a
    finish, PEFT, ZeRO-3's partitioned weight) has each slab checkpointed, its logits recomputed
    in backward. Exact: the slab sums add up to the same sum."""
    # a Linear (or PEFT's wrapper) knows its width also when ZeRO-3 has partitioned its weight away
    chunk = chunk or slab_tokens(getattr(head, "out_features", None) or head.weight.shape[0])
    flat_h, flat_y = hidden.flatten(0, -2), shift_labels.flatten().to(hidden.device)
    if finish is None and _fusable(head, final_softcap) and torch.is_grad_enabled():
        local = _FusedLinearLoss.apply(flat_h, flat_y, head.weight, head.bias, chunk)
    else:
        local = hidden.new_zeros((), dtype=torch.float64)
        # Every slab joins the graph, even one whose labels are all ignored: each rank's backward
        # must reach every attention layer, whose ring backward is a collective.
        for a in range(0, flat_h.size(0), chunk):
            local = local + checkpoint(_slab_loss, flat_h[a:a + chunk], flat_y[a:a + chunk], head, final_softcap,
                                       finish, use_reentrant=False)
    return _global_loss(local, count, sp, torch.promote_types(hidden.dtype, torch.float32))
