"""Helpers for testing ringseq against a single-process reference (tests only: no benchmark
and no production module imports this).

``DistPool`` keeps ``world_size`` CPU processes with a gloo process group (on a free port)
alive and runs test functions on all of them; every rank runs the same function and asserts,
and a failure re-raises with the failing ranks' tracebacks. ``assert_close`` and friends apply
the project's tolerance rule (``ringseq.tolerance``): ringseq's error against a float64
reference may be at most twice the error of the plain same-dtype computation, plus a floor of
two roundings of the reference.
"""
from __future__ import annotations

import queue
import traceback

import torch
import torch.multiprocessing as mp

from . import tolerance
from .processes import free_port, join_gloo
from .tolerance import error, relative_norm_error, rounding  # noqa: F401 - the tests' interface


def _worker(rank: int, world: int, port: int, jobs, results) -> None:
    import torch.distributed as dist

    join_gloo(rank, world, port, threads=1)
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args, kwargs = job
        _fresh_lockstep()
        try:
            results.put((rank, None, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - the traceback travels to the parent
            results.put((rank, traceback.format_exc(), None))
    dist.destroy_process_group()


def _fresh_lockstep() -> None:
    """Every job starts all ranks at the same point: forget the previous job's collective
    counts (a test that has only some ranks call ringseq leaves them apart on purpose)."""
    from . import ledger, lockstep

    lockstep.forget()
    ledger._ledgers.clear()


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
        return self.run_expecting(range(self.world_size), fn, *args, **kwargs)

    def run_expecting(self, ranks, fn, *args, **kwargs) -> list:
        """Run ``fn`` on every rank but wait only for ``ranks`` (the others are meant to die or
        hang); their results, None for the others."""
        for q in self._jobs:
            q.put((fn, args, kwargs))
        ranks = list(ranks)
        out, failures = [None] * self.world_size, []
        for _ in ranks:
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


def assert_close(actual: torch.Tensor, plain: torch.Tensor, ref64: torch.Tensor, what: str,
                 floor: float | None = None) -> None:
    """ringseq's ``actual`` vs the float64 ``ref64`` by the 2x rule (``ringseq.tolerance.within``)."""
    assert actual.shape == ref64.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(ref64.shape)}"
    assert actual.dtype == plain.dtype, f"{what}: dtype {actual.dtype} != {plain.dtype}"
    verdict = tolerance.within(actual, plain, ref64, what, floor)
    assert verdict.ok, f"{verdict} ({actual.dtype})"


def assert_shards_close(local: torch.Tensor, plain: torch.Tensor, ref64: torch.Tensor, what: str, *, sp,
                        dim: int = 2, layout=None) -> None:
    """``assert_close`` on the whole tensor: this rank's shard of ringseq's result is gathered
    (every rank then checks the same whole tensor against the full-sequence references).
    ``layout``: a batch's own (``ringseq.balance``) instead of ``sp.layout``."""
    from .sharding import gather

    assert_close(gather(local.detach(), dim, sp=sp, layout=layout), plain, ref64, what)


def assert_named_close(got: dict, plain: dict, ref64: dict, what: str, rounded: dict | None = None,
                       dtype: torch.dtype | None = None) -> None:
    """Named tensors (a model's gradients or updates) by the 2x rule, layer by layer and all
    together (``ringseq.tolerance.by_layer``)."""
    assert got.keys() == ref64.keys() == plain.keys(), f"{what}: the tensors differ: {sorted(got)} vs {sorted(ref64)}"
    for verdict in tolerance.by_layer(got, plain, ref64, rounded, dtype):
        assert verdict.ok, f"{what}: {verdict}"


def assert_model_close(loss, grads: dict, plain_loss, plain_grads: dict, ref_loss, ref_grads: dict, what: str) -> None:
    """A model's loss (``assert_close``) and gradients (``assert_named_close``), summed over the
    sequence group, against the plain same-dtype run and the float64 run."""
    assert_close(torch.as_tensor(loss), torch.as_tensor(plain_loss), torch.as_tensor(ref_loss).double(),
                 f"{what}: loss")
    assert_named_close(grads, plain_grads, ref_grads, f"{what}: gradients")


def assert_updates_close(got: dict, plain: dict, ref64: dict, start: dict, what: str) -> None:
    """Parameters after some optimizer steps, compared by what the steps changed (``p - start``):
    the parameters themselves are dominated by their initial values, whose rounding would hide
    any error in the steps."""
    def moved(params):  # exact: a difference of two numbers of the run's dtype fits in float64
        return {n: params[n].double() - start[n].double() for n in start}

    dtype = next(iter(got.values())).dtype
    assert_named_close(moved(got), moved(plain), moved(ref64), what, rounded={n: p.double() for n, p in ref64.items()},
                       dtype=dtype)


def assert_refused(make, words: str) -> None:
    """``make()`` raises ``RingSeqError`` whose message says ``words``."""
    from .errors import RingSeqError

    try:
        make()
    except RingSeqError as err:
        assert words in str(err), err
        return
    raise AssertionError(f"not refused: {words}")
