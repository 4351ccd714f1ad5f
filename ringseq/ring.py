"""The ring: blockwise forward and backward over K/V blocks that travel the ring.

Shapes (``ringseq.shapes``): q [B,H,s,D], k/v [B,K,s,D], out [B,H,s,D], lse fp32 [B,H,s].

Forward, at step t = 0..P-1, rank r holds the K/V block of rank j = (r - t) mod P. It posts
the transfer of that block to rank r+1, computes the calls of ``block_plan(r, j)``, merges the
partial outputs into an fp32 (fp64 for fp64 inputs) accumulator by log-sum-exp, then waits.

Backward runs the same ring with the merged ``out``/``lse``. The dK/dV of block j travel with
it: each rank adds its contribution to the accumulator it received and passes it on, so after
P hops every accumulator is back with the rank that owns the block. Only the K kv heads cross
the wire, never copies repeated to H heads.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .comm import RingComm
from .kernels import _acc_dtype, select
from .plan import block_plan


@dataclasses.dataclass(frozen=True)
class RingOptions:
    """Everything non-tensor the ring needs, packed so autograd's backward stays short."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    r: int
    layout: str
    causal: bool
    scale: float
    kernel: str | None = None

    @property
    def P(self) -> int:
        return len(self.ranks)


def _merge(out_acc, lse_acc, rows: slice, o, l):
    """Fold a partial (o, l) for query ``rows`` into the running (out_acc, lse_acc), in place."""
    old = lse_acc[..., rows]
    new = torch.logaddexp(old, l)
    w_old = torch.exp(old - new).nan_to_num_(0.0).unsqueeze(-1)  # nan only where both are -inf
    w_new = torch.exp(l - new).nan_to_num_(0.0).unsqueeze(-1)
    acc = out_acc[..., rows, :]
    acc.mul_(w_old).addcmul_(o.to(acc.dtype), w_new.to(acc.dtype))
    lse_acc[..., rows] = new


def _empty_if_none(out_acc, lse_acc, shape, dtype, device):
    """The accumulators of rows that have seen no key yet: output 0, log-sum-exp -inf."""
    if out_acc is not None:
        return out_acc, lse_acc
    return (torch.zeros(shape, dtype=dtype, device=device),
            torch.full(shape[:-1], float("-inf"), dtype=dtype, device=device))


def ring_forward(q, k, v, opts: RingOptions):
    """Return (out in q dtype, lse fp32, aux for the backward kernel)."""
    kernel = select(q, opts.kernel)
    B, H, s, D = q.shape
    acc = _acc_dtype(q)
    out_acc, lse_acc = None, None
    comm = RingComm(opts.group, opts.ranks, opts.r) if opts.P > 1 else None
    kv, aux = (k.contiguous(), v.contiguous()), None
    for t in range(opts.P):
        j = (opts.r - t) % opts.P
        pending = comm.post(list(kv)) if t < opts.P - 1 else None
        for call in block_plan(opts.layout, s, opts.P, opts.r, j, opts.causal):
            o, l, a = kernel.forward(q[:, :, call.q_rows], kv[0][:, :, call.k_rows],
                                     kv[1][:, :, call.k_rows], call.causal, opts.scale)
            aux = aux if aux is not None else a
            if out_acc is None and call.q_rows == slice(0, s):  # first call covers every row
                out_acc, lse_acc = o.to(acc), l.to(acc)
                continue
            out_acc, lse_acc = _empty_if_none(out_acc, lse_acc, (B, H, s, D), acc, q.device)
            _merge(out_acc, lse_acc, call.q_rows, o, l)
        if pending is not None:
            kv = tuple(pending.wait())
    out_acc, lse_acc = _empty_if_none(out_acc, lse_acc, (B, H, s, D), acc, q.device)
    return out_acc.to(q.dtype), lse_acc.float(), aux


def ring_backward(dout, q, k, v, out, lse, aux, opts: RingOptions):
    """Return (dq, dk, dv) in the input dtypes; accumulation is fp32 (fp64 for fp64 inputs)."""
    kernel = select(q, opts.kernel)
    s, acc = q.size(2), _acc_dtype(q)
    dout = dout.contiguous()
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    comm = RingComm(opts.group, opts.ranks, opts.r) if opts.P > 1 else None
    kv, travelling = (k.contiguous(), v.contiguous()), None
    for t in range(opts.P):
        j = (opts.r - t) % opts.P
        pending_kv = comm.post(list(kv)) if t < opts.P - 1 else None
        dk = torch.zeros(kv[0].shape, dtype=acc, device=q.device)
        dv = torch.zeros(kv[1].shape, dtype=acc, device=q.device)
        for call in block_plan(opts.layout, s, opts.P, opts.r, j, opts.causal):
            qr, kr = call.q_rows, call.k_rows
            gq, gk, gv = kernel.backward(dout[:, :, qr], q[:, :, qr], kv[0][:, :, kr], kv[1][:, :, kr],
                                         out[:, :, qr], lse[:, :, qr], aux, call.causal, opts.scale)
            dq[:, :, qr] += gq
            dk[:, :, kr] += gk
            dv[:, :, kr] += gv
        if comm is None:
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        if travelling is not None:  # block j's accumulators, from the rank that held it before
            dk_in, dv_in = travelling.wait()
            dk += dk_in
            dv += dv_in
        travelling = comm.post([dk, dv])
        if pending_kv is not None:
            kv = tuple(pending_kv.wait())
    dk, dv = travelling.wait()  # our own block's gradients, home after P hops
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Forward: P-1 point-to-point K/V hops around the ring, overlapped with block compute.
    Backward: P-1 K/V hops again, plus P hops of the fp32 dK/dV accumulators."""

    @staticmethod
    def forward(ctx, q, k, v, opts: RingOptions):
        out, lse, aux = ring_forward(q, k, v, opts)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.opts, ctx.aux = opts, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*ring_backward(dout, q, k, v, out, lse, ctx.aux, ctx.opts), None)
