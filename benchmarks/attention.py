"""Attention layer benchmark: ringseq against the alternatives, side by side.

Causal attention, B=1, 8 query heads, 8 or 2 kv heads, D=64, fp32, global length N.
Implementations, each timed in a fresh process tree in the same run:

``ringseq``               ringseq.ring_attention, P=2 ranks, one thread each, zigzag layout.
``ringseq_compute_only``  the same ring with its transfers replaced by handing back the sent
                          block: same kernel calls, no communication; the difference to
                          ``ringseq`` is the communication the ring fails to hide.
``torch_ring``            PyTorch's own ring attention (``torch.distributed.tensor.experimental``
                          context parallel, load-balanced). Its public ``context_parallel()``
                          has no CPU sharding strategy in torch 2.13, so its templated ring
                          forward/backward are driven directly with the CPU flash kernel, with
                          its default K/V rotation (all-gather).
``ulysses``               DeepSpeed Ulysses ``DistributedAttention`` (all-to-all over heads)
                          around SDPA, P=2 ranks, one thread each.
``sdpa``                  one process with 2 threads running full-sequence SDPA (same cores,
                          no parallelism).

Prints one JSON line per (impl, N, kv_heads) with fwd_ms, fwd_bwd_ms (median of the slowest
rank), peak_mb (per-rank peak resident memory above the process's pre-input baseline) and
max_err (largest error of 32 sampled output rows against float64 exact attention), and draws
``benchmarks/results/attention.png``. Usage::

    python benchmarks/attention.py                      # N = 4k..32k, kv heads 8 and 2
    python benchmarks/attention.py --lengths 4096 --reps 2
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

H, D, B = 8, 64, 1
IMPLS = ("ringseq", "ringseq_compute_only", "torch_ring", "ulysses", "sdpa")


def _positions(impl: str, N: int, P: int, r: int) -> torch.Tensor:
    from ringseq.layouts import global_positions

    if impl == "sdpa":
        return torch.arange(N)
    return global_positions("contiguous" if impl == "ulysses" else "zigzag", N, P, r)


class _Echo:
    """A transfer that 'receives' what it sent: same shapes, no communication."""

    def __init__(self, parts):
        self._flat = parts[0].clone() if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts])

    def wait(self):
        return self._flat  # the sent buffer handed back: what a transfer's receive buffer holds


def _ringseq_step(compute_only: bool):
    import ringseq
    from ringseq.attention.comm import RingComm

    if compute_only:
        RingComm.post = lambda self, parts, step, shift=1, kind="kv": _Echo(parts)
    sp = ringseq.init(sp_size=dist.get_world_size())
    return lambda q_, k_, v_: ringseq.ring_attention(q_, k_, v_, sp=sp, causal=True)


class _TorchRing(torch.autograd.Function):
    """PyTorch's templated ring attention forward/backward over the CPU flash kernel."""

    @staticmethod
    def forward(ctx, q, k, v):
        from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

        out, lse = _templated_ring_attention(dist.group.WORLD, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                                             q, k, v, is_causal=True, dropout_p=0.0, scale=None)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _templated_ring_attention_backward)

        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _templated_ring_attention_backward(
            dist.group.WORLD, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            dout, "grad_out", q, k, v, out, lse, is_causal=True, dropout_p=0.0, scale=None)
        return dq, dk, dv


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.size(1) != k.size(1))


def _ulysses_step():
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.init_distributed(dist_backend="gloo")

    def local(q, k, v, *args, **kwargs):  # [B, S, h, D] -> [B, S, h, D]
        return _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    attn = DistributedAttention(local, dist.group.WORLD, scatter_idx=2, gather_idx=1)
    # ringseq's [B, H, s, D] convention outside, DeepSpeed's [B, s, H, D] inside
    return lambda q, k, v: attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                batch_dim_idx=0).transpose(1, 2)


