"""``patch(fit=True)`` on batches whose length changes every step, beside the fixed switches a
user would set for the longest one.

Lengths: one document per batch (a padding-free collator's rows), drawn (seeded) from a published
histogram of ``benchmarks/doc_lengths/`` (``--mix``, default ProLong 64K): a bucket at or above
``--min-n`` by its share of documents, a length uniform inside it, capped at ``--max-n``. The
model: ``longest.py``'s (``--model``: its 47M "bench" Llama by default), fp32, at sp ``--P``
through ``ringseq.initialize`` (ZeRO-1, SGD), as ``longest.py``'s contenders. Systems, one fresh
process tree each, the same lengths in the same order after a warm-up step:

- ``fit``: ``patch(fit=True, memory_budget=--budget-mb)``;
- ``fixed``: the fastest set that fits the longest length (``--max-n``) in the budget, as the
  planner predicts it, on every step: what a user who sizes the switches for the worst batch sets
  by hand.

The budget (``--budget-mb``, default ``longest.py``'s 448) bounds each step's memory as
``longest.py`` measures it (the peak resident set of forward + backward above the set before it,
largest over ranks). Per step: the length, fit's choice, whether it re-planned,
measured and predicted step memory, seconds. Per system: tokens/s over the run, re-plans and
planning seconds (fit), the largest step memory over the budget, and the predicted cost of
planning by bucket (the chosen switches' predicted time at each length against the choice made at
that exact length). Prints JSON lines, writes ``fit_mixed.jsonl`` and ``fit_mixed.png``. Usage::

    python benchmarks/fit_mixed.py                     # 24 steps, 1024..16384 tokens, P = 2 (about 8 min here)
    python benchmarks/fit_mixed.py --model small --steps 8 --max-n 8192 --mix pile --budget-mb 96
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import balance  # noqa: E402
import common  # noqa: E402
import longest  # noqa: E402

MB = 2**20


def lengths(mix: str, steps: int, lo: int, hi: int, seed: int) -> list[int]:
    """``steps`` document lengths from the mix's histogram: buckets reaching ``lo`` or more, by share."""
    lows, highs, shares = balance.histogram(os.path.join(balance.DATA, f"{mix}.json"))
    keep = highs > lo
    lows, highs, shares = lows[keep], highs[keep], shares[keep]
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        b = int(torch.multinomial(shares, 1, generator=g))
        n = int(torch.randint(max(lo, int(lows[b])), max(lo + 1, int(highs[b])), (1,), generator=g))
        out.append(min(n, hi))
    return out


def setting(P: int):
    """What fit costs for these runs (``ringseq.initialize``'s ZeRO-1, this machine's preset)."""
    import contenders
    from ringseq.planner import fit, hardware, model_spec

    model = contenders.MODELS[os.environ.get("RINGSEQ_LONGEST_MODEL", "bench")]  # the trees' (imported afresh)
    return fit.Setting(spec=model_spec(model), hw=hardware("cpu"), zero_stage=1, ring=P, gpus=P, per_node=P)


def worst_case(P: int, max_n: int, budget_mb: float) -> tuple[tuple, object]:
    """(longest.py's feature names, the switches) of the fastest set that fits ``max_n``."""
    from ringseq.planner import fit

    best = fit.choose(setting(P), max_n, 1, budget_mb * MB)
    if best is None:
        raise SystemExit(f"no set fits --max-n {max_n}: {fit.refusal(setting(P), max_n, 1, budget_mb * MB)}")
    sw = best.switches
    names = tuple(n for n, on in (("loss", sw.chunked_loss), ("ckpt", sw.checkpointing and sw.keep_ring_outputs),
                                  ("replay", sw.checkpointing and not sw.keep_ring_outputs), ("tiled", sw.tiled_mlp),
                                  ("groups", sw.head_groups == "kv")) if on)
    return names, sw


def run(P: int, features: tuple, budget_mb: float, ns: list[int], fixed=None) -> list[dict]:
    """One process tree: a warm-up step, then a probe at each length (``longest.probe``);
    ``fixed``: the switches of the fixed system (its predicted step memory is recorded too)."""
    import contenders
    from ringseq.planner import fit

    dog = longest.Watchdog(budget_mb)
    dog.start()
    system = contenders.KINDS["ringseq"](P, features)
    system.forward_backward(min(ns))
    system.optimizer_step()
    out, replans = [], 0
    for i, N in enumerate(ns):
        got = longest.probe(system, N, dog)
        if "fit" in features:
            handle = system.engine.module._ringseq_patch
            exact = fit.choose(handle.fit.setting, N, 1, handle.fit.budget)
            got.update(replanned=got["replans"] > replans, planning_s=round(handle.fit.planning_s, 4),
                       exact_s=exact.predicted_step_s,
                       used_s=fit.cost(handle.fit.setting, fit.Switches(**got["switches"]), N, 1).predicted_step_s)
            replans = got["replans"]
        else:
            got["predicted_mb"] = round(fit.cost(setting(P), fixed, N, 1).predicted_peak_bytes / MB, 1)
        out.append(dict(step=i, N=N, **got))
    return out


