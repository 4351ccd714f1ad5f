"""``ringseq check script.py``: does ringseq reproduce the unpatched model on your model and data?

    ringseq check --sp 2 [--steps 3] [--lr 1e-3] [--layout zigzag] my_model.py

``my_model.py`` defines ``make_model()`` (a transformers causal LM, small enough for one
process) and ``make_batches()`` (an iterable of full batches). ``--sp`` processes (torchrun)
run the patched model on each batch; rank 0 runs the unpatched model on the same weights in the
same dtype and in float64. For each step it prints the three losses and, per decoder layer and
top-level module, the gradient's relative error against float64 for ringseq and for the
unpatched model, then all take the same SGD step. Exit status 0 when ringseq's error is within
twice the unpatched model's own (plus two roundings of the float64 value) everywhere, 1 when
not: the rule of the tests (``ringseq.tolerance``; the loss against the unpatched model's mean
per-token error). The script is imported here first: one without ``make_model()`` or
``make_batches()``, or that fails to import, is refused in one line (exit status 2) before any
process starts.
"""
from __future__ import annotations

import os
import subprocess
import traceback

from ringseq.config import RingSeqConfig
from ringseq.errors import RingSeqError
from ringseq.layouts import LAYOUTS

from .check_job import load_script
from .launch_cmd import command, environment


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="compare loss and per-layer gradients with and without sequence parallelism",
                       description="Run a few steps of your model over --sp processes (torchrun) with ringseq, and on "
                                   "rank 0 without it in the same dtype and in float64, on the same weights and "
                                   "batches; print the losses and every layer's gradient error against float64. Exit "
                                   "status 0 when ringseq's error is within twice the unpatched model's own (plus two "
                                   "roundings) everywhere, 1 when not, 2 when the script or the settings are refused "
                                   "(checked here, before any process starts).")
    p.add_argument("--sp", type=int, default=2,
                   help="ranks that split each sequence: the processes started (default: %(default)s)")
    p.add_argument("--ulysses", type=int, default=1,
                   help="Ulysses degree inside the sequence group; divides --sp (default: %(default)s)")
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag",
                   help="how a sequence is split over the ring (default: %(default)s)")
    p.add_argument("--steps", type=int, default=3,
                   help="batches to check, an SGD step after each (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3,
                   help="SGD learning rate between the checked steps (default: %(default)s)")
    p.add_argument("--out", default=None, help="also write the results as JSON to this file (default: not written)")
    p.add_argument("script", help="a Python file defining make_model() and make_batches()")
    p.set_defaults(run=run)


def check_script(path: str) -> None:
    """Import the user's script here, as every rank will, and require ``make_model`` and
    ``make_batches``: a bad script is refused in one line before any process starts."""
    if not os.path.isfile(path):
        raise RingSeqError(f"{path} is not a file: give a Python file defining make_model() and make_batches()")
    try:
        load_script(path)
    except RingSeqError:
        raise
    except Exception as err:  # the script's own error, reported in one line with its place in the script
        lines = [frame.lineno for frame in traceback.extract_tb(err.__traceback__)
                 if os.path.abspath(frame.filename) == os.path.abspath(path)]
        where = f" (line {lines[-1]})" if lines else ""
        raise RingSeqError(f"importing {path} raised {type(err).__name__}{where}: {err}") from err


def run(args) -> int:
    config = RingSeqConfig(sp_size=args.sp, ulysses_size=args.ulysses, layout=args.layout)
    check_script(args.script)
    job = ["--steps", str(args.steps), "--lr", str(args.lr)] + (["--out", args.out] if args.out else [])
    cmd = command("torchrun", args.sp, "ringseq.launch.check_job", [os.path.abspath(args.script), *job], module=True)
    return subprocess.call(cmd, env=environment(config))
