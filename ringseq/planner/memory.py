"""Per-rank memory: weights, gradients and optimizer state by ZeRO stage; activations by layer.

Letters of ``ringseq.shapes``; ``s`` local tokens of a rank, ``b`` bytes per element, G ranks
that ZeRO shards over. Activations are counted in elements per token and layer of a Llama
layer under autograd (see ``layer_elements``); transients (the loss's logits, one layer's
backward, the ring's buffers) are added once, at their largest.
"""
from __future__ import annotations

from ringseq.slabs import slab_tokens

from .features import Features
from .model_spec import ModelSpec

GB = 2**30


def layer_elements(m: ModelSpec) -> int:
    """Elements per token one Llama layer saves for backward, as autograd's saved tensors of
    transformers' Llama show them: each RMSNorm its input, the normalised input and the
    weighted output (3d) and 1/rms (1); attention q, k, v after RoPE, output and log-sum-exp
    (2HD + 2KD + H); the MLP's gate, up, silu(gate) and product (4F)."""
    return 6 * m.d + 2 + 2 * m.H * m.D + 2 * m.K * m.D + m.H + 4 * m.F


def kept_elements(m: ModelSpec, f: Features) -> float:
    """Elements per token and layer kept until backward, under checkpointing / tiled MLP."""
    if f.checkpointing:
        return m.d + m.H * m.D + m.H  # layer input, ring output, log-sum-exp (fp32: H per token)
    if f.tiled_mlp:
        return layer_elements(m) - 4 * m.F
    return layer_elements(m)


def states(m: ModelSpec, f: Features, b: int, G: int) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state per rank."""
    N = m.params
    weights = N * b / (G if f.zero_stage >= 3 else 1)
    if f.zero_stage >= 3:  # the gathered weights of the layer in use and the one prefetched
        weights += 2 * (m.layer_params + 2 * m.d) * b
    grads = N * b / (G if f.zero_stage >= 2 else 1) if f.training else 0.0
    adam = (8 + (4 if b < 4 else 0)) * N / (G if f.zero_stage >= 1 else 1)  # m, v (+ fp32 master)
    optimizer = adam if f.training and f.optimizer and not f.offload else 0.0
    if f.offload and f.zero_stage >= 3:
        weights = 2 * (m.layer_params + 2 * m.d) * b
    return dict(weights=weights, grads=grads, optimizer=optimizer)


def activations(m: ModelSpec, f: Features, b: int, s: int, c: int, U: int) -> dict[str, float]:
    """Bytes of activations per rank: ``s`` local tokens, ring chunk ``c`` tokens of H/U heads."""
    B = f.micro_batch
    if not f.training:
        kept, layer_ws = 0.0, layer_elements(m) * s * b * B
    else:
        kept = (m.L * kept_elements(m, f) + 3 * m.d) * s * b * B  # + final norm and the head's input
        layer_ws = layer_elements(m) * s * b * B * (2 if f.checkpointing else 1)
        if f.tiled_mlp:
            layer_ws -= 4 * m.F * s * b * B * (1 - 1 / f.tiled_mlp)
    h, k = m.H / U, max(m.K / U, 1)
    ring = (2 * 2 * c * k * m.D * b + c * h * m.D * 4) * B  # two K/V buffers in flight, fp32 accumulator
    if f.training:
        ring = max(ring, (2 * 2 * c * k * m.D * (b + 4) + c * h * m.D * 4) * B)  # K/V + fp32 dK/dV, fp32 dQ
    ulysses = 2 * s * (2 * m.H + 2 * max(m.K, U)) * m.D * b * B if U > 1 else 0.0
    rows = min(s, slab_tokens(m.V)) if f.chunked_loss else s
    loss = rows * m.V * (b + (4 if b < 4 else 0) + (8 if f.training else 0)) * B  # logits, fp32 copy, log-softmax, grad
    return dict(activations=kept, transient=max(loss, layer_ws + ring + ulysses))


def per_rank(m: ModelSpec, f: Features, b: int, G: int, s: int, c: int, U: int) -> dict[str, float]:
    """Every part in GiB, and ``total``."""
    parts = {**states(m, f, b, G), **activations(m, f, b, s, c, U)}
    parts = {k: v / GB for k, v in parts.items()}
    parts["total"] = sum(parts.values())
    return parts
