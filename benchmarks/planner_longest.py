"""The longest sequence the planner predicts for Llama-3 8B and 70B on H100s, switch by switch, beside the
published figures (predictions: no GPU has measured them; pure Python, a second).

For each model and cluster (one GPU, one node of 8, four nodes) and each set of ringseq's switches, all under
DeepSpeed ZeRO-3 and the chunked loss, ``ringseq.planner.longest`` finds the longest sequence whose best
ring x Ulysses shape fits an H100's 80 GiB and whose offloaded state fits the node's host memory (the preset's:
80% of a DGX H100's 2 TB):

``checkpointing``     gradient checkpointing that keeps the ring outputs (``patch(checkpointing=True)``'s default);
``+ replay, tiles``   the recompute replays the ring (``keep_ring_outputs=False``) and the MLP runs in 64 tiles;
``+ optimizer off``   DeepSpeed's optimizer (and ZeRO-3 weight) offload;
``+ activations off`` the kept tensors in host memory too (``offload_activations``), bounded by the host.

Published, Llama-3.1-8B on H100 80GB: DeepSpeed ALST 500K tokens on one GPU, 3.7M on one node, 15M on four
(arXiv 2506.13996); UPipe 5M on one node (arXiv 2602.21196). No figure of the same kind was found for 70B.

Writes ``docs/planner_longest.jsonl`` and ``docs/planner_longest.png``. Usage::

    python benchmarks/planner_longest.py
"""
from __future__ import annotations

import argparse
import json
import os

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
MODELS = {
    "Llama-3-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256),
    "Llama-3-70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=128256),
}
CLUSTERS = (1, 8, 32)
SWITCHES = {
    "checkpointing": dict(checkpointing=True),
    "+ replay, tiles": dict(checkpointing=True, keep_ring_outputs=False, tiled_mlp=64),
    "+ optimizer off": dict(checkpointing=True, keep_ring_outputs=False, tiled_mlp=64, offload=True),
    "+ activations off": dict(checkpointing=True, keep_ring_outputs=False, tiled_mlp=64, offload=True,
                              offload_activations=True),
}
PUBLISHED = {("Llama-3-8B", 1): {"ALST": 500_000}, ("Llama-3-8B", 8): {"ALST": 3_700_000, "UPipe": 5_000_000},
             ("Llama-3-8B", 32): {"ALST": 15_000_000}}


def records(hardware: str = "h100") -> list[dict]:
    from ringseq.planner import longest

    out = []
    for name, config in MODELS.items():
        for gpus in CLUSTERS:
            for label, switches in SWITCHES.items():
                p = longest(model=config, gpus=gpus, gpus_per_node=8, hardware=hardware, zero_stage=3, **switches)
                row = dict(model=name, gpus=gpus, switches=label, hardware=hardware, predicted=True,
                           longest_tokens=round(p.tokens_per_rank * p.sp_size) if p else 0)
                if p:
                    row.update(shape=p.recommendation.mode, gib_per_rank=round(p.memory_per_rank_gb, 1),
                               host_gib_per_node=round(p.host_memory_per_node_gb), host_limit_gib=p.host_limit_gb,
                               step_s=round(p.step_time_s, 1))
                row["published"] = PUBLISHED.get((name, gpus), {})
                out.append(row)
    return out


def table(rows: list[dict]) -> str:
    """docs/planner.md's table: one line per model and cluster, a column per switch set, the best of them (offloading
    the kept tensors shortens the sequence where the optimizer's state has filled the host already), the published
    beside."""
    labels = list(SWITCHES)
    lines = ["| model | H100s | " + " | ".join(labels) + " | best | published |", "|---" * (len(labels) + 4) + "|"]
    for name in MODELS:
        for gpus in CLUSTERS:
            got = {r["switches"]: r for r in rows if r["model"] == name and r["gpus"] == gpus}
            cells = [f"{got[k]['longest_tokens'] / 1e6:.2f}M" if got[k]["longest_tokens"] else "none fits"
                     for k in labels]
            best = max(got.values(), key=lambda r: r["longest_tokens"])
            cells.append(f"**{best['longest_tokens'] / 1e6:.2f}M** ({best['switches']})" if best["longest_tokens"]
                         else "none fits")
            pub = ", ".join(f"{k} {v / 1e6:g}M" for k, v in PUBLISHED.get((name, gpus), {}).items()) or "-"
            lines.append(f"| {name} | {gpus} | " + " | ".join(cells) + f" | {pub} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS), figsize=(12, 4.2), sharey=False)
    width = 0.8 / len(SWITCHES)
    for ax, name in zip(axes, MODELS):
        for i, label in enumerate(SWITCHES):
            ys = [next(r["longest_tokens"] for r in rows if r["model"] == name and r["gpus"] == g and
                       r["switches"] == label) / 1e6 for g in CLUSTERS]
            ax.bar([c + (i - len(SWITCHES) / 2 + 0.5) * width for c in range(len(CLUSTERS))], ys, width, label=label)
        for c, gpus in enumerate(CLUSTERS):
            for k, (who, v) in enumerate(PUBLISHED.get((name, gpus), {}).items()):
                ax.hlines(v / 1e6, c - 0.42, c + 0.42, colors="k", linestyles=("--", ":")[k])
                ax.annotate(f"{who} {v / 1e6:g}M", (c + 0.42, v / 1e6), fontsize=7, ha="right", va="bottom")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(range(len(CLUSTERS)), [f"{g} x H100" for g in CLUSTERS])
        ax.set_title(f"{name}, ZeRO-3: predicted longest sequence")
        ax.set_ylabel("million tokens")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hardware", default="h100")
    p.add_argument("--out", default=DOCS, help="folder for the JSON lines and the figure (default: docs/)")
    args = p.parse_args(argv)
    rows = records(args.hardware)
    with open(os.path.join(args.out, "planner_longest.jsonl"), "w") as f:
        for r in rows:
            print(json.dumps(r))
            f.write(json.dumps(r) + "\n")
    print(table(rows))
    plot(rows, os.path.join(args.out, "planner_longest.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
