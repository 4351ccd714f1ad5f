"""Planner vs measurement: a tiny Llama's forward+backward on this machine at P = 1, 2, 4.

Each (N, P) runs in fresh process trees (one thread per rank, gloo), the model of
``model_memory.py`` (fp32, 4 layers, d=256) unpatched at P=1 and ``ringseq.patch``-ed over a
ring of P ranks otherwise. Measured: step time, the median over ``--rounds`` trees (the cases
interleaved, round after round) of each tree's median of ``--reps`` steps (slowest rank) after
two warm-up steps, with glibc's default allocator; and, in trees of their own, a step's memory:
its peak resident set above the resident set just before it, after a warm-up step (gradients,
activations, workspace; not the weights), the largest over ranks (``common.step_peak_mb``, what
``longest.py`` measures), with ``common.MMAP_THRESHOLD`` (freed tensors leave the resident set:
``peak_mb``, what the planner's tensor count is checked against) and with glibc's default
(``peak_mb_default_malloc``: what glibc's heap keeps on top). Next to each
measurement the record holds the inputs of ``ringseq.plan`` (preset "cpu", calibrated apart by
``planner_calibrate.py``) and its prediction; ``tests/unit/test_planner_measured.py`` recomputes
the predictions. Writes ``docs/planner_validation.jsonl``. Usage::

    flock /tmp/ringseq-cpu.lock python benchmarks/planner_validate.py
    flock /tmp/ringseq-cpu.lock python benchmarks/planner_validate.py --memory-only  # keep the times
    python benchmarks/planner_validate.py --repredict   # new predictions beside the stored measurements
    python benchmarks/planner_validate.py --tables      # the tables of docs/planner.md
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import contenders  # noqa: E402
import longest  # noqa: E402
import model_memory  # noqa: E402

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2)


def measure(N: int, reps: int) -> dict:
    """``reps`` > 0: the median step time (ms); 0: the step memory (MB, ``common.step_peak_mb``)."""
    import ringseq

    P = dist.get_world_size()
    model = model_memory.tiny_llama()
    if P > 1:
        ringseq.patch(model, sp=ringseq.init(sp_size=P))
    ids = torch.randint(0, CONFIG["vocab_size"], (1, N), generator=torch.Generator().manual_seed(1))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    if not reps:
        return dict(N=N, P=P, peak_mb=round(common.slowest(common.step_peak_mb(step)), 1))
    step()
    step()  # the allocator settles over the first steps
    ms = common.timed_ms(step, reps)
    return dict(N=N, P=P, step_ms=round(ms, 1))


def measure_memory(N: int, P: int, returned: bool = True) -> float:
    """A step's peak MB above the resident set before it (largest rank), in a tree of its own;
    ``returned``: with ``common.MMAP_THRESHOLD`` (else glibc's default)."""
    with common.freed_memory_returned() if returned else contextlib.nullcontext():
        return common.run_tree(measure, P, 1, N, 0)["peak_mb"]


def plan_inputs(N: int, P: int, chunked_loss: bool | None = None) -> dict:
    """The ``ringseq.plan`` keywords that describe the measured run (by default the unpatched
    model's full-logits loss at P = 1 and ringseq's chunked loss beyond)."""
    return dict(model=CONFIG, seq_len=N, gpus=P, gpus_per_node=P, hardware="cpu", zero_stage=0, optimizer=False,
                chunked_loss=P > 1 if chunked_loss is None else chunked_loss, layout="zigzag", ulysses_size=1)


def predict(inputs: dict) -> dict:
    """Predicted step time (ms) and memory above the weights (MB) for ``plan_inputs``."""
    import ringseq

    p = ringseq.plan(**inputs)
    parts = next(e for e in p.modes if e.ulysses == p.recommendation.ulysses).memory_gb
    return dict(step_ms=round(p.step_time_s * 1e3, 1),
                peak_mb=round((sum(parts.values()) - parts["weights"]) * 1024, 1))


def longest_inputs(system: str, N: int, switches: dict | None = None) -> dict | None:
    """The ``ringseq.plan`` keywords of one ``longest.py`` probe (its "bench" Llama, fp32, one SGD
    step), or None for what the planner does not cost: DeepSpeed ALST and ZeRO-3. ``fsdp2``: FSDP2 over
    every rank (``plan(zero_stage=3, fsdp=True)``). ``groups``: one ring per kv
    head; ``replay``: checkpointing that replays the ring (``keep_ring_outputs=False``). ringseq runs through
    ``ringseq.initialize`` with ZeRO-1 (so DeepSpeed's reduce bucket counts), the unpatched model
    without DeepSpeed; ``tiled`` is ``tiled_mlp=True``, one tile per hidden_size local tokens.
    ``fit`` (``patch(fit=True)``): the ``switches`` its probe recorded (None without them)."""
    from ringseq.patches.tiled_mlp import tiles_for

    kind, P, features = longest.parse_system(system)
    if kind == "alst" or ("fit" in features and switches is None) or "zero3" in features:
        return None  # DeepSpeed's ZeRO-3 buckets and prefetch are not costed (its step: docs/memory.md)
    if "fit" in features:
        features = tuple(name for name, on in (
            ("loss", switches["chunked_loss"]), ("ckpt", switches["checkpointing"] and switches["keep_ring_outputs"]),
            ("replay", switches["checkpointing"] and not switches["keep_ring_outputs"]),
            ("tiled", switches["tiled_mlp"]), ("groups", switches["head_groups"] == "kv")) if on)
    model = contenders.MODELS["bench"]
    tiles = tiles_for(True, N // P, model["hidden_size"]) if "tiled" in features else 1
    return dict(model=model, seq_len=N, gpus=P, gpus_per_node=P, hardware="cpu", fsdp="fsdp2" in features,
                zero_stage=0 if kind == "unpatched" else 3 if "fsdp2" in features else 1,
                optimizer=kind != "unpatched", chunked_loss="loss" in features,
                checkpointing="ckpt" in features or "replay" in features, keep_ring_outputs="replay" not in features,
                tiled_mlp=tiles if tiles > 1 else None, offload="offload" in features, layout="zigzag", ulysses_size=1,
                head_groups="kv" if "groups" in features else None)


def predict_step_mb(inputs: dict) -> float:
    """Predicted step memory (MB) for ``longest_inputs``: what a forward + backward adds to the
    state held between steps (the gradients, activations and workspace at the step's peak; not
    the weights or optimizer state)."""
    import ringseq

    p = ringseq.plan(**inputs)
    parts = next(e for e in p.modes if e.ulysses == p.recommendation.ulysses).memory_gb
    return round((parts["grads"] + parts["activations"] + parts["transient"]) * 1024, 1)


def longest_records(path: str) -> list[dict]:
    """Every probe of ``path`` (longest.jsonl) that the planner costs, with its prediction."""
    out = []
    with open(path) as f:
        for rec in map(json.loads, f):
            inputs = (longest_inputs(rec["system"], rec["N"], rec.get("switches"))
                      if rec["kind"] == "probe" and rec.get("step_mb") else None)
            if inputs is not None:
                pred = predict_step_mb(inputs)
                out.append(dict(system=rec["system"], P=rec["P"], N=rec["N"], measured_mb=rec["step_mb"],
                                predicted_mb=pred, error=round(pred / rec["step_mb"] - 1, 3)))
    return out


def predicted_longest(system: str, budget_mb: float, grain: int = 512, cap: int = 1 << 20) -> int | None:
    """The longest N on ``longest.py``'s grid whose predicted step memory fits ``budget_mb``
    (None: a system the planner does not cost)."""
    if longest_inputs(system, grain) is None:
        return None
    N = 0
    while N + grain <= cap and predict_step_mb(longest_inputs(system, N + grain)) <= budget_mb:
        N += grain
    return N


def longest_rows(path: str) -> list[dict]:
    """Each system's last searched longest N in ``path`` (longest.jsonl) beside the planner's, for
    the systems the planner costs; a capped search gives a lower bound (``capped``)."""
    with open(path) as f:
        found = {r["system"]: r for r in map(json.loads, f) if r["kind"] == "longest"}
    out = []
    for name, r in found.items():
        pred = predicted_longest(name, r["budget_mb"])
        if pred is not None:
            out.append(dict(system=name, P=r["P"], run=r.get("run"), measured_N=r["longest_N"], capped=r["capped"],
                            predicted_N=pred, error=round(pred / r["longest_N"] - 1, 3)))
    return out


def record(N: int, P: int, measured: dict) -> dict:
    """One line of the validation file: the measurement, the plan's inputs, prediction and error."""
    inputs = plan_inputs(N, P)
    pred = predict(inputs)
    return dict(N=N, P=P, measured=measured, predicted=pred,
                error=dict(step=round(pred["step_ms"] / measured["step_ms"] - 1, 3),
                           memory=round(pred["peak_mb"] / measured["peak_mb"] - 1, 3)), plan=inputs)


def model_memory_records(path: str) -> list[dict]:
    """Every record of ``path`` (model_memory.jsonl) with the planner's prediction: the unpatched
    model (full logits) and ringseq (chunked loss), the model and set-up of ``plan_inputs``."""
    out = []
    with open(path) as f:
        for rec in map(json.loads, f):
            pred = predict(plan_inputs(rec["N"], rec["P"], rec["system"] == "ringseq"))["peak_mb"]
            out.append(dict(rec, predicted_mb=pred, error=round(pred / rec["peak_mb"] - 1, 3)))
    return out


def tables(docs: str) -> str:
    """The markdown tables of docs/planner.md from the stored records, predictions recomputed."""
    with open(os.path.join(docs, "planner_validation.jsonl")) as f:
        val = [json.loads(line) for line in f]
    lines = ["| N | P | measured ms | predicted ms | error | measured MB | predicted MB | error | "
             "glibc default MB |", "|---|---|---|---|---|---|---|---|---|"]
    for rec in val:
        got, pred = rec["measured"], predict(rec["plan"])
        lines.append(f"| {rec['N']} | {rec['P']} | {got['step_ms']:.0f} | {pred['step_ms']:.0f} | "
                     f"{pred['step_ms'] / got['step_ms'] - 1:+.1%} | {got['peak_mb']:.0f} | {pred['peak_mb']:.0f} | "
                     f"{pred['peak_mb'] / got['peak_mb'] - 1:+.1%} | "
                     f"{got.get('peak_mb_default_malloc', float('nan')):.0f} |")
    lines += ["", "| N | system | P | measured MB | predicted MB | error |", "|---|---|---|---|---|---|"]
    for rec in model_memory_records(os.path.join(docs, "model_memory.jsonl")):
        lines.append(f"| {rec['N']} | {rec['system']} | {rec['P']} | {rec['peak_mb']:.0f} | "
                     f"{rec['predicted_mb']:.0f} | "
                     f"{rec['error']:+.1%} |")
    lines += ["", "| system | P | probes | N | step MB measured | predicted | error range |",
              "|---|---|---|---|---|---|---|"]
    recs = longest_records(os.path.join(docs, "longest.jsonl"))
    for name in dict.fromkeys(r["system"] for r in recs):
        rs = sorted((r for r in recs if r["system"] == name), key=lambda r: r["N"])
        lo, hi = min(r["error"] for r in rs), max(r["error"] for r in rs)
        lines.append(f"| {name} | {rs[0]['P']} | {len(rs)} | {rs[0]['N']}-{rs[-1]['N']} | "
                     f"{rs[0]['measured_mb']:.0f}-{rs[-1]['measured_mb']:.0f} | "
                     f"{rs[0]['predicted_mb']:.0f}-{rs[-1]['predicted_mb']:.0f} | {lo:+.1%} .. {hi:+.1%} |")
    lines += ["", "| system | P | run | longest N measured | predicted | error |", "|---|---|---|---|---|---|"]
    for r in longest_rows(os.path.join(docs, "longest.jsonl")):
        bound = ">= " if r["capped"] else ""
        lines.append(f"| {r['system']} | {r['P']} | {r['run']} | {bound}{r['measured_N']} | {r['predicted_N']} | "
                     f"{r['error']:+.1%}{' (a bound)' if r['capped'] else ''} |")
    return "\n".join(lines)


def memory_only(path: str) -> None:
    """Measure the step memory anew (both allocator settings) beside the stored times."""
    with open(path) as f:
        old = [json.loads(line) for line in f]
    for rec in old:
        got = rec["measured"]
        got["peak_mb"] = measure_memory(rec["N"], rec["P"])
        got["peak_mb_default_malloc"] = measure_memory(rec["N"], rec["P"], returned=False)
    with open(path, "w") as f:
        for rec in old:
            f.write(json.dumps(record(rec["N"], rec["P"], rec["measured"])) + "\n")


def repredict(path: str) -> None:
    """Recompute the predictions beside the stored measurements (after a change to the model)."""
    with open(path) as f:
        old = [json.loads(line) for line in f]
    with open(path, "w") as f:
        for rec in old:
            f.write(json.dumps(record(rec["N"], rec["P"], rec["measured"])) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--reps", type=int, default=5, help="timed steps per tree (their median)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timing trees per case, the cases interleaved (the median of the rounds)")
    parser.add_argument("--out", default=DOCS)
    parser.add_argument("--repredict", action="store_true", help="keep the measurements, recompute the predictions")
    parser.add_argument("--memory-only", action="store_true", help="keep the stored times, measure peak_mb anew")
    parser.add_argument("--tables", action="store_true", help="print the markdown tables of docs/planner.md")
    args = parser.parse_args(argv)
    stored = os.path.join(args.out, "planner_validation.jsonl")
    if args.repredict:
        return repredict(stored)
    if args.memory_only:
        return memory_only(stored)
    if args.tables:
        return print(tables(args.out))
    path = common.fresh_file(args.out, "planner_validation.jsonl")
    start = time.perf_counter()
    cases = [(N, P) for N in args.lengths for P in args.sizes]
    rounds = {case: [] for case in cases}
    for _ in range(args.rounds):  # a slow spell of this shared machine then spreads over the cases
        for N, P in cases:
            rounds[N, P].append(common.run_tree(measure, P, 1, N, args.reps)["step_ms"])
    for N, P in cases:
        measured = dict(step_ms=statistics.median(rounds[N, P]), step_ms_rounds=rounds[N, P],
                        peak_mb=measure_memory(N, P), peak_mb_default_malloc=measure_memory(N, P, returned=False))
        common.emit(record(N, P, measured), path)
    print(f"wrote {path} in {time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
