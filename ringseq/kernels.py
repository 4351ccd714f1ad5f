"""Block attention kernels: one interface, several backends (shapes: ``ringseq.shapes``).

    forward(q [B,H,sq,D], k/v [B,K,sk,D], causal, scale, mask, softcap)
        -> out [B,H,sq,D], lse fp32 [B,H,sq], aux
    backward(dout, q, k, v, out, lse, aux, causal, scale, mask, softcap)
        -> dq [B,H,sq,D], dk/dv [B,K,sk,D]

``causal`` is top-left aligned: query i sees key j when j <= i (the ring only asks for it on
square blocks). ``mask`` (a ``ringseq.masks.RowMask`` or None) replaces ``causal`` when given:
it yields the visibility of a slab of rows at a time, so no kernel ever holds an sq x sk mask.
A row that sees no key gets output 0 and log-sum-exp -inf. ``softcap`` c maps scores to
c * tanh(scores / c) before the mask (Gemma 2). ``out``/``lse`` given to ``backward`` are the *merged* (global) output and
log-sum-exp of those query rows, which is what makes a blockwise backward exact. ``aux`` is
whatever a backend needs to carry from forward to backward (None for most).

Backends, chosen per call by ``select`` unless one is named:

``cpu_flash``   ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward: fused,
                returns the log-sum-exp, takes GQA natively (K < H) in both directions, and
                masks (as an additive mask, a slab of rows per call).
``cuda_flash``  ``aten._scaled_dot_product_flash_attention`` (fp16/bf16, D <= 256; no mask).
``torch``       plain PyTorch, blockwise over query rows so memory stays O(rows x sk); the
                fallback for anything the fused kernels cannot take (softcap, masks on CUDA).
"""
from __future__ import annotations

import torch

from .errors import RingSeqError

aten = torch.ops.aten

_ROWS = 512  # query rows per step of the PyTorch kernel: bounds its scores to 512 x sk
_MASK_ROWS = 1024  # query rows per masked call of the CPU flash kernel: bounds its mask


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _slabs(n: int, size: int):
    return [slice(a, min(a + size, n)) for a in range(0, n, size)]


def _additive(visible: torch.Tensor, dtype) -> torch.Tensor:
    """bool [B, rows, sk] -> [B, 1, rows, sk] of 0 / -inf in the query dtype."""
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf")).unsqueeze(1)


class CpuFlash:
    name, takes_mask, takes_softcap = "cpu_flash", True, False

    @staticmethod
    def forward(q, k, v, causal, scale, mask=None, softcap=None):
        op = aten._scaled_dot_product_flash_attention_for_cpu
        if mask is None:
            out, lse = op(q, k, v, 0.0, causal, scale=scale)
            return out, lse, None
        B, H, sq, D = q.shape
        out = q.new_zeros(B, H, sq, D)
        lse = torch.full((B, H, sq), float("-inf"), dtype=_acc_dtype(q))
        for rows in _slabs(sq, _MASK_ROWS):
            lo, hi = mask.key_range(rows.start, rows.stop)
            if hi == lo:
                continue  # these rows see none of this call's keys
            visible = mask.rows(rows.start, rows.stop, lo, hi)
            o, l = op(q[:, :, rows], k[:, :, lo:hi], v[:, :, lo:hi], 0.0, False,
                      attn_mask=_additive(visible, q.dtype), scale=scale)
            out[:, :, rows] = o
            # the kernel reports lse 0 for a row that sees nothing; the merge needs -inf
            lse[:, :, rows] = l.masked_fill(~visible.any(-1).unsqueeze(1), float("-inf"))
        return out, lse, None

    @staticmethod
    def backward(dout, q, k, v, out, lse, aux, causal, scale, mask=None, softcap=None):
        op = aten._scaled_dot_product_flash_attention_for_cpu_backward
        if mask is None:
            return op(dout, q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale)
        acc = _acc_dtype(q)
        dq = torch.zeros_like(q)
        dk = torch.zeros(k.shape, dtype=acc)
        dv = torch.zeros(v.shape, dtype=acc)
        for rows in _slabs(q.size(2), _MASK_ROWS):
            lo, hi = mask.key_range(rows.start, rows.stop)
            if hi == lo:
                continue
            am = _additive(mask.rows(rows.start, rows.stop, lo, hi), q.dtype)
            gq, gk, gv = op(dout[:, :, rows], q[:, :, rows], k[:, :, lo:hi], v[:, :, lo:hi], out[:, :, rows],
                            lse[:, :, rows].contiguous(), 0.0, False, attn_mask=am, scale=scale)
            dq[:, :, rows] = gq
            dk[:, :, lo:hi] += gk
            dv[:, :, lo:hi] += gv
        return dq, dk, dv


class CudaFlash:
    """The CUDA flash kernel. ``aux`` carries the sequence metadata and RNG state the forward
    returns; with dense inputs and no dropout they are the same for every block, so the first
    block's copy serves all (as PyTorch's own ring attention does)."""

    name, takes_mask, takes_softcap = "cuda_flash", False, False

    @staticmethod
    def forward(q, k, v, causal, scale, mask=None, softcap=None):
        out, lse, *aux = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, tuple(aux[:6])

    @staticmethod
    def backward(dout, q, k, v, out, lse, aux, causal, scale, mask=None, softcap=None):
        cum_q, cum_k, _, _, seed, offset = aux
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, q.size(2), k.size(2), 0.0, causal,
            seed, offset, scale=scale)[:3]


