"""The ring as PyTorch custom ops, for the patched attention under ``torch.compile``.

Dynamo cannot trace the ring: its transfers, agreements and failure notes are Python that
talks to other processes. So under ``torch.compile`` each attention layer calls one opaque op,
``ringseq::ring_attention``, whose implementation is the eager ring (``ringseq.ring_attention``
with everything it checks, agrees and shares), and whose gradient is a second op,
``ringseq::ring_attention_backward``, that runs the eager ring's backward. Both have fake
implementations (shapes only), so a decoder layer compiles as one graph with the ring inside.

What a call needs of its batch (documents, padding, the batch's layout, the sequence group,
head groups) reaches the op as a 0-d int64 tensor naming the batch (``ShardedBatch.key``,
``register_batch``): a graph input, so a new batch of the same shape is no recompile, and
nothing batch-dependent is a constant of the graph. The forward keeps its eager autograd graph
(the ring's saved q, k, v, output and log-sum-exp, as eager autograd would; q, k and v copied, so
that the compiled graph may reuse its own buffers) under a number it returns as a second 0-d
tensor; the backward op takes that graph back by the number and runs it. In a compiled
checkpointed region (the batch's ``in_checkpoint`` twin: ``keep.compiled_checkpoint``) it keeps
what eager keeping keeps instead (``ringseq.attention.keep``: the log-sum-exp, and the ring's output
where it is not the op's own), and its backward, ``ringseq::ring_attention_replay``, takes q, k, v
(recomputed by the compiled graph) and the output, rebuilds the ring's autograd around the kept
output (no transfer, no block compute) and runs the eager ring's backward. A forward whose
backward never runs (a loss dropped with grad enabled) is forgotten after ``KEEP_BATCHES`` newer
batches; a backward later than that is refused by name.

The batch registry and the kept graphs (``batch_of``, ``keep_graph``, ``gradients_of``) serve the
recurrent layers' op too (``ringseq.patches.compiled_mixers``), which keeps its eager graph.

Activation checkpointing under compile (``ringseq.attention.keep.save_ring``): the ring op's outputs are
saved, the rest of the layer recomputed, so the op never runs in a backward; a recompute that
would run it (torch's checkpoint without the policy) is refused. An eager checkpoint around a
compiled layer (``ringseq.attention.keep``) keeps the ring's outputs as eagerly: its first forward
keeps nothing of its own, its recompute takes the kept outputs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import weakref
from typing import Optional

import torch

from ringseq.errors import RingSeqError

from . import keep

KEEP_BATCHES = 8
"""Batches whose compiled ring calls still wait for their backward, at most; older ones are forgotten."""

_batches: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_batch_numbers = itertools.count(1)
_call_numbers = itertools.count(1)


@dataclasses.dataclass
class _Pending:
    batch: int
    outs: tuple
    leaves: tuple


_pending: dict[int, object] = {}
"""What each compiled call kept for its backward, by call number: a recurrent op's ``_Pending`` graph,
a ring call's ``_Kept`` output."""
GONE = (f"the backward of a compiled ringseq op found its forward's graph gone: ringseq keeps it for the "
        f"{KEEP_BATCHES} latest batches (or it ran already). Run each batch's backward before {KEEP_BATCHES} more "
        f"batches go forward")
_waiting: list[int] = []
"""The batches (numbers, oldest first) whose compiled calls kept a graph, the latest ``KEEP_BATCHES``."""


def register_batch(batch) -> torch.Tensor:
    """A 0-d int64 tensor naming ``batch`` (a ``ShardedBatch``) for the compiled ring ops; the
    batch is held weakly: the caller keeps it alive while its layers run."""
    number = next(_batch_numbers)
    _batches[number] = batch
    return torch.tensor(number, dtype=torch.long)


