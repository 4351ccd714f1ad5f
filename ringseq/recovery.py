"""A step that fails on one rank fails on every rank in that step, and the next step is exact (docs/engines.md).

The loop a long-context job runs around a step that can run out of memory catches the exception, skips the
batch and goes on. Under an engine that is a promise about two kinds of collectives: ringseq's (agreements,
ring transfers) and the engine's (DDP's buffer broadcast and bucket all-reduces, FSDP's all-gathers and
reduce-scatters), which a rank that raised would otherwise leave unmatched, so that the next step's pair with
the wrong ones (a hang, or gloo aborting the process). So a rank that leaves a patched step with an exception:

1. tells its group (``lockstep.tell``): its peers, waiting at their next agreement or at a layer's gate
   (``ringseq.engines``: before every FSDP unit's collectives), raise there in the same step, naming it;
2. puts the engine back to idle with every other rank (``ringseq.engines.recover``): the engine's collectives
   the step left unmatched are matched (DDP's gradient buckets, counted by its process group's sequence
   number) and its per-step state reset (DDP's reducer, FSDP2's ``reset_iter_state``); the failed step's
   gradients are dropped. An engine whose state cannot be put back (DeepSpeed ZeRO-3's prefetches, a backward
   failure under DeepSpeed) marks the group broken: the next step raises ``RingSeqError`` saying so, before any
   collective.

A failure in the patched forward is caught there (``ringseq.patches.forward``). One in a backward pass is caught
where every backward pass runs (torch's ``_engine_run_backward``, wrapped once by ``watch_backward``): it acts
only for a group whose patched training step's backward has not ended (``lockstep.open_step``), once per
outermost backward pass (a reentrant checkpoint's inner ones are part of it).
"""
from __future__ import annotations

import functools
import threading

import torch

from . import engines, lockstep
from .errors import RingSeqError

_local = threading.local()
_installed = []


def step_failed(sp, error: BaseException, label: str, model=None) -> None:
    """This rank leaves a patched step of ``sp`` with ``error``: its note, every rank told, the engine recovered
    with every other rank. Never raises (the caller raises ``error``)."""
    shared = getattr(error, "ringseq_shared", False)  # shared in the ring call that raised it: its group knows
    if not isinstance(error, RingSeqError) and not getattr(error, "relayed", False) and not shared:
        lockstep.mark_failed(sp, f"{label}: {type(error).__name__}: {error}")
    backward = lockstep.state(sp).open is not None
    # under an engine over several sequence groups every rank of the job is told too: the others meet the job at
    # the step's next gate, at the forward's end (no backward to come) or at the backward's start or end
    scope = lockstep.wider(sp)
    if not shared and (scope is None or not lockstep.state(scope).told):  # raised at the job's gate: its whole
        lockstep.tell(sp, label, error)  # group met it there
    if scope is not None:
        lockstep.tell(scope, label, error)
    lockstep.close_step(sp)
    try:
        engines.recover(sp, model, backward=backward, scope=scope)
    except RingSeqError as err:  # the peers never came to the recovery: the group cannot go on
        lockstep.mark_broken(sp, str(err))


def watch_backward() -> None:
    """Wrap torch's ``_engine_run_backward`` (where ``Tensor.backward``, ``torch.autograd.backward`` and
    ``torch.autograd.grad`` run the engine) once per process, so that a backward pass that raises during a
    patched step's backward recovers the step (``step_failed``) before the exception reaches the caller."""
    import torch.autograd as autograd
    import torch.autograd.graph as graph

    if _installed:
        return
    original = graph._engine_run_backward

    @functools.wraps(original)
    def _engine_run_backward(*args, **kwargs):
        depth = getattr(_local, "depth", 0)
        _local.depth = depth + 1
        try:
            return original(*args, **kwargs)
        except BaseException as exc:
            if depth == 0 and not torch.compiler.is_compiling():
                for sp in lockstep.open_steps():
                    step_failed(sp, exc, "the backward")
            raise
        finally:
            _local.depth = depth

    graph._engine_run_backward = autograd._engine_run_backward = _engine_run_backward
    _installed.append(original)
