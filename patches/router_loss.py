"""The MoE router's auxiliary (load-balancing) loss over the whole sequence group.

transformers' ``load_balancing_loss_func`` (Switch Transformer's, in every MoE family that has
one) is ``E x sum_e f_e P_e``: ``f_e`` the share of top-k assignments that went to expert e and
``P_e`` its mean routing probability, both means over every token of every MoE layer (padding
weighted out by the attention mask). Means of the whole batch do not split into per-rank
means, so each rank sums its own tokens' assignments, probabilities and token count, one
all-reduce adds them up, and the loss takes the global value with the gradient of this rank's
own probabilities (``f_e`` carries none: it comes from a top-k), times the gradient rule's factor
(``ringseq.gradients``): averaged over the group the gradients are the unpatched model's. At patch time the family's own function is run on random
router logits beside this one, so a family whose function differs is refused, never
approximated.
"""
from __future__ import annotations

import dataclasses
import inspect
import sys

import torch
import torch.distributed as dist

from ringseq import lockstep
from ringseq.errors import RingSeqError
from ringseq.gradients import scaled


@dataclasses.dataclass(frozen=True)
class RouterLoss:
    experts: int
    top_k: int
    coef: float


def plan(model) -> RouterLoss | None:
    """The router loss the unpatched model adds (None: its forward adds none, or it has no
    router); raises ``RingSeqError`` when its function is not the one ringseq reproduces."""
    forward = type(model).forward
    module = sys.modules[type(model).__module__]
    family_fn = getattr(module, "load_balancing_loss_func", None)
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        source = ""
    if family_fn is None or "load_balancing_loss_func" not in source:
        return None
    names = [("num_experts", "num_local_experts", "n_routed_experts"), ("num_experts_per_tok",),
             ("router_aux_loss_coef",)]
    values = []
    for options in names:
        value = next((getattr(model, n) for n in options if isinstance(getattr(model, n, None), (int, float))), None)
        if value is None:
            config = model.config.get_text_config()  # a VLM keeps its experts in its text config
            value = next((getattr(config, n) for n in options if getattr(config, n, None) is not None), None)
        if value is None:
            raise RingSeqError(f"{type(model).__name__} adds a router loss but has none of {options}: ringseq cannot "
                               f"reproduce it; set output_router_logits=False")
        values.append(value)
    loss = RouterLoss(experts=int(values[0]), top_k=int(values[1]), coef=float(values[2]))
    _self_check(family_fn, loss, type(model).__name__)
    return loss


def _self_check(family_fn, loss: RouterLoss, name: str) -> None:
    """The family's function and ringseq's sums on the same random logits, with and without a mask."""
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(2 * 5, loss.experts, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, :2] = 0
    for m in (None, mask):
        theirs = family_fn(logits, loss.experts, loss.top_k, m)
        weights = None if m is None else m.reshape(-1).double()
        ours = _value(_sums(logits, loss, weights), loss)
        if not torch.allclose(torch.as_tensor(theirs, dtype=torch.float64), ours, rtol=1e-6, atol=1e-9):
            raise RingSeqError(f"{name}'s load_balancing_loss_func is not the Switch Transformer loss ringseq splits "
                               f"over ranks ({float(theirs):.6g} vs {float(ours):.6g}); set output_router_logits=False")


def _sums(router_logits, loss: RouterLoss, weights: torch.Tensor | None) -> torch.Tensor:
    """[2E + 1]: per-expert assignment counts, per-expert probability sums and the token count
    of these rows (weighted), every MoE layer's rows together."""
    counts = probs = rows = 0
    for logits in router_logits:
        routing = torch.softmax(logits, dim=-1)
        _, chosen = torch.topk(routing, loss.top_k, dim=-1)
        w = torch.ones(routing.size(0), dtype=torch.float64, device=routing.device) if weights is None else weights
        hits = torch.zeros(loss.experts, dtype=torch.float64, device=routing.device)
        counts = counts + hits.scatter_add_(0, chosen.reshape(-1), w.repeat_interleave(loss.top_k))
        probs = probs + (routing.double() * w[:, None]).sum(0)
        rows = rows + w.sum()
    return torch.cat([counts, probs, torch.as_tensor(rows, dtype=torch.float64, device=probs.device).reshape(1)])


def _value(sums: torch.Tensor, loss: RouterLoss, probs: torch.Tensor | None = None) -> torch.Tensor:
    """E x sum_e (assignments_e / rows) (probabilities_e / rows), from ``_sums`` (``probs``:
    the probability sums to use instead of the ones in ``sums``)."""
    E = loss.experts
    counts, rows = sums[:E], sums[2 * E]
    probs = sums[E:2 * E] if probs is None else probs
    return (counts / rows * (probs / rows)).sum() * E


def aux_loss(router_logits, loss: RouterLoss, batch, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The auxiliary loss of the whole batch (every rank of the group gets the same value) from
    this rank's router logits (a tuple of [B * s, E], one per MoE layer), with the gradient of this
    rank's share. ``attention_mask``: this rank's shard of the padding mask, if the batch had one;
    the layout's own padding is never counted."""
    positions = batch.positions().to(router_logits[0].device)
    B = router_logits[0].size(0) // positions.numel()
    weights = (positions < batch.length).to(torch.float64)[None, :].expand(B, -1)
    if attention_mask is not None:
        weights = weights * attention_mask.to(torch.float64)
    local = _sums(router_logits, loss, weights.reshape(-1))
    total = local.detach().clone()
    sp = batch.sp
    if sp.size > 1:
        lockstep.agree(sp, "loss", {"sums": 2, "dtype": lockstep.dtype_code(total), "size": total.numel()})
        work = dist.all_reduce(total, group=sp.group, async_op=True)
        lockstep.wait(work, sp, "the all-reduce of the router loss sums", peer=None)
    E = loss.experts  # the global value, the gradient of this rank's probabilities (assignments carry none)
    mine = local[E:2 * E]
    return _value(total, loss, probs=scaled(mine, sp) + (total[E:2 * E] - mine).detach())