@contextlib.contextmanager
def _autograd():
    """Autograd on inside a custom op's implementation, which the dispatcher runs below autograd
    (the eager ring builds and later runs its own graph there); autocast stays off. ADInplaceOrView
    too: without it a view or an in-place copy from a tensor that needs a gradient records no
    history (the recurrent layers' halo, written into a buffer, lost its gradient: silently)."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    keys = torch._C.DispatchKey
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor, keys.ADInplaceOrView):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


def given(value, none):
    """An op's scalar argument back as the eager call takes it: None where the op got its stand-in."""
    return None if value == none else value


# the ops talk to other processes and keep state on the host: a CUDA graph must never capture them
# (inductor's CUDA graphs leave graphs with such an op out, or split them around it)
OP_TAGS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


@dataclasses.dataclass
class _Kept:
    """What a compiled ring call keeps for its backward: the ring's output and log-sum-exp (its
    ``keep.Kept`` entries, as eager keeping holds them), the batch (held until then) and the call's
    arguments. Not q, k and v: the backward op takes them from the compiled graph, which saves or
    recomputes them (under selective checkpointing: recomputes)."""

    batch: int
    found: object
    entries: list
    args: tuple


class _Capture(keep.Kept):
    """The store one compiled ring call runs with: it records what the call computes (or takes
    from the store of an eagerly checkpointed layer around it, whose recompute this is)."""

    def __init__(self, outer: keep.Kept | None):
        super().__init__()
        self.outer = outer

    def put(self, out, lse, aux) -> None:
        if self.outer is not None:
            self.outer.put(out, lse, aux)
        self.entries.append((out.detach(), lse, aux))

    def take(self, q):
        got = None if self.outer is None else self.outer.take(q)
        if got is not None:
            self.entries.append(got)
        return got


def _ring(found, q, k, v, sinks, args):
    from .api import ring_attention

    scale, window, softcap = args
    return ring_attention(q, k, v, sp=found.sp, causal=True, scale=given(scale, -1.0),
                          window=given(window, -1), softcap=given(softcap, 0.0), sinks=sinks,
                          token_info=found.info, head_groups=found.head_groups)


@torch.library.custom_op("ringseq::ring_attention", mutates_args=(), tags=OP_TAGS)
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor], batch: torch.Tensor,
             scale: float, window: int, softcap: float, train: bool,
             lean: bool) -> tuple[torch.Tensor, torch.Tensor]:
    refuse_recompute("ring_attention")
    found = batch_of(batch)
    retain, args = keeps_graph(train), (scale, window, softcap)
    if retain and lean:  # checkpointed: keep what eager keeping keeps, the backward replays around it
        capture = _Capture(keep.current())
        with torch.no_grad(), keep.using(capture):
            out = _ring(found, q, k, v, sinks, args)
        call = next(_call_numbers)
        # the ring's own output is the op's (no Ulysses, no padded head dim): the backward gets it from the
        # compiled graph, which saves it anyway, rather than from a second copy here
        entries = [(None if tuple(e[0].shape) == tuple(out.shape) else e[0], *e[1:]) for e in capture.entries]
        _pending[call] = _Kept(int(batch), found, entries, args)
        _forget_old(int(batch))
    else:  # the eager graph kept whole: its backward is the eager ring's, with nothing to redo
        with _autograd(), torch.set_grad_enabled(retain):
            # the kept graph owns copies of its inputs: the compiled graph may reuse their memory
            leaves = tuple(None if t is None else (t.detach().clone() if retain and t is not sinks else t.detach())
                           .requires_grad_(retain) for t in (q, k, v, sinks))
            out = _ring(found, *leaves, args)
        call = keep_graph(int(batch), (out,), tuple(t for t in leaves if t is not None)) if retain else 0
    # a copy: the compiled graph may reuse a dead output's memory, which the kept graph or entries hold
    return out.detach().clone(memory_format=torch.contiguous_format), torch.tensor(call, dtype=torch.long)


def batch_of(batch: torch.Tensor):
    """The ``ShardedBatch`` a compiled op's 0-d ``batch`` tensor names (``register_batch``)."""
    number = int(batch)
    found = _batches.get(number)
    if found is None:
        raise RingSeqError(f"a compiled ringseq op names batch {number}, which is gone: the compiled layers read "
                           f"their batch from the patched forward (or ringseq.shard_batch's local['ringseq']), "
                           f"which must stay alive while its layers run")
    return found


