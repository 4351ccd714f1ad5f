"""Block attention kernels: one interface, one file per backend, one ``select`` (shapes: ``ringseq.shapes``).

    forward(q [B,H,sq,D], k/v [B,K,sk,D], spec)           -> out [B,H,sq,D], lse [B,H,sq], aux
    backward(dout, q, k, v, out, lse, aux, spec)           -> dq [B,H,sq,D], dk/dv [B,K,sk,D]

``spec`` (``BlockSpec``) carries the call's options: ``causal`` is top-left aligned (query i
sees key j when j <= i; the ring only asks for it on square blocks); ``mask`` (a
``ringseq.attention.masks.RowMask`` or None) replaces ``causal`` when given and yields the
visibility of a slab of rows at a time, so no kernel ever holds an sq x sk mask; ``softcap`` c
maps scores to c * tanh(scores / c) before the mask (Gemma 2); ``rows`` bounds the query rows
per slab. A row that sees no key gets output 0 and log-sum-exp -inf. ``out``/``lse`` given to
``backward`` are the *merged* (global) output and log-sum-exp of those query rows, which is
what makes a blockwise backward exact; the ring keeps that log-sum-exp in fp64 and each
backend takes it at the precision it can use. ``aux`` is whatever a backend carries from
forward to backward (None for most).

Backends (``select`` picks per call unless one is forced):

``cpu_flash``   ``aten._scaled_dot_product_flash_attention_for_cpu`` (fused, GQA-native, masks
                as an additive mask a slab of rows at a time).
``cuda_flash``  ``aten._scaled_dot_product_flash_attention`` (fp16/bf16, D <= 256, unmasked).
``cuda_varlen`` ``aten._flash_attention_forward`` over variable-length runs (fp16/bf16, D <= 256):
                documents, padding and windows whose visibility is runs (``runs``).
``flex``        FlexAttention, compiled on CUDA: softcap and any mask (a block mask built once
                per batch and call); off CUDA eager and forward only.
``torch``       plain PyTorch in fp32, blockwise over query rows: softcap, and the fallback.

The table of which backend each call gets is in ``select``.
"""
from .common import BlockSpec
from .select import BACKENDS, Need, for_call, select

__all__ = ["BACKENDS", "BlockSpec", "Need", "for_call", "select"]
