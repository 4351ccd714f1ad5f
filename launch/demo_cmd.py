"""``ringseq demo``: the main job. Two CPU processes (torchrun) fine-tune a tiny Llama to retrieve
a fact stored on the other rank's half of a long sequence, through the ring; beside it the same
model with attention cut at the middle stays at chance - the picture of why the ring exists. At
every step the unpatched model on the same weights must give the same loss as the ring. A short
report and a PNG show the loss curves and the retrieval accuracy over training."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from ringseq.config import RingSeqConfig

from .launch_cmd import command, environment
from .plan_cmd import tokens

AGREE = 1e-4  # largest relative difference between ring and unpatched loss on the same weights (fp32)


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run the demo: retrieval across ranks with the ring, and without it",
                       description="Two CPU processes (--nproc, torchrun) fine-tune a tiny random-init Llama to "
                                   "retrieve a fact stored on the other rank's half of each sequence, through the "
                                   "ring; beside it the same model with attention cut at the middle stays at "
                                   "chance. At every step the unpatched model on the same weights must give the "
                                   "ring's loss. The progress bar shows each model's loss (ring, cut), the ring "
                                   "model's retrieval accuracy at the last evaluation (acc) and the rank the ring "
                                   "waited for most since then (waited_for, from ringseq.stats: the straggler; rank "
                                   "0 also runs the unpatched model). Exit status 0 when the ring's loss equals the "
                                   "unpatched one.")
    p.add_argument("--steps", type=int, default=120, help="training steps of each model (default: %(default)s)")
    p.add_argument("--seq-len", type=tokens, default=1024,
                   help="tokens per sequence, split over the processes; K = 1024 (default: %(default)s)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default: %(default)s)")
    p.add_argument("--nproc", type=int, default=2,
                   help="processes, the ranks of the ring; the fact sits on rank 1's half only at 2 "
                        "(default: %(default)s)")
    p.add_argument("--out", default="ringseq-demo",
                   help="folder for ring.json and demo.png, under the current directory unless absolute; git "
                        "ignores it in ringseq's checkout (default: %(default)s)")
    p.set_defaults(run=run)


def plot(ring: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(ring["twin_losses"], label="unpatched, same weights", lw=3, alpha=0.45)
    left.plot(ring["losses"]["ring"], label=f"ringseq, {ring['ranks']} ranks", lw=1.2, ls="--")
    left.plot(ring["losses"]["cut"], label="attention cut at the middle", lw=1.2)
    left.set(xlabel="step", ylabel="answer loss", yscale="log", title="loss")
    right.plot(ring["eval_steps"], ring["accuracy"]["ring"], marker="o", label="ringseq (whole sequence)")
    right.plot(ring["eval_steps"], ring["accuracy"]["cut"], marker="o", label="attention cut at the middle")
    right.axhline(ring["chance"], color="gray", ls=":", label="chance")
    right.set(xlabel="step", ylabel="retrieval accuracy", ylim=(0, 1.05),
              title=f"the answer sits on the other rank ({ring['seq_len']} tokens)")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def report(ring: dict) -> tuple[str, bool]:
    losses = ring["losses"]["ring"]
    same = [_rel(a, b) for a, b in zip(losses, ring["twin_losses"])]
    agree = len(same) == len(losses) > 0 and max(same) <= AGREE
    n = len(losses)
    marks = sorted({0, 1, n // 4, n // 2, 3 * n // 4, n - 1})
    lines = ["", "ringseq demo report", "",
             f"  {'step':>5}  {'ring loss':>10}  {'unpatched':>10}  {'rel. diff':>9}  {'cut loss':>9}"]
    lines += [f"  {i:>5}  {losses[i]:>10.6f}  {ring['twin_losses'][i]:>10.6f}  {same[i]:>9.1e}  "
              f"{ring['losses']['cut'][i]:>9.4f}" for i in marks if i < n]
    acc, cut = ring["accuracy"]["ring"][-1], ring["accuracy"]["cut"][-1]
    lines += ["",
              f"  ring loss = unpatched loss on the same weights, every step: {'yes' if agree else 'NO'} "
              f"(largest relative difference {max(same):.1e}, limit {AGREE:g})",
              f"  retrieval accuracy after {n} steps: ring {acc:.0%}, attention cut at the middle {cut:.0%} "
              f"(chance {ring['chance']:.0%})",
              f"  answers by model.generate on held-out prompts: ring {ring['generate_accuracy']['ring']:.0%} "
              f"(the whole {ring['seq_len'] - 1}-token prompt, its cache split over {ring['ranks']} ranks), cut "
              f"{ring['generate_accuracy']['cut']:.0%} (the half after the middle)",
              f"  peak memory per rank (RSS): {', '.join(f'{m:.0f} MB' for m in ring['peak_rss_mb'])}",
              f"  throughput: {ring['tokens_per_s']:,.0f} tok/s over both models"]
    return "\n".join(lines), agree


def run(args) -> int:
    env = environment(RingSeqConfig(sp_size=args.nproc, layout="zigzag"))
    job = ["--steps", str(args.steps), "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--out", args.out]
    print(f"{args.nproc} processes, sequence parallel (torchrun): the ring model and the cut model\n"
          "bar: ring, cut = each model's answer loss; acc = the ring model's retrieval accuracy at the last "
          "evaluation; waited_for = the rank the ring waited for most since then (ringseq.stats)", flush=True)
    if subprocess.call(command("torchrun", args.nproc, "ringseq.launch.demo_job", job, module=True), env=env):
        print("ringseq demo: the sequence-parallel run failed", file=sys.stderr)
        return 1
    with open(os.path.join(args.out, "ring.json")) as f:
        ring = json.load(f)
    text, agree = report(ring)
    png = os.path.abspath(os.path.join(args.out, "demo.png"))
    plot(ring, png)
    print(text + f"\n  curves: {png}\n")
    return 0 if agree else 1
