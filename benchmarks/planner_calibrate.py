"""Calibrate the planner's "cpu" preset: kernel rates and gloo links of this machine, alone.

Measured apart from the validation runs (``planner_validate.py``), so the preset is not fitted
to the points it is checked against. One thread per process, fp32, the shapes of the tiny
Llama the validation trains (d=256, F=688, 8 query / 2 kv heads, D=32):

``gemm``       GFLOP/s of [n, d] x [d, F] matmuls, forward and both backward products.
``attention``  GFLOP/s of the CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``
               through SDPA), non-causal 1024 x 1024 block, forward and backward apart.
``memory``     GB/s of an elementwise ``a + b -> c`` over 64 MB tensors (bytes read + written), and
               ``layer_gbps``: the elementwise work of a layer (RMSNorms, residuals, RoPE, SiLU gate,
               forward and backward, no matmuls) counted as the planner counts it (5 passes over the
               elements a layer keeps): the rate the "cpu" preset's ``hbm_gbps`` holds.
``all_cores_busy``  how much slower the same kernels run with one process on every core (two
               processes at once): the preset's ``busy_slowdown``.
``gloo``       GB/s and latency (us) of a send/recv between two processes (8 MB and 4 bytes).
``ring``       ms of one ``ringseq.ring_attention`` forward+backward at P=2 at 32 and 1024 tokens
               per rank: the preset's ``ring_overhead_ms`` (the 32-token call less its kernels) and
               ``ring_compute_factor`` (the rest of the 1024-token call over the kernel-rate prediction).

The kernels run in fresh processes of one thread (one alone, then one per core at once), as the
validation's ranks do. Each rate is the median of 10 repetitions after a warm-up, the statistic
the validation reports (this machine is shared: its speed moves, and the best repetition caught
its fastest moments).
Prints JSON lines, writes ``docs/planner_calibration.jsonl`` and, with ``--write-preset``, the
"cpu" entry of ``ringseq/planner/presets.json``. Usage::

    flock /tmp/ringseq-cpu.lock python benchmarks/planner_calibrate.py --write-preset
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def _typical(fn, reps: int = 10) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rms(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _rot(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


_ELEMENTS = 6 * 256 + 2 + 2 * 8 * 32 + 2 * 2 * 32 + 8 + 4 * 688  # ringseq.planner.memory.layer_elements


def _elementwise_layer(n: int):
    """The elementwise work of two tiny-Llama layers (norms, residuals, RoPE, SiLU gate), forward
    and backward, without their matmuls and attention: what the planner counts at ``hbm_gbps``."""
    d, F, H, K, D = 256, 688, 8, 2, 32
    x = torch.randn(1, n, d, requires_grad=True)
    w = torch.ones(d, requires_grad=True)
    q, k = torch.randn(1, H, n, D, requires_grad=True), torch.randn(1, K, n, D, requires_grad=True)
    cos, sin = torch.randn(1, 1, n, D), torch.randn(1, 1, n, D)
    gate, up = torch.randn(1, n, F, requires_grad=True), torch.randn(1, n, F, requires_grad=True)
    total = 0
    for _ in range(2):
        h = x + _rms(x, w)
        h = h + _rms(h, w)
        total = total + h.sum() + _rot(q, cos, sin).sum() + _rot(k, cos, sin).sum() + \
            (torch.nn.functional.silu(gate) * up).sum()
    total.backward()


def kernels() -> list[dict]:
    torch.set_num_threads(1)
    n, d, F = 2048, 256, 688
    x, w = torch.randn(n, d, requires_grad=True), torch.randn(d, F, requires_grad=True)
    g = torch.randn(n, F)
    gemm = 3 * 2 * n * d * F / _typical(lambda: torch.autograd.grad(x @ w, (x, w), g)) / 1e9
    H, K, D, c = 8, 2, 32, 1024
    q = torch.randn(1, H, c, D, requires_grad=True)
    k, v = (torch.randn(1, H, c, D, requires_grad=True) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fwd_flops = 4 * c * c * H * D
    t_fwd = _typical(lambda: sdpa(q.detach(), k.detach(), v.detach()))
    out = sdpa(q, k, v)
    dout = torch.randn_like(out)
    t_both = _typical(lambda: torch.autograd.grad(sdpa(q, k, v), (q, k, v), dout))
    a, b = torch.randn(16 << 20), torch.randn(16 << 20)
    c_ = torch.empty_like(a)
    mem = 3 * a.numel() * 4 / _typical(lambda: torch.add(a, b, out=c_)) / 1e9
    # two layers' worth of elements, five passes each, as the planner counts
    layer = 2 * _ELEMENTS * n * 4 * 5 / _typical(lambda: _elementwise_layer(n)) / 1e9
    return [dict(part="gemm", gflops=round(gemm, 2), shape=[n, d, F]),
            dict(part="attention", fwd_gflops=round(fwd_flops / t_fwd / 1e9, 2),
                 bwd_gflops=round(2.5 * fwd_flops / (t_both - t_fwd) / 1e9, 2), block=c, heads=H, head_dim=D),
            dict(part="memory", gbps=round(mem, 2), layer_gbps=round(layer, 2))]


def _tree_kernels() -> list[dict]:
    """``kernels()`` on every rank of a fresh process tree at once: rank 0's rates."""
    dist.barrier()
    return kernels()


