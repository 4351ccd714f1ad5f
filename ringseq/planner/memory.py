"""Per-rank memory: weights, gradients and optimizer state by ZeRO stage; a step's peak by phase.

Letters of ``ringseq.shapes``; ``s`` local tokens of a rank, ``c`` tokens of a ring chunk, ``h``
and ``k`` query and kv heads per rank, ``b`` bytes per element, G ranks that ZeRO shards over,
U the Ulysses degree and R the ranks of a ring (1: no ring).
Activations are counted in elements per token and layer, as autograd's saved tensors of
transformers' Llama show them (``layer_elements``); ``benchmarks/memory_profile.py`` measures
them.

A training step's memory is not a sum of everything it ever allocates: the gradients appear as
backward frees the activations. Its peak is the largest of four moments, each counted as what
is alive then (``step_phases``):

``loss``   the loss's backward: every layer's kept activations and log-softmax's backward over
           the shard's logits (a slab's with the chunked loss, beside the head's weight
           gradient summed over the earlier slabs);
``top``    the last layer's backward (the first to run): the kept activations of the other
           layers, this layer's saved tensors (rebuilt by the recompute under checkpointing) and
           its backward workspace (the ring's, or the MLP's), the head's gradients;
``bottom`` the first layer's backward: its own saved tensors and workspace, every other
           layer's gradients;
``end``    the end of backward: every gradient, and under DeepSpeed ZeRO-1/2 the contiguous
           reduce bucket the gradients are copied into.
"""
from __future__ import annotations

import dataclasses

from ringseq.slabs import slab_tokens

from .features import Features
from .model_spec import ModelSpec

GB = 2**30
ACC = 4  # bytes of the ring's accumulators (dq, dk/dv, the output): fp32
LSE = 8  # bytes of a log-sum-exp element: ringseq keeps it in fp64
REDUCE_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size (elements), ZeRO-1/2 contiguous_gradients


def layer_elements(m: ModelSpec) -> int:
    """Elements per token one Llama layer saves for backward, as autograd's saved tensors of
    transformers' Llama show them: each RMSNorm its input, the normalised input and the
    weighted output (3d) and 1/rms (1); attention q, k, v after RoPE, output and log-sum-exp
    (2HD + 2KD + H); the MLP's gate, up, silu(gate) and product (4F)."""
    return 6 * m.d + 2 + 2 * m.H * m.D + 2 * m.K * m.D + m.H + 4 * m.F


@dataclasses.dataclass(frozen=True)
class _Layer:
    """Bytes per token of one layer at one rank: ``saved`` for backward, ``kept`` until backward
    (``saved`` without checkpointing), ``workspace`` the backward's peak beyond its saved tensors."""

    saved: float
    kept: float
    workspace: float
    offloaded: float = 0.0
    """Bytes per token of the kept tensors held in host memory instead (``offload_activations``)."""


def _layer(m: ModelSpec, f: Features, b: int, s: int, c: int, U: int, R: int, host: bool) -> _Layer:
    h, k, D = m.H / U, max(m.K / U, 1), m.D
    ring = R > 1
    mlp_saved = 0 if f.tiled_mlp else 4 * m.F * b  # gate, up, silu(gate), product (a tiled MLP saves none)
    saved = (layer_elements(m) - 4 * m.F) * b + mlp_saved
    lse = LSE if b >= ACC else ACC  # ringseq's ring keeps its log-sum-exp in fp64 (fp32 for half inputs)
    if ring:
        saved += m.H * (lse - b)
    kept = saved
    if f.checkpointing:  # the layer input, and the ring output and log-sum-exp ringseq keeps (unless it replays)
        kept = m.d * b + (m.H * D * b + m.H * lse if ring and f.keep_ring_outputs else 0)
    offloaded = 0.0
    if f.checkpointing and f.offload_activations:  # the kept tensors wait in host memory
        kept, offloaded = 0.0, kept
    per_chunk = c / s  # the ring works on c tokens (Ulysses: all of them, for h heads)
    if ring:
        # One ring for all heads by default; with head groups (``patch(head_groups=)``) g rings one
        # after the other, each holding its group's buffers. A ring holds: dq (fp32) and the kernel's
        # dq (dout is taken in transformers' layout, no copy); K/V: the receive buffers (b), one where
        # the ring makes one hop (R = 2), else two (a group's heads are copied out of transformers'
        # layout for the wire, ``comm.wire``, as are all heads after Ulysses' head-major
        # all-to-all); dK/dV (fp32): on GPUs this step's, the kernel's, the sent ones in flight and
        # the received set; on CPUs (``ringseq.attention.ring``) the step adds into the received
        # dK/dV, the sent ones gone. Beside a group's: the whole dq (a group's dq is written into its
        # share when q is fp32) and the earlier groups' dK/dV, in the input dtype.
        g = f.groups(k)
        dkv_pairs = 2 if host else 4
        kv = 2 * (1 if R == 2 else 2) + (2 if U > 1 else 0) + (2 if g > 1 and U == 1 else 0)
        group_dq = 0 if b == ACC and g > 1 else ACC  # its own accumulator, unless it sums into the whole
        whole = h * D * b * (g > 1) + 2 * k * D * b * (g - 1) / g
        attn = per_chunk * (h / g * D * (ACC + group_dq) + k / g * D * (kv * b + 2 * dkv_pairs * ACC) + whole)
    else:  # the kernel's dq, dk, dv and dout's copy
        attn = h * D * 2 * b + 2 * k * D * b
    attn += m.H * D * b  # the gradient of the o_proj input
    if U > 1:  # the all-to-all's send and receive copies of q, k, v and the output
        attn += 2 * (2 * m.H + 2 * max(m.K, U)) * D * b / U
    # backward runs the MLP first, with everything saved: the product's gradient, then silu's
    # and up's, as the product is freed (+2F); a tiled MLP rebuilds one tile at a time (its 4F
    # and those 2F) beside the input's gradient. By the attention's backward the MLP and the
    # second norm have freed what they saved.
    tiles = f.tiled_mlp or 1
    mlp = (6 * m.F / tiles + m.d) * b if f.tiled_mlp else 2 * m.F * b
    attn -= mlp_saved + (3 * m.d + 1) * b
    workspace = max(attn, mlp) + 2 * m.d * b  # + the residual stream's gradient, twice
    return _Layer(saved=saved, kept=kept, workspace=workspace, offloaded=offloaded)


