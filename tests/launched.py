"""Tests that start their own processes: the real launchers (deepspeed, torchrun, accelerate
launch), the ringseq command, and the process-death and SIGSTOP cases. Everything else runs in
the warm pools of tests/conftest.py."""
import os
import subprocess
import sys
from pathlib import Path

from ringseq.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
DEEPSPEED = str(Path(sys.executable).with_name("deepspeed"))
# torchrun and accelerate launch give each rank one thread; deepspeed's launcher leaves torch's
# default (every core), so its ranks would oversubscribe this machine's cores
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def launched(cmd, expect, count, env=None, cwd=ROOT, returncode=0, timeout=900):
    """Run ``cmd``; it must exit with ``returncode`` and print ``expect`` ``count`` times."""
    run = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **ONE_THREAD, "PYTHONUNBUFFERED": "1", **(env or {})})
    out = run.stdout + run.stderr
    assert run.returncode == returncode, out[-5000:]
    assert out.count(expect) == count, out[-5000:]
    return out


def deepspeed(nproc, script, *args):
    return [DEEPSPEED, "--num_gpus", str(nproc), "--master_port", str(free_port()), str(script), *args]


def torchrun(nproc, script, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), str(script), *args]


def accelerate(nproc, script, *flags):
    return [sys.executable, "-m", "accelerate.commands.launch", *flags, "--num_processes", str(nproc),
            "--main_process_port", str(free_port()), str(script)]


def ringseq_cmd(*args, cwd=ROOT, timeout=600):
    return subprocess.run([sys.executable, "-m", "ringseq.launch.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
