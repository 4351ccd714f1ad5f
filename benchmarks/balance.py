"""How even each layout spreads the attention work of packed rows over P ranks, on real
document-length mixes.

Rows of N tokens are packed from documents whose lengths are drawn (seeded) from the published
histograms in ``benchmarks/doc_lengths/`` (The Pile, ProLong 64K, ProLong 512K: each bucket
``[lo,hi)`` with its share of documents; a length uniform inside its bucket), the last document
of a row cut at N, documents apart as position ids restarting at 0. For each layout and P the
work of a rank is the visible query-key pairs of its queries under causal attention inside the
documents (``ringseq.attention.work``, what ``ringseq.stats`` reports); the slowest rank sets the
step, so the figure is the busiest rank's work over the mean, per row, averaged over ``--rows``
rows. No process group: the counts follow from the rows alone. Prints JSON lines, writes
``balance.jsonl`` and ``balance.png``. Usage::

    python benchmarks/balance.py                         # N = 32768; P = 2, 4, 8; 16 rows per mix
    python benchmarks/balance.py --N 131072 --sizes 4 --rows 4
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "doc_lengths")  # a copy of shared/data/doc_lengths
MIXES = ("pile", "prolong64k", "prolong512k")
LAYOUTS = ("zigzag", "contiguous", "striped")


def histogram(path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bucket lows, bucket highs, shares) of a ``{"[lo,hi)": share}`` file."""
    with open(path) as f:
        table = json.load(f)
    lows, highs, shares = [], [], []
    for bucket, share in table.items():
        lo, hi = (int(x) for x in re.fullmatch(r"\[(\d+),(\d+)\)", bucket.strip()).groups())
        lows.append(lo)
        highs.append(hi)
        shares.append(float(share))
    return torch.tensor(lows), torch.tensor(highs), torch.tensor(shares, dtype=torch.float64)


def packed_positions(N: int, hist, g: torch.Generator) -> torch.Tensor:
    """[N] position ids of one row packed from drawn documents (each >= 1 token)."""
    lows, highs, shares = hist
    pos, filled = [], 0
    while filled < N:
        b = int(torch.multinomial(shares, 1, generator=g))
        n = int(torch.randint(max(1, int(lows[b])), max(2, int(highs[b])), (1,), generator=g))
        n = min(n, N - filled)
        pos.append(torch.arange(n))
        filled += n
    return torch.cat(pos)


def measure(mix: str, N: int, P: int, layout: str, rows: int, seed: int) -> dict:
    from ringseq.attention.masks import TokenInfo, documents
    from ringseq.attention.work import per_rank

    hist = histogram(os.path.join(DATA, f"{mix}.json"))
    g = torch.Generator().manual_seed(seed)
    ratios, docs = [], []
    for _ in range(rows):
        pos = packed_positions(N, hist, g)[None]
        doc = documents(pos)
        docs.append(int(doc.max()) + 1)
        work = per_rank(TokenInfo(doc=doc), layout, N, P)
        ratios.append(max(work) / (sum(work) / P))
    return dict(mix=mix, N=N, P=P, layout=layout, rows=rows, max_over_mean=round(sum(ratios) / rows, 4),
                worst_row=round(max(ratios), 4), documents_per_row=round(sum(docs) / rows, 1))


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["P"] for r in records})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, P in zip(axes[0], sizes):
        for k, layout in enumerate(LAYOUTS):
            rows = [next(r for r in records if r["P"] == P and r["layout"] == layout and r["mix"] == m) for m in MIXES]
            ax.bar([i + 0.27 * (k - 1) for i in range(len(MIXES))], [r["max_over_mean"] for r in rows], 0.27,
                   label=layout)
        ax.axhline(1.05, color="grey", ls=":", label="5% over the mean")
        ax.set_xticks(range(len(MIXES)), MIXES)
        ax.set(ylabel="busiest rank's work / mean", title=f"P = {P}, N = {records[0]['N']}")
    common.save_figure(fig, axes[0], path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--N", type=int, default=32768)
    p.add_argument("--sizes", type=int, nargs="*", default=[2, 4, 8])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=common.RESULTS)
    args = p.parse_args(argv)
    jsonl = common.fresh_file(args.out, "balance.jsonl")
    records = []
    for mix in MIXES:
        for P in args.sizes:
            for layout in LAYOUTS:
                records.append(measure(mix, args.N, P, layout, args.rows, args.seed))
                common.emit(records[-1], jsonl)
    plot(records, os.path.join(args.out, "balance.png"))


if __name__ == "__main__":
    main()
