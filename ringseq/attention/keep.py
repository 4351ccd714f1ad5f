"""Ring outputs kept from a checkpointed layer's forward for its recompute.

Activation checkpointing runs a layer's forward twice: once without keeping activations, and
again inside the backward to rebuild them. For ring attention the second run would replay the
whole ring (P-1 K/V transfers and every block's attention) only to get back what the first run
computed. So a checkpointed layer runs inside ``keeping(Kept())``: its first forward puts each
ring call's output and log-sum-exp ([B,H,s,D] and [B,H,s]: the size of q) into the store; the
recompute takes them back in the same order and the ring autograd function is rebuilt around
them, making no transfer and no block compute (its backward is the ring backward as always).

Under ``torch.compile`` a checkpointed layer is torch's selective checkpointing instead
(``compiled_checkpoint``, ``save_ring``): the compiled ring op's outputs saved, the rest recomputed.

With ``offload=True`` the checkpointed layer's saved inputs go to host memory
(``torch.autograd.graph.save_on_cpu``, pinned when a GPU is present) and so do the kept ring
outputs (``Kept(offload=True)``). On a CPU-only machine this is a no-op copy that saves nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

from ringseq.errors import RingSeqError

_current: contextvars.ContextVar["Kept | None"] = contextvars.ContextVar("ringseq_kept", default=None)


class Kept:
    """The ring outputs of one run of one checkpointed layer: recorded by its first forward,
    replayed (in call order) by each recompute."""

    def __init__(self, *, offload: bool = False, record: bool = True):
        self.offload, self.record = offload, record
        self.entries: list[tuple] = []
        self.replaying = False
        self._next = 0

    def put(self, out: torch.Tensor, lse: torch.Tensor, aux) -> None:
        """Keep one call's result (first forward only)."""
        if self.record and not self.replaying:
            self.entries.append((self._store(out.detach()), self._store(lse), aux))

    def take(self, q: torch.Tensor):
        """The next kept (out, lse, aux) for a recomputed call on ``q``, or None when nothing was
        kept for it (the ring then runs again: exact, only slower)."""
        if not self.replaying or self._next >= len(self.entries):
            return None
        out, lse, aux = self.entries[self._next]
        if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
            raise RingSeqError(f"the recompute of a checkpointed layer made a ring_attention call on q "
                               f"{tuple(q.shape)} {q.dtype} where its forward made one on {tuple(out.shape)} "
                               f"{out.dtype}: a checkpointed layer must compute the same thing twice")
        self._next += 1
        return out.to(q.device, non_blocking=True), lse.to(q.device, non_blocking=True), aux

    def _store(self, t: torch.Tensor) -> torch.Tensor:
        if not self.offload or t.device.type == "cpu":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        return host.copy_(t, non_blocking=True)

    @contextlib.contextmanager
    def run(self):
        """One run of the layer: the first records, every later one replays from the start."""
        token = _current.set(self)
        self._next = 0
        try:
            yield
        finally:
            _current.reset(token)
            if self.replaying:  # the recompute holds what it took (in its autograd nodes) from here
                self.entries = []
            self.replaying = True


def current() -> Kept | None:
    """The store of the checkpointed layer being run, if any."""
    return _current.get()


@contextlib.contextmanager
def using(store: Kept):
    """``store`` as the current one for the calls inside, as it is (neither reset nor flipped to
    replaying: the compiled ring op records one call into a store of its own, and replays it)."""
    token = _current.set(store)
    try:
        yield
    finally:
        _current.reset(token)


def save_ring(ctx, op, *args, **kwargs):
    """A selective checkpointing policy (``torch.utils.checkpoint.create_selective_checkpoint_contexts``)
    that saves the outputs of ringseq's compiled ops (the ring: ``ringseq.attention.compiled``; the
    recurrent layers' sharded kernels: ``ringseq.patches.compiled_mixers``) and recomputes everything
    else: what ringseq's checkpointed layers run under ``torch.compile`` (no exchange runs again in
    the backward)."""
    from torch.utils.checkpoint import CheckpointPolicy

    if getattr(op, "namespace", None) == "ringseq":  # the ring, the recurrent layers' exchanges
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(kwargs: dict) -> dict:
    """A layer call's keyword arguments inside a compiled checkpointed region: the batch swapped for its
    checkpointed twin (``ShardedBatch.in_checkpoint``), so the ring and recurrent ops keep what eager
    keeping keeps (transformers' checkpointing here; torch's ``checkpoint_wrapper``: ``patches.checkpointing``)."""
    twin = getattr(kwargs.get("ringseq"), "in_checkpoint", None)
    return kwargs if twin is None else {**kwargs, "ringseq": twin}


