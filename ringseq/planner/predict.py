"""``ringseq.plan``: memory, step time and the best ring x Ulysses shape for a cluster."""
from __future__ import annotations

import dataclasses
import math

from ringseq.errors import RingSeqError

from . import cost, memory
from .features import Features
from .hardware import Hardware, hardware as get_hardware
from .model_spec import ModelSpec, model_spec

LAYOUTS = ("contiguous", "zigzag", "striped")


class _Fields:
    """Results read as attributes or, for JSON-minded callers, as ``obj["field"]``."""

    def __getitem__(self, key):
        return getattr(self, key)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ModeEstimate(_Fields):
    """One shape of the sequence group: ``ulysses`` ranks inside, a ring of ``ring`` across."""

    name: str
    ring: int
    ulysses: int
    step_time_s: float
    """Predicted time of one optimizer step (one forward without training)."""
    efficiency: float
    """Ideal time (the same FLOPs perfectly balanced, no transfers) / step_time_s."""
    exposed_comm_s: float
    """Transfer time per step that compute does not hide."""
    memory_per_rank_gb: float
    memory_gb: dict
    """Parts of memory_per_rank_gb: weights, grads, optimizer, activations, transient (GiB)."""
    ring_crosses_nodes: bool
    attention_s: float
    """Attention's share of step_time_s (all layers, forward and backward)."""


@dataclasses.dataclass(frozen=True)
class Recommendation(_Fields):
    mode: str
    ring: int
    ulysses: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Plan(_Fields):
    """What ``ringseq.plan`` predicts; times in seconds, memory in GiB per rank."""

    memory_per_rank_gb: float
    step_time_s: float
    modes: list
    recommendation: Recommendation
    min_tokens_per_rank_for_overlap: float
    """Ring block (tokens per rank of a pure ring) at which a step's compute hides its transfer;
    the balanced causal layouts need twice the full-block figure, since each step computes half a block."""
    tokens_per_rank: float
    sp_size: int
    hardware: str
    fits: bool


def mode_name(R: int, U: int) -> str:
    return "ring" if U == 1 else "ulysses" if R == 1 else f"hybrid {U}x{R}"


def ulysses_sizes(m: ModelSpec, P: int) -> list[int]:
    """Ulysses sizes U dividing P that split the heads (H % U == 0, and K % U == 0 or U % K == 0)."""
    return [U for U in range(1, P + 1) if P % U == 0 and m.H % U == 0 and (m.K % U == 0 or U % m.K == 0)]


def estimate(m: ModelSpec, hw: Hardware, f: Features, *, S: int, R: int, U: int, G: int, per_node: int,
             layout: str, causal: bool = True) -> ModeEstimate:
    """Time and memory of one shape; S is padded to the multiple the layout needs."""
    multiple = (2 * R if layout == "zigzag" else R) * U
    S = math.ceil(S / multiple) * multiple
    P = R * U
    s = S / P
    on_host = min(G, per_node)
    slowdown = 1.0
    if hw.cores and on_host >= hw.cores:  # ranks share the host's cores: time-sliced, and each core slower
        slowdown = on_host / hw.cores * hw.busy_slowdown
    crosses = R > 1 and P > per_node
    ring = cost.ring_layer(m, hw, S, R, U, layout=layout, causal=causal, training=f.training, inter=crosses,
                           slowdown=slowdown, batch=f.micro_batch)
    a2a = cost.ulysses_layer(m, hw, s, U, training=f.training, inter=U > per_node, batch=f.micro_batch)
    dense = cost.dense_layer(m, hw, s, f, slowdown)
    head = cost.head(m, hw, s, f, slowdown)
    collective, optimizer = cost.state_traffic(m, hw, f, G, inter=G > per_node)
    compute = m.L * (dense + ring.time_s + a2a) + head + optimizer
    step = max(compute, collective + optimizer)
    ideal = m.L * (dense + ring.ideal_s) + head + optimizer
    exposed = m.L * (ring.exposed_s + a2a) + max(0.0, collective + optimizer - compute)
    mem = memory.per_rank(m, f, hw.bytes, G, int(s), int(S / R), U, ring=R > 1, host=hw.name == "cpu")
    return ModeEstimate(name=mode_name(R, U), ring=R, ulysses=U, step_time_s=step, efficiency=ideal / step,
                        exposed_comm_s=exposed, memory_per_rank_gb=mem["total"],
                        memory_gb={k: v for k, v in mem.items() if k != "total"}, ring_crosses_nodes=crosses,
                        attention_s=m.L * (ring.time_s + a2a))


