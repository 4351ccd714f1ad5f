"""The one reference attention of the tests, the benchmarks and the GPU check (shapes: ``ringseq.shapes``).

Dense attention on the whole sequence, written from the definitions alone (not from ringseq's
mask or ring code): query i sees key j when j <= i (causal), 0 <= i - j < window, both are in
the same packed document (a document starts where ``position_ids[i] != position_ids[i-1] + 1``)
and j is not padding; a bidirectional block (``blocks``: ids per token, -1 for none) lets a query
see every key of its own block, later ones too; scores are scaled, soft-capped (``c * tanh(s / c)``), and sinks join every
softmax denominator. Run it in float64 for the reference, or in a lower dtype for "the plain
computation" the 2x rule compares against (``ringseq.tolerance``); ``sdpa=True`` hands the
dense mask to ``scaled_dot_product_attention`` as an unpatched model's sdpa path does.
"""
from __future__ import annotations

import torch


def visibility(S: int, *, causal: bool, window=None, position_ids=None, attention_mask=None, query_positions=None,
               device=None, blocks=None) -> torch.Tensor:
    """bool [B or 1, n, S]: True where query row (global index ``query_positions``, default
    0..S-1) sees key j."""
    i = (torch.arange(S, device=device) if query_positions is None else query_positions.to(device))[:, None]
    j = torch.arange(S, device=device)[None, :]
    vis = torch.ones(1, i.size(0), S, dtype=torch.bool, device=device)
    if causal:
        vis = vis & (j <= i)
        if blocks is not None:
            own = blocks.to(device)[:, i[:, 0], None]
            vis = vis | ((own == blocks.to(device)[:, None, :]) & (own >= 0))
    if window is not None:
        vis = vis & ((i - j) < window)
    if position_ids is not None:
        pos = position_ids.to(device).reshape(-1, S)
        starts = torch.ones(pos.shape, dtype=torch.bool, device=device)
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        doc = torch.cumsum(starts.long(), 1)
        vis = vis & (doc[:, i[:, 0], None] == doc[:, None, :])
    if attention_mask is not None:
        vis = vis & attention_mask.to(device).bool()[:, None, :]
    return vis


def attention(q, k, v, dout=None, *, causal: bool = True, scale=None, window=None, softcap=None, sinks=None,
              position_ids=None, attention_mask=None, query_positions=None, sdpa: bool = False, blocks=None):
    """Attention of q [B, H, n, D] over k [B, K, S, D] and v [B, K, S, Dv] (H % K == 0) in the
    inputs' dtype. ``query_positions`` [n]: the global indices of q's rows (default: all S).
    Returns out [B, H, n, Dv]; with ``dout``, (out, dq, dk, dv, dsinks) from its backward.

    ``sdpa=True`` (no softcap) computes it as transformers' sdpa path does: the dense mask into
    ``scaled_dot_product_attention``, sinks as one extra key of value 0 whose additive mask
    column holds the sink logit (the sinks' own gradient still comes from the written-out path,
    as SDPA's fused kernels give no mask gradient)."""
    grad = dout is not None
    q, k, v = (t.detach().clone().requires_grad_(grad) for t in (q, k, v))
    sinks = None if sinks is None else sinks.detach().clone().requires_grad_(grad)
    B, H, n, D = q.shape
    S, G = k.size(2), H // k.size(1)
    scale = D ** -0.5 if scale is None else scale
    vis = visibility(S, causal=causal, window=window, position_ids=position_ids, attention_mask=attention_mask,
                     query_positions=query_positions, device=q.device, blocks=blocks).expand(B, n, S)
    with torch.set_grad_enabled(grad):
        if sdpa and softcap is None:
            out = _sdpa(q, k, v, vis, scale, sinks, G)
        else:
            out = _written_out(q, k, v, vis, scale, softcap, sinks, G)
    if not grad:
        return out.detach()
    out.backward(dout)
    dsinks = None if sinks is None else sinks.grad
    if sdpa and softcap is None and sinks is not None:
        dsinks = attention(q, k, v, dout, causal=causal, scale=scale, window=window, sinks=sinks,
                           position_ids=position_ids, attention_mask=attention_mask,
                           query_positions=query_positions, blocks=blocks)[4]
    return out.detach(), q.grad, k.grad, v.grad, dsinks


def _sdpa(q, k, v, vis, scale, sinks, G):
    mask, kk, vv = vis[:, None], k, v
    if sinks is not None:
        B, H, n, _ = q.shape
        mask = torch.zeros(B, H, n, k.size(2) + 1, dtype=q.dtype, device=q.device)
        mask[..., :-1].masked_fill_(~vis[:, None], float("-inf"))
        mask[..., -1] = sinks.detach().to(q.dtype)[None, :, None]
        kk = torch.cat([k, k.new_zeros(B, k.size(1), 1, k.size(3))], 2)
        vv = torch.cat([v, v.new_zeros(B, v.size(1), 1, v.size(3))], 2)
    return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale, enable_gqa=G > 1)


def _written_out(q, k, v, vis, scale, softcap, sinks, G):
    s = q @ k.repeat_interleave(G, 1).transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~vis[:, None], float("-inf"))
    if sinks is not None:
        B, H, n, S = s.shape
        s = torch.cat([s, sinks.to(s.dtype)[None, :, None, None].expand(B, H, n, 1)], -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v.repeat_interleave(G, 1)
