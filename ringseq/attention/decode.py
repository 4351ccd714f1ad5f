"""Attention of new tokens over a KV cache split across the sequence group (generation's decode).

Every rank keeps the keys and values of some tokens: its share of the prompt, which the ring
prefilled, and the new tokens it was chosen to keep. The new tokens' queries are on every rank
(generation feeds every rank the same tokens). Each rank attends to the keys it holds (a partial
output with its largest score and its sum of exponentials, in float32, or float64 for a
float64 model), one all-gather brings every rank's partials, and every rank merges them in
group order: the softmax over all keys, exactly, and the same numbers bit
for bit on every rank (so every rank picks the same next token).

Masks are the ring's (``ringseq.attention.masks``), by global index: key j is visible to query
i when ``j <= i``, ``i - j < window`` and key j is not padding. Shapes: ``ringseq.shapes``
(n new tokens, m keys held by this rank).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ringseq import lockstep
from ringseq.errors import RingSeqError

KEY_SLAB = 16384
"""Keys scored at a time: a partial over m keys holds B x H x n x KEY_SLAB floats, never B x H x n x m."""


def _scores(q, k, scale: float, softcap):
    """q [B,K,G,n,D], k [B,K,m,D] -> [B,K,G,n,m] in q's dtype (GQA: K/V never repeated)."""
    s = torch.einsum("bkgnd,bkmd->bkgnm", q, k.to(q.dtype)) * scale
    return s if softcap is None else softcap * torch.tanh(s / softcap)


def merge(outs: torch.Tensor, maxes: torch.Tensor, sums: torch.Tensor, sinks: torch.Tensor | None = None):
    """Partials over disjoint key sets -> the attention over all of them: (out, max, sum).

    outs [P, ..., Dv] (each normalised over its own keys), maxes [P, ...] (each part's largest
    score, -inf where it saw no key) and sums [P, ...] (its sum of exp(score - max)). ``sinks``
    [...]-broadcastable per-head logits that take part in the softmax's denominator only
    (gpt-oss). Maxima and sums rather than log-sum-exps: a log-sum-exp carries an absolute error
    of its magnitude times the dtype's epsilon, which exp() turns into a relative error of the
    weights many times the plain softmax's. A row no part saw is 0."""
    top = maxes.max(0).values
    if sinks is not None:
        top = torch.maximum(top, sinks.to(top.dtype).expand_as(top))
    base = top.masked_fill(top == -math.inf, 0.0)
    scaled = sums * torch.exp(maxes - base.unsqueeze(0))
    total = scaled.sum(0)
    denominator = total if sinks is None else total + torch.exp(sinks.to(top.dtype).expand_as(top) - base)
    weights = (scaled / denominator.unsqueeze(0)).nan_to_num(0.0)  # 0 / 0: a row nothing saw
    return (weights.unsqueeze(-1) * outs).sum(0), top, total