def measure(impl: str, N: int, kv: int, reps: int, warmup: bool) -> dict:
    P, r = dist.get_world_size(), dist.get_rank()
    if impl in ("ringseq", "ringseq_compute_only"):
        attention = _ringseq_step(impl == "ringseq_compute_only")
    elif impl == "torch_ring":
        attention = _TorchRing.apply
    elif impl == "ulysses":
        attention = _ulysses_step()
    else:
        attention = _sdpa
    base = common.rss_mb()
    pos = _positions(impl, N, P, r)
    q, k, v = (common.tokens(pos, B, h, D, seed).requires_grad_(True) for h, seed in ((H, 1), (kv, 2), (kv, 3)))
    dout = common.tokens(pos, B, H, D, 4)
    result = {}

    def fwd():
        with torch.no_grad():
            result["out"] = attention(q, k, v)

    def fwd_bwd():
        attention(q, k, v).backward(dout)
        for t in (q, k, v):
            t.grad = None

    if warmup:
        fwd_bwd()
    fwd_ms = common.timed_ms(fwd, reps)
    fwd_bwd_ms = common.timed_ms(fwd_bwd, reps)
    peak = common.slowest(common.peak_rss_mb() - base)
    # accuracy: 32 sampled output rows against float64 exact attention over the full sequence
    rows = torch.linspace(0, len(pos) - 1, 32).long()
    full = torch.arange(N)
    exact = common.exact_rows(q.detach()[:, :, rows], pos[rows], common.tokens(full, B, kv, D, 2),
                              common.tokens(full, B, kv, D, 3), 1 / math.sqrt(D))
    err = common.slowest((result["out"][:, :, rows].double() - exact).abs().max().item())
    if impl == "ringseq_compute_only":
        err = None  # it attends to its own block P times by construction: no meaningful error
    return dict(impl=impl, N=N, kv_heads=kv, P=P if impl != "sdpa" else 1, fwd_ms=round(fwd_ms, 2),
                fwd_bwd_ms=round(fwd_bwd_ms, 2), peak_mb=round(peak, 1), max_err=err)


def default_reps(N: int) -> int:
    return 3 if N <= 8192 else 2 if N <= 16384 else 1


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kvs = sorted({r["kv_heads"] for r in records}, reverse=True)
    fig, axes = plt.subplots(2, len(kvs), figsize=(6 * len(kvs), 8), squeeze=False)
    for col, kv in enumerate(kvs):
        for impl in IMPLS:
            rs = sorted((r for r in records if r["impl"] == impl and r["kv_heads"] == kv), key=lambda r: r["N"])
            if rs:
                axes[0][col].plot([r["N"] for r in rs], [r["fwd_bwd_ms"] for r in rs], marker="o", label=impl)
                axes[1][col].plot([r["N"] for r in rs], [r["peak_mb"] for r in rs], marker="o", label=impl)
        axes[0][col].set(title=f"causal, 8 q heads / {kv} kv heads, D=64, fp32", ylabel="forward+backward ms",
                         xscale="log", yscale="log")
        axes[1][col].set(xlabel="sequence length N", ylabel="peak MB per rank", xscale="log", yscale="log")
        for ax in axes[:, col]:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2])
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default: 3, 2 at 16k, 1 at 32k)")
    parser.add_argument("--out", default=common.RESULTS)
    args = parser.parse_args(argv)
    jsonl = common.fresh_file(args.out, "attention.jsonl")
    records = []
    for N in args.lengths:
        reps = args.reps or default_reps(N)
        for kv in args.kv_heads:
            for impl in args.impls:
                nprocs, threads = (1, 2) if impl == "sdpa" else (2, 1)
                rec = common.run_tree(measure, nprocs, threads, impl, N, kv, reps, reps > 1)
                records.append(rec)
                common.emit(rec, jsonl)
    plot(records, os.path.join(args.out, "attention.png"))
    print(f"wrote {jsonl} and attention.png", file=sys.stderr)


if __name__ == "__main__":
    main()
