"""Figures of docs/planner.md from the planner and its simulator (no process group, ~1 min).

``efficiency``  ring attention's efficiency (ideal / predicted, one Llama-3-8B layer, zigzag,
                forward+backward, H100 preset) against tokens per device, for a ring of 8 over
                NVLink and a ring of 64 whose steps cross InfiniBand.
``stragglers``  the cost of one rank computing 10% slower or 1 ms longer per ring step, against
                ring length P (8 .. 100,000),
                for a 1-D ring, Ulysses 8 x ring P/8 and a ring of rings (8 inside x P/8 across).
``seed``        at 100,000 ranks: one layer (forward+backward ring) and one training step of the
                three arrangements, and what one rank throttled by 1 ms, 10 ms (per ring step) or
                10% costs each, at 4096 and 8192 tokens per rank.

Writes ``docs/planner_efficiency.png``, ``docs/planner_stragglers.png`` and
``docs/planner_figures.jsonl``. Usage::

    python benchmarks/planner_plots.py
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np


DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
PER_NODE = 8


def efficiency_records():
    from ringseq.planner import hardware, model_spec
    from ringseq.planner.cost import overlap_block, ring_layer

    m, hw = model_spec(LLAMA3_8B), hardware("h100")
    out = []
    for link, R, inter in (("NVLink", 8, False), ("InfiniBand", 64, True)):
        threshold = overlap_block(hw, m.H, m.K, m.D, share=0.5, inter=inter, training=True)
        for tokens in 2 ** np.arange(9, 19):
            r = ring_layer(m, hw, int(tokens) * R, R, 1, training=True, inter=inter)
            out.append(dict(figure="efficiency", link=link, ring=R, tokens_per_device=int(tokens),
                            efficiency=round(r.ideal_s / r.time_s, 4), overlap_tokens=round(threshold)))
    return out


def arrangements(m, hw, S, P):
    """(name, simulator arrangement, rows, cols, forward Costs, backward Costs) at P ranks."""
    from ringseq.planner.scenario import ring_costs

    rows = P // PER_NODE
    return [("1-D ring", "ring", rows, PER_NODE, ring_costs(m, hw, S, P), ring_costs(m, hw, S, P, backward=True)),
            ("Ulysses 8 x ring", "ulysses", rows, PER_NODE, ring_costs(m, hw, S, rows, PER_NODE),
             ring_costs(m, hw, S, rows, PER_NODE, backward=True)),
            ("ring of rings 8 x", "ring2d", rows, PER_NODE, ring_costs(m, hw, S, P),
             ring_costs(m, hw, S, P, backward=True))]


def layer_time(arrangement, rows, cols, fwd, bwd, factor=None, extra=None):
    """One layer's forward and backward ring passes, back to back (seconds, and sim seconds)."""
    from ringseq.planner.simulate import simulate

    a = simulate(arrangement, rows, cols, fwd, factor=factor, extra=extra)
    b = simulate(arrangement, rows, cols, bwd, factor=factor, extra=extra)
    return a.makespan + b.makespan, a.seconds + b.seconds, a.finish + b.finish


