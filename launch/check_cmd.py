"""``ringseq check script.py``: does ringseq reproduce the unpatched model on your model and data?

    ringseq check --sp 2 [--steps 3] [--lr 1e-3] [--layout zigzag] my_model.py

``my_model.py`` defines ``make_model()`` (a transformers causal LM, small enough for one
process) and ``make_batches()`` (an iterable of full batches). ``--sp`` processes (torchrun)
run the patched model on each batch; rank 0 runs the unpatched model on the same weights in the
same dtype and in float64. For each step it prints the three losses and, per decoder layer and
top-level module, the gradient's relative error against float64 for ringseq and for the
unpatched model, then all take the same SGD step. Exit status 0 when ringseq's error is within
twice the unpatched model's own (plus a floor) everywhere, 1 when not.
"""
from __future__ import annotations

import os
import subprocess

from ringseq.config import RingSeqConfig
from ringseq.errors import RingSeqError

from .launch_cmd import command, environment


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="compare loss and per-layer gradients with and without sequence parallelism")
    p.add_argument("--sp", type=int, default=2, help="ranks that split each sequence (processes started)")
    p.add_argument("--ulysses", type=int, default=1)
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--steps", type=int, default=3, help="batches to check (an SGD step after each)")
    p.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate between the checked steps")
    p.add_argument("--out", default=None, help="also write the results as JSON to this file")
    p.add_argument("script", help="a Python file defining make_model() and make_batches()")
    p.set_defaults(run=run)


def run(args) -> int:
    if not os.path.isfile(args.script):
        raise RingSeqError(f"{args.script} is not a file")
    config = RingSeqConfig(sp_size=args.sp, ulysses_size=args.ulysses, layout=args.layout)
    job = ["--steps", str(args.steps), "--lr", str(args.lr)] + (["--out", args.out] if args.out else [])
    cmd = command("torchrun", args.sp, "ringseq.launch.check_job", [os.path.abspath(args.script), *job], module=True)
    return subprocess.call(cmd, env=environment(config))
