"""Shared parts of the benchmarks: process trees, timing, memory, deterministic inputs.

Each measurement runs in a fresh tree of processes (spawned, gloo on a free port), so one
implementation's allocator state never leaks into another's. Times are the median over
repetitions of the slowest rank's time; memory is each rank's peak resident set above its
resident set before inputs were made (so it counts inputs, outputs, gradients and workspace).
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist

from ringseq import processes, reference

BLOCK = 256  # inputs are generated in blocks of this many tokens, each from its own seed
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def fresh_file(out_dir: str, name: str) -> str:
    """``out_dir/name``, with the folder made and an earlier file of that name removed."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    if os.path.exists(path):
        os.remove(path)
    return path


def run_tree(fn, nprocs: int, threads: int, *args, timeout: float = 3600.0):
    """Run ``fn(*args)`` in ``nprocs`` fresh processes of ``threads`` threads each; return
    rank 0's result (every rank's failure is raised): ``ringseq.processes.run_tree``."""
    return processes.run_tree(fn, nprocs, *args, threads=threads, timeout=timeout)


MMAP_THRESHOLD = "65536"
"""glibc's MALLOC_MMAP_THRESHOLD_ for memory measurements: every allocation of 64 KiB or more gets
pages of its own, returned when the tensor is freed, so the resident set follows the live tensors
(glibc's default, a threshold that rises up to 32 MiB as large blocks are freed, keeps freed
tensors in its heap instead)."""


def return_freed_memory() -> None:
    """This process from now on as under ``MMAP_THRESHOLD`` (glibc's ``mallopt(M_MMAP_THRESHOLD)``): for a
    measurement in a process already started."""
    M_MMAP_THRESHOLD = -3
    if not ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, int(MMAP_THRESHOLD)):
        raise RuntimeError("glibc refused mallopt(M_MMAP_THRESHOLD): the resident set would not follow the tensors")


@contextlib.contextmanager
def freed_memory_returned():
    """Processes spawned inside run with ``MMAP_THRESHOLD`` (read by glibc at process start)."""
    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    try:
        yield
    finally:
        if old is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old


def hwm_mb() -> float:
    """The resident set's high-water mark (VmHWM) since the last ``reset_peak``, MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    """Free what can be freed and reset VmHWM to the current resident set."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def step_peak_mb(step) -> float:
    """The peak resident set of ``step()`` above the resident set just before it, MB, after one
    warm-up ``step()`` (a process's first step also faults in code, thread pools and caches it
    keeps: about 10-15 MB here, whatever the sequence length)."""
    step()
    reset_peak()
    before = rss_mb()
    step()
    return hwm_mb() - before


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def slowest(seconds: float) -> float:
    """The largest value over all ranks (a step is as slow as its slowest rank)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed_ms(step, reps: int) -> float:
    """Median over ``reps`` of the slowest rank's wall time of ``step()``, in ms."""
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(slowest(time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def tokens(positions: torch.Tensor, B: int, heads: int, D: int, seed: int) -> torch.Tensor:
    """[B, heads, len(positions), D] fp32 values for the given global token positions; the
    same position always gets the same values, so shards agree with the full tensor."""
    blocks = positions // BLOCK
    out = torch.empty(B, heads, len(positions), D)
    for b in torch.unique(blocks).tolist():
        g = torch.Generator().manual_seed(seed * 1_000_003 + b)
        block = torch.randn(B, heads, BLOCK, D, generator=g)
        sel = (blocks == b).nonzero().squeeze(1)
        out[:, :, sel] = block[:, :, positions[sel] % BLOCK]
    return out


def exact_rows(q_rows, q_pos, k, v, scale: float, window: int | None = None) -> torch.Tensor:
    """float64 causal (optionally sliding-window) attention of a few query rows (at global
    positions ``q_pos``) over full k/v, by ``ringseq.reference``: the reference for ``max_err``."""
    return reference.attention(q_rows.double(), k.double(), v.double(), causal=True, scale=scale, window=window,
                               query_positions=q_pos)


def emit(record: dict, path: str | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def save_figure(fig, axes, path: str) -> None:
    """Grid and legend on every panel, then the PNG (the benchmarks' one look)."""
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