def refuse_recompute(what: str) -> None:
    """A compiled op run inside a backward without an eager checkpoint's store: torch's checkpoint
    recomputing a compiled layer without ringseq's policy (``keep.save_ring``)."""
    if torch._C._current_graph_task_id() != -1 and keep.current() is None:
        raise RingSeqError(f"a compiled layer under activation checkpointing recomputes its {what} in the "
                           "backward, which ringseq does not do (its exchanges would run again, its batch gone): "
                           "checkpoint through transformers (gradient_checkpointing=True / "
                           "gradient_checkpointing_enable(), which ringseq makes save the ring's outputs), or "
                           "pass torch.utils.checkpoint a policy that saves them: context_fn=functools.partial("
                           "create_selective_checkpoint_contexts, ringseq.attention.keep.save_ring)")


def keeps_graph(train: bool) -> bool:
    """Whether a compiled op's forward keeps its eager graph for a backward: in training, unless it
    is the first forward of an eagerly checkpointed layer (recomputed before its backward)."""
    kept = keep.current()
    return train and not (kept is not None and not kept.replaying)


def keep_graph(number: int, outs: tuple, leaves: tuple) -> int:
    """Keep an op's eager autograd graph (``outs`` computed from ``leaves``) for its backward op,
    under a new call number."""
    call = next(_call_numbers)
    _pending[call] = _Pending(number, outs, leaves)
    _forget_old(number)
    return call


def kept_graphs() -> set[int]:
    """The calls whose eager autograd graphs compiled ops keep for their backward now (what compiled
    checkpointing must not keep: it holds ring outputs and batches only)."""
    return {call for call, p in _pending.items() if isinstance(p, _Pending)}


def hold_batch(number: int, found) -> int:
    """Hold ``found`` (batch ``number``) for a compiled op's backward, which recomputes its eager
    part (a recurrent layer's kernel under compiled checkpointing), under a new call number."""
    call = next(_call_numbers)
    _pending[call] = _Kept(number, found, [], ())
    _forget_old(number)
    return call


def held_batch(call: int):
    """The batch ``hold_batch`` held for ``call`` (once)."""
    kept = _pending.pop(call, None)
    if kept is None:
        raise RingSeqError(GONE)
    return kept.found


def gradients_of(call: int, douts, inputs: tuple = ()) -> list:
    """The kept graph ``call``'s gradients for its leaves, as ``op_gradients`` makes them (the
    backward op's other tensor ``inputs`` besides ``douts``)."""
    pending = _pending.pop(call, None)
    if pending is None:
        raise RingSeqError(GONE)
    with _autograd():
        grads = torch.autograd.grad(pending.outs, pending.leaves, douts, allow_unused=True)
    return op_gradients(grads, pending.leaves, (*douts, *inputs))


def op_gradients(grads, leaves, inputs: tuple) -> list:
    """``grads`` of ``leaves`` as a backward op may return them: zeros where a leaf was unused, each
    contiguous and aliasing neither the op's ``inputs`` nor another (an op's outputs may not alias)."""
    grads = [torch.zeros_like(t) if g is None else g.contiguous() for g, t in zip(grads, leaves)]
    seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None}
    for i, g in enumerate(grads):
        if g.untyped_storage().data_ptr() in seen:
            grads[i] = g = g.clone()
        seen.add(g.untyped_storage().data_ptr())
    return grads


def _forget_old(number: int) -> None:
    """Keep the graphs of the ``KEEP_BATCHES`` latest batches that wait for a backward."""
    if number in _waiting:
        return
    _waiting.append(number)
    for old in _waiting[:-KEEP_BATCHES]:
        for call in [c for c, p in _pending.items() if p.batch == old]:
            del _pending[call]
    del _waiting[:-KEEP_BATCHES]


@_forward.register_fake
def _(q, k, v, sinks, batch, scale, window, softcap, train, lean):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), torch.empty((), dtype=torch.long, device="cpu")


