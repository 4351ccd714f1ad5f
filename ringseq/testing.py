"""Helpers for testing ringseq against a single-process reference (tests only: no benchmark
and no production module imports this).

``DistPool`` keeps ``world_size`` CPU processes with a gloo process group (on a free port)
alive and runs test functions on all of them; every rank runs the same function and asserts,
and a failure re-raises with the failing ranks' tracebacks. ``DistPool.run_script`` runs a
launched script's ``main()`` in them as torchrun, deepspeed or ``accelerate launch`` would start
it (their variables), so its imports, DeepSpeed's comm layer and the group stay warm between
cases; each case starts from a clean state (``_Clean``). ``assert_close`` and friends apply
the project's tolerance rule (``ringseq.tolerance``): ringseq's error against a float64
reference may be at most twice the error of the plain same-dtype computation, plus a floor of
two roundings of the reference.
"""
from __future__ import annotations

import os
import queue
import random
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

from . import tolerance
from .processes import free_port, join_gloo
from .tolerance import error, relative_norm_error, rounding  # noqa: F401 - the tests' interface


def _worker(rank: int, world: int, port: int | None, jobs, results) -> None:
    import torch.distributed as dist

    if port is not None:  # a pool without a group runs one-process scripts that make their own
        join_gloo(rank, world, port, threads=1)
    _keep_world()
    clean = _Clean()
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args, kwargs = job
        clean.start()
        try:
            results.put((rank, None, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - the traceback travels to the parent
            results.put((rank, traceback.format_exc(), None))
        finally:
            clean.restore()
    if dist.is_initialized():
        _real_destroy()


_real_destroy = None  # torch's destroy_process_group, in a pool's worker


def _keep_world() -> None:
    """The pool's process group outlives its cases: a case that destroys the default group (a
    script's last line, Accelerate's ``end_training``) leaves it; other groups go as asked."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    global _real_destroy
    _real_destroy = real = c10d.destroy_process_group

    def destroy_process_group(group=None):
        if group is None or group is c10d.GroupMember.WORLD:
            return
        real(group)

    dist.destroy_process_group = c10d.destroy_process_group = destroy_process_group


class _Clean:
    """What a case may change in its worker, put back after it: environment, argv, working
    directory, import path, torch's default dtype and threads, the seeds (every case starts from
    the same), ringseq's collective counts and notes' clocks, Accelerate's shared state and
    transformers' DeepSpeed config."""

    def __init__(self):
        self.env, self.argv, self.cwd = dict(os.environ), list(sys.argv), os.getcwd()
        self.path, self.dtype, self.threads = list(sys.path), torch.get_default_dtype(), torch.get_num_threads()

    def start(self) -> None:
        from . import ledger, lockstep
        from .planner import fit

        # every job starts all ranks at the same point: forget the previous job's collective
        # counts (a test that has only some ranks call ringseq leaves them apart on purpose)
        lockstep.forget()
        ledger._ledgers.clear()
        fit.reports.clear()  # an earlier job's fit choices are not this one's (ringseq.stats reports them)
        fit.peaks.clear()
        random.seed(0)
        torch.manual_seed(0)

    def restore(self) -> None:
        from . import peers

        os.environ.clear()
        os.environ.update(self.env)
        sys.argv[:], sys.path[:] = self.argv, self.path
        os.chdir(self.cwd)
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        peers._silent_until = peers._linger_until = 0.0
        if "accelerate.state" in sys.modules:
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
        if "transformers.integrations.deepspeed" in sys.modules:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()


def launcher_env(launcher, world: int) -> dict:
    """The variables a launcher gives every rank beyond torchrun's (which a pool's ranks have:
    ``join_gloo``): ``"torchrun"``, ``"deepspeed"`` (deepspeed/launcher/launch.py's), ``None``
    (a plain ``python script``: no launcher's variables at all) or ``("accelerate", *flags)``:
    what ``accelerate launch FLAGS --num_processes world`` exports, from Accelerate's own
    launch code. One thread per rank, as torchrun gives several ranks on a node (and the tests
    give the deepspeed launcher's)."""
    if launcher is None:
        return {}
    one_thread = {"OMP_NUM_THREADS": "1"}
    if launcher == "torchrun":
        return one_thread
    if launcher == "deepspeed":
        return {"CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": str(world), **one_thread}
    kind, *flags = launcher
    assert kind == "accelerate", launcher
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    # the port is only the launcher's own rendezvous (the pool's group and store keep theirs); a
    # config file gives its own process count, which must be the pool's
    count = [] if "--config_file" in flags else ["--num_processes", str(world)]
    args = launch_command_parser().parse_args([*flags, *count, "--main_process_port", str(free_port()), "script.py"])
    args, defaults, mixed_from_config = _validate_launch_command(args)
    assert args.num_processes == world, f"accelerate launch {' '.join(flags)} starts {args.num_processes} processes"
    if args.use_deepspeed:  # as accelerate's launch_command prepares it
        fields = list(defaults.deepspeed_config.keys()) if defaults else []
        args.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * mixed_from_config)
        env = prepare_deepspeed_cmd_env(args)[1]
    else:  # as launch_command: FSDP through the multi-GPU launcher too
        assert args.multi_gpu or args.use_fsdp, f"a pool runs multi-process launches: {flags}"
        env = prepare_multi_gpu_env(args)
    return {**one_thread, **{k: v for k, v in env.items() if os.environ.get(k) != v}}


