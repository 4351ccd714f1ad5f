"""Recurrent layers of hybrid models on the rank's shard: the families' own kernels, state passed.

What is patched, and why: the sequence mixers of hybrid families (gated DeltaNet, KDA, Mamba2,
short convolutions) call module-level kernel functions of their modeling file
(``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``,
``mamba2_chunk_scan``; behind each, transformers' hub wrapper picks FLA, causal-conv1d,
mamba-ssm or the PyTorch fallback). transformers has no registry for them, and the mixers'
forwards read them by global name, so ringseq replaces those globals in the modeling module
with dispatchers: a call that carries the ``ringseq`` keyword argument (the patched forward's
``ShardedBatch``, which transformers passes from the model down to these functions) runs the
family's kernel on this rank's runs with state passing (``ringseq.recurrent``); any other call
(an unpatched model in the same process) goes to the original function unchanged. The fused
Mamba2 kernel (``mamba2_split_conv1d_scan_combined``, mamba-ssm's one-call mixer) answers None
under ringseq, so the mixer takes its own split path (convolution, then scan). In a generation's
prefill the kernels also return the state after the whole prompt (every run folded, the same on
every rank); its decode steps (``ringseq`` is a ``DecodeStep``) run the family's own step
functions unchanged, on every rank alike. The originals come back when the last patched model
using a module is unpatched.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import sys
import weakref

import torch

from ringseq import lockstep, recurrent
from ringseq.errors import RingSeqError

from . import compiled_mixers
from .cache import DecodeStep

# The mixers ringseq shards exactly (tested against the unpatched model in tests/integration),
# by class name; any other sequence-mixing module is refused by name (``patches.checks``).
MIXERS = {
    "Qwen3_5GatedDeltaNet": "gated DeltaNet", "Qwen3_5MoeGatedDeltaNet": "gated DeltaNet",
    "Qwen3NextGatedDeltaNet": "gated DeltaNet", "OlmoHybridGatedDeltaNet": "gated DeltaNet",
    "KimiLinearDeltaAttention": "KDA", "BambaMixer": "Mamba2", "GraniteMoeHybridMambaLayer": "Mamba2",
    "NemotronHMamba2Mixer": "Mamba2", "FalconH1Mixer": "Mamba2", "Zamba2MambaMixer": "Mamba2",
    "Lfm2ShortConv": "short convolution",
    "Lfm2MoeShortConv": "short convolution",
}
DECODE_ONLY = ("causal_conv1d_update", "torch_recurrent_gated_delta_rule", "recurrent_kimi_delta_attention",
               "mamba2_selective_state_update")


def _conv(original, batch, hidden_states, weight, bias=None, activation=None, **kwargs):
    return recurrent.causal_conv(lambda x, w, **kw: original(x, w, **kw), hidden_states, weight, batch, bias=bias,
                                 activation=activation, **kwargs)


def _no_state(name, initial):
    if initial is not None:
        raise RingSeqError(f"{name} was called with a recurrent state to start from under ringseq: a sharded "
                           f"prompt starts from the zero state (generation continues a filled cache one token at "
                           f"a time); pass the whole sequence as the prompt")


def _delta_rule(original, batch, query, key, value, g, beta, chunk_size=64, initial_state=None,
                output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """Gated DeltaNet / KDA on this rank's runs (the kernel in float32, as its torch fallback
    computes anyway, so the widened columns are not rounded to a half dtype)."""
    _no_state(original.__name__, initial_state)
    if kwargs.get("cu_seqlens") is not None:
        raise RingSeqError("cu_seq_lens describe packed documents whose recurrent states reset at their starts; "
                           "ringseq cannot reset them: pass packed documents as position_ids only (the recurrent "
                           "layers then run across documents, as transformers' PyTorch path does)")
    Dk = key.size(-1)

    def run(part, init):
        return original(part["query"], part["key"], part["value"], g=part["g"], beta=part["beta"],
                        chunk_size=chunk_size, initial_state=init, output_final_state=True,
                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)

    inputs = {"query": query.float(), "key": key.float(), "value": value.float(), "g": g.float(),
              "beta": beta.float()}
    out = recurrent.state_passing(recurrent.DeltaRule, run, inputs, "value", Dk, batch, whole=output_final_state)
    if output_final_state:  # a generation's prefill: the state after the whole prompt, for its cache
        return out[0].to(query.dtype), out[1]
    return out.to(query.dtype), None


def _mamba2(original, batch, hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
            dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    """Mamba2's chunked scan on this rank's runs (float32 output, as the PyTorch scan returns)."""
    _no_state(original.__name__, initial_states)
    if kwargs.get("seq_idx") is not None:
        raise RingSeqError("seq_idx describes packed documents whose states reset at their starts; ringseq cannot "
                           "reset them: pass packed documents as position_ids only")
    N = B.size(-1)

    def run(part, init):
        return original(part["x"], part["dt"], A, part["B"], part["C"], chunk_size=chunk_size, D=D, dt_bias=dt_bias,
                        initial_states=init, dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=True,
                        **kwargs)

    # x, B and C in float32, as the PyTorch scan computes them anyway (mamba-ssm would return its output in x's
    # dtype, rounding the widened columns); dt as the mixer gives it: the scan's own arithmetic on it runs in its dtype
    inputs = {"x": hidden_states.float(), "dt": dt, "B": B.float(), "C": C.float()}
    return recurrent.state_passing(recurrent.Mamba2, run, inputs, "x", N, batch, whole=return_final_states)


def _fused_mamba2(original, batch, *args, **kwargs):
    return None  # the mixer then runs its split path: convolution and scan, each sharded


def _decode_only(original, batch, *args, **kwargs):
    raise RingSeqError(f"{original.__name__} steps a cache one token at a time, but it was called on a sharded "
                       f"sequence: the model stepped its cache inside a prefill, which ringseq does not reproduce")


SHARDED = {"causal_conv1d_fn": _conv, "torch_chunk_gated_delta_rule": _delta_rule,
           "chunk_kimi_delta_attention": _delta_rule, "mamba2_chunk_scan": _mamba2,
           "mamba2_split_conv1d_scan_combined": _fused_mamba2, **{name: _decode_only for name in DECODE_ONLY}}

_users: dict[str, weakref.WeakSet] = {}
"""modeling module name -> the patch handles of models whose mixers live there."""


_IN_FORWARD = contextvars.ContextVar("ringseq_patched_forward", default=False)
_forwards = 0
"""Patched forwards running in this process: what compiled code reads (dynamo cannot read a ContextVar)."""


@contextlib.contextmanager
def patched_forward():
    """Inside a patched forward, a recurrent kernel called without ringseq's batch would mix this
    rank's tokens alone (a family that stopped handing its keyword arguments down): refused."""
    global _forwards
    token = _IN_FORWARD.set(True)
    _forwards += 1
    try:
        with lockstep.batched():  # its ring calls' failures reach the peers at the batch's agreements
            yield
    finally:
        _forwards -= 1
        _IN_FORWARD.reset(token)


