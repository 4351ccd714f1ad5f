"""How even each layout spreads the attention work of packed rows over P ranks, on real
document-length mixes.

Rows of N tokens are packed from documents whose lengths are drawn (seeded) from the published
histograms in ``benchmarks/doc_lengths/`` (The Pile, ProLong 64K, ProLong 512K: each bucket
``[lo,hi)`` with its share of documents; a length uniform inside its bucket), the last document
of a row cut at N, documents apart as position ids restarting at 0. For each layout and P the
work of a rank is the visible query-key pairs of its queries under causal attention inside the
documents (``ringseq.attention.work``, what ``ringseq.stats`` reports); the slowest rank sets the
step, so the figure is the busiest rank's work over the mean, per row, averaged over ``--rows``
rows. ``balanced`` is what ``shard_batch`` and a patched model do by default under the zigzag
layout (``ringseq.balance``: each row gets a layout of its own, by work); ``zigzag`` is plain
zigzag (``balance=False``). No process group: the counts follow from the rows alone. Prints JSON lines, writes
``balance.jsonl`` and ``balance.png``.

``--step-N N`` also times what the imbalance costs: a patched tiny Llama (2 layers, hidden 256,
4 heads of 64) takes a forward and backward step on the first packed row of N tokens of each mix,
under each of ``--step-layouts`` at each P (a fresh process tree each, one thread per rank;
median of ``--reps`` steps of the slowest rank), reported beside that row's work ratio and as a
ratio to zigzag's step (``step_over_zigzag``); written to ``balance_step.jsonl``. Usage::

    python benchmarks/balance.py                         # N = 32768; P = 2, 4, 8; 16 rows per mix
    python benchmarks/balance.py --N 131072 --sizes 4 --rows 4
    python benchmarks/balance.py --sizes 2 4 --step-N 8192 --reps 3
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "doc_lengths")  # a copy of shared/data/doc_lengths
MIXES = ("pile", "prolong64k", "prolong512k")
LAYOUTS = ("balanced", "zigzag", "contiguous", "striped")
"""``balanced``: what ``shard_batch`` does by default under zigzag (``ringseq.balance``: the
row's own layout, by work); ``zigzag``: plain zigzag (``shard_batch(..., balance=False)``)."""


def layout_of(layout: str, info, N: int, P: int):
    """The layout a row gets: ``balanced`` is the row's own (``ringseq.balance``)."""
    from ringseq.balance import balanced

    return balanced(info, N, P) if layout == "balanced" else layout


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
        info = TokenInfo(doc=doc)
        work = per_rank(info, layout_of(layout, info, N, P), N, P)
        ratios.append(max(work) / (sum(work) / P))
    return dict(mix=mix, N=N, P=P, layout=layout, rows=rows, max_over_mean=round(sum(ratios) / rows, 4),
                worst_row=round(max(ratios), 4), documents_per_row=round(sum(docs) / rows, 1))


def _step(mix: str, N: int, layout: str, reps: int, seed: int) -> dict:
    """In a process tree of P: a patched tiny Llama's step on the first packed row of ``mix``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import ringseq
    from ringseq.attention.masks import TokenInfo, documents
    from ringseq.attention.work import per_rank

    P = dist.get_world_size()
    pos = packed_positions(N, histogram(os.path.join(DATA, f"{mix}.json")), torch.Generator().manual_seed(seed))[None]
    info = TokenInfo(doc=documents(pos))
    work = per_rank(info, layout_of(layout, info, N, P), N, P)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=N, use_cache=False)
    sp = ringseq.init(sp_size=P, layout="zigzag" if layout == "balanced" else layout)
    model = ringseq.patch(LlamaForCausalLM(config), sp=sp)
    ids = torch.randint(0, 64, (1, N), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids, "position_ids": pos}

    def step():  # sharding included: the balanced layout is made per batch
        model.zero_grad(set_to_none=True)
        model(**ringseq.shard_batch(batch, sp=sp, balance=layout == "balanced")).loss.backward()

    step()  # warm
    return dict(mix=mix, N=N, P=P, layout=layout, step_ms=round(common.timed_ms(step, reps), 1),
                work_max_over_mean=round(max(work) / (sum(work) / P), 4))


def steps(args, path: str) -> list[dict]:
    records = []
    for mix in MIXES:
        for P in args.sizes:
            rows = [common.run_tree(_step, P, 1, mix, args.step_N, layout, args.reps, args.seed)
                    for layout in args.step_layouts]
            for r in rows:
                r["step_over_zigzag"] = round(r["step_ms"] / next(x["step_ms"] for x in rows
                                                                if x["layout"] == "zigzag"), 3)
                records.append(r)
                common.emit(r, path)
    return records


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["P"] for r in records})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, P in zip(axes[0], sizes):
        for k, layout in enumerate(LAYOUTS):
            rows = [next(r for r in records if r["P"] == P and r["layout"] == layout and r["mix"] == m) for m in MIXES]
            ax.bar([i + 0.2 * (k - 1.5) for i in range(len(MIXES))], [r["max_over_mean"] for r in rows], 0.2,
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
    p.add_argument("--step-N", type=int, default=None, help="also time a patched tiny Llama's step on rows of this N")
    p.add_argument("--step-layouts", nargs="*", default=["balanced", "zigzag", "striped"], choices=LAYOUTS)
    p.add_argument("--reps", type=int, default=3)
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
    if args.step_N:
        if "zigzag" not in args.step_layouts:
            p.error("--step-layouts needs zigzag (the steps are reported as ratios to it)")
        steps(args, common.fresh_file(args.out, "balance_step.jsonl"))


if __name__ == "__main__":
    main()