def straggler_records(tokens_per_rank: int):
    from ringseq.planner import hardware, model_spec
    from ringseq.planner.simulate import slowdowns

    m, hw = model_spec(LLAMA3_8B), hardware("h100")
    out = []
    for P in (8, 64, 512, 4096, 32768, 100_000):
        for name, arr, rows, cols, fwd, bwd in arrangements(m, hw, tokens_per_rank * P, P):
            base, _, _ = layer_time(arr, rows, cols, fwd, bwd)
            rec = dict(figure="stragglers", P=P, arrangement=name, layer_s=round(base, 6))
            for label, kw in (("10%", dict(slow_factor=1.1)), ("1ms", dict(slow_extra_s=1e-3))):
                f, e = slowdowns(rows, cols, slow_rank=rows * cols // 2, **kw)
                slow, _, _ = layer_time(arr, rows, cols, fwd, bwd, f, e)
                rec[f"slow_cost_{label}"] = round(slow / base - 1, 4)
            out.append(rec)
    return out


def seed_records(tokens_per_rank: int, P: int = 100_000):
    """The seed's questions at P ranks: layer and step time, and the cost of one throttled rank."""
    from ringseq.planner import hardware, model_spec
    from ringseq.planner.cost import dense_layer, head
    from ringseq.planner.features import Features
    from ringseq.planner.simulate import slowdowns

    m, hw = model_spec(LLAMA3_8B), hardware("h100")
    S = tokens_per_rank * P
    f = Features(checkpointing=True)
    dense = m.L * dense_layer(m, hw, tokens_per_rank, f) + head(m, hw, tokens_per_rank, f)
    out = []
    for name, arr, rows, cols, fwd, bwd in arrangements(m, hw, S, P):
        base, secs, finish = layer_time(arr, rows, cols, fwd, bwd)
        rec = dict(figure="seed", P=P, arrangement=name, shape=f"{rows} x {cols}", tokens_per_rank=tokens_per_rank,
                   tokens=S, ring_step_ms=round(fwd.compute * 1e3, 3), layer_s=round(base, 3),
                   step_s=round(m.L * base + dense, 1),
                   rank_finish_ms={k: round(float(v) * 1e3, 3) for k, v in
                                   zip(("p1", "p50", "p99"), np.percentile(finish, [1, 50, 99]))},
                   simulated_in_s=round(secs, 2))
        for label, kw in (("1ms", dict(slow_extra_s=1e-3)), ("10ms", dict(slow_extra_s=1e-2)),
                          ("10%", dict(slow_factor=1.1))):
            fac, ext = slowdowns(rows, cols, slow_rank=P // 2, **kw)
            slow, _, _ = layer_time(arr, rows, cols, fwd, bwd, fac, ext)
            rec[f"step_s_{label}"] = round(m.L * slow + dense, 1)
            rec[f"cost_{label}"] = round((m.L * slow + dense) / (m.L * base + dense) - 1, 4)
        out.append(rec)
    return out


def plot_efficiency(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for link in ("NVLink", "InfiniBand"):
        rs = [r for r in records if r["link"] == link]
        line, = ax.plot([r["tokens_per_device"] for r in rs], [r["efficiency"] for r in rs], marker="o",
                        label=f"{link} (ring of {rs[0]['ring']})")
        ax.axvline(rs[0]["overlap_tokens"], color=line.get_color(), ls="--", lw=0.8)
    ax.set(xscale="log", xlabel="tokens per device", ylabel="ring attention efficiency (ideal / predicted)",
           title="Llama-3-8B layer, zigzag, fwd+bwd, H100 preset", ylim=(0, 1.05))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_stragglers(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name in dict.fromkeys(r["arrangement"] for r in records):
        rs = [r for r in records if r["arrangement"] == name]
        line, = ax.plot([r["P"] for r in rs], [100 * r["slow_cost_10%"] for r in rs], marker="o",
                        label=f"{name}: one rank 10% slower")
        ax.plot([r["P"] for r in rs], [100 * r["slow_cost_1ms"] for r in rs], marker="s", ls="--",
                color=line.get_color(), label=f"{name}: one rank +1 ms per ring step")
    ax.set(xscale="log", yscale="log", xlabel="ranks P", ylabel="ring attention slowdown of the layer (%)",
           title="one slow rank vs ring length (Llama-3-8B, 8k tokens/rank, H100)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens-per-rank", type=int, default=8192)
    parser.add_argument("--out", default=DOCS)
    args = parser.parse_args(argv)
    path = os.path.join(args.out, "planner_figures.jsonl")
    eff = efficiency_records()
    strag = straggler_records(args.tokens_per_rank)
    seed = [r for tokens in (4096, args.tokens_per_rank) for r in seed_records(tokens)]
    with open(path, "w") as f:
        for rec in eff + strag + seed:
            f.write(json.dumps(rec) + "\n")
            print(json.dumps(rec))
    plot_efficiency(eff, os.path.join(args.out, "planner_efficiency.png"))
    plot_stragglers(strag, os.path.join(args.out, "planner_stragglers.png"))


if __name__ == "__main__":
    main()
