"""``cuda_varlen``: aten's CUDA flash kernel over variable-length runs (fp16/bf16, head dim <= 256).

Packed documents, padding and windows become segments and one window pair (``runs``); GQA is
native. ``torch.nn.attention.varlen.varlen_attn`` wraps the same two aten ops, but its autograd
saves its own output and log-sum-exp, and the ring needs the backward with the *merged* ones:
so the ops are called directly, forward and backward, as ``cuda_flash`` does for dense blocks.

The runs are built on the CPU once per batch and call, and their two int32 tables go to the
device once (pinned, asynchronous), before the ring loop: no host synchronisation per call.
"""
from __future__ import annotations

import functools

import torch

from ringseq.errors import RingSeqError

from .common import BlockSpec, acc_dtype
from .runs import NO_BOUND, Runs, runs

_forward = torch.ops.aten._flash_attention_forward
_backward = torch.ops.aten._flash_attention_backward


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _dense_runs(spec: BlockSpec, B: int, n: int, m: int) -> Runs:
    """An unmasked call: one segment per sample, causal (square calls only) or not."""
    cu_q = torch.arange(0, (B + 1) * n, n, dtype=torch.int32)
    cu_k = torch.arange(0, (B + 1) * m, m, dtype=torch.int32)
    return Runs(cu_q, cu_k, n, m, NO_BOUND, 0 if spec.causal else NO_BOUND)


def _cached(spec: BlockSpec, B: int, n: int, m: int):
    """(key, cache) of a call's runs: unmasked calls by shape, masked ones on their TokenInfo."""
    mask = spec.mask
    if mask is None:
        return ("runs dense", B, n, m, spec.causal), _DENSE
    return ("runs", mask.q, mask.k, mask.window, mask.causal, B), mask.info._cache


def call_runs(spec: BlockSpec, B: int, n: int, m: int) -> Runs | None:
    """The call's runs (None: its visibility is not runs), made once per batch and call."""
    key, cache = _cached(spec, B, n, m)
    if key not in cache:
        mask = spec.mask
        cache[key] = _dense_runs(spec, B, n, m) if mask is None else runs(mask.q, mask.k, mask.info, mask.window,
                                                                          mask.causal, B)
    return cache[key]


def prepared(spec: BlockSpec, B: int, n: int, m: int, device):
    """(runs, cu_q, cu_k on the device) for a call, cached like its runs; None when it is not runs."""
    r = call_runs(spec, B, n, m)
    if r is None:
        return None
    key, cache = _cached(spec, B, n, m)
    key = (*key, str(device))
    if key not in cache:
        cache[key] = (r, _to_device(r.cu_q, device), _to_device(r.cu_k, device))
    return cache[key]


_DENSE: dict = {}  # the runs of unmasked calls depend on shapes only (and the device)


def _pack(t: torch.Tensor) -> torch.Tensor:
    """[B, heads, n, D] -> [B*n, heads, D]."""
    B, h, n, D = t.shape
    return t.transpose(1, 2).reshape(B * n, h, D)


def _unpack(t: torch.Tensor, B: int) -> torch.Tensor:
    """[B*n, heads, D] -> [B, heads, n, D]."""
    return t.reshape(B, -1, t.size(1), t.size(2)).transpose(1, 2)


@functools.lru_cache(maxsize=8)
def _unused(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward's RNG state and unused tensor (no dropout: never read): made once per device."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device)


class CudaVarlen:
    name, takes_mask, takes_softcap = "cuda_varlen", True, False
    exact_lse = False  # takes the merged log-sum-exp at its own precision (else in the accumulation dtype)
    prepared = staticmethod(prepared)

    @staticmethod
    def prepare(spec: BlockSpec, q, n: int, m: int) -> None:
        """Build the call's runs and their device tables once per batch (every layer and the backward reuse them)."""
        prepared(spec, q.size(0), n, m, q.device)

    @staticmethod
    def applies(device_type: str, dtype: torch.dtype, head_dim: int) -> bool:
        return device_type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim <= 256

    @staticmethod
    def expresses(spec: BlockSpec, B: int, n: int, m: int) -> bool:
        """Whether this call's visibility is varlen runs (always, without a mask)."""
        return call_runs(spec, B, n, m) is not None

    @staticmethod
    def forward(q, k, v, spec: BlockSpec):
        B, n, m = q.size(0), q.size(2), k.size(2)
        plan = prepared(spec, B, n, m, q.device)
        if plan is None:
            raise RingSeqError("kernel 'cuda_varlen' cannot express this call's mask as variable-length runs "
                               "(padding inside a document, or windows that differ between samples); "
                               "leave kernel unset so FlexAttention takes it")
        r, cu_q, cu_k = plan
        out, lse, _, _, _ = _forward(_pack(q), _pack(k), _pack(v), cu_q, cu_k, r.max_q, r.max_k, 0.0,
                                     r.left == NO_BOUND and r.right == 0, False, scale=spec.scale,
                                     window_size_left=r.left, window_size_right=r.right)
        lse = lse.reshape(q.size(1), B, n).transpose(0, 1)  # [H, B*n] -> [B, H, n]
        # a row in a segment without keys gets lse +inf from the kernel; the merge needs -inf
        return _unpack(out, B), lse.nan_to_num(posinf=float("-inf"), neginf=float("-inf")), None

    @staticmethod
    def backward(dout, q, k, v, out, lse, aux, spec: BlockSpec):
        B, n, m = q.size(0), q.size(2), k.size(2)
        r, cu_q, cu_k = prepared(spec, B, n, m, q.device)
        lse_packed = lse.to(acc_dtype(q)).transpose(0, 1).reshape(q.size(1), B * n).contiguous()
        rng, unused = _unused(str(q.device))
        dq, dk, dv = _backward(_pack(dout), _pack(q), _pack(k), _pack(v), _pack(out), lse_packed, cu_q, cu_k,
                               r.max_q, r.max_k, 0.0, r.left == NO_BOUND and r.right == 0, rng, unused,
                               scale=spec.scale, window_size_left=r.left, window_size_right=r.right)
        return _unpack(dq, B), _unpack(dk, B), _unpack(dv, B), 0
