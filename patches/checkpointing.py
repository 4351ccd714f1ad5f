"""Checkpointed decoder layers keep their ring outputs, so their recompute never replays the ring.

What is patched, and why: transformers puts a checkpoint function on every checkpointed layer
(``layer._gradient_checkpointing_func``) when ``gradient_checkpointing_enable`` /
``activation_checkpointing_enable`` (or the Trainer's ``gradient_checkpointing=True``) runs, and
the layer calls it with its own forward. ringseq wraps that function on the layer
(``ringseq.attention.keep.checkpoint_keeping_ring``): the first forward keeps each ring call's
output and log-sum-exp, the recompute reuses them. The wrapping is done by the patched forward
before each run of the decoder, so checkpointing enabled before or after ``patch`` (under any
transformers 5.x) is covered; ``unwrap`` (from ``unpatch``) puts the plain functions back.

Offload (transformers' ``offload=True``; ``gradient_checkpointing_kwargs={"offload": True}`` in
the Trainer): ringseq takes the option over when checkpointing is enabled after ``patch`` (as the
Trainer does), through an instance-level ``activation_checkpointing_enable``: transformers'
own version pins host memory even on a machine without a GPU (where pinning fails), and it
cannot move the kept ring outputs, which are not saved tensors. ringseq's moves both the saved
layer inputs and the kept ring outputs to host memory (``ringseq.attention.keep``). Enabled
before ``patch``, transformers' offload stays as it is and the ring outputs stay on the device.

torch's own ``checkpoint_wrapper`` (torchtitan's way, each decoder layer wrapped, then compiled; and FSDP's
own activation checkpointing, ``apply_activation_checkpointing``, which Accelerate's
``fsdp_activation_checkpointing`` applies) gets the same: ``wrap`` puts ``checkpoint_keeping_ring`` around the
wrapper's ``checkpoint_fn`` when it is torch's checkpoint with no policy of its own or with ringseq's
``save_ring`` (``context_fn=partial(create_selective_checkpoint_contexts, save_ring)``). Eagerly the recompute
then takes the ring's kept outputs; under compile the region is torch's selective checkpointing under
``save_ring`` with the batch's ``in_checkpoint`` twin (``keep.compiled_checkpoint``), so the ring and recurrent
ops keep what eager keeping keeps. A wrapper with another policy is left alone (its compiled recompute would run
the ring again, which the op refuses by name).
"""
from __future__ import annotations

import functools
import inspect

import torch
from torch._dynamo.eval_frame import OptimizedModule

from ringseq.attention.keep import checkpoint_keeping_ring, save_ring
from ringseq.errors import RingSeqError


COMPILED_INSIDE = ("torch's checkpoint_wrapper was put around a decoder layer that was compiled already (e.g. "
                   "FSDP's or Accelerate's activation checkpointing applied to layers compiled by layer.compile()): "
                   "its recompute would compile and run the layer's graph anew instead of taking the ring's kept "
                   "outputs. Compile after wrapping (torchtitan's order: checkpoint_wrapper, then compile, then "
                   "fully_shard), compile the whole model (TrainingArguments(torch_compile=True)), or checkpoint "
                   "through transformers (gradient_checkpointing=True)")


def _layers(model):
    return [m for m in model.modules() if "_gradient_checkpointing_func" in vars(m)]


def _wrapped_checkpoints(model):
    """torch's ``checkpoint_wrapper`` modules in ``model`` whose checkpoint is torch's with no policy of its
    own or with ringseq's ``save_ring`` (as wrapped by ``checkpoint_keeping_ring`` or not yet)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    for module in model.modules():
        if not isinstance(module, CheckpointWrapper):
            continue
        fn = getattr(module.checkpoint_fn, "wrapped", module.checkpoint_fn)
        if not (isinstance(fn, functools.partial) and fn.func is checkpoint):
            continue
        policy = fn.keywords.get("context_fn")
        if policy is None or (isinstance(policy, functools.partial) and policy.func is create_selective_checkpoint_contexts
                              and policy.args[:1] == (save_ring,)):
            yield module


def _keeping(fn, offload: bool, keep: bool):
    """``fn`` (a checkpoint function) wrapped to keep ring outputs with these settings (``fn`` itself when it is)."""
    if getattr(fn, "keeps_ring", False):
        if (fn.offload, fn.keep) == (offload, keep):
            return fn
        fn = fn.wrapped
    return checkpoint_keeping_ring(fn, offload=offload, keep=keep)


def wrap(model, offload: bool, keep: bool = True) -> None:
    """Make every checkpointed layer's checkpoint function (transformers' on the layer, torch's
    ``checkpoint_wrapper``'s) keep ring outputs (``keep``) and offload (``offload``); idempotent."""
    for wrapper in _wrapped_checkpoints(model):
        inner = wrapper._checkpoint_wrapped_module
        if getattr(inner, "_compiled_call_impl", None) is not None or isinstance(inner, OptimizedModule):
            raise RingSeqError(COMPILED_INSIDE)
        wrapper.checkpoint_fn = _keeping(wrapper.checkpoint_fn, offload, keep)
    for layer in _layers(model):
        layer._gradient_checkpointing_func = _keeping(layer._gradient_checkpointing_func, offload, keep)


def unwrap(model) -> None:
    for wrapper in _wrapped_checkpoints(model):
        wrapper.checkpoint_fn = getattr(wrapper.checkpoint_fn, "wrapped", wrapper.checkpoint_fn)
    for layer in _layers(model):
        fn = layer._gradient_checkpointing_func
        if getattr(fn, "keeps_ring", False):
            layer._gradient_checkpointing_func = fn.wrapped
    if "activation_checkpointing_enable" in vars(model):
        del model.activation_checkpointing_enable


def watch_offload(model, handle) -> None:
    """Take transformers' ``offload`` option over (recorded on ``handle``) whenever checkpointing
    is enabled."""
    enable = getattr(type(model), "activation_checkpointing_enable", None)
    if enable is None or "offload" not in inspect.signature(enable).parameters:
        return  # a transformers release without the option

    @functools.wraps(enable)
    def activation_checkpointing_enable(*args, **kwargs):
        bound = inspect.signature(enable).bind(model, *args, **kwargs)
        handle.offload = bool(bound.arguments.get("offload", False))
        bound.arguments["offload"] = False  # ringseq's checkpoint wrapper offloads instead
        return enable(*bound.args, **bound.kwargs)

    model.activation_checkpointing_enable = activation_checkpointing_enable
