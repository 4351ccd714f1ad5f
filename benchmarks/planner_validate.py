"""Planner vs measurement: a tiny Llama's forward+backward on this machine at P = 1, 2, 4.

Each (N, P) runs in a fresh process tree (one thread per rank, gloo), the model of
``model_memory.py`` (fp32, 4 layers, d=256) unpatched at P=1 and ``ringseq.patch``-ed over a
ring of P ranks otherwise. Measured: the first step's peak resident memory above the baseline
after the model was built (gradients, activations, workspace; not the weights), and the median
of 3 later steps' time (slowest rank), after a second warm-up step. Next to each measurement the
record holds the inputs of ``ringseq.plan`` (preset "cpu", calibrated apart by
``planner_calibrate.py``) and its prediction; ``tests/unit/test_planner_measured.py`` recomputes the predictions. Writes
``docs/planner_validation.jsonl``. Usage::

    flock /tmp/ringseq-cpu.lock python benchmarks/planner_validate.py
    python benchmarks/planner_validate.py --repredict   # new predictions beside the stored measurements
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import model_memory  # noqa: E402

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2)


def measure(N: int, reps: int) -> dict:
    import ringseq

    P = dist.get_world_size()
    model = model_memory.tiny_llama()
    if P > 1:
        ringseq.patch(model, sp=ringseq.init(sp_size=P))
    ids = torch.randint(0, CONFIG["vocab_size"], (1, N), generator=torch.Generator().manual_seed(1))
    base = common.rss_mb()

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    peak = common.slowest(common.peak_rss_mb() - base)
    step()  # the allocator settles over the first steps
    ms = common.timed_ms(step, reps)
    return dict(N=N, P=P, peak_mb=round(peak, 1), step_ms=round(ms, 1))


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


def record(N: int, P: int, measured: dict) -> dict:
    """One line of the validation file: the measurement, the plan's inputs, prediction and error."""
    inputs = plan_inputs(N, P)
    pred = predict(inputs)
    return dict(N=N, P=P, measured=measured, predicted=pred,
                error=dict(step=round(pred["step_ms"] / measured["step_ms"] - 1, 3),
                           memory=round(pred["peak_mb"] / measured["peak_mb"] - 1, 3)), plan=inputs)


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
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=DOCS)
    parser.add_argument("--repredict", action="store_true", help="keep the measurements, recompute the predictions")
    args = parser.parse_args(argv)
    if args.repredict:
        return repredict(os.path.join(args.out, "planner_validation.jsonl"))
    path = common.fresh_file(args.out, "planner_validation.jsonl")
    start = time.perf_counter()
    for N in args.lengths:
        for P in args.sizes:
            got = common.run_tree(measure, P, 1, N, args.reps)
            common.emit(record(N, P, dict(step_ms=got["step_ms"], peak_mb=got["peak_mb"])), path)
    print(f"wrote {path} in {time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
