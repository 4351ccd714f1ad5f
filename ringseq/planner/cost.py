"""Time of one training step of one shape (ring R x Ulysses U) on given hardware.

Glossary (``ringseq.shapes``): S global tokens, P = R x U sequence ranks, s = S / P local
tokens, c = S / R tokens of a ring chunk (what one rank holds after the Ulysses all-to-all),
h = H / U query heads and k = max(K / U, 1) kv heads per rank, b bytes per element.
Times in seconds, FLOPs counted 2 per multiply-add.

Ring step t (t = 0..R-1): compute w_t * 4 c^2 h D FLOPs (forward; backward 2.5x) while the
next K/V block, 2 c k D b bytes (backward: plus fp32 dK/dV, 2 c k D 4), crosses one link;
the step takes max(compute, latency + bytes / bandwidth). w_t is the share of a full block
the slowest rank computes: 1/2 at every step for the balanced layouts (zigzag, striped) under
a causal mask; 1/2 at step 0 and 1 after it for contiguous (the ring waits for the rank with
the most visible keys); 1 without a mask. Each step after the first merges its partial output
into the fp32 accumulator through memory (c h D (8 + b) bytes). The diagonal step computes
the kernel tiles the causal mask cuts whole: 4 c min(tile, c) / 2 h D FLOPs more. With a ring
of more than one rank, step compute is scaled by the preset's ``ring_compute_factor``, each step
pays its own operations' launches (``STEP_OPS`` x ``launch_us``, per ring: head groups pay them
once per group) and each call pays ``ring_overhead_ms`` (factor and overhead measured on CPU; 1
and 0 on the GPU presets, whose ``launch_us`` is a typical CUDA launch).
"""
from __future__ import annotations

import dataclasses

from .features import Features
from .hardware import Hardware
from .memory import layer_elements
from .model_spec import ModelSpec

BWD_FLOPS = 2.5  # attention backward / forward FLOPs (5 block matmuls against 2)


@dataclasses.dataclass(frozen=True)
class RingTime:
    """One attention layer: ``time_s`` on the slowest rank, ``exposed_s`` the transfer time
    compute did not hide, ``ideal_s`` the same FLOPs perfectly balanced with no transfers."""

    time_s: float
    exposed_s: float
    ideal_s: float


def step_shares(R: int, layout: str, causal: bool) -> list[float]:
    """Share of a full block that the slowest rank computes at each of the R ring steps."""
    if not causal:
        return [1.0] * R
    if layout == "contiguous":
        return [0.5] + [1.0] * (R - 1)
    return [0.5] * R


STEP_OPS = (7, 7)
"""Operations a ring step makes outside its kernels, forward and backward, per ring (one ring for all
heads; ``benchmarks/ring_ops.py``, dense: the hop's send and receive and the in-place merge's five
forward; two hops and three accumulations backward). Each is a kernel launch on a GPU."""


def ring_layer(m: ModelSpec, hw: Hardware, S: int, R: int, U: int, *, layout: str = "zigzag", causal: bool = True,
               training: bool = True, inter: bool = False, slowdown: float = 1.0, batch: int = 1,
               groups: int = 1) -> RingTime:
    """Ring (x Ulysses) attention of one layer; ``inter``: the ring crosses nodes; ``slowdown``:
    compute time multiplier (ranks sharing cores). ``groups``: rings per call, one after the
    other (``head_groups``; 1: one ring for all heads): the same bytes and blocks, but every step's
    launches (``STEP_OPS`` x ``launch_us``) and link latency paid once per ring."""
    c, h, k, b = S / R, m.H / U, max(m.K / U, 1), hw.bytes
    full = 4 * c * c * h * m.D * batch
    diagonal = 4 * c * min(hw.causal_tile, c) / 2 * h * m.D * batch  # whole tiles on the diagonal
    bw, lat = hw.link(inter)
    fwd_rate = hw.peak_tflops * 1e12 * hw.attn_fwd_efficiency / slowdown
    bwd_rate = hw.peak_tflops * 1e12 * hw.attn_bwd_efficiency / slowdown
    hbm = hw.hbm_gbps * 1e9 / slowdown
    launch = hw.launch_us * 1e-6 * groups
    passes = [(fwd_rate, 1.0, 2 * c * k * m.D * b, c * h * m.D * (8 + b), STEP_OPS[0] * launch)]
    if training:
        passes.append((bwd_rate, BWD_FLOPS, 2 * c * k * m.D * (b + 4), c * (h + 2 * k) * m.D * (8 + b),
                       STEP_OPS[1] * launch))
    shares = step_shares(R, layout, causal)
    factor = hw.ring_compute_factor if R > 1 else 1.0
    time = exposed = ideal = 0.0
    for rate, flops, wire, merge, launches in passes:
        wire, merge = wire * batch, merge * batch
        comm = groups * lat + wire / bw if R > 1 else 0.0
        for t, share in enumerate(shares):
            work = share * full + (diagonal if t == 0 and causal else 0.0)
            compute = factor * (work * flops / rate + (merge / hbm if t else 0.0)) + (launches if R > 1 else 0.0)
            transfer = comm if t < R - 1 else 0.0
            time += max(compute, transfer)
            exposed += max(0.0, transfer - compute)
        ideal += (0.5 if causal else 1.0) * 4 * S * S * h * m.D * batch * flops / rate / R
    if training and R > 1:  # the dK/dV accumulators go home after the last step
        home = groups * lat + 2 * c * k * m.D * 4 * batch / bw
        time += home
        exposed += home
    if R > 1:  # fixed cost of a ring call (forward alone: a third of forward + backward)
        time += hw.ring_overhead_ms * 1e-3 * slowdown * (1.0 if training else 1 / 3)
    return RingTime(time, exposed, ideal)