def compiled_checkpoint(function, *args, **kwargs):
    """A checkpointed layer as dynamo traces it: torch's non-reentrant checkpoint under ``save_ring``."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    kwargs = checkpointed({k: v for k, v in kwargs.items() if k not in ("use_reentrant", "context_fn")})
    if isinstance(function, functools.partial):  # transformers' layer call: its kwargs bound in a partial
        function = functools.partial(function.func, *function.args, **checkpointed(function.keywords))
    return checkpoint(function, *args, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, save_ring), **kwargs)


OFFLOAD_COMPILED = ("offload=True (transformers' checkpoint offload, or fit's offload_activations) is not applied to "
                    "compiled layers: torch.compile's saved activations do not go through the host-memory hooks, so "
                    "the layers would keep them on the device. Compile without offload, or offload without compiling "
                    "(gradient_checkpointing_kwargs={'offload': False}, or no torch.compile)")


@torch.library.custom_op("ringseq::refused", mutates_args=())
def _refused(x: torch.Tensor, why: str) -> torch.Tensor:
    raise RingSeqError(why)


@_refused.register_fake
def _(x, why):
    return torch.empty_like(x)


torch.library.register_autograd("ringseq::refused", lambda ctx, grad: (grad, None))  # traced, never run


def refused(x: torch.Tensor, why: str) -> torch.Tensor:
    """``x`` in a compiled graph, through an op that raises ``RingSeqError(why)`` when the graph runs:
    a refusal that reaches the user (a raise while dynamo traces falls back to eager code instead)."""
    return torch.ops.ringseq.refused(x, why)


def _refusing(args: tuple, kwargs: dict, why: str):
    """``args``, ``kwargs`` with their first tensor passed through ``ringseq::refused``: the compiled
    layer raises ``RingSeqError(why)`` when it runs (dynamo would turn a raise while it traces into
    an eager fallback that never reaches the user)."""
    args = list(args)
    for where in (args, kwargs):
        for key in (range(len(where)) if where is args else list(where)):
            if isinstance(where[key], torch.Tensor):
                where[key] = refused(where[key], why)
                return tuple(args), kwargs
    raise RingSeqError(why)


def checkpoint_keeping_ring(checkpoint_fn, *, offload: bool = False, keep: bool = True):
    """Wrap a checkpoint function (``torch.utils.checkpoint.checkpoint`` or a partial of it, as
    transformers sets on each layer) so the ring attention inside is never replayed.
    ``keep=False`` replays it instead (the recompute runs the ring again: one q-sized tensor per
    layer less memory, P-1 K/V transfers and the forward blocks more per layer); ``offload``
    applies either way."""
    if getattr(checkpoint_fn, "keeps_ring", False):
        return checkpoint_fn

    def checkpoint(function, *args, **kwargs):
        if torch.compiler.is_compiling():  # traced by dynamo: the ring op's outputs saved, the rest recomputed
            if _engine_inside(function):  # its hooks break the region's graph: kept eagerly (``eager_under_compile``)
                return eager_under_compile(function, *args, **kwargs)
            if offload or (getattr(checkpoint_fn, "keywords", None) or {}).get("offload"):  # ours, or transformers'
                args, kwargs = _refusing(args, kwargs, OFFLOAD_COMPILED)
            return compiled_checkpoint(function, *args, **kwargs)
        return eagerly(function, *args, **kwargs)

    def eagerly(function, *args, **kwargs):
        kept = Kept(offload=offload, record=keep)  # not recording: the runs are still told apart (``compiled``)

        def run(*a, **k):
            with kept.run():
                return function(*a, **k)

        if not offload:
            return checkpoint_fn(run, *args, **kwargs)
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return checkpoint_fn(run, *args, **kwargs)

    # an engine's hooks inside the region (DeepSpeed ZeRO-3's parameter fetches, FSDP units wrapped inside a
    # checkpoint wrapper, as Accelerate's auto-wrap does) break its graph; dynamo would then run torch's selective
    # checkpointing eagerly, whose recompute must repeat the forward's ops one for one, which the eager ring (its
    # agreements, its kept outputs) does not: the region runs as eager checkpointing keeping the ring's outputs,
    # uncompiled (a graph break at the call, where the engine's hooks make one anyway)
    eager_under_compile = torch.compiler.disable(eagerly)
    checkpoint.keeps_ring, checkpoint.wrapped, checkpoint.offload, checkpoint.keep = True, checkpoint_fn, offload, keep
    return checkpoint


def _engine_inside(function) -> bool:
    """Whether the module a checkpoint function runs (transformers' ``partial(forward, layer, ...)``, a bound
    method's partial, or a module: torch's ``checkpoint_wrapper``) holds an engine's hooks: DeepSpeed ZeRO-3
    partitioned parameters, or FSDP units (FSDP2's ``fully_shard``, FSDP1) inside it."""
    candidates = [function]
    if isinstance(function, functools.partial):
        candidates = [*function.args[:1], getattr(function.func, "__self__", None)]
    modules = [m for m in candidates if isinstance(m, torch.nn.Module)]
    return any(_engine_unit(sub) for m in modules for sub in m.modules()) or \
        any(hasattr(p, "ds_id") for m in modules for p in m.parameters())


def _engine_unit(module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2 in this namespace
        FSDPModule = ()
    return isinstance(module, (FSDPModule, FullyShardedDataParallel))
