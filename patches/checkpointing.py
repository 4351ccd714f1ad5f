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
"""
from __future__ import annotations

import functools
import inspect

from ringseq.attention.keep import checkpoint_keeping_ring


def _layers(model):
    return [m for m in model.modules() if "_gradient_checkpointing_func" in vars(m)]


def wrap(model, offload: bool, keep: bool = True) -> None:
    """Make every checkpointed layer's checkpoint function keep ring outputs (``keep``) and
    offload (``offload``); idempotent."""
    for layer in _layers(model):
        fn = layer._gradient_checkpointing_func
        if getattr(fn, "keeps_ring", False):
            if (fn.offload, fn.keep) == (offload, keep):
                continue
            fn = fn.wrapped
        layer._gradient_checkpointing_func = checkpoint_keeping_ring(fn, offload=offload, keep=keep)


def unwrap(model) -> None:
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