def _in_forward() -> bool:
    return _forwards > 0 if torch.compiler.is_compiling() else _IN_FORWARD.get()


def _named(original, name: str):
    """``original`` as a function called ``name``. transformers >= 5.25 makes its kernel functions
    instances of the kernels hub's ``Func`` module (so a model can swap in a hub kernel), which have
    no ``__name__`` and whose attributes ``functools.wraps`` should not copy."""
    if getattr(original, "__name__", None) == name:
        return original

    def call(*args, **kwargs):
        return original(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


_dispatchers = itertools.count(1)
_numbers: dict[tuple, int] = {}
"""(kernel, name) -> its dispatcher's number: one per kernel, however often its module is patched anew."""


def _dispatcher(original, name: str):
    kernel = _named(original, name)
    number = _numbers.get((original, name))
    if number is None:
        number = _numbers[original, name] = next(_dispatchers)
        if name in compiled_mixers.KERNELS:  # under torch.compile: one op (``patches.compiled_mixers``)
            compiled_mixers.register(number, name, lambda batch, **kw: SHARDED[name](kernel, batch, **kw))

    @functools.wraps(kernel)
    def dispatch(*args, ringseq=None, **kwargs):
        if isinstance(ringseq, DecodeStep):  # generation's decode: every rank steps the same states alike
            return original(*args, **kwargs)
        if ringseq is not None:
            if torch.compiler.is_compiling() and name in compiled_mixers.KERNELS:
                out = compiled_mixers.call(number, ringseq, args, kwargs)
                if out is not NotImplemented:
                    return out
            return SHARDED[name](kernel, ringseq, *args, **kwargs)
        if _in_forward():
            raise RingSeqError(f"{name} was called inside a patched forward without ringseq's batch (the model no "
                               f"longer hands its keyword arguments to its recurrent kernels): it would mix this "
                               f"rank's tokens alone. This transformers release is not one ringseq supports here")
        return original(*args, **kwargs)

    dispatch.ringseq_original, dispatch.ringseq_number = original, number
    return dispatch


def mixer_modules(model) -> list[str]:
    """The modeling modules (by name) whose mixers ``model`` runs."""
    return sorted({type(m).__module__ for m in model.modules() if type(m).__name__ in MIXERS})


def install(model, handle) -> None:
    """Route the mixers' kernels of ``model``'s modeling modules through ringseq (idempotent)."""
    for name in mixer_modules(model):
        module = sys.modules[name]
        for fn_name in SHARDED:
            fn = getattr(module, fn_name, None)
            if fn is not None and not hasattr(fn, "ringseq_original"):
                setattr(module, fn_name, _dispatcher(fn, fn_name))
        _users.setdefault(name, weakref.WeakSet()).add(handle)
    handle.mixer_modules = mixer_modules(model)


def adopt(handle) -> None:
    """A copy of a patched model (its handle deep-copied) uses the same dispatchers."""
    for name in handle.mixer_modules:
        _users.setdefault(name, weakref.WeakSet()).add(handle)


def uninstall(handle) -> None:
    """Put the original kernels back in the modules no other patched model uses."""
    for name in handle.mixer_modules:
        users = _users.get(name)
        if users is None:
            continue
        users.discard(handle)
        if len(users):
            continue
        module = sys.modules[name]
        for fn_name in SHARDED:
            fn = getattr(module, fn_name, None)
            if fn is not None and hasattr(fn, "ringseq_original"):
                setattr(module, fn_name, fn.ringseq_original)
        del _users[name]


def has_recurrent_layers(model) -> bool:
    return any(type(m).__name__ in MIXERS for m in model.modules())