def _ring_call() -> dict:
    """ms of one ringseq.ring_attention forward+backward at P=2 ranks (this model's 8/2 heads,
    D=32), at 32 and 1024 tokens per rank: its fixed cost and how its compute compares."""
    import ringseq

    sp = ringseq.init(sp_size=dist.get_world_size())
    out = {}
    for s in (32, 1024):
        q = torch.randn(1, 8, s, 32, requires_grad=True)
        k, v = (torch.randn(1, 2, s, 32, requires_grad=True) for _ in range(2))

        def step():
            o = ringseq.ring_attention(q, k, v, sp=sp)
            o.backward(torch.ones_like(o))

        for _ in range(3):
            step()
        times = []
        for _ in range(10):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(common.slowest(time.perf_counter() - start))
        out[s] = statistics.median(times) * 1e3
    return dict(part="ring", ms_32=round(out[32], 2), ms_1024=round(out[1024], 2))


def _gloo() -> dict:
    r = dist.get_rank()
    out = {}
    for name, numel, reps in (("big", 2 << 20, 10), ("small", 1, 200)):
        t = torch.zeros(numel)
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            if r == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
            times.append((time.perf_counter() - start) / 2)
        out[name] = statistics.median(times)
    return dict(part="gloo", gbps=round((2 << 20) * 4 / (out["big"] - out["small"]) / 1e9, 3),
                latency_us=round(out["small"] * 1e6, 1))


