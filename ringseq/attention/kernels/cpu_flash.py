"""``cpu_flash``: aten's fused CPU flash kernel (returns the log-sum-exp, GQA-native both ways).

Masks go in as an additive 0/-inf mask, one slab of query rows at a time against only the key
columns that slab can see (``RowMask.key_range``), so a window or short documents cost
O(rows x (rows + window)) and no mask is ever sq x sk.
"""
from __future__ import annotations

import torch

from .common import BlockSpec, acc_dtype, slabs

ROWS = 1024  # query rows per masked call: bounds the additive mask to ROWS x keys

_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _additive(visible: torch.Tensor, dtype) -> torch.Tensor:
    """bool [B, rows, sk] -> [B, 1, rows, sk] of 0 / -inf in the query dtype."""
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf")).unsqueeze(1)


class CpuFlash:
    name, takes_mask, takes_softcap = "cpu_flash", True, False

    @staticmethod
    def applies(device_type: str, dtype: torch.dtype, head_dim: int) -> bool:
        return device_type == "cpu"

    @staticmethod
    def forward(q, k, v, spec: BlockSpec):
        mask = spec.mask
        if mask is None:
            out, lse = _forward(q, k, v, 0.0, spec.causal, scale=spec.scale)
            return out, lse, None
        B, H, sq, D = q.shape
        out = q.new_zeros(B, H, sq, D)
        lse = torch.full((B, H, sq), float("-inf"), dtype=acc_dtype(q))
        for rows in slabs(sq, spec.rows or ROWS):
            lo, hi = mask.key_range(rows.start, rows.stop)
            if hi == lo:
                continue  # these rows see none of this call's keys
            visible = mask.rows(rows.start, rows.stop, lo, hi)
            o, l = _forward(q[:, :, rows], k[:, :, lo:hi], v[:, :, lo:hi], 0.0, False,
                            attn_mask=_additive(visible, q.dtype), scale=spec.scale)
            out[:, :, rows] = o
            # the kernel reports lse 0 for a row that sees nothing; the merge needs -inf
            lse[:, :, rows] = l.masked_fill(~visible.any(-1).unsqueeze(1), float("-inf"))
        return out, lse, None

    @staticmethod
    def backward(dout, q, k, v, out, lse, aux, spec: BlockSpec):
        mask = spec.mask
        if mask is None:
            return _backward(dout, q, k, v, out, lse.to(acc_dtype(q)).contiguous(), 0.0, spec.causal, scale=spec.scale)
        acc = acc_dtype(q)
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k, dtype=acc)  # k's layout: the ring's, which its wire takes as it is
        dv = torch.zeros_like(v, dtype=acc)
        for rows in slabs(q.size(2), spec.rows or ROWS):
            lo, hi = mask.key_range(rows.start, rows.stop)
            if hi == lo:
                continue
            am = _additive(mask.rows(rows.start, rows.stop, lo, hi), q.dtype)
            gq, gk, gv = _backward(dout[:, :, rows], q[:, :, rows], k[:, :, lo:hi], v[:, :, lo:hi], out[:, :, rows],
                                   lse[:, :, rows].to(acc).contiguous(), 0.0, False, attn_mask=am, scale=spec.scale)
            dq[:, :, rows] = gq
            dk[:, :, lo:hi] += gk
            dv[:, :, lo:hi] += gv
        return dq, dk, dv
