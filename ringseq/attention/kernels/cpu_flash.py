"""``cpu_flash``: aten's fused CPU flash kernel (returns the log-sum-exp, GQA-native both ways).

Masks go in as an additive 0/-inf mask, one slab of query rows at a time against only the key
columns that slab can see (``RowMask.key_range``), so a window or short documents cost
O(rows x (rows + window)) and no mask is ever sq x sk. A call's masks are made once per batch
(``prepare``) and kept on its ``TokenInfo`` for every layer and the backward, up to
``MASK_BYTES`` per batch (beyond that, made again at each call); with them the log-sum-exp fix
of the rows that see none of the call's keys (the kernel reports 0 there; the ring needs -inf).
A call of one slab returns the kernel's results as they are: its gradients of K and V cover only
the key columns the slab sees (``backward``'s fourth result is where they start).
"""
from __future__ import annotations

import torch

from .common import BlockSpec, acc_dtype, slabs

ROWS = 1024  # query rows per masked slab: bounds the additive mask to ROWS x keys
MASK_BYTES = 64 * 2**20
"""Additive masks kept per batch (``prepare``); a batch whose masked calls need more makes the rest
again at every call."""

_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _slab(mask, a: int, b: int, dtype):
    """(rows, lo, hi, additive mask [B, 1, rows, hi - lo], lse fix [B, 1, rows] or None) of query
    rows a..b, or None when they see none of the call's keys. The fix adds -inf to the kernel's
    log-sum-exp of the rows that see nothing (it reports 0 for them)."""
    lo, hi = mask.key_range(a, b)
    if hi == lo:
        return None
    visible = mask.rows(a, b, lo, hi)
    additive = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf")).unsqueeze(1)
    empty = ~visible.any(-1)
    fix = None
    if bool(empty.any()):
        lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        fix = torch.zeros(empty.shape, dtype=lse_dtype).masked_fill_(empty, float("-inf")).unsqueeze(1)
    return slice(a, b), lo, hi, additive, fix


def _slabs(spec: BlockSpec, n: int, dtype, keep: bool = False) -> list:
    """The call's slabs (``_slab``), kept on the batch's ``TokenInfo`` while they fit ``MASK_BYTES``."""
    mask = spec.mask
    key = ("cpu_flash slabs", mask.q, mask.k, mask.window, mask.causal, mask.B, dtype, spec.rows or ROWS)
    cache = mask.info._cache
    if key in cache:
        return cache[key]
    made = [x for x in (_slab(mask, r.start, r.stop, dtype) for r in slabs(n, spec.rows or ROWS)) if x is not None]
    size = sum(x[3].numel() * x[3].element_size() for x in made)
    used = cache.get("cpu_flash mask bytes", 0)
    if keep and used + size <= MASK_BYTES:
        cache[key] = made
        cache["cpu_flash mask bytes"] = used + size
    return made


def _whole(made: list, n: int):
    """The one slab of a call whose single slab covers every query row, else None."""
    if len(made) == 1 and made[0][0] == slice(0, n):
        return made[0]
    return None


class CpuFlash:
    name, takes_mask, takes_softcap = "cpu_flash", True, False
    exact_lse = False  # takes the merged log-sum-exp at its own precision (else in the accumulation dtype)

    @staticmethod
    def applies(device_type: str, dtype: torch.dtype, head_dim: int) -> bool:
        return device_type == "cpu"

    @staticmethod
    def prepare(spec: BlockSpec, q, n: int, m: int) -> None:
        """Make and keep a masked call's slabs (once per batch: every layer and the backward reuse them)."""
        if spec.mask is not None:
            _slabs(spec, n, q.dtype, keep=True)

    @staticmethod
    def forward(q, k, v, spec: BlockSpec):
        if spec.mask is None:
            out, lse = _forward(q, k, v, 0.0, spec.causal, scale=spec.scale)
            return out, lse, None
        B, H, sq, D = q.shape
        made = _slabs(spec, sq, q.dtype)
        whole = _whole(made, sq)
        if whole is not None:
            _, lo, hi, additive, fix = whole
            out, lse = _forward(q, k[:, :, lo:hi], v[:, :, lo:hi], 0.0, False, attn_mask=additive, scale=spec.scale)
            return out, lse if fix is None else lse.add_(fix), None
        out = q.new_zeros(B, H, sq, D)
        lse = torch.full((B, H, sq), float("-inf"), dtype=acc_dtype(q))
        for rows, lo, hi, additive, fix in made:
            o, l = _forward(q[:, :, rows], k[:, :, lo:hi], v[:, :, lo:hi], 0.0, False, attn_mask=additive,
                            scale=spec.scale)
            out[:, :, rows] = o
            lse[:, :, rows] = l if fix is None else l.add_(fix)
        return out, lse, None

    @staticmethod
    def backward(dout, q, k, v, out, lse, aux, spec: BlockSpec):
        """(dq, dk, dv, first key): dk/dv cover the call's keys from ``first key`` on. ``lse``: the
        merged log-sum-exp of these rows, contiguous (the ring makes it so once per row range)."""
        acc = acc_dtype(q)
        lse = lse.to(acc).contiguous()
        if spec.mask is None:
            return (*_backward(dout, q, k, v, out, lse, 0.0, spec.causal, scale=spec.scale), 0)
        made = _slabs(spec, q.size(2), q.dtype)
        whole = _whole(made, q.size(2))
        if whole is not None:
            _, lo, hi, additive, _ = whole
            return (*_backward(dout, q, k[:, :, lo:hi], v[:, :, lo:hi], out, lse, 0.0, False, attn_mask=additive,
                               scale=spec.scale), lo)
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k, dtype=acc)  # k's layout: the ring's, which its wire takes as it is
        dv = torch.zeros_like(v, dtype=acc)
        for rows, lo, hi, additive, _ in made:
            gq, gk, gv = _backward(dout[:, :, rows], q[:, :, rows], k[:, :, lo:hi], v[:, :, lo:hi], out[:, :, rows],
                                   lse[:, :, rows].contiguous(), 0.0, False, attn_mask=additive, scale=spec.scale)
            dq[:, :, rows] = gq
            dk[:, :, lo:hi] += gk
            dv[:, :, lo:hi] += gv
        return dq, dk, dv, 0
