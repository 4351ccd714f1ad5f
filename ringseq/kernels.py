"""Block attention kernels: one interface, several backends (shapes: ``ringseq.shapes``).

    forward(q [B,H,sq,D], k/v [B,K,sk,D], causal, scale) -> out [B,H,sq,D], lse fp32 [B,H,sq], aux
    backward(dout, q, k, v, out, lse, aux, causal, scale) -> dq [B,H,sq,D], dk/dv [B,K,sk,D]

``causal`` is top-left aligned: query i sees key j when j <= i (the ring only asks for it on
square blocks). ``out``/``lse`` given to ``backward`` are the *merged* (global) output and
log-sum-exp of those query rows, which is what makes a blockwise backward exact. ``aux`` is
whatever a backend needs to carry from forward to backward (None for most).

Backends, chosen per call by ``select`` unless one is named:

``cpu_flash``   ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward: fused,
                returns the log-sum-exp, takes GQA natively (K < H) in both directions.
``cuda_flash``  ``aten._scaled_dot_product_flash_attention`` (fp16/bf16, D <= 256).
``torch``       plain PyTorch, blockwise over query rows so memory stays O(rows x sk); the
                fallback for anything the fused kernels cannot take.
"""
from __future__ import annotations

import torch

from .errors import RingSeqError

aten = torch.ops.aten

_ROWS = 512  # query rows per step of the PyTorch kernel: bounds its scores to 512 x sk


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class CpuFlash:
    name = "cpu_flash"

    @staticmethod
    def forward(q, k, v, causal, scale):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, None

    @staticmethod
    def backward(dout, q, k, v, out, lse, aux, causal, scale):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale)


class CudaFlash:
    """The CUDA flash kernel. ``aux`` carries the sequence metadata and RNG state the forward
    returns; with dense inputs and no dropout they are the same for every block, so the first
    block's copy serves all (as PyTorch's own ring attention does)."""

    name = "cuda_flash"

    @staticmethod
    def forward(q, k, v, causal, scale):
        out, lse, *aux = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, tuple(aux[:6])

    @staticmethod
    def backward(dout, q, k, v, out, lse, aux, causal, scale):
        cum_q, cum_k, _, _, seed, offset = aux
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, q.size(2), k.size(2), 0.0, causal,
            seed, offset, scale=scale)[:3]


def _grouped(q: torch.Tensor, K: int) -> torch.Tensor:
    """[B,H,n,D] -> [B,K,H/K,n,D] (query heads of one kv head side by side)."""
    B, H, n, D = q.shape
    return q.reshape(B, K, H // K, n, D)


def _scores(q, k, rows: slice, causal: bool, scale: float) -> torch.Tensor:
    # q [B,K,G,rows,D] (acc dtype), k [B,K,sk,D] -> scores [B,K,G,rows,sk]
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
        j = torch.arange(k.size(-2), device=q.device)[None, :]
        s = s.masked_fill(j > i, float("-inf"))
    return s


class TorchBlocks:
    """Attention in plain PyTorch, in fp32 (fp64 for fp64 inputs), ``_ROWS`` query rows at a time."""

    name = "torch"

    @staticmethod
    def forward(q, k, v, causal, scale):
        acc = _acc_dtype(q)
        K, sq = k.size(1), q.size(2)
        qg, kf, vf = _grouped(q, K).to(acc), k.to(acc), v.to(acc)
        outs, lses = [], []
        for a in range(0, sq, _ROWS):
            rows = slice(a, min(a + _ROWS, sq))
            s = _scores(qg[..., rows, :], kf, rows, causal, scale)
            lse = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)  # rows that see nothing
            outs.append(torch.matmul(p, vf.unsqueeze(2)))
            lses.append(lse)
        out = torch.cat(outs, dim=-2).flatten(1, 2)
        return out, torch.cat(lses, dim=-1).flatten(1, 2).float(), None

    @staticmethod
    def backward(dout, q, k, v, out, lse, aux, causal, scale):
        acc = _acc_dtype(q)
        K, sq = k.size(1), q.size(2)
        qg, kf, vf = _grouped(q, K).to(acc), k.to(acc), v.to(acc)
        dog, lseg = _grouped(dout, K).to(acc), _grouped(lse.unsqueeze(-1), K).to(acc)
        delta = (dog * _grouped(out, K).to(acc)).sum(-1, keepdim=True)  # [B,K,G,sq,1]
        dq = torch.empty_like(qg)
        dk = torch.zeros_like(kf)
        dv = torch.zeros_like(vf)
        for a in range(0, sq, _ROWS):
            rows = slice(a, min(a + _ROWS, sq))
            s = _scores(qg[..., rows, :], kf, rows, causal, scale)
            p = torch.exp(s - lseg[..., rows, :]).nan_to_num_(0.0)
            do = dog[..., rows, :]
            dv += torch.matmul(p.transpose(-1, -2), do).sum(2)
            ds = p * (torch.matmul(do, vf.unsqueeze(2).transpose(-1, -2)) - delta[..., rows, :])
            dq[..., rows, :] = torch.matmul(ds, kf.unsqueeze(2)) * scale
            dk += torch.matmul(ds.transpose(-1, -2), qg[..., rows, :]).sum(2) * scale
        return dq.flatten(1, 2), dk, dv


BACKENDS = {b.name: b for b in (CpuFlash, CudaFlash, TorchBlocks)}


def select(q: torch.Tensor, name: str | None = None):
    """The backend for these inputs: ``name`` if given, else the fastest one that applies."""
    if name is not None:
        if name not in BACKENDS:
            raise RingSeqError(f"unknown kernel {name!r}: choose one of {', '.join(BACKENDS)}")
        return BACKENDS[name]
    if q.is_cuda:
        if q.dtype in (torch.float16, torch.bfloat16) and q.size(-1) <= 256:
            return CudaFlash
        return TorchBlocks
    if q.device.type == "cpu":
        return CpuFlash
    return TorchBlocks
