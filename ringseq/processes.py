"""The processes ringseq starts or runs in: free ports, a clean exit, and the one harness that
spawns a local gloo world (``join_gloo``: what every rank does first; ``run_tree``: a fresh tree
of ranks for one function).

Production code (the ``ringseq`` command, launched jobs), the tests' ``DistPool`` and the
benchmarks all use these.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def exit_now(code: int = 0) -> None:
    """End a process without interpreter teardown, once its work and checks are done: our test
    scripts and launched test jobs leave this way (no finalization to race, no teardown time).
    A user's job exits normally; ``settle_at_exit`` keeps that exit clean. Either way a process
    that serves the rendezvous store stays while the survivors of a recent failure read their
    notes (``ringseq.peers.linger``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    _linger()
    os._exit(code)


def _linger() -> None:
    """The store's host stays while the survivors of a failure read its notes (``ringseq.peers.linger``)."""
    if "ringseq.peers" in sys.modules:
        sys.modules["ringseq.peers"].linger()


SETTLE_S = 0.2  # how long the interpreter hands the GIL to torch's threads before it finalizes
_settling = False


def settle_at_exit() -> None:
    """Let torch's communication threads finish before the interpreter finalizes (registered
    once, by ``ringseq.init``). A gloo worker thread frees a finished collective's work after
    the caller has its result; a collective issued during a backward pass holds a Python object
    (autograd stashes a context in the thread-local state that each work copies), so that free
    needs the GIL. A worker that reaches the GIL after ``Py_FinalizeEx`` has begun is ended by
    Python with ``pthread_exit`` inside C++ code: "terminate called without an active exception"
    and SIGABRT, after the job's work is done (measured here: 1 accelerate run of 5-6; pytorch
    issue 190489). At exit, while the interpreter is whole, this collects garbage and sleeps
    ``SETTLE_S`` with the GIL released, so the workers take it and finish (0 aborts in 20)."""
    global _settling
    if not _settling:
        atexit.register(_settle)
        _settling = True


def _settle() -> None:
    import gc

    _linger()
    gc.collect()
    time.sleep(SETTLE_S)


def join_gloo(rank: int, world: int, port: int, threads: int | None = None) -> None:
    """Become rank ``rank`` of a local gloo world on ``port`` as a launcher would set it up (the
    variables torchrun sets, one node), with ``threads`` torch threads."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if threads:
        torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)


_tree_results = None  # the running tree's queue, in a rank of ``run_tree``


def end_tree_early(value) -> None:
    """From a rank of ``run_tree``: end the whole tree now; ``run_tree`` returns ``("early",
    value)`` (a benchmark's watchdog stopping a step that outgrew its budget)."""
    import torch.distributed as dist

    _tree_results.put((dist.get_rank(), "early", value))
    _tree_results.close()
    _tree_results.join_thread()
    os._exit(3)


def _tree_entry(rank, world, port, threads, fn, args, results):
    import traceback

    import torch.distributed as dist

    global _tree_results
    _tree_results = results
    try:
        join_gloo(rank, world, port, threads)
        results.put((rank, None, fn(*args)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported by the parent
        results.put((rank, traceback.format_exc(), None))


def run_tree(fn, nprocs: int, *args, threads: int = 1, timeout: float = 3600.0):
    """Run ``fn(*args)`` on ``nprocs`` fresh spawned processes joined in a gloo world (the one
    harness of the benchmarks; the tests' ``DistPool`` keeps its ranks alive between cases).
    Returns rank 0's result, or ``("early", value)`` when a rank called ``end_tree_early``; a
    rank's failure is raised with its traceback, and so is a rank that exits without a result."""
    import glob
    import queue

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_tree_entry, args=(r, nprocs, port, threads, fn, args, results))
             for r in range(nprocs)]
    for p in procs:
        p.start()
    got, waited = {}, 0.0
    try:
        while len(got) < nprocs:
            try:
                rank, err, value = results.get(timeout=5)
            except queue.Empty:  # check that every rank is still alive
                waited += 5
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a rank exited with code {dead[0]} without a result") from None
                if waited >= timeout:
                    raise TimeoutError(f"{fn.__name__} did not finish on {nprocs} ranks within {timeout:.0f} s")
                continue
            if err == "early":
                return ("early", value)
            if err:
                raise RuntimeError(f"rank {rank} failed:\n{err}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if got else 0.1)
            if p.is_alive():
                p.kill()
        for name in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):  # DeepSpeed's CPU comm buffers
            os.remove(name)
    return got[0]