def summary(name: str, rows: list[dict], budget_mb: float) -> dict:
    ran = [r for r in rows if r.get("step_mb") is not None]
    rec = dict(kind="summary", system=name, steps=len(rows), tokens=sum(r["N"] for r in ran),
               tokens_per_s=round(sum(r["N"] for r in ran) / sum(r["seconds"] for r in ran), 1),
               largest_step_over_budget=round(max(r["step_mb"] for r in ran) / budget_mb, 3),
               steps_over_budget=sum(r["step_mb"] > budget_mb for r in ran), refused=len(rows) - len(ran))
    if ran:
        rec["predicted_error"] = [round(min(r["predicted_mb"] / r["step_mb"] - 1 for r in ran), 3),
                                  round(max(r["predicted_mb"] / r["step_mb"] - 1 for r in ran), 3)]
    if rows and "replans" in rows[0]:
        seconds = sum(r["seconds"] for r in ran)
        rec.update(replans=rows[-1]["replans"], distinct_lengths=len({r["N"] for r in rows}),
                   planning_s=rows[-1]["planning_s"], planning_share=round(rows[-1]["planning_s"] / seconds, 6),
                   bucket_cost=round(sum(r["used_s"] for r in ran) / sum(r["exact_s"] for r in ran) - 1, 4),
                   choices=sorted({r["fit"] for r in ran}))
    return rec


def plot(records: list[dict], budget_mb: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for name in ("fit", "fixed"):
        rows = [r for r in records if r.get("system") == name and r["kind"] == "step" and r.get("step_mb")]
        axes[0].scatter([r["N"] for r in rows], [r["step_mb"] for r in rows], s=12, label=name)
        axes[1].scatter([r["N"] for r in rows], [r["N"] / r["seconds"] for r in rows], s=12, label=name)
    axes[0].axhline(budget_mb, color="k", lw=0.8, ls="--", label="budget")
    axes[0].set(xscale="log", xlabel="batch length N", ylabel="step MB per rank (forward + backward)",
                title="memory of each step")
    axes[1].set(xscale="log", xlabel="batch length N", ylabel="tokens/s", title="speed of each step")
    common.save_figure(fig, axes, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--P", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--min-n", type=int, default=1024)
    parser.add_argument("--max-n", type=int, default=16384)
    parser.add_argument("--mix", choices=balance.MIXES, default="prolong64k")
    parser.add_argument("--budget-mb", type=float, default=448.0, help="step memory per rank (longest.py's)")
    parser.add_argument("--model", choices=("bench", "small"), default="bench", help="longest.py's models")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=common.RESULTS)
    args = parser.parse_args(argv)
    os.environ["RINGSEQ_LONGEST_MODEL"] = args.model  # contenders.py reads it on import (here and in the trees)
    budget = args.budget_mb
    features, switches = worst_case(args.P, args.max_n, budget)
    os.environ["RINGSEQ_LONGEST_BUDGET_MB"] = str(budget)
    path = common.fresh_file(args.out, "fit_mixed.jsonl")
    ns = lengths(args.mix, args.steps, args.min_n, args.max_n, args.seed)
    common.emit(dict(kind="setup", P=args.P, mix=args.mix, budget_mb=budget, lengths=ns,
                     fixed=",".join(features)), path)
    records = []
    for name, feats in (("fit", ("fit",)), ("fixed", features)):
        started = time.perf_counter()
        rows = longest.tree(run, args.P, args.P, feats, budget, ns, None if name == "fit" else switches)
        if isinstance(rows, tuple):  # the watchdog ended the tree: a step went past twice the budget
            raise SystemExit(f"{name}: the watchdog ended the run at N = {rows[1]} (past twice the budget)")
        for r in rows:
            records.append(dict(kind="step", system=name, **r))
            common.emit(records[-1], path)
        records.append(dict(summary(name, rows, budget), wall_s=round(time.perf_counter() - started, 1)))
        common.emit(records[-1], path)
    fit_sum, fixed_sum = (r for r in records if r["kind"] == "summary")
    common.emit(dict(kind="ratio", fit_over_fixed_tokens_per_s=round(fit_sum["tokens_per_s"] /
                                                                      fixed_sum["tokens_per_s"], 3)), path)
    plot(records, budget, os.path.join(args.out, "fit_mixed.png"))
    print(f"wrote {path} and fit_mixed.png", file=sys.stderr)


if __name__ == "__main__":
    main()
