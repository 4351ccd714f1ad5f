"""Helpers for testing ringseq against a single-process reference.

``DistPool`` keeps ``world_size`` CPU processes with a gloo process group (on a free port)
alive and runs test functions on all of them; every rank runs the same function and asserts,
and a failure re-raises with the failing ranks' tracebacks. ``assert_close`` applies the
project's tolerance rule: ringseq's error against a float64 reference may be at most twice
the error of the plain same-dtype computation, plus a floor of a few roundings of the output.
"""
from __future__ import annotations

import os
import queue
import socket
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, jobs, results) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            results.put((rank, None, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - the traceback travels to the parent
            results.put((rank, traceback.format_exc(), None))
    dist.destroy_process_group()


class DistPool:
    """``world_size`` gloo processes that run functions together. Use as a context manager."""

    def __init__(self, world_size: int, timeout: float = 300.0, grace: float = 20.0):
        self.world_size, self.timeout, self.grace = world_size, timeout, grace
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self._procs = [ctx.Process(target=_worker, args=(r, world_size, port, self._jobs[r], self._results),
                                   daemon=True) for r in range(world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results."""
        for q in self._jobs:
            q.put((fn, args, kwargs))
        out, failures = [None] * self.world_size, []
        for _ in range(self.world_size):
            # once a rank has failed, the others may wait forever on a collective it skipped
            timeout = self.grace if failures else self.timeout
            try:
                rank, err, value = self._results.get(timeout=timeout)
            except queue.Empty:
                self.close(force=True)
                if failures:
                    failures.append(f"(the other ranks did not finish within {self.grace:.0f}s after that)")
                    break
                raise TimeoutError(f"{fn.__name__} did not finish on all {self.world_size} ranks "
                                   f"within {self.timeout:.0f}s (a hang or a rank that died)") from None
            out[rank] = value
            if err:
                failures.append(f"--- rank {rank} ---\n{err}")
        if failures:
            raise AssertionError(f"{fn.__name__} failed on {len(failures)} of {self.world_size} ranks:\n"
                                 + "\n".join(sorted(failures)))
        return out

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self, force: bool = False) -> None:
        for q, p in zip(self._jobs, self._procs):
            if p.is_alive() and not force:
                q.put(None)
        for p in self._procs:
            p.join(timeout=0 if force else 30)
            if p.is_alive():
                p.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_SHARED = {}


def shared_init(**kwargs):
    """``ringseq.init(**kwargs)``, made once per worker process and configuration. Tests run
    hundreds of cases on long-lived workers; every gloo group keeps threads polling its
    sockets, so making fresh groups for each case would slow the whole machine down."""
    from .topology import init

    key = tuple(sorted(kwargs.items()))
    if key not in _SHARED:
        _SHARED[key] = init(**kwargs)
    return _SHARED[key]


def error(actual: torch.Tensor, ref64: torch.Tensor) -> float:
    return (actual.double() - ref64).abs().max().item()


def assert_close(actual: torch.Tensor, plain: torch.Tensor, ref64: torch.Tensor, what: str) -> None:
    """ringseq's ``actual`` vs the float64 ``ref64``: error <= 2 x error of ``plain`` (the same
    computation done plainly in the same dtype) + a floor of 4 output roundings."""
    assert actual.shape == ref64.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(ref64.shape)}"
    assert actual.dtype == plain.dtype, f"{what}: dtype {actual.dtype} != {plain.dtype}"
    err, ref_err = error(actual, ref64), error(plain, ref64)
    floor = 4 * torch.finfo(actual.dtype).eps * max(ref64.abs().max().item(), 1e-30)
    assert err <= 2 * ref_err + floor, (
        f"{what}: max error {err:.3e} > 2 x plain {actual.dtype} error {ref_err:.3e} + floor {floor:.1e}")


def sdpa_reference(q, k, v, dout, *, causal: bool, scale: float | None = None):
    """Full-sequence attention and its gradients by ``scaled_dot_product_attention``:
    returns (out, dq, dk, dv) computed in the inputs' dtype."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, enable_gqa=k.size(1) != q.size(1))
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def exit_now(code: int = 0) -> None:
    """End a launched job without interpreter teardown. With torch 2.13 on this CPU machine a
    2-process gloo job that has imported ``torch._dynamo`` (DeepSpeed and transformers do) aborts
    at exit in about 1 run of 3 ("terminate called without an active exception", even after
    destroy_process_group; without the import it does not): our jobs and test scripts flush and
    leave with ``os._exit`` once their work and checks are done."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
