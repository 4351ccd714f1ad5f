"""``cuda_flash``: aten's CUDA flash kernel for dense blocks (fp16/bf16, head dim <= 256).

``aux`` carries the sequence metadata and RNG state the forward returns; with dense inputs and
no dropout they are the same for every block, so the first block's copy serves all (as
PyTorch's own ring attention does).
"""
from __future__ import annotations

import torch

from .common import BlockSpec

_forward = torch.ops.aten._scaled_dot_product_flash_attention
_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward


class CudaFlash:
    name, takes_mask, takes_softcap = "cuda_flash", False, False
    exact_lse = False  # takes the merged log-sum-exp at its own precision (else in the accumulation dtype)

    @staticmethod
    def applies(device_type: str, dtype: torch.dtype, head_dim: int) -> bool:
        return device_type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim <= 256

    @staticmethod
    def forward(q, k, v, spec: BlockSpec):
        out, lse, *aux = _forward(q, k, v, 0.0, spec.causal, False, scale=spec.scale)
        return out, lse, tuple(aux[:6])

    @staticmethod
    def backward(dout, q, k, v, out, lse, aux, spec: BlockSpec):
        cum_q, cum_k, _, _, seed, offset = aux
        grads = _backward(dout, q, k, v, out, lse.float().contiguous(), cum_q, cum_k, q.size(2), k.size(2), 0.0,
                          spec.causal, seed, offset, scale=spec.scale)
        return (*grads[:3], 0)
