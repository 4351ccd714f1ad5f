"""Attention modes benchmark: sliding windows that skip the ring, and ring vs Ulysses vs hybrid.

``window``  causal GQA attention (8 q / 2 kv heads, D=64, fp32) at N=16k over P=4 ranks, one
            thread each, for a sweep of sliding windows and both contiguous and zigzag layouts.
            Reports forward+backward time, the ring steps actually run and the ratio to full
            causal attention: under the contiguous layout a window no longer than a shard is a
            neighbour exchange (2 ring steps instead of 4), and inside a block only the band
            the window leaves visible is computed, so the layer gets cheaper with the window.
``modes``   the same attention at N=8k over P=4 ranks (4 processes on 2 cores: oversubscribed,
            so compare the modes with each other, not with other runs) as a pure ring
            (ulysses_size=1), the 2-D hybrid (2 x 2) and pure Ulysses (ulysses_size=4), for 8
            and 4 kv heads (Ulysses needs kv heads divisible by its degree or vice versa).

Prints JSON lines and draws ``benchmarks/results/window.png`` and ``modes.png``. Usage::

    python benchmarks/modes.py            # both parts
    python benchmarks/modes.py window
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


def _steps(sp, N, window):
    from ringseq.attention.masks import TokenInfo
    from ringseq.attention.schedule import steps_needed

    return steps_needed(sp.layout, N, sp.ring_size, True, TokenInfo(), window)


def measure(N: int, kv: int, layout: str, ulysses: int, window, reps: int) -> dict:
    import ringseq
    from ringseq.layouts import sp_positions

    P, r = dist.get_world_size(), dist.get_rank()
    sp = ringseq.init(sp_size=P, ulysses_size=ulysses, layout=layout)
    base = common.rss_mb()
    pos = sp_positions(layout, N, sp.ring_size, ulysses, sp.rank)
    q, k, v = (common.tokens(pos, B, h, D, seed).requires_grad_(True) for h, seed in ((H, 1), (kv, 2), (kv, 3)))
    dout = common.tokens(pos, B, H, D, 4)
    result = {}

    def fwd_bwd():
        out = ringseq.ring_attention(q, k, v, sp=sp, window=window)
        out.backward(dout)
        result["out"] = out.detach()
        for t in (q, k, v):
            t.grad = None

    fwd_bwd()  # warm-up
    ms = common.timed_ms(fwd_bwd, reps)
    peak = common.slowest(common.peak_rss_mb() - base)
    rows = torch.linspace(0, len(pos) - 1, 16).long()
    full = torch.arange(N)
    exact = common.exact_rows(q.detach()[:, :, rows], pos[rows], common.tokens(full, B, kv, D, 2),
                              common.tokens(full, B, kv, D, 3), 1 / math.sqrt(D), window=window)
    err = common.slowest((result["out"][:, :, rows].double() - exact).abs().max().item())
    return dict(N=N, P=P, kv_heads=kv, layout=layout, ulysses_size=ulysses, ring_size=sp.ring_size,
                window=window, ring_steps=_steps(sp, N, window), fwd_bwd_ms=round(ms, 2),
                peak_mb=round(peak, 1), max_err=err)


def window_sweep(out_dir: str, reps: int, N: int) -> list[dict]:
    P, records = 4, []
    for layout in ("contiguous", "zigzag"):
        full = None
        for window in (None, N // 2, N // 4, N // 16, N // 64):
            rec = common.run_tree(measure, P, 1, N, 2, layout, 1, window, reps)
            full = rec["fwd_bwd_ms"] if window is None else full
            rec["ratio_to_full_causal"] = round(rec["fwd_bwd_ms"] / full, 3)
            records.append(rec)
            common.emit(rec, os.path.join(out_dir, "window.jsonl"))
    return records


def mode_sweep(out_dir: str, reps: int, N: int, kv_heads=(8, 4), ulysses_sizes=(1, 2, 4)) -> list[dict]:
    P, records = 4, []
    for kv in kv_heads:
        ring = None
        for ulysses in ulysses_sizes:
            rec = common.run_tree(measure, P, 1, N, kv, "zigzag", ulysses, None, reps)
            ring = rec["fwd_bwd_ms"] if ulysses == 1 else ring
            rec["ratio_to_ring"] = round(rec["fwd_bwd_ms"] / ring, 3) if ring else None
            records.append(rec)
            common.emit(rec, os.path.join(out_dir, "modes.jsonl"))
    return records


def plot_window(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for layout in ("contiguous", "zigzag"):
        rs = [r for r in records if r["layout"] == layout and r["window"] is not None]
        rs.sort(key=lambda r: r["window"])
        ax.plot([r["window"] for r in rs], [r["ratio_to_full_causal"] for r in rs], marker="o", label=layout)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set(xscale="log", xlabel="sliding window (tokens)", ylabel="fwd+bwd time / full causal",
           title=f"N={records[0]['N']}, P=4: windowed layer cost (shard = {records[0]['N'] // 4} tokens)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_modes(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    names = {1: "ring 4", 2: "hybrid 2x2", 4: "Ulysses 4"}
    kvs = sorted({r["kv_heads"] for r in records}, reverse=True)
    width = 0.8 / len(kvs)
    for i, kv in enumerate(kvs):
        rs = sorted((r for r in records if r["kv_heads"] == kv), key=lambda r: r["ulysses_size"])
        ax.bar([j + i * width for j in range(len(rs))], [r["fwd_bwd_ms"] for r in rs], width, label=f"{kv} kv heads")
        ax.set_xticks([j + width * (len(kvs) - 1) / 2 for j in range(len(rs))], [names[r["ulysses_size"]] for r in rs])
    ax.set(ylabel="fwd+bwd ms (slowest rank)", title=f"N={records[0]['N']}, P=4 (4 processes on 2 cores)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("parts", nargs="*", help="window and/or modes (default: both)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--window-n", type=int, default=16384, help="sequence length of the window sweep")
    parser.add_argument("--modes-n", type=int, default=8192, help="sequence length of the mode comparison")
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 4], help="kv heads of the mode comparison")
    parser.add_argument("--ulysses-sizes", type=int, nargs="+", default=[1, 2, 4], choices=[1, 2, 4],
                        help="ulysses_size of the modes compared over 4 ranks (1: pure ring, 4: pure Ulysses)")
    parser.add_argument("--out", default=common.RESULTS)
    args = parser.parse_args(argv)
    parts = args.parts or ["window", "modes"]
    if set(parts) - {"window", "modes"}:
        parser.error(f"unknown parts {sorted(set(parts) - {'window', 'modes'})}: choose window and/or modes")
    for part in parts:
        common.fresh_file(args.out, f"{part}.jsonl")
        if part == "window":
            plot_window(window_sweep(args.out, args.reps, args.window_n), os.path.join(args.out, "window.png"))
        else:
            plot_modes(mode_sweep(args.out, args.reps, args.modes_n, args.kv_heads, args.ulysses_sizes), os.path.join(args.out, "modes.png"))


if __name__ == "__main__":
    main()
