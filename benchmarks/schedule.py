"""Ring planning time: how long one rank takes to plan its ring calls for a batch.

No process group: the script plans as one rank of a ring of P would, from the batch's global
position ids (what ``token_info`` all-gathers): document ids and the per-batch tables
(``TokenInfo``), the ring step count every rank agrees on, and this rank's calls with their
status (hidden, full or masked). That is all the work done before the first ring step of a
forward, once per batch (the layers reuse it). Packed documents have random lengths; with
``--window`` every layer sees a sliding window. Prints one JSON line per configuration with
``plan_ms`` (median over ``--reps``) and draws ``benchmarks/results/schedule.png``. Usage::

    python benchmarks/schedule.py --P 64 --S 1048576 --docs 1000     # one line, plan_ms
    python benchmarks/schedule.py --P 64 --S 1048576 --docs 1000 --layout balanced --mix prolong512k
    python benchmarks/schedule.py                                     # the sweep and its plot
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def packed_positions(S: int, docs: int, seed: int = 0) -> torch.Tensor:
    """[1, S] position ids of ``docs`` packed documents of random lengths (1 doc: 0..S-1)."""
    if docs <= 1:
        return torch.arange(S)[None]
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(S - 1, generator=g)[: docs - 1].sort().values + 1
    starts = torch.zeros(S, dtype=torch.long)
    starts[cuts] = cuts
    return (torch.arange(S) - torch.cummax(starts, 0).values)[None]


def plan_once(layout: str, S: int, P: int, rank: int, pos: torch.Tensor, window: int | None) -> float:
    """Milliseconds to plan; ``balanced``: the row's own layout made first (``ringseq.balance``,
    what ``shard_batch`` does under zigzag), its making counted in."""
    from ringseq.attention.masks import TokenInfo, documents
    from ringseq.attention.schedule import rank_schedule
    from ringseq.balance import balanced

    start = time.perf_counter()
    doc = documents(pos)
    info = TokenInfo(doc=doc if bool(doc.any()) else None)
    if layout == "balanced":
        layout = balanced(info, S, P)
        info = TokenInfo(doc=info.doc, layout=None if layout == "zigzag" else layout)
    plan = rank_schedule(layout, S, P, rank, True, info, window)
    if info.doc is not None or window is not None:
        assert plan.steps >= 1 and len(plan.calls) == plan.steps
    return (time.perf_counter() - start) * 1e3


def measure(P: int, S: int, docs: int, layout: str, window: int | None, reps: int) -> dict:
    pos = packed_positions(S, docs)
    times = [plan_once(layout, S, P, P // 2, pos, window) for _ in range(reps)]
    return dict(P=P, S=S, docs=docs, layout=layout, window=window, plan_ms=round(statistics.median(times), 2))


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    keys = sorted({(r["docs"], r["window"] or 0, r["layout"]) for r in records})
    for docs, window, layout in keys:
        rs = sorted((r for r in records if (r["docs"], r["window"] or 0, r["layout"]) == (docs, window, layout)),
                    key=lambda r: r["P"])
        label = f"{layout}, {docs} docs" + (f", window {window}" if window else "")
        ax.plot([r["P"] for r in rs], [r["plan_ms"] for r in rs], marker="o", label=label)
    ax.axhline(50, color="gray", lw=0.8, ls="--")
    ax.set(xscale="log", yscale="log", xlabel="ring size P (S = 16k tokens x P)", ylabel="plan ms per rank per batch",
           title="ring planning time, one rank")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--P", type=int, nargs="+", default=None, help="ring sizes (default: 8..256)")
    parser.add_argument("--S", type=int, default=None, help="global length (default: 16384 x P)")
    parser.add_argument("--docs", type=int, nargs="+", default=None, help="packed documents per row")
    parser.add_argument("--layout", nargs="+", default=["zigzag"])
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=common.RESULTS)
    args = parser.parse_args(argv)
    single = args.P is not None and len(args.P) == 1 and args.S is not None
    sizes = args.P or [8, 16, 32, 64, 128, 256]
    docs = args.docs or ([1000] if single else [1, 1000, 10000])
    jsonl = None if single else common.fresh_file(args.out, "schedule.jsonl")
    records = []
    torch.set_num_threads(1)
    for layout in args.layout:
        for P in sizes:
            for d in docs:
                for window in ([args.window] if single or args.window else [None, 4096]):
                    if window is not None and d > 1:
                        continue  # the sweep's window rows are unpacked
                    records.append(measure(P, args.S or 16384 * P, d, layout, window, args.reps))
                    common.emit(records[-1], jsonl)
    if not single:
        plot(records, os.path.join(args.out, "schedule.png"))


if __name__ == "__main__":
    main()