def offloaded_bytes(m: ModelSpec, f: Features, b: int, s: int, c: int, U: int, R: int, host: bool = False) -> float:
    """Bytes a training step copies to host memory and back (``offload_activations``): every
    layer's kept tensors, once each way."""
    return m.L * _layer(m, f, b, s, c, U, R, host).offloaded * s * f.micro_batch


def host_bytes(m: ModelSpec, f: Features, b: int, G: int, s: int, c: int, U: int, R: int, host: bool = False) -> float:
    """Bytes a rank keeps in host memory through a training step: the kept tensors it offloads
    (``offload_activations``, every layer's at the end of the forward) and, with ``offload``
    (DeepSpeed's ZeRO-Offload), its shard of the fp32 master weights, Adam's m and v and the fp32
    gradients (16 bytes per parameter) and under ZeRO-3 its shard of the weights (``states``
    keeps only the gathered layers on the device)."""
    kept = offloaded_bytes(m, f, b, s, c, U, R, host) if f.training else 0.0
    if not (f.offload and f.training):
        return kept
    shard = m.params / (G if f.zero_stage >= 1 else 1)
    return kept + 16 * shard + (m.params * b / G if f.zero_stage >= 3 else 0.0)


def states(m: ModelSpec, f: Features, b: int, G: int) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state per rank."""
    N = m.params
    weights = N * b / (G if f.zero_stage >= 3 else 1)
    if f.zero_stage >= 3 and not f.fsdp:  # the gathered weights of the layer in use and the one prefetched
        weights += 2 * (m.layer_params + 2 * m.d) * b  # (FSDP2's: allocated by the step, ``step_phases``)
    grads = N * b / (G if f.zero_stage >= 2 else 1) if f.training else 0.0
    adam = (8 + (4 if b < 4 else 0)) * N / (G if f.zero_stage >= 1 else 1)  # m, v (+ fp32 master)
    optimizer = adam if f.training and f.optimizer and not f.offload else 0.0
    if f.offload and f.zero_stage >= 3:
        weights = 2 * (m.layer_params + 2 * m.d) * b
    return dict(weights=weights, grads=grads, optimizer=optimizer)


def step_phases(m: ModelSpec, f: Features, b: int, G: int, s: int, c: int, U: int, R: int,
                host: bool = False) -> dict[str, dict]:
    """What is alive at each moment of a training step's peak candidates (module docstring):
    {phase: {grads, activations, transient}} in bytes per rank."""
    B = f.micro_batch
    ly = _layer(m, f, b, s, c, U, R, host)
    grads = states(m, f, b, G)["grads"]
    head_grad = m.V * m.d * b  # the LM head's weight gradient
    layer_grad = (m.layer_params + 2 * m.d) * b
    kept_layers = m.L * ly.kept * s * B
    rows = min(s, slab_tokens(m.V)) if f.chunked_loss else s
    # Full logits: log-softmax's backward, its saved output and the gradient in and out (fp32; +
    # the logits in b and their fp32 copy below 4 bytes). Chunked: a slab's gradient is formed over
    # its fp32 logits in place (``ringseq.loss``) beside the head's weight gradient: one accumulator
    # filled slab by slab in the loss's forward (a plain Linear head), or under ZeRO-3 (the
    # checkpointed slabs) the slab's weight gradient and, from the second slab on, the earlier sum.
    upcast = 4 if b < 4 else 0
    if f.chunked_loss:
        loss = rows * m.V * (b + upcast) * B + head_grad
    else:
        loss = rows * m.V * (b + upcast + 8) * B
    loss += m.d * b * s * B  # the final hidden states' gradient, the whole shard's (the fused loss: formed in forward)
    loss_grads = head_grad if f.chunked_loss and s > rows and f.zero_stage == 3 else 0.0
    rebuilt = (ly.saved - ly.kept if f.checkpointing else 0.0) * s * B  # offloaded: the layer's own brought back
    work = ly.workspace * s * B
    phases = dict(
        loss=dict(grads=loss_grads, activations=kept_layers + 3 * m.d * b * s * B, transient=loss),  # + final norm
        top=dict(grads=head_grad, activations=kept_layers, transient=rebuilt + work),
        bottom=dict(grads=min(grads, head_grad + (m.L - 1) * layer_grad), activations=ly.kept * s * B,
                    transient=rebuilt + work),
        end=dict(grads=grads, activations=0.0, transient=0.0))
    if 1 <= f.zero_stage <= 2 and f.optimizer:  # DeepSpeed copies the gradients into its reduce bucket
        phases["end"]["transient"] = min(m.params, REDUCE_BUCKET) * (4 if f.zero_stage == 1 else b)
    if f.fsdp:  # what FSDP2 gathers within the step (``Features.fsdp``)
        root = (m.V * m.d * (1 if m.tied else 2) + m.d) * b
        layers = 2 * (m.layer_params + 2 * m.d) * b
        # at the end the root's whole gradients, its reduce-scatter's input copy and its output shard
        for name, extra in (("loss", root), ("top", root + layers), ("bottom", root + layers),
                            ("end", 2 * root + root / G)):
            phases[name]["transient"] += extra
    return phases


def kv_cache(m: ModelSpec, b: int, s: int, B: int = 1) -> float:
    """Bytes of a generation's cache on a rank after a prompt of s tokens per rank: the keys and
    values of its own tokens in every attention layer (``patches.cache``; Ulysses ranks keep all
    heads of their tokens) and, for a hybrid, every recurrent layer's state and convolution tail
    (the whole prompt's, the same on every rank; states in fp32)."""
    kv = m.attention_layers * 2 * m.K * m.D * b * s * B
    r = m.recurrent
    if r is None:
        return kv
    state = 0 if r.kind == "conv" else r.heads * r.rows * r.cols * 4
    return kv + r.layers * (state + r.channels * r.width * b) * B


def _inference(m: ModelSpec, f: Features, b: int, s: int, c: int, U: int) -> dict[str, float]:
    """One forward (a generation's prefill): one layer's activations at a time, the ring's
    buffers, the logits, and the KV cache it fills (all of it alive at the last layer)."""
    B = f.micro_batch
    h, k = m.H / U, max(m.K / U, 1)
    layer = layer_elements(m) * s * b * B
    ring = (2 * 2 * c * k * m.D * b + 2 * c * h * m.D * ACC) * B  # two K/V sets, the accumulator, a partial
    ulysses = 2 * s * (2 * m.H + 2 * max(m.K, U)) * m.D * b * B if U > 1 else 0.0
    logits = min(s, slab_tokens(m.V)) if f.chunked_loss else s
    return dict(grads=0.0, activations=0.0, transient=max(logits * m.V * (b + 4) * B, layer + ring + ulysses),
                kv_cache=kv_cache(m, b, s, B))


def activations(m: ModelSpec, f: Features, b: int, G: int, s: int, c: int, U: int, R: int,
                host: bool = False) -> dict[str, float]:
    """Bytes alive at the step's peak: {grads, activations, transient, phase}; ``host``: ranks on
    CPUs (their kernels' workspace differs)."""
    if not f.training:
        return dict(_inference(m, f, b, s, c, U), phase="forward")
    phases = step_phases(m, f, b, G, s, c, U, R, host)
    name = max(phases, key=lambda p: sum(phases[p].values()))
    return dict(phases[name], phase=name)


def per_rank(m: ModelSpec, f: Features, b: int, G: int, s: int, c: int, U: int, R: int,
             host: bool = False) -> dict[str, float]:
    """Every part in GiB at the step's peak (weights, optimizer state; the gradients, activations
    and workspace alive then), and ``total``."""
    st = states(m, f, b, G)
    peak = activations(m, f, b, G, s, c, U, R, host)
    parts = dict(weights=st["weights"], optimizer=st["optimizer"], grads=peak["grads"],
                 activations=peak["activations"], transient=peak["transient"], kv_cache=peak.get("kv_cache", 0.0))
    parts = {k: v / GB for k, v in parts.items()}
    parts["total"] = sum(parts.values())
    return parts