def _script_job(script: str, argv: list, launcher, env: dict, cwd: str | None, own_group: bool) -> str:
    """Run ``script``'s ``main()`` as its launcher would start it on this rank (its variables,
    argv, working directory); returns what it printed to stdout (stderr stays the worker's: a log
    handler a case makes must not keep a dead buffer). After a case that ended well on every rank,
    the process groups it made are destroyed (a fresh sequence-parallel group per case); after a
    failure the pool is closed anyway."""
    import contextlib
    import io
    import runpy

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    os.environ.update(env)
    if launcher == "deepspeed":
        argv = [f"--local_rank={os.environ['LOCAL_RANK']}", *argv]
    if launcher is None:  # a plain `python script`: no launcher's variables
        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(name, None)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    if cwd:
        os.chdir(cwd)
    before = set(c10d._world.pg_map) if dist.is_initialized() else set()
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            try:
                runpy.run_path(script, run_name="__ringseq_case__")["main"]()
            except SystemExit as stop:
                if stop.code not in (None, 0):
                    raise
    except BaseException as err:
        raise RuntimeError(f"{os.path.basename(script)} failed; what it printed:\n{printed.getvalue()[-4000:]}") from err
    if dist.is_initialized():
        if own_group:
            dist.barrier()  # every rank is done with the case's groups (bounded: the pool's timeout)
        _drop_groups(set(c10d._world.pg_map) - before)
        if not own_group:  # a one-process script's own world goes with it
            _real_destroy()
    return printed.getvalue()


def _drop_groups(groups) -> None:
    """Destroy a case's process groups, and DeepSpeed's references to them (its data-parallel and
    world groups, its mpu) so that no later case finds a destroyed group there."""
    from torch.distributed import distributed_c10d as c10d

    release = None
    if "deepspeed.utils.groups" in sys.modules:
        release = sys.modules["deepspeed.utils.groups"]._release_process_group_references
    for group in groups:
        if group is not c10d.GroupMember.WORLD:
            if release is not None:
                release(group)
            _real_destroy(group)