@dataclasses.dataclass(frozen=True)
class RecurrentTime:
    """One recurrent layer of a hybrid, sharded one way: ``time_s`` on a rank, ``exposed_s`` its
    communication (blocking collectives: nothing hides it), ``ideal_s`` the one-process FLOPs over
    P, ``sent_bytes`` a rank sends, ``possible``: whether the way applies at this P."""

    time_s: float
    exposed_s: float
    ideal_s: float
    sent_bytes: float
    possible: bool = True


def _recurrence_flops(r, cols: float) -> float:
    """FLOPs per token and head of a chunked recurrence kernel with ``cols`` state columns: the
    intra-chunk products (chunk x (rows + cols)), the state read and written (rows x cols), the
    triangular solve (chunk x rows); counted 2 per multiply-add."""
    return 2 * r.chunk * (r.rows + cols) + 4 * r.rows * cols + 2 * r.chunk * r.rows


def recurrent_layer(m: ModelSpec, hw: Hardware, S: float, P: int, mode: str, *, training: bool = True,
                    inter: bool = False, slowdown: float = 1.0, batch: int = 1, runs: int = 2) -> RecurrentTime:
    """A recurrent layer at P sequence ranks (``ringseq.recurrent``), ``mode``:

    ``state``  each rank's kernel on its s = S / P tokens with the value widened by ``rows``
               columns (its response to an entering state), one all-gather of the ``runs``
               runs' summaries (rows x (cols + rows) per head for the delta rule; rows x
               (cols + 1) for Mamba2) and one of the convolution's halos; backward all-reduces
               the summaries' gradients. Bytes independent of S.
    ``heads``  the head all-to-all: q, k, v and the gates in, the output back, each rank running
               the kernel on all S tokens for heads / P heads; P must divide the key heads.
    Convolution-only layers (LFM2) exchange the halo alone either way."""
    r, b = m.recurrent, hw.bytes
    s = S / P
    bw, lat = hw.link(inter)
    rate = hw.peak_tflops * 1e12 * hw.attn_fwd_efficiency / slowdown
    passes = 1 + (BWD_FLOPS if training else 0)
    halo = (P - 1) * runs * r.channels * (r.width - 1) * b * batch if P > 1 else 0.0
    ideal = S / P * r.heads * (_recurrence_flops(r, r.cols) if r.rows else 2 * r.width * r.channels) * passes \
        * batch / rate
    if r.kind == "conv":
        comm = (lat * (P - 1) + halo / bw) * (2 if training else 1) if P > 1 else 0.0
        return RecurrentTime(ideal + comm, comm, ideal, halo * (2 if training else 1))
    if mode == "state":
        flops = s * r.heads * _recurrence_flops(r, r.cols + r.rows) * passes * batch
        summary = r.heads * r.rows * ((r.cols + r.rows) if r.kind == "delta" else (r.cols + 1)) * 4 * batch
        sent = (P - 1) * runs * summary + halo + (2 * (P - 1) * runs * summary if training else 0.0)
        collectives = (2 + (2 if training else 0)) if P > 1 else 0
        comm = collectives * lat * (P - 1) + sent / bw if P > 1 else 0.0
        return RecurrentTime(flops / rate + comm, comm, ideal, sent)
    possible = P == 1 or r.key_heads % P == 0
    flops = s * r.heads * _recurrence_flops(r, r.cols) * passes * batch
    inputs = (2 * r.key_heads * r.rows + r.heads * r.cols + 2 * r.heads) if r.kind == "delta" else \
        (r.heads * r.cols + 2 * r.rows + r.heads)
    per_pass = (P - 1) / P * s * (inputs + r.heads * r.cols) * b * batch
    sent = per_pass * (2 if training else 1) + halo
    comm = (2 * (2 if training else 1) * lat * (P - 1) + sent / bw) if P > 1 else 0.0
    return RecurrentTime(flops / rate + comm, comm, ideal, sent, possible)