@torch.library.custom_op("ringseq::ring_attention_backward", mutates_args=(), tags=OP_TAGS)
def _backward(dout: torch.Tensor, call: torch.Tensor, q_shape: list[int], k_shape: list[int], v_shape: list[int],
              sinks: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept eager graph's gradients."""
    return _with_sinks(gradients_of(int(call), (dout,), (sinks,)), dout, sinks)


@_backward.register_fake
def _(dout, call, q_shape, k_shape, v_shape, sinks):
    return (dout.new_empty(q_shape), dout.new_empty(k_shape), dout.new_empty(v_shape),
            dout.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape))


@torch.library.custom_op("ringseq::ring_attention_replay", mutates_args=(), tags=OP_TAGS)
def _replay(dout: torch.Tensor, call: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            sinks: Optional[torch.Tensor], out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                    torch.Tensor]:
    """A checkpointed call's gradients: the ring's autograd rebuilt around its kept output from q, k
    and v (``keep``'s replay: no block compute, no K/V transfer), then the eager ring's backward."""
    kept = _pending.pop(int(call), None)
    if kept is None:
        raise RingSeqError(GONE)
    replay = keep.Kept()
    replay.entries, replay.replaying = [(out if e[0] is None else e[0], *e[1:]) for e in kept.entries], True
    with _autograd(), torch.enable_grad(), keep.using(replay):
        leaves = tuple(None if t is None else t.detach().requires_grad_() for t in (q, k, v, sinks))
        again = _ring(kept.found, *leaves, kept.args)
        grads = torch.autograd.grad(again, [t for t in leaves if t is not None], dout, allow_unused=True)
    grads = op_gradients(grads, [t for t in leaves if t is not None], (dout, q, k, v, sinks, out))
    return _with_sinks(grads, dout, sinks)


@_replay.register_fake
def _(dout, call, q, k, v, sinks, out):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),  # contiguous, as the op makes them
            dout.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape))


def _with_sinks(grads: list, dout, sinks) -> tuple:
    """dq, dk, dv and dsinks (an empty tensor where the call had no sinks)."""
    return tuple(grads) if sinks is not None else (*grads, dout.new_empty(0))


def _setup(ctx, inputs, output):
    q, k, v, sinks = inputs[:4]
    ctx.sinks, ctx.lean = sinks is not None, inputs[-1]
    if ctx.lean:  # q, k, v and the output: saved by the compiled graph (q, k, v recomputed, checkpointed)
        ctx.save_for_backward(output[1], sinks, q, k, v, output[0])
    else:  # the kept graph holds its own
        ctx.shapes = (list(q.shape), list(k.shape), list(v.shape))
        ctx.save_for_backward(output[1], sinks)


def _gradients(ctx, dout, _call):
    call, sinks, *saved = ctx.saved_tensors
    if ctx.lean:
        q, k, v, out = saved
        dq, dk, dv, dsinks = torch.ops.ringseq.ring_attention_replay(dout.contiguous(), call, q, k, v, sinks, out)
    else:
        dq, dk, dv, dsinks = torch.ops.ringseq.ring_attention_backward(dout.contiguous(), call, *ctx.shapes, sinks)
    return dq, dk, dv, dsinks if ctx.sinks else None, None, None, None, None, None, None


torch.library.register_autograd("ringseq::ring_attention", _gradients, setup_context=_setup)


def attend(q, k, v, *, batch, scale=None, window=None, softcap=None, sinks=None) -> torch.Tensor:
    """The patched attention's ring call as the compiled graph sees it (traced by dynamo): q, k,
    v cast as ``ring_attention`` casts them under autocast, then one ``ringseq::ring_attention``."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    train = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
    out, _ = torch.ops.ringseq.ring_attention(q, k, v, sinks, batch.key, -1.0 if scale is None else float(scale),
                                              -1 if window is None else int(window),
                                              0.0 if softcap is None else float(softcap), train,
                                              getattr(batch, "checkpointed", False))
    return out
