"""``ringseq launch``: start a script under a real launcher with ringseq's settings.

    ringseq launch --sp 2 --nproc 2 [--launcher torchrun|deepspeed|accelerate] script.py [args...]

It builds the launcher's own command line (torchrun, ``deepspeed``, ``accelerate launch``) on
a free port, exports ``RINGSEQ_SP_SIZE``/``RINGSEQ_ULYSSES_SIZE``/``RINGSEQ_LAYOUT`` (read by
``ringseq.config.from_env`` in the script), and runs it; the exit status is the launcher's.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from ringseq.config import ENV, RingSeqConfig
from ringseq.layouts import LAYOUTS
from ringseq.processes import free_port

LAUNCHERS = ("torchrun", "deepspeed", "accelerate")


def add_parser(sub) -> None:
    p = sub.add_parser("launch", help="run a training script under torchrun, deepspeed or accelerate",
                       description="Start a script under a real launcher on this machine, on a free port, with "
                                   "RINGSEQ_SP_SIZE, RINGSEQ_ULYSSES_SIZE and RINGSEQ_LAYOUT set (read by "
                                   "ringseq.init(config=ringseq.config.from_env()) in the script). The exit status "
                                   "is the launcher's.")
    p.add_argument("--sp", type=int, default=None, help="sequence-parallel size (default: --nproc)")
    p.add_argument("--ulysses", type=int, default=1,
                   help="Ulysses degree inside each sequence group (default: %(default)s)")
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag",
                   help="how a sequence is split over the ring (default: %(default)s)")
    p.add_argument("--nproc", type=int, default=2, help="processes on this machine (default: %(default)s)")
    p.add_argument("--launcher", choices=LAUNCHERS, default="torchrun", help="the launcher (default: %(default)s)")
    p.add_argument("-m", "--module", action="store_true",
                   help="the target is a module, not a script (default: a script)")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("args", nargs="...", help="arguments for the script")
    p.set_defaults(run=run)


def command(launcher: str, nproc: int, script: str, args: list[str], module: bool = False,
            port: int | None = None) -> list[str]:
    """The real launcher's command line."""
    port = port or free_port()
    if launcher == "torchrun":
        target = ["-m", script] if module else [script]
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_addr", "127.0.0.1", "--master_port", str(port), *target, *args]
    if launcher == "deepspeed":
        beside = Path(sys.executable).with_name("deepspeed")  # the venv's, even when it is not on PATH
        exe = str(beside) if beside.exists() else shutil.which("deepspeed") or "deepspeed"
        target = ["--module", script] if module else [script]
        return [exe, "--num_gpus", str(nproc), "--master_port", str(port), *target, *args]
    target = ["-m", script] if module else [script]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
            "--main_process_port", str(port), *target, *args]


def environment(config: RingSeqConfig) -> dict:
    env = dict(os.environ)
    env.update({ENV["sp_size"]: str(config.sp_size), ENV["ulysses_size"]: str(config.ulysses_size),
                ENV["layout"]: config.layout})
    return env


def run(args) -> int:
    config = RingSeqConfig(sp_size=args.sp or args.nproc, ulysses_size=args.ulysses, layout=args.layout)
    config.check_world(args.nproc)
    cmd = command(args.launcher, args.nproc, args.script, args.args, module=args.module)
    print("ringseq launch:", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.call(cmd, env=environment(config))