def _check(seq_len, gpus, gpus_per_node, sp_size, layout):
    for name, value in (("seq_len", seq_len), ("gpus", gpus), ("gpus_per_node", gpus_per_node), ("sp_size", sp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RingSeqError(f"{name} must be a positive integer, got {value!r}")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise RingSeqError(f"gpus {gpus} is not a whole number of nodes of gpus_per_node {gpus_per_node}: "
                           f"choose gpus = {gpus // gpus_per_node * gpus_per_node} or "
                           f"{(gpus // gpus_per_node + 1) * gpus_per_node}")
    if gpus % sp_size:
        raise RingSeqError(f"sp_size {sp_size} does not divide gpus {gpus}: gpus must be data x sequence "
                           f"(choose sp_size among {[d for d in range(1, gpus + 1) if gpus % d == 0]})")
    if layout not in LAYOUTS:
        raise RingSeqError(f"unknown layout {layout!r}: choose one of {list(LAYOUTS)}")
    if seq_len < sp_size:
        raise RingSeqError(f"seq_len {seq_len} is shorter than sp_size {sp_size}: use fewer sequence ranks")


def _recommend(modes: list[ModeEstimate], hw: Hardware, f: Features, chosen: int | None) -> tuple[ModeEstimate, str]:
    fitting = [e for e in modes if e.memory_per_rank_gb <= hw.memory_gb]
    pool = [e for e in modes if e.ulysses == chosen] if chosen else (fitting or modes)
    best = min(pool, key=lambda e: e.step_time_s)
    others = sorted((e for e in modes if e is not best), key=lambda e: e.step_time_s)
    why = "the ulysses_size asked for" if chosen else "fastest shape that fits" if fitting else "fastest shape"
    reason = (f"{best.name} (ulysses {best.ulysses} x ring {best.ring}): {why}, {best.step_time_s:.3g} s/step at "
              f"{best.efficiency:.0%} efficiency, {best.exposed_comm_s:.3g} s of exposed communication")
    if others:
        reason += f"; next {others[0].name} at {others[0].step_time_s:.3g} s"
    if best.memory_per_rank_gb > hw.memory_gb:
        switches = (("checkpointing=True", f.checkpointing), ("tiled_mlp=4", f.tiled_mlp),
                    ("offload=True", f.offload), ("zero_stage=3", f.zero_stage == 3))
        fixes = ["add gpus"] + [fix for fix, on in switches if not on]
        reason += f"; needs {best.memory_per_rank_gb:.1f} GiB per rank of {hw.memory_gb:g}: {', '.join(fixes)}"
    return best, reason


def plan(*, model, seq_len: int, gpus: int, gpus_per_node: int = 8, hardware: str | Hardware = "h100",
         zero_stage: int = 3, training: bool = True, layout: str = "zigzag", sp_size: int | None = None,
         ulysses_size: int | None = None, checkpointing: bool = False, tiled_mlp: int | None = None,
         chunked_loss: bool = True, offload: bool = False, optimizer: bool = True, micro_batch: int = 1,
         intra_gbps: float | None = None, inter_gbps: float | None = None, tflops: float | None = None) -> Plan:
    """Predict per-rank memory and step time of fine-tuning ``model`` (a transformers config, a
    dict of its fields or a path to config.json) on sequences of ``seq_len`` tokens over ``gpus``
    devices (``gpus_per_node`` per node), one sequence group of ``sp_size`` ranks (default: all)
    per sequence; every ring x Ulysses shape is costed and the fastest that fits recommended.
    ``optimizer=False`` costs forward + backward alone (no Adam state, no gradient reduction)."""
    m = model_spec(model)
    sp_size = gpus if sp_size is None else sp_size
    _check(seq_len, gpus, gpus_per_node, sp_size, layout)
    hw = get_hardware(hardware, intra_gbps=intra_gbps, inter_gbps=inter_gbps, tflops=tflops)
    f = Features(training=training, zero_stage=zero_stage, optimizer=optimizer, checkpointing=checkpointing,
                 tiled_mlp=tiled_mlp, chunked_loss=chunked_loss, offload=offload, micro_batch=micro_batch)
    sizes = ulysses_sizes(m, sp_size)
    if ulysses_size is not None and ulysses_size not in sizes:
        raise RingSeqError(f"ulysses_size {ulysses_size} cannot split this model over sp_size {sp_size} "
                           f"({m.H} query heads, {m.K} kv heads): choose one of {sizes}")
    modes = [estimate(m, hw, f, S=seq_len, R=sp_size // U, U=U, G=gpus, per_node=gpus_per_node, layout=layout)
             for U in sizes]
    best, reason = _recommend(modes, hw, f, ulysses_size)
    share = cost.step_shares(2, layout, True)[1]
    crosses = sp_size > gpus_per_node
    overlap = cost.overlap_block(hw, m.H, m.K, m.D, share=share, inter=crosses, training=training)
    return Plan(memory_per_rank_gb=best.memory_per_rank_gb, step_time_s=best.step_time_s, modes=modes,
                recommendation=Recommendation(mode=best.name, ring=best.ring, ulysses=best.ulysses, reason=reason),
                min_tokens_per_rank_for_overlap=overlap, tokens_per_rank=seq_len / sp_size, sp_size=sp_size,
                hardware=hw.name, fits=best.memory_per_rank_gb <= hw.memory_gb)
