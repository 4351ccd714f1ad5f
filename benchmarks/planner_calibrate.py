"""Calibrate the planner's "cpu" preset: kernel rates and gloo links of this machine, alone.

Measured apart from the validation runs (``planner_validate.py``), so the preset is not fitted
to the points it is checked against. One thread per process, fp32, the shapes of the tiny
Llama the validation trains (d=256, F=688, 8 query / 2 kv heads, D=32):

``gemm``       GFLOP/s of [n, d] x [d, F] matmuls, forward and both backward products.
``attention``  GFLOP/s of the CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``
               through SDPA), non-causal 1024 x 1024 block, forward and backward apart.
``memory``     GB/s of an elementwise ``a + b -> c`` over 64 MB tensors (bytes read + written).
``gloo``       GB/s and latency (us) of a send/recv between two processes (8 MB and 4 bytes).

Prints JSON lines and writes ``docs/planner_calibration.jsonl``; copy the figures into
``ringseq/planner/presets.json`` ("cpu"). Usage::

    flock /tmp/ringseq-cpu.lock python benchmarks/planner_calibrate.py
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def _best(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def kernels() -> list[dict]:
    torch.set_num_threads(1)
    n, d, F = 2048, 256, 688
    x, w = torch.randn(n, d, requires_grad=True), torch.randn(d, F, requires_grad=True)
    g = torch.randn(n, F)
    gemm = 3 * 2 * n * d * F / _best(lambda: torch.autograd.grad(x @ w, (x, w), g)) / 1e9
    H, K, D, c = 8, 2, 32, 1024
    q = torch.randn(1, H, c, D, requires_grad=True)
    k, v = (torch.randn(1, H, c, D, requires_grad=True) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fwd_flops = 4 * c * c * H * D
    t_fwd = _best(lambda: sdpa(q.detach(), k.detach(), v.detach()))
    out = sdpa(q, k, v)
    dout = torch.randn_like(out)
    t_both = _best(lambda: torch.autograd.grad(sdpa(q, k, v), (q, k, v), dout))
    a, b = torch.randn(16 << 20), torch.randn(16 << 20)
    c_ = torch.empty_like(a)
    mem = 3 * a.numel() * 4 / _best(lambda: torch.add(a, b, out=c_)) / 1e9
    return [dict(part="gemm", gflops=round(gemm, 2), shape=[n, d, F]),
            dict(part="attention", fwd_gflops=round(fwd_flops / t_fwd / 1e9, 2),
                 bwd_gflops=round(2.5 * fwd_flops / (t_both - t_fwd) / 1e9, 2), block=c, heads=H, head_dim=D),
            dict(part="memory", gbps=round(mem, 2))]


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=DOCS)
    args = parser.parse_args(argv)
    path = common.fresh_file(args.out, "planner_calibration.jsonl")
    for rec in kernels() + [common.run_tree(_gloo, 2, 1)]:
        common.emit(rec, path)


if __name__ == "__main__":
    main()