def write_preset(records: list[dict]) -> None:
    """Store the measured rates as the "cpu" preset (GEMM rate as peak, kernels as fractions of it)."""
    by = {r["part"]: r for r in records}
    path = os.path.join(os.path.dirname(DOCS), "ringseq", "planner", "presets.json")
    with open(path) as f:
        presets = json.load(f)
    g, att, gloo = by["gemm"]["gflops"], by["attention"], by["gloo"]
    presets["cpu"].update(peak_tflops=round(g / 1e3, 5), gemm_efficiency=1.0,
                          attn_fwd_efficiency=round(att["fwd_gflops"] / g, 3),
                          attn_bwd_efficiency=round(att["bwd_gflops"] / g, 3), hbm_gbps=by["memory"]["layer_gbps"],
                          pcie_gbps=by["memory"]["gbps"], intra_gbps=gloo["gbps"], inter_gbps=gloo["gbps"],
                          intra_latency_us=gloo["latency_us"], inter_latency_us=gloo["latency_us"],
                          busy_slowdown=by["all_cores_busy"]["slowdown"])
    presets["cpu"]["source"] = (f"this machine, measured by benchmarks/planner_calibrate.py on "
                                f"{time.strftime('%Y-%m-%d')} "
                                f"(docs/planner_calibration.jsonl), one thread per rank, fp32: GEMM {g} GFLOP/s, CPU "
                                f"flash attention fwd {att['fwd_gflops']} / bwd {att['bwd_gflops']} GFLOP/s, a layer's "
                                f"elementwise work {by['memory']['layer_gbps']} GB/s, gloo {gloo['gbps']} GB/s and "
                                f"{gloo['latency_us']} us; kernels {by['all_cores_busy']['slowdown']}x slower with "
                                "every core busy; 2 cores; causal_tile 512: kvSplitSize of aten's CPU flash "
                                "attention for keys >= 512")
    presets["cpu"].update(ring_compute_factor=1.0, ring_overhead_ms=0.0)
    presets["cpu"].update(_ring_fields(presets["cpu"], by["ring"]))
    presets["cpu"]["source"] += (f"; ring_attention at P=2 (8/2 heads, D=32): {by['ring']['ms_32']} ms per call at 32 "
                                 f"tokens per rank, {by['ring']['ms_1024']} ms at 1024")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30  # the host is the devices' memory too
    presets["cpu"]["host_memory_gb"] = int(0.8 * total)
    presets["cpu"]["source"] += (f"; host_memory_gb: this machine's {total:.0f} GiB in all, which is also the devices' "
                                 "memory; 80% of it")
    with open(path, "w") as f:
        f.write(json.dumps(presets, indent=2) + "\n")


def _ring_fields(cpu: dict, ring: dict) -> dict:
    """ring_overhead_ms: the measured call at 32 tokens less its predicted kernel time;
    ring_compute_factor: the rest of the 1024-token call over its predicted ring time."""
    from ringseq.planner import Hardware
    from ringseq.planner.cost import ring_layer
    from ringseq.planner.model_spec import ModelSpec

    hw = Hardware(name="cpu", **cpu)
    m = ModelSpec(d=256, F=688, L=4, H=8, K=2, D=32, V=2048)
    predicted = {s: ring_layer(m, hw, 2 * s, 2, 1).time_s * 1e3 for s in (32, 1024)}
    fixed = max(0.0, ring["ms_32"] - predicted[32])
    return dict(ring_overhead_ms=round(fixed, 2),
                ring_compute_factor=round(max(1.0, (ring["ms_1024"] - fixed) / predicted[1024]), 3))



def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=DOCS)
    parser.add_argument("--write-preset", action="store_true", help="store the rates as the cpu preset")
    args = parser.parse_args(argv)
    path = common.fresh_file(args.out, "planner_calibration.jsonl")
    # alone in a fresh process, as each rank of the validation runs, then on every core at once;
    # the same kernels in this driver process are recorded beside them (part "driver"), not used
    records = common.run_tree(_tree_kernels, 1, 1)
    loaded = {r["part"]: r for r in common.run_tree(_tree_kernels, 2, 1)}
    driver = {r["part"]: r for r in kernels()}
    single = {r["part"]: r for r in records}
    ratios = [single["gemm"]["gflops"] / loaded["gemm"]["gflops"],
              single["attention"]["fwd_gflops"] / loaded["attention"]["fwd_gflops"],
              single["attention"]["bwd_gflops"] / loaded["attention"]["bwd_gflops"],
              single["memory"]["layer_gbps"] / loaded["memory"]["layer_gbps"]]
    records.append(dict(part="all_cores_busy", slowdown=round(statistics.mean(ratios), 3),
                        ratios=[round(r, 3) for r in ratios]))
    records.append(dict(part="driver", gemm_gflops=driver["gemm"]["gflops"],
                        fwd_gflops=driver["attention"]["fwd_gflops"], bwd_gflops=driver["attention"]["bwd_gflops"],
                        layer_gbps=driver["memory"]["layer_gbps"]))
    records.append(common.run_tree(_gloo, 2, 1))
    records.append(common.run_tree(_ring_call, 2, 1))
    for rec in records:
        common.emit(rec, path)
    if args.write_preset:
        write_preset(records)


if __name__ == "__main__":
    main()