def partial(q, k, v, *, q_pos, k_pos, k_valid, scale: float, window=None, softcap=None):
    """This rank's share: q [B,H,n,D] over its keys k [B,K,m,D], v [B,K,m,Dv] at global indices
    ``k_pos`` [m] (``k_valid`` [B, m]: False for padding) -> (out [B,H,n,Dv], max [B,H,n],
    sum [B,H,n]) as ``merge`` takes them, in float32 (float64 for a float64 q), key slab by key
    slab."""
    B, H, n, D = q.shape
    K, m, Dv = k.size(1), k.size(2), v.size(-1)
    qg = q.to(torch.promote_types(q.dtype, torch.float32)).reshape(B, K, H // K, n, D)
    outs, maxes, sums = [], [], []
    for a in range(0, max(m, 1), KEY_SLAB):
        b = min(m, a + KEY_SLAB)
        s = _scores(qg, k[:, :, a:b], scale, softcap)
        kp = k_pos[a:b]
        vis = kp[None, :] <= q_pos[:, None]  # [n, m]
        if window is not None:
            vis = vis & (q_pos[:, None] - kp[None, :] < window)
        vis = vis[None] & k_valid[:, None, a:b]  # [B, n, m]
        s = s.masked_fill(~vis[:, None, None].to(s.device), -math.inf)
        top = s.amax(-1) if s.size(-1) else s.new_full(s.shape[:-1], -math.inf)
        e = torch.exp(s - top.masked_fill(top == -math.inf, 0.0).unsqueeze(-1))
        total = e.sum(-1)
        outs.append(torch.einsum("bkgnm,bkmv->bkgnv", e / total.unsqueeze(-1).clamp_min(torch.finfo(e.dtype).tiny),
                                 v[:, :, a:b].to(e.dtype)))
        maxes.append(top)
        sums.append(total)
    out, top, total = torch.stack(outs), torch.stack(maxes), torch.stack(sums)
    if out.size(0) > 1:
        out, top, total = merge(out, top, total)
    else:
        out, top, total = out[0], top[0], total[0]
    return out.reshape(B, H, n, Dv), top.reshape(B, H, n), total.reshape(B, H, n)


def decode_attention(q, k, v, *, sp, q_pos, k_pos, k_valid, scale=None, window=None, softcap=None,
                     sinks=None, agreed: bool = False) -> torch.Tensor:
    """Exact attention of the new tokens' queries q [B,H,n,D] (the same on every rank) over the
    keys of every rank of ``sp``: this rank's k [B,K,m,D], v [B,K,m,Dv] at global indices
    ``k_pos`` [m], ``k_valid`` [B, m]; ``q_pos`` [n] the queries' global indices. Returns
    [B,H,n,Dv] in q's dtype, identical on every rank. One all-gather of B x H x n x (Dv + 3)
    floats (the last: whether the rank's part failed: every rank then raises in this call; in a
    patched model's decode step on a GPU, at the end of the step, ``lockstep.finish_step``),
    bounded by ``sp.timeout`` and agreed first (``ringseq.lockstep``) unless ``agreed``: a patched
    model's decode step agrees once on its new tokens, from which every layer's call follows alike
    on every rank, and spares each layer the agreement's round trip (decode is latency-bound)."""
    scale = q.size(-1) ** -0.5 if scale is None else scale
    B, H, n, Dv = q.size(0), q.size(1), q.size(2), v.size(-1)
    label = f"decode attention{lockstep.at_layer()}"
    if sp.size > 1 and not agreed:  # before anything can fail on one rank only
        lockstep.agree(sp, "decode", {"batch": B, "heads": H, "tokens": n, "value dim": Dv,
                                      "dtype": lockstep.dtype_code(q), "scale": lockstep.float_bits(scale),
                                      "window": window or 0, "softcap": lockstep.float_bits(softcap),
                                      "sinks": int(sinks is not None)})
    error = None
    try:
        out, top, total = partial(q, k, v, q_pos=q_pos.cpu(), k_pos=k_pos.cpu(), k_valid=k_valid.cpu(), scale=scale,
                                  window=window, softcap=softcap)
        mine = torch.cat([out, top.unsqueeze(-1), total.unsqueeze(-1), torch.zeros_like(total).unsqueeze(-1)], -1)
    except Exception as exc:  # noqa: BLE001 - raised below, after the peers learnt of it in this same all-gather
        if sp.size == 1:
            raise
        error, mine = exc, torch.zeros((B, H, n, Dv + 3), dtype=torch.promote_types(q.dtype, torch.float32),
                                       device=q.device)
        mine[..., -1] = dist.get_rank() + 1  # the status column: this rank's part failed (exact in fp32)
        lockstep.mark_failed(sp, f"{label}: {type(exc).__name__}: {exc}")
    if sp.size > 1:
        every = [torch.empty_like(mine) for _ in range(sp.size)]
        work = dist.all_gather(every, mine.contiguous(), group=sp.group, async_op=True)
        lockstep.wait(work, sp, f"the decode partials of every rank ({tuple(mine.shape)}){lockstep.at_layer()}",
                      peer=None)
        parts = torch.stack(every)
        deferred = agreed and lockstep.defers(q.device)
        if error is not None and not deferred:
            raise error
        if error is not None:  # a patched decode step on a GPU: its peers read the flag at the end of the step,
            lockstep.defer_own(sp, error)  # so this rank makes every later layer's all-gather too, then raises
        else:
            _check_parts(sp, label, parts[..., -1].reshape(sp.size, -1)[:, :1], deferred)
    else:
        parts = mine[None]
    head_sinks = None if sinks is None else sinks.reshape(1, -1, 1)
    return merge(parts[..., :-3], parts[..., -3], parts[..., -2], head_sinks)[0].to(q.dtype)


def _check_parts(sp, label: str, flags: torch.Tensor, deferred: bool) -> None:
    """Raise on every rank whose peers' partials came flagged failed (their part raised): at once
    on the CPU and for a raw call, whose caller gets its result now; a patched model's decode step
    on a GPU (``deferred``) reads them later, without a host synchronisation per layer
    (``lockstep.check_later``: at the end of the decode step, ``lockstep.finish_step``)."""
    if deferred:
        lockstep.check_later(sp, label, [flags.amax()])
    elif bool(flags.any()):
        lockstep.mark_failed(sp)
        raise RingSeqError(lockstep.peer_failed(sp, label, culprit=int(flags.max()) - 1))