def _grouped(q: torch.Tensor, K: int) -> torch.Tensor:
    """[B,H,n,D] -> [B,K,H/K,n,D] (query heads of one kv head side by side)."""
    B, H, n, D = q.shape
    return q.reshape(B, K, H // K, n, D)


def _scores(q, k, rows: slice, causal: bool, scale: float, mask, softcap, cols=(0, None)):
    """q [B,K,G,rows,D] (acc dtype), k [B,K,n,D] (the key columns ``cols`` of the call)
    -> (scores [B,K,G,rows,n] masked with -inf, tanh of the capped scores or None)."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = softcap * t
    if mask is not None:
        visible = mask.rows(rows.start, rows.stop, *cols)[:, None, None]  # [B,1,1,rows,n]
        s = s.masked_fill(~visible, float("-inf"))
    elif causal:
        i = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
        j = torch.arange(k.size(-2), device=q.device)[None, :]
        s = s.masked_fill(j > i, float("-inf"))
    return s, t


def _columns(rows: slice, sk: int, causal: bool, mask) -> tuple[int, int]:
    """Key columns that query ``rows`` may see: bounded by the mask, or by the causal corner."""
    if mask is not None:
        return mask.key_range(rows.start, rows.stop)
    return 0, min(sk, rows.stop) if causal else sk


class TorchBlocks:
    """Attention in plain PyTorch, in fp32 (fp64 for fp64 inputs), ``_ROWS`` query rows at a time."""

    name, takes_mask, takes_softcap = "torch", True, True

    @staticmethod
    def forward(q, k, v, causal, scale, mask=None, softcap=None):
        acc = _acc_dtype(q)
        K, sq = k.size(1), q.size(2)
        qg, kf, vf = _grouped(q, K).to(acc), k.to(acc), v.to(acc)
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        for rows in _slabs(sq, _ROWS):
            lo, hi = _columns(rows, kf.size(-2), causal, mask)
            if hi == lo:
                continue  # these rows see none of this call's keys
            s, _ = _scores(qg[..., rows, :], kf[..., lo:hi, :], rows, causal, scale, mask, softcap, (lo, hi))
            l = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - l.unsqueeze(-1)).nan_to_num_(0.0)  # rows that see nothing
            out[..., rows, :] = torch.matmul(p, vf[..., lo:hi, :].unsqueeze(2))
            lse[..., rows] = l
        return out.flatten(1, 2), lse.flatten(1, 2).to(acc), None

    @staticmethod
    def backward(dout, q, k, v, out, lse, aux, causal, scale, mask=None, softcap=None):
        acc = _acc_dtype(q)
        K, sq = k.size(1), q.size(2)
        qg, kf, vf = _grouped(q, K).to(acc), k.to(acc), v.to(acc)
        dog, lseg = _grouped(dout, K).to(acc), _grouped(lse.unsqueeze(-1), K).to(acc)
        delta = (dog * _grouped(out, K).to(acc)).sum(-1, keepdim=True)  # [B,K,G,sq,1]
        dq = torch.empty_like(qg)
        dk = torch.zeros_like(kf)
        dv = torch.zeros_like(vf)
        for rows in _slabs(sq, _ROWS):
            lo, hi = _columns(rows, kf.size(-2), causal, mask)
            if hi == lo:
                dq[..., rows, :] = 0
                continue
            kb, vb = kf[..., lo:hi, :], vf[..., lo:hi, :]
            s, t = _scores(qg[..., rows, :], kb, rows, causal, scale, mask, softcap, (lo, hi))
            p = torch.exp(s - lseg[..., rows, :]).nan_to_num_(0.0)
            do = dog[..., rows, :]
            dv[..., lo:hi, :] += torch.matmul(p.transpose(-1, -2), do).sum(2)
            ds = p * (torch.matmul(do, vb.unsqueeze(2).transpose(-1, -2)) - delta[..., rows, :])
            if t is not None:
                ds = ds * (1 - t * t)  # through the cap: d(c tanh(x/c))/dx = 1 - tanh^2
            dq[..., rows, :] = torch.matmul(ds, kb.unsqueeze(2)) * scale
            dk[..., lo:hi, :] += torch.matmul(ds.transpose(-1, -2), qg[..., rows, :]).sum(2) * scale
        return dq.flatten(1, 2), dk, dv


BACKENDS = {b.name: b for b in (CpuFlash, CudaFlash, TorchBlocks)}


def select(q: torch.Tensor, name: str | None = None, *, masked: bool = False, softcap: bool = False):
    """The backend for these inputs: ``name`` if given, else the fastest one that applies."""
    if name is not None:
        if name not in BACKENDS:
            raise RingSeqError(f"unknown kernel {name!r}: choose one of {', '.join(BACKENDS)}")
        backend = BACKENDS[name]
        if (masked and not backend.takes_mask) or (softcap and not backend.takes_softcap):
            need = "a softcap" if softcap and not backend.takes_softcap else "a mask"
            raise RingSeqError(f"kernel {name!r} cannot apply {need}; use kernel='torch' or leave kernel unset")
        return backend
    if softcap:
        return TorchBlocks
    if q.is_cuda:
        if not masked and q.dtype in (torch.float16, torch.bfloat16) and q.size(-1) <= 256:
            return CudaFlash
        return TorchBlocks
    if q.device.type == "cpu":
        return CpuFlash
    return TorchBlocks
