"""Per-rank activation memory of a patched tiny Llama as the sequence grows: does it fall as 1/P?

For each length N and ring size P, a fresh process tree runs forward+backward steps of the same
random-init model on the same batch and reports each rank's step memory: the peak resident set
of a step above the resident set just before it, after a warm-up step (``common.step_peak_mb``,
as ``longest.py`` measures; the weights, identical everywhere, are not counted).
Like is compared with like: P=1 is ringseq at sp 1 (the same chunked loss and code path as at
P > 1), and ``scaling_efficiency`` = peak(N, 1) / (P x peak(N, P)) (1.0: memory falls exactly as
1/P). The unpatched model in one process (transformers' full-logits loss) is reported beside it
as ``system: unpatched``. Prints one JSON line per (N, system, P) with ``peak_mb`` (largest rank)
and ``loss``, and draws ``benchmarks/results/model_memory.png``. The trees run with
``common.MMAP_THRESHOLD`` (freed tensors leave the resident set, as ``longest.py`` measures;
``--default-malloc``: glibc's default, whose heap keeps some of them). Usage::

    python benchmarks/model_memory.py
    python benchmarks/model_memory.py --lengths 4096 8192 --sizes 1 2
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1 << 17,
                         use_cache=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def measure(N: int, patched: bool = True) -> dict:
    import ringseq

    P = dist.get_world_size()
    model = tiny_llama()
    if patched:
        ringseq.patch(model, sp=ringseq.init(sp_size=P))
    ids = torch.randint(0, 2048, (1, N), generator=torch.Generator().manual_seed(1))
    losses = []

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())

    peak = common.slowest(common.step_peak_mb(step))
    return dict(N=N, P=P, system="ringseq" if patched else "unpatched", peak_mb=round(peak, 1),
                loss=round(losses[-1], 6))


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for system, P in sorted({(r["system"], r["P"]) for r in records}, key=lambda k: (k[0] != "unpatched", k[1])):
        rs = sorted((r for r in records if r["P"] == P and r["system"] == system), key=lambda r: r["N"])
        ax.plot([r["N"] for r in rs], [r["peak_mb"] for r in rs], marker="o", ls="--" if system == "unpatched" else "-",
                label=f"{system} P={P}")
    ax.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel="peak activation MB per rank",
           title="tiny Llama (4 layers, d=256), forward+backward")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", default=common.RESULTS)
    parser.add_argument("--default-malloc", action="store_true",
                        help="glibc's default allocator (freed tensors may stay resident) instead of MMAP_THRESHOLD")
    args = parser.parse_args(argv)
    if not args.default_malloc:  # inherited by the process trees: freed tensors leave the resident set
        os.environ["MALLOC_MMAP_THRESHOLD_"] = common.MMAP_THRESHOLD
    jsonl = common.fresh_file(args.out, "model_memory.jsonl")
    records = []
    for N in args.lengths:
        rec = common.run_tree(measure, 1, 1, N, False)
        records.append(rec)
        common.emit(rec, jsonl)
        single = None
        for P in args.sizes:
            rec = common.run_tree(measure, P, 1, N)
            single = rec["peak_mb"] if P == 1 else single
            rec["scaling_efficiency"] = round(single / (P * rec["peak_mb"]), 3) if single else None
            records.append(rec)
            common.emit(rec, jsonl)
    plot(records, os.path.join(args.out, "model_memory.png"))
    print(f"wrote {jsonl} and model_memory.png", file=sys.stderr)


if __name__ == "__main__":
    main()
