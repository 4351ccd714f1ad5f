"""Hardware presets (data in ``presets.json``) and command-line style overrides.

Units: TFLOP/s and GB/s (1e9 bytes/s) per device and direction, microseconds, GiB.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from importlib import resources

from ringseq.errors import RingSeqError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """One device type and its links."""

    name: str
    """Preset name (``h100``, ``h200``, ``a100``, ``cpu``) or ``custom``."""
    peak_tflops: float
    """Dense TFLOP/s of one device in the training dtype."""
    gemm_efficiency: float
    """Achieved fraction of peak for large matmuls."""
    attn_fwd_efficiency: float
    """Achieved fraction of peak of the attention kernel, forward."""
    attn_bwd_efficiency: float
    """Achieved fraction of peak of the attention kernel, backward (counted as 2.5x forward FLOPs)."""
    hbm_gbps: float
    """Device memory bandwidth, GB/s (elementwise work and log-sum-exp merges)."""
    intra_gbps: float
    """Per-device bandwidth to a device of the same node, GB/s one direction (NVLink)."""
    inter_gbps: float
    """Per-device bandwidth to another node, GB/s one direction (InfiniBand / RoCE NIC)."""
    pcie_gbps: float
    """Host link, GB/s (optimizer offload)."""
    intra_latency_us: float
    inter_latency_us: float
    memory_gb: float
    """Device memory, GiB."""
    host_memory_gb: float = float("inf")
    """Host memory per node that the job may fill, GiB: what offloaded optimizer state, weights and kept
    activations are bounded by (``inf``: not bounded)."""
    bytes: int
    """Bytes per activation / weight element (2 for bf16, 4 for fp32)."""
    cores: int
    """Devices that compute at once on this host (0: every rank has its own device)."""
    busy_slowdown: float = 1.0
    """Compute slowdown when every core of the host is busy (shared memory bandwidth and clocks;
    1 for devices of their own)."""
    ring_compute_factor: float = 1.0
    """Ring steps' compute time / what the kernel rates give (the ring's own work around the
    kernels: slicing, merges, zero-filled accumulators); measured on CPU, 1 where unmeasured."""
    ring_overhead_ms: float = 0.0
    """Fixed time of one ring attention call, forward + backward, with a ring of more than one
    rank (Python, agreements, transfer set-up); measured on CPU, 0 where unmeasured."""
    launch_us: float = 0.0
    """Device time of one small operation of a ring step (a kernel launch and a pass over a block;
    ``cost.STEP_OPS`` per step and ring). 0 on the CPU, whose ``ring_compute_factor`` holds it."""
    causal_tile: int = 128
    """Keys per kernel tile: a causal (diagonal) block of n queries computes n * tile / 2 FLOP-pairs
    more than its n^2 / 2 visible ones, since tiles the diagonal cuts are computed whole."""
    source: str = ""

    def link(self, inter: bool) -> tuple[float, float]:
        """(bytes/s, latency s) of an inter-node or intra-node link."""
        gbps, lat = (self.inter_gbps, self.inter_latency_us) if inter else (self.intra_gbps, self.intra_latency_us)
        return gbps * 1e9, lat * 1e-6


@functools.cache
def presets() -> dict[str, dict]:
    text = resources.files("ringseq.planner").joinpath("presets.json").read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def hardware(name: str | Hardware, *, intra_gbps: float | None = None, inter_gbps: float | None = None,
             tflops: float | None = None, host_memory_gb: float | None = None) -> Hardware:
    """The preset ``name`` with any override; ``tflops`` replaces the peak TFLOP/s, ``host_memory_gb`` the host
    memory per node the job may fill."""
    if isinstance(name, Hardware):
        base = dataclasses.asdict(name)
    elif name in presets():
        base = dict(presets()[name], name=name)
    else:
        raise RingSeqError(f"unknown hardware {name!r}: choose one of {sorted(presets())}, or give "
                           "--intra-gbps, --inter-gbps and --tflops with the nearest preset")
    for key, value in (("intra_gbps", intra_gbps), ("inter_gbps", inter_gbps), ("peak_tflops", tflops),
                       ("host_memory_gb", host_memory_gb)):
        if value is not None:
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise RingSeqError(f"{key} must be a positive finite number, got {value!r}")
            base[key] = float(value)
            if key != "host_memory_gb":  # the node's memory, not the device's rates: the preset stays the preset
                base["name"] = f"{base['name']}+custom"
    return Hardware(**base)
