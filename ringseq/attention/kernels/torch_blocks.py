"""``torch``: attention in plain PyTorch, in fp32 (fp64 for fp64 inputs), a slab of query rows
at a time so memory stays O(rows x keys). It takes every feature (masks, softcap) and is the
fallback where no fused kernel applies."""
from __future__ import annotations

import torch

from .common import LSE, BlockSpec, acc_dtype, slabs

ROWS = 512  # query rows per slab: bounds the scores to ROWS x keys


def _grouped(q: torch.Tensor, K: int) -> torch.Tensor:
    """[B,H,n,D] -> [B,K,H/K,n,D] (query heads of one kv head side by side)."""
    B, H, n, D = q.shape
    return q.reshape(B, K, H // K, n, D)


def _scores(q, k, rows: slice, cols: tuple[int, int], spec: BlockSpec):
    """q [B,K,G,rows,D] (acc dtype), k [B,K,n,D] (the key columns ``cols`` of the call)
    -> (scores [B,K,G,rows,n] masked with -inf, tanh of the capped scores or None)."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * spec.scale
    t = None
    if spec.softcap is not None:
        t = torch.tanh(s / spec.softcap)
        s = spec.softcap * t
    if spec.mask is not None:
        visible = spec.mask.rows(rows.start, rows.stop, *cols)[:, None, None]  # [B,1,1,rows,n]
        s = s.masked_fill(~visible, float("-inf"))
    elif spec.causal:
        i = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
        j = torch.arange(cols[0], cols[1], device=q.device)[None, :]
        s = s.masked_fill(j > i, float("-inf"))
    return s, t


def _columns(rows: slice, sk: int, spec: BlockSpec) -> tuple[int, int]:
    """Key columns that query ``rows`` may see: bounded by the mask, or by the causal corner."""
    if spec.mask is not None:
        return spec.mask.key_range(rows.start, rows.stop)
    return 0, min(sk, rows.stop) if spec.causal else sk


class TorchBlocks:
    name, takes_mask, takes_softcap = "torch", True, True
    exact_lse = True  # takes the merged log-sum-exp at its own precision (else in the accumulation dtype)

    @staticmethod
    def applies(device_type: str, dtype: torch.dtype, head_dim: int) -> bool:
        return True

    @staticmethod
    def forward(q, k, v, spec: BlockSpec):
        acc = acc_dtype(q)
        K, sq = k.size(1), q.size(2)
        qg, kf, vf = _grouped(q, K).to(acc), k.to(acc), v.to(acc)
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=LSE, device=q.device)
        for rows in slabs(sq, spec.rows or ROWS):
            lo, hi = _columns(rows, kf.size(-2), spec)
            if hi == lo:
                continue  # these rows see none of this call's keys
            s, _ = _scores(qg[..., rows, :], kf[..., lo:hi, :], rows, (lo, hi), spec)
            m = s.amax(-1, keepdim=True)
            m = m.masked_fill(m == float("-inf"), 0.0)  # rows that see nothing: sum 0, lse -inf
            e = torch.exp(s - m)
            total = e.sum(-1, keepdim=True)
            out[..., rows, :] = torch.matmul(e / total, vf[..., lo:hi, :].unsqueeze(2)).nan_to_num_(0.0)
            # the maximum is exact; adding log(sum) in fp64 keeps the log-sum-exp to fp64 precision,
            # which the backward's exp(s - lse) needs to be as accurate as a plain softmax
            lse[..., rows] = (m.to(LSE) + torch.log(total.to(LSE))).squeeze(-1)
        return out.flatten(1, 2), lse.flatten(1, 2), None

    @staticmethod
    def backward(dout, q, k, v, out, lse, aux, spec: BlockSpec):
        acc = acc_dtype(q)
        K, sq = k.size(1), q.size(2)
        qg, kf, vf = _grouped(q, K).to(acc), k.to(acc), v.to(acc)
        dog, lse64 = _grouped(dout, K).to(acc), _grouped(lse.unsqueeze(-1), K).to(LSE)
        # lse as hi + lo in the compute dtype: exp((s - hi) - lo) keeps its fp64 precision
        lse_hi = lse64.to(acc)
        lse_lo = torch.where(torch.isfinite(lse64), lse64 - lse_hi.to(LSE), 0.0).to(acc)
        # A plain softmax backward subtracts sum_j p_j dp_j, made from the same rounded dp, so dp's
        # rounding cancels; blockwise, delta = sum_d dout_d out_d cannot cancel it. With fp32 inputs
        # dp and delta are therefore formed in fp64 (this fallback then stays within 2x of the
        # plain fp32 error, e.g. for softcap); with half inputs the inputs' rounding dominates.
        precise = torch.float64 if q.dtype in (torch.float32, torch.float64) else acc
        delta = (dog.to(precise) * _grouped(out, K).to(precise)).sum(-1, keepdim=True)  # [B,K,G,sq,1]
        dq = torch.zeros_like(qg)
        dk = torch.zeros_like(kf)
        dv = torch.zeros_like(vf)
        for rows in slabs(sq, spec.rows or ROWS):
            lo, hi = _columns(rows, kf.size(-2), spec)
            if hi == lo:
                continue
            kb, vb = kf[..., lo:hi, :], vf[..., lo:hi, :]
            s, t = _scores(qg[..., rows, :], kb, rows, (lo, hi), spec)
            p = torch.exp((s - lse_hi[..., rows, :]) - lse_lo[..., rows, :]).nan_to_num_(0.0)
            do = dog[..., rows, :]
            dv[..., lo:hi, :] += torch.matmul(p.transpose(-1, -2), do).sum(2)
            dp = torch.matmul(do.to(precise), vb.to(precise).unsqueeze(2).transpose(-1, -2))
            ds = p * (dp - delta[..., rows, :]).to(acc)
            if t is not None:
                ds = ds * (1 - t * t)  # through the cap: d(c tanh(x/c))/dx = 1 - tanh^2
            dq[..., rows, :] = torch.matmul(ds, kb.unsqueeze(2)) * spec.scale
            dk[..., lo:hi, :] += torch.matmul(ds.transpose(-1, -2), qg[..., rows, :]).sum(2) * spec.scale
        return dq.flatten(1, 2), dk, dv, 0