def ulysses_layer(m: ModelSpec, hw: Hardware, s: float, U: int, *, training: bool, inter: bool,
                  batch: int = 1) -> float:
    """All-to-alls of one layer: q, k, v in and the output back (backward: their gradients).
    A rank sends (U-1)/U of its s tokens of each; kv heads fewer than U are replicated."""
    if U == 1:
        return 0.0
    bw, lat = hw.link(inter)
    wire = (U - 1) / U * s * (2 * m.H + 2 * max(m.K, U)) * m.D * hw.bytes * batch
    return (4 * lat + wire / bw) * (2 if training else 1)


def dense_layer(m: ModelSpec, hw: Hardware, s: float, f: Features, slowdown: float = 1.0) -> float:
    """Projections and MLP (matmuls) plus elementwise work (norms, RoPE, SiLU: each kept
    activation written and read in the forward, read and its gradient written/read in backward);
    a tiled MLP runs its forward once more in backward."""
    fwd = 2 * m.layer_params * s * f.micro_batch / (hw.peak_tflops * 1e12 * hw.gemm_efficiency)
    passes = 5 if f.training else 2
    matmul = fwd * ((3 + (1 if f.checkpointing else 0)) if f.training else 1)
    if f.training and f.tiled_mlp:  # DeepSpeed's TiledMLP recomputes the MLP's forward in its backward
        matmul += 2 * 3 * m.d * m.F * s * f.micro_batch / (hw.peak_tflops * 1e12 * hw.gemm_efficiency)
    if f.checkpointing:
        passes += 2
    elementwise = layer_elements(m) * s * f.micro_batch * hw.bytes * passes / (hw.hbm_gbps * 1e9)
    return (matmul + elementwise) * slowdown


def head(m: ModelSpec, hw: Hardware, s: float, f: Features, slowdown: float = 1.0) -> float:
    """Output projection and loss: 2 s d V FLOPs forward (x3 with backward; ringseq's chunked loss
    forms a plain head's gradients in its forward, also x3; under ZeRO-3 its checkpointed slabs
    recompute their logits in backward: x4), logits through memory."""
    recompute = f.chunked_loss and f.zero_stage == 3
    flops = 2 * s * m.d * m.V * f.micro_batch * ((4 if recompute else 3) if f.training else 1)
    logits = s * m.V * f.micro_batch * 4 * (4 if f.training else 1)
    return (flops / (hw.peak_tflops * 1e12 * hw.gemm_efficiency) + logits / (hw.hbm_gbps * 1e9)) * slowdown


def state_traffic(m: ModelSpec, hw: Hardware, f: Features, G: int, inter: bool) -> tuple[float, float]:
    """(collective seconds, optimizer seconds) per step: gradient reduction over the G ranks
    (ZeRO-3 adds the weight all-gathers of forward and backward), and Adam's pass over its shard."""
    gathers = (2 if f.training else 1) if f.zero_stage >= 3 else 0  # weights all-gathered in forward (and backward)
    # gradients reduce-scattered (ZeRO-2/3) or all-reduced (twice the volume)
    reductions = 1 if f.training and f.optimizer else 0
    volumes = gathers + (reductions if f.zero_stage >= 2 else 2 * reductions)
    if G == 1 or volumes == 0:
        collective = 0.0
    else:
        bw, lat = hw.link(inter)
        collective = volumes * ((G - 1) / G * m.params * hw.bytes / bw + 2 * (G - 1) * lat)
    optimizer = 0.0
    if f.training and f.optimizer:
        shard = m.params / (G if f.zero_stage >= 1 else 1)
        optimizer = shard * 28 / (hw.hbm_gbps * 1e9)  # fp32 master, m, v read+written, grad read, weight written
        if f.offload:
            optimizer = shard * 2 * hw.bytes / (hw.pcie_gbps * 1e9)
    return collective, optimizer


def overlap_block(hw: Hardware, h: float, k: float, D: int, *, share: float, inter: bool, training: bool) -> float:
    """Smallest ring chunk c (tokens) whose step compute share * 4 c^2 h D / rate hides the
    transfer latency + 2 c k D b / bandwidth (backward: 2.5x FLOPs and b + 4 bytes). Without
    latency, MHA (k = h), 16-bit and a full block this is c = FLOPs / bandwidth (Liu et al. 2023)."""
    bw, lat = hw.link(inter)
    conditions = [(hw.attn_fwd_efficiency, 1.0, hw.bytes)]
    if training:
        conditions.append((hw.attn_bwd_efficiency, BWD_FLOPS, hw.bytes + 4))
    worst = 0.0
    for eff, flops, bytes_ in conditions:
        a = share * 4 * h * D * flops / (hw.peak_tflops * 1e12 * eff)
        beta = 2 * k * D * bytes_ / bw
        worst = max(worst, (beta + (beta * beta + 4 * a * lat) ** 0.5) / (2 * a))
    return worst