def process_context():
    """New ranks fork from a server that has imported torch once (``forkserver``): a pool starts in
    a fraction of the time a fresh interpreter takes per rank, and nothing has run in the server
    that a fork could copy half-done (no threads, no process group)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "ringseq.testing"])
    return ctx


class DistPool:
    """``world_size`` gloo processes that run functions together. Use as a context manager.

    ``group=False``: processes without a process group, for one-process scripts (references
    that must not look distributed). A case that fails, hangs or kills a rank closes the pool
    (it may be out of step); ``alive`` then says False and the tests' fixtures make a new one.
    Every wait is bounded: ``timeout`` for a case, ``grace`` for the others once one rank failed."""

    def __init__(self, world_size: int, timeout: float = 300.0, grace: float = 20.0, group: bool = True):
        self.world_size, self.timeout, self.grace, self.group = world_size, timeout, grace, group
        ctx = process_context()
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        self.port = free_port() if group else None
        self._closed = False
        self._procs = [ctx.Process(target=_worker, args=(r, world_size, self.port, self._jobs[r], self._results),
                                   daemon=True) for r in range(world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results."""
        return self.run_expecting(range(self.world_size), fn, *args, **kwargs)

    def run_script(self, script, *argv, launcher="torchrun", env: dict | None = None, cwd=None) -> str:
        """Run ``script``'s ``main()`` on every rank as ``launcher`` would start it
        (``launcher_env``; ``"deepspeed"`` also passes ``--local_rank``), with ``env`` added;
        returns what the ranks printed, rank by rank. The script's imports stay warm for the next."""
        assert (launcher is None) == (not self.group), "a pool without a group runs plain scripts (launcher=None)"
        env = {**launcher_env(launcher, self.world_size), **(env or {})}
        return "".join(self.run(_script_job, str(script), [str(a) for a in argv], launcher, env,
                                str(cwd) if cwd else None, self.group))

    def run_expecting(self, ranks, fn, *args, **kwargs) -> list:
        """Run ``fn`` on every rank but wait only for ``ranks`` (the others are meant to die or
        hang); their results, None for the others. A rank that raises, dies or outlasts the
        timeout fails the case with its traceback (the others get ``grace`` to finish) and
        closes the pool."""
        for q in self._jobs:
            q.put((fn, args, kwargs))
        waiting, out, failures = set(ranks), [None] * self.world_size, []
        if len(waiting) < self.world_size:  # the others' late results would be read as the next case's
            self._closed = True
        deadline = time.time() + self.timeout
        while waiting:
            try:
                rank, err, value = self._results.get(timeout=min(1.0, max(0.0, deadline - time.time())))
            except queue.Empty:
                for r in sorted(waiting):
                    if self._procs[r].exitcode is not None:
                        failures.append(f"--- rank {r} ---\nits process died (exit code {self._procs[r].exitcode}) "
                                        f"in {fn.__name__}")
                        waiting.discard(r)
                        deadline = min(deadline, time.time() + self.grace)
                if waiting and time.time() >= deadline:
                    self.close(force=True)
                    if not failures:
                        raise TimeoutError(f"{fn.__name__} did not finish on all {self.world_size} ranks within "
                                           f"{self.timeout:.0f}s (a hang); ranks {sorted(waiting)} never "
                                           f"answered") from None
                    failures.append(f"(ranks {sorted(waiting)} did not finish within {self.grace:.0f}s after that)")
                    break
                continue
            waiting.discard(rank)
            out[rank] = value
            if err:
                failures.append(f"--- rank {rank} ---\n{err}")
                # once a rank has failed, the others may wait forever on a collective it skipped
                deadline = min(deadline, time.time() + self.grace)
        if failures:  # the ranks may be out of step (a collective one of them left): a new pool for the next
            self.close(force=True)
            raise AssertionError(f"{fn.__name__} failed on {len(failures)} of {self.world_size} ranks:\n"
                                 + "\n".join(sorted(failures)))
        return out

    @property
    def alive(self) -> bool:
        return not self._closed and all(p.is_alive() for p in self._procs)

    def stop(self) -> None:
        """Ask every rank to leave after its current case (``close`` then waits for them)."""
        for q, p in zip(self._jobs, self._procs):
            if p.is_alive():
                q.put(None)

    def close(self, force: bool = False) -> None:
        """End the ranks: after their current case, or at once (``force``: SIGKILL)."""
        self._closed = True
        if not force:
            self.stop()
        for p in self._procs:
            p.join(timeout=0 if force else 30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

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
    """A model's loss (``assert_close``) and gradients (``assert_named_close``), averaged over the
    sequence group, against the plain same-dtype run and the float64 run."""
    assert_close(torch.as_tensor(loss), torch.as_tensor(plain_loss), torch.as_tensor(ref_loss).double(),
                 f"{what}: loss")
    assert_named_close(grads, plain_grads, ref_grads, f"{what}: gradients")


def assert_updates_close(got: dict, plain: dict, ref64: dict, start: dict, what: str,
                         plain_start: dict | None = None) -> None:
    """Parameters after some optimizer steps, compared by what the steps changed (``p - start``):
    the parameters themselves are dominated by their initial values, whose rounding would hide
    any error in the steps. ``plain_start``: where the plain run started when it holds its weights in
    another dtype (a bf16 model beside fp32 master weights: the bf16 equivalent of mixed precision)."""
    def moved(params, origin):  # exact: a difference of two numbers of the run's dtype fits in float64
        return {n: params[n].double() - origin[n].double() for n in start}

    dtype = next(iter(got.values())).dtype
    assert_named_close(moved(got, start), moved(plain, plain_start or start), moved(ref64, start), what,
                       rounded={n: p.double() for n, p in ref64.items()}, dtype=dtype)


def assert_refused(make, words: str) -> None:
    """``make()`` raises ``RingSeqError`` whose message says ``words``."""
    from .errors import RingSeqError

    try:
        make()
    except RingSeqError as err:
        assert words in str(err), err
        return
    raise AssertionError(f"not refused: {words}")
