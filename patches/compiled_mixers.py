"""The recurrent layers' sharded kernels as one PyTorch custom op, for hybrids under ``torch.compile``.

Under ringseq a hybrid's recurrent kernel (``patches.mixers``) runs on this rank's runs of tokens
and exchanges their states or convolution halos with the other ranks (``ringseq.recurrent``):
Python that talks to other processes, which dynamo cannot trace. So under ``torch.compile`` each
call is one opaque op, ``ringseq::recurrent``, whose implementation is that eager path (the
family's own kernel, the agreed exchanges, the fold), and whose gradient runs the eager graph it
kept (``ringseq::kept_backward``). In a compiled checkpointed region (the batch's ``in_checkpoint``
twin, which ``keep.compiled_checkpoint`` hands the layer) it keeps no graph: its backward,
``ringseq::recurrent_backward``, runs the kernel again on its inputs (which the compiled graph
recomputes), exchange included, as eager checkpointing does, and the layer holds no kernel internals
until its backward. The mixer around it (projections, gates, norms) compiles with the rest of the
layer: one graph.

A kernel's arguments reach the op as a list of tensors, a list of ints (sizes and flags), a list
of floats and a string, in the order its ``_Kernel`` names them; the batch as its 0-d ``key``.
Which dispatcher (and so which family's kernel) is a number fixed when the dispatcher is made.
A call with arguments the op does not carry (a starting state, packed-document tables) goes the
eager way, where ringseq refuses what it cannot shard.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch

from ringseq.attention import compiled
from ringseq.errors import RingSeqError


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """How one kernel's call is carried by the op. ``order``: its signature's arguments in order
    (as callers pass them positionally); ``tensors``, ``ints`` (sizes and flags), ``floats`` (a
    tuple's items) and ``text``: the ones the op carries, every other must be None; ``fake``: its
    outputs' shapes and dtypes (out, final state or None) from the tensors and ints; ``final``:
    the flag asking for the final state (a generation's prefill); ``pair``: it returns (out,
    state or None) even without that flag."""

    order: tuple[str, ...]
    tensors: tuple[str, ...]
    ints: tuple[str, ...]
    floats: tuple[str, ...]
    text: Optional[str]
    defaults: dict
    fake: Callable
    final: Optional[str] = None
    pair: bool = False


def _conv_fake(t, ints):
    return t[0].new_empty(t[0].shape), None


def _delta_fake(t, ints):
    query, value = t[0], t[2]
    state = None
    if ints[1]:
        B, _, H, Dv = value.shape
        state = value.new_empty((B, H, t[1].shape[-1], Dv), dtype=torch.float32)
    return query.new_empty(value.shape), state


def _mamba2_fake(t, ints):
    x, B = t[0], t[3]
    state = None
    if ints[2]:
        b, _, H, Pd = x.shape
        state = x.new_empty((b, H, Pd, B.shape[-1]), dtype=torch.float32)
    return x.new_empty(x.shape, dtype=torch.float32), state


_DELTA = _Kernel(order=("query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state",
                        "use_qk_l2norm_in_kernel"),
                 tensors=("query", "key", "value", "g", "beta"),
                 ints=("chunk_size", "output_final_state", "use_qk_l2norm_in_kernel"), floats=(), text=None,
                 defaults={"chunk_size": 64, "output_final_state": False, "use_qk_l2norm_in_kernel": False},
                 fake=_delta_fake, final="output_final_state", pair=True)
KERNELS = {
    "causal_conv1d_fn": _Kernel(order=("hidden_states", "weight", "bias", "activation"),
                                tensors=("hidden_states", "weight", "bias"), ints=(), floats=(), text="activation",
                                defaults={"bias": None, "activation": None}, fake=_conv_fake),
    "torch_chunk_gated_delta_rule": _DELTA,
    "chunk_kimi_delta_attention": _DELTA,
    "mamba2_chunk_scan": _Kernel(order=("hidden_states", "dt", "A", "B", "C", "chunk_size", "D", "dt_bias",
                                        "initial_states", "dt_softplus", "dt_limit", "return_final_states"),
                                 tensors=("hidden_states", "dt", "A", "B", "C", "D", "dt_bias"),
                                 ints=("chunk_size", "dt_softplus", "return_final_states"), floats=("dt_limit",),
                                 text=None, defaults={"D": None, "dt_bias": None, "dt_softplus": False,
                                                      "dt_limit": (0.0, math.inf), "return_final_states": False},
                                 fake=_mamba2_fake, final="return_final_states"),
}
"""The sharded kernels the op carries, by name (``patches.mixers.SHARDED``); the others run eagerly."""

_UNUSED = ("use_cache", "position_embeddings", "return_dict")
"""Keyword arguments the models hand down to their kernels, which take and ignore them (``**kwargs``),
besides the ``output_*`` flags (``output_router_logits``, which ringseq's router loss sets, and the like)."""


def _ignored(key: str) -> bool:
    return key in _UNUSED or key.startswith("output_")


_runners: dict[int, tuple[str, Callable]] = {}
"""dispatcher number -> (kernel name, the eager sharded call ``run(batch, **arguments)``)."""


def register(number: int, name: str, run: Callable) -> None:
    """Make dispatcher ``number``'s eager sharded call reachable from the op."""
    _runners[number] = (name, run)


def _bind(kernel: _Kernel, args: tuple, kwargs: dict):
    """The call's arguments by name, or None when it passes one the op does not carry."""
    if len(args) > len(kernel.order):
        return None
    named = {**kernel.defaults, **dict(zip(kernel.order, args)), **kwargs}
    carried = {*kernel.tensors, *kernel.ints, *kernel.floats, kernel.text}
    if any(value is not None for key, value in named.items() if key not in carried and not _ignored(key)):
        return None  # a starting state, packed documents' tables, a gate: the eager path decides
    if any(key not in named for key in kernel.tensors[:2] + kernel.ints[:1]):
        return None
    return named


def call(number: int, batch, args: tuple, kwargs: dict):
    """Dispatcher ``number``'s sharded kernel call as the compiled graph sees it (traced by dynamo):
    one ``ringseq::recurrent``; NotImplemented when the call is one for the eager path."""
    kernel = KERNELS[_runners[number][0]]
    named = _bind(kernel, args, kwargs)
    if named is None:
        return NotImplemented
    given = [named.get(n) for n in kernel.tensors]
    # the tensors given (torch's autograd for custom ops loses a list's gradients when it holds a None),
    # which ones they are: the first int, a bit each
    tensors = [t for t in given if t is not None]
    ints = [sum(1 << i for i, t in enumerate(given) if t is not None), *(int(named[n]) for n in kernel.ints)]
    # never empty: the registered autograd would then want an empty list for its gradient, not None
    floats = [float(x) for n in kernel.floats for x in named[n]] or [0.0]
    text = "" if kernel.text is None or named[kernel.text] is None else str(named[kernel.text])
    train = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    out, state, _ = torch.ops.ringseq.recurrent(number, tensors, batch.key, ints, floats, text, train,
                                                batch.checkpointed)
    final = kernel.final is not None and named[kernel.final]
    if final or kernel.pair:
        return out, state if final else None
    return out


def _given(kernel: _Kernel, tensors, ints) -> list:
    """The kernel's tensor arguments in order, None where the call gave none (``call``)."""
    at = iter(tensors)
    return [next(at) if ints[0] >> i & 1 else None for i in range(len(kernel.tensors))]


def _unbind(kernel: _Kernel, tensors, ints, floats, text) -> dict:
    named = dict(zip(kernel.tensors, _given(kernel, tensors, ints)))
    named.update((n, bool(v) if n != "chunk_size" else v) for n, v in zip(kernel.ints, ints[1:]))
    if kernel.floats:  # one tuple (mamba2's dt_limit)
        named[kernel.floats[0]] = tuple(floats)
    if kernel.text is not None:
        named[kernel.text] = text or None
    return named


def _described(t) -> str:
    return "nothing" if t is None else f"{tuple(t.shape)} {t.dtype}"


@torch.library.custom_op("ringseq::recurrent", mutates_args=(), tags=compiled.OP_TAGS)
def _recurrent(number: int, tensors: list[torch.Tensor], batch: torch.Tensor, ints: list[int],
               floats: list[float], text: str, train: bool,
               recompute: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    name, run = _runners[number]
    compiled.refuse_recompute(name)
    found = compiled.batch_of(batch)
    retain = compiled.keeps_graph(train)
    graph = retain and not recompute  # else the backward runs the kernel again (``_recurrent_backward``)
    kernel = KERNELS[name]
    with compiled._autograd(), torch.set_grad_enabled(graph):
        # the kept graph owns copies of its inputs: the compiled graph may reuse their memory
        leaves = [(t.detach().clone() if graph else t.detach()).requires_grad_(graph and t.is_floating_point())
                  for t in tensors]
        result = run(found, **_unbind(kernel, leaves, ints, floats, text))
    out, state = (result, None) if isinstance(result, torch.Tensor) else (result[0], result[1])
    promised = kernel.fake(_given(kernel, [t.detach() for t in tensors], ints), ints[1:])
    for got, want in zip((out, state), promised):
        if (got is None) != (want is None) or got is not None and (got.shape, got.dtype) != (want.shape, want.dtype):
            raise RingSeqError(f"{name} under ringseq returned {_described(got)} where the compiled op promised "
                               f"{_described(want)}: this kernel's release is not one ringseq's compiled path "
                               f"knows; run the model without torch.compile")
    call = 0
    if graph and out.requires_grad:
        call = compiled.keep_graph(int(batch), (out,), tuple(t for t in leaves if t.requires_grad))
    elif retain and recompute:
        call = compiled.hold_batch(int(batch), found)
    state = out.new_empty(0) if state is None else state.detach().clone(memory_format=torch.contiguous_format)
    return out.detach().clone(memory_format=torch.contiguous_format), state, torch.tensor(call, dtype=torch.long)


@_recurrent.register_fake
def _(number, tensors, batch, ints, floats, text, train, recompute):
    kernel = KERNELS[_runners[number][0]]
    out, state = kernel.fake(_given(kernel, tensors, ints), ints[1:])
    return out, out.new_empty(0) if state is None else state, torch.empty((), dtype=torch.long, device="cpu")


_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@torch.library.custom_op("ringseq::kept_backward", mutates_args=(), tags=compiled.OP_TAGS)
def _kept_backward(dout: torch.Tensor, call: torch.Tensor, shapes: list[int], ndims: list[int],
                   dtypes: list[int]) -> list[torch.Tensor]:
    """The gradients of a kept eager graph's leaves (the op's floating-point tensor inputs, in order)."""
    return compiled.gradients_of(int(call), (dout,))


@_kept_backward.register_fake
def _(dout, call, shapes, ndims, dtypes):
    grads, at = [], 0
    for n, code in zip(ndims, dtypes):
        grads.append(dout.new_empty(shapes[at:at + n], dtype=_DTYPES[code]))
        at += n
    return grads


@torch.library.custom_op("ringseq::recurrent_backward", mutates_args=(), tags=compiled.OP_TAGS)
def _recurrent_backward(dout: torch.Tensor, call: torch.Tensor, tensors: list[torch.Tensor], number: int,
                        ints: list[int], floats: list[float], text: str) -> list[torch.Tensor]:
    """The gradients of the op's floating-point tensor inputs (in order), its kernel run again on them
    with autograd (under compiled checkpointing the forward kept no graph: what eager checkpointing
    recomputes, exchange included, every rank in the same order)."""
    name, run = _runners[number]
    found = compiled.held_batch(int(call))
    with compiled._autograd(), torch.enable_grad():
        leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
        result = run(found, **_unbind(KERNELS[name], leaves, ints, floats, text))
        out = result if isinstance(result, torch.Tensor) else result[0]
        wanted = [t for t in leaves if t.requires_grad]
        grads = torch.autograd.grad(out, wanted, dout, allow_unused=True)
    return compiled.op_gradients(grads, wanted, (dout, *tensors))


@_recurrent_backward.register_fake
def _(dout, call, tensors, number, ints, floats, text):
    return [t.new_empty(t.shape) for t in tensors if t.is_floating_point()]


def _setup(ctx, inputs, output):
    number, tensors, _, ints, floats, text, _, recompute = inputs
    ctx.differentiable = [t.is_floating_point() for t in tensors]
    kept = [t for t, d in zip(tensors, ctx.differentiable) if d]
    ctx.shapes = [n for t in kept for n in t.shape]
    ctx.ndims = [t.dim() for t in kept]
    ctx.dtypes = [_DTYPES.index(t.dtype) for t in kept]
    ctx.recompute = (number, ints, floats, text) if recompute else None
    # recomputing: the inputs, which the compiled graph saves or (checkpointed) recomputes itself
    ctx.save_for_backward(output[2], *(tensors if recompute else ()))
    ctx.mark_non_differentiable(output[1], output[2])


def _gradients(ctx, dout, _state, _call):
    call, *tensors = ctx.saved_tensors
    if ctx.recompute is not None:
        grads = iter(torch.ops.ringseq.recurrent_backward(dout.contiguous(), call, tensors, *ctx.recompute))
    else:
        grads = iter(torch.ops.ringseq.kept_backward(dout.contiguous(), call, ctx.shapes, ctx.ndims, ctx.dtypes))
    tensors = [next(grads) if d else None for d in ctx.differentiable]
    return None, tensors, None, None, None, None, None, None


torch.library.register_autograd("ringseq::recurrent", _gradients, setup_context=_setup)
