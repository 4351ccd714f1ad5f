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

torch's own ``checkpoint_wrapper`` (torchtitan's way: each decoder layer wrapped, then compiled) with
ringseq's policy (``context_fn=partial(create_selective_checkpoint_contexts, save_ring)``): the wrapper
gets a forward pre-hook (``wrap`` too) that, while dynamo traces it, hands the layer the batch's
``in_checkpoint`` twin, as ``keep.compiled_checkpoint`` does for transformers' checkpointing. The ring
and recurrent ops then know they are checkpointed and keep what eager keeping keeps (the log-sum-exp;
the recurrent kernel runs again in the backward) instead of their whole eager graphs. A wrapper with
another policy is left alone (its recompute would run the ring again, which the op refuses by name).
"""
from __future__ import annotations

import functools
import inspect

import torch

from ringseq.attention.keep import checkpoint_keeping_ring, checkpointed, save_ring


def _layers(model):
    return [m for m in model.modules() if "_gradient_checkpointing_func" in vars(m)]


def _saving_ring(module) -> bool:
    """Whether ``module`` is torch's ``checkpoint_wrapper`` (non-reentrant) under ``save_ring``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if not isinstance(module, CheckpointWrapper):
        return False
    keywords = getattr(getattr(module, "checkpoint_fn", None), "keywords", None) or {}
    policy = keywords.get("context_fn")
    return (keywords.get("use_reentrant") is False and isinstance(policy, functools.partial)
            and policy.func is create_selective_checkpoint_contexts and policy.args[:1] == (save_ring,))


def _hand_twin(module, args, kwargs):
    """A ``checkpoint_wrapper`` under ``save_ring``, traced by dynamo: the layer gets the batch's
    checkpointed twin."""
    return (args, checkpointed(kwargs)) if torch.compiler.is_compiling() else None


def _hook_wrappers(model) -> None:
    for module in model.modules():
        if "_ringseq_twin" not in vars(module) and _saving_ring(module):
            module._ringseq_twin = module.register_forward_pre_hook(_hand_twin, with_kwargs=True)


def wrap(model, offload: bool, keep: bool = True) -> None:
    """Make every checkpointed layer's checkpoint function keep ring outputs (``keep``) and
    offload (``offload``), and torch's checkpoint wrappers under ``save_ring`` hand their layers the
    checkpointed twin under compile; idempotent."""
    _hook_wrappers(model)
    for layer in _layers(model):
        fn = layer._gradient_checkpointing_func
        if getattr(fn, "keeps_ring", False):
            if (fn.offload, fn.keep) == (offload, keep):
                continue
            fn = fn.wrapped
        layer._gradient_checkpointing_func = checkpoint_keeping_ring(fn, offload=offload, keep=keep)


def unwrap(model) -> None:
    for module in model.modules():
        if "_ringseq_twin" in vars(module):
            vars(module).pop("_ringseq_twin").remove()
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
