"""Simulator inputs from the cost model: per-step compute and per-block transfer of a shape."""
from __future__ import annotations

from .cost import BWD_FLOPS
from .hardware import Hardware
from .model_spec import ModelSpec
from .simulate import Costs


def ring_costs(m: ModelSpec, hw: Hardware, S: int, R: int, U: int = 1, *, backward: bool = False) -> Costs:
    """One balanced-causal ring step (half a block of c = S / R tokens, H / U heads) and its
    block transfer, as ``ringseq.planner.cost.ring_layer`` counts them; ``backward``: the
    backward pass (2.5x FLOPs, K/V plus fp32 dK/dV on the wire)."""
    c, h, k, b = S / R, m.H / U, max(m.K / U, 1), hw.bytes
    eff, flops, wire = ((hw.attn_bwd_efficiency, BWD_FLOPS, 2 * c * k * m.D * (b + 4)) if backward
                        else (hw.attn_fwd_efficiency, 1.0, 2 * c * k * m.D * b))
    compute = (0.5 * 4 * c * c * h * m.D * flops / (hw.peak_tflops * 1e12 * eff)
               + c * h * m.D * (8 + b) / (hw.hbm_gbps * 1e9))
    (intra_bw, intra_lat), (inter_bw, inter_lat) = hw.link(False), hw.link(True)
    s = S / (R * U)
    a2a = 0.0
    if U > 1:
        a2a_bytes = (U - 1) / U * s * (2 * m.H + 2 * max(m.K, U)) * m.D * b
        a2a = 4 * intra_lat + a2a_bytes / intra_bw
    return Costs(compute=compute, intra=intra_lat + wire / intra_bw, inter=inter_lat + wire / inter_bw, all_to_all=a2a)
