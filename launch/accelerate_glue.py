"""Accelerate with ringseq: one call, ``ringseq.prepare_accelerator(accelerator, sp=sp)``.

Accelerate has no plugin slot for another kind of sequence parallelism (its ``sp_size`` is wired
to DeepSpeed Ulysses, its ``cp_size`` to torch's SDPA ring), so ringseq adjusts one ``Accelerator``
instance, before its ``prepare`` is called, where the sequence group matters (FSDP2 and
``cp_size``: ``ringseq.launch.accelerate_fsdp``):

* **data** - ``prepare_data_loader`` shards over the data-parallel replicas only, so every rank
  of a sequence group draws the same batch (the patched model shards it along the sequence);
* **gradients** - nothing: under ringseq's gradient rule (``ringseq.gradients``) the plain average
  over every process that DDP, FSDP2 and DeepSpeed make is exact; a DeepSpeed engine is made by
  ``ringseq.initialize`` (Accelerate's batch size already counts processes, as DeepSpeed does);
* **metrics** - ``gather_for_metrics`` gathers one copy per sequence group (over the replicas).

Without a GPU, Accelerate decides from the launcher's environment that there is no process group
(``accelerate launch --multi_gpu`` or ``--use_deepspeed`` on CPU: no backend, so every process
reports itself alone). ``prepare_accelerator(sp=sp)`` without an accelerator therefore creates
one itself, after settling Accelerate's shared process state on the gloo group that
``ringseq.init`` made: MULTI_CPU (DDP over gloo), or DeepSpeed over gloo when the launcher asked
for DeepSpeed. An Accelerator made by hand that sees fewer processes than the group is refused.
"""
from __future__ import annotations

import contextlib
import os
import types

import torch
import torch.distributed as dist

from ringseq import versions
from ringseq.errors import RingSeqError

from . import accelerate_fsdp


def check_world(accelerator, sp) -> None:
    """Refuse an Accelerator that sees fewer processes than the process group (made before it)."""
    if accelerator.num_processes != dist.get_world_size():
        raise RingSeqError(f"Accelerate sees {accelerator.num_processes} process(es) but the process group has "
                           f"{dist.get_world_size()} (without a GPU Accelerate finds no backend by itself): let "
                           f"ringseq.prepare_accelerator(sp=sp) create the Accelerator, or call ringseq.init() "
                           f"before TrainingArguments")


def _gather_replicas(sp, data):
    """All-gather tensors (nested) over the data-parallel replicas, concatenated along dim 0."""
    from accelerate.utils import recursively_apply

    def gather_one(tensor):
        tensor = tensor.contiguous()
        if tensor.dim() == 0:
            tensor = tensor[None]
        parts = [torch.empty_like(tensor) for _ in range(sp.dp_size)]
        dist.all_gather(parts, tensor, group=sp.dp_group)
        return torch.cat(parts)

    return recursively_apply(gather_one, data, error_on_other_type=True)


@contextlib.contextmanager
def _deepspeed_with_sp(sp):
    """Route Accelerate's ``deepspeed.initialize(**kwargs)`` through ``ringseq.initialize``."""
    import deepspeed

    from .deepspeed_glue import initialize_with

    original = deepspeed.initialize

    def initialize(*, config=None, config_params=None, **kwargs):
        config = dict(config if config is not None else config_params)
        return initialize_with(original, sp=sp, config=config, batch_over="ranks", **kwargs)

    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = original


def _settle_cpu_state() -> None:
    """Before the first Accelerator, on CPU with several processes: make Accelerate's shared
    state join the existing gloo group instead of deciding there is none."""
    from accelerate import PartialState

    if PartialState._shared_state or torch.cuda.is_available() or dist.get_world_size() == 1:
        return
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        PartialState(backend="gloo")  # DeepSpeed's comm layer wraps the gloo group
    else:
        PartialState(cpu=True)  # MULTI_CPU: DDP over gloo


def prepare_accelerator(accelerator=None, *, sp, **accelerator_kwargs):
    """Make ``accelerator.prepare`` and ``gather_for_metrics`` follow ``sp``'s topology.

    Call after ``ringseq.init`` and before ``accelerator.prepare``. With no ``accelerator``,
    creates ``accelerate.Accelerator(**accelerator_kwargs)`` on the process group ringseq joined
    (on CPU too; FSDP2 too, ``ringseq.launch.accelerate_fsdp``). Returns the accelerator. Raises
    ``RingSeqError`` when Accelerate's Ulysses or tensor parallelism is configured too, a ``cp_size``
    that is not ringseq's sequence group, or when Accelerate missed the process group.
    """
    versions.require("accelerate", "ringseq.prepare_accelerator (it overrides Accelerator._prepare_deepspeed, "
                                   "prepare_data_loader and PartialState's shared state)")
    from accelerate import Accelerator
    from accelerate.data_loader import prepare_data_loader
    from accelerate.utils import DistributedType

    if accelerator is None:
        _settle_cpu_state()
        accelerate_fsdp.settle_on_cpu(accelerator_kwargs.get("fsdp_plugin"), accelerator_kwargs.get("parallelism_config"))
        accelerator = Accelerator(**accelerator_kwargs)
    elif accelerator_kwargs:
        raise RingSeqError(f"Accelerator arguments {sorted(accelerator_kwargs)} are for a new Accelerator; "
                           f"this one is already made")

    if getattr(accelerator, "_ringseq", None) is not None:
        if accelerator._ringseq is not sp:
            raise RingSeqError("this Accelerator is already prepared for another ringseq topology")
        return accelerator
    accelerate_fsdp.check_context_parallel(accelerator, sp)
    check_world(accelerator, sp)
    accelerate_fsdp.no_torch_context_parallel(accelerator)
    accelerator._ringseq = sp
    cls = type(accelerator)

    def prepare_data_loader_(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return cls.prepare_data_loader(self, data_loader, device_placement, slice_fn_for_dispatch)
        if self.dispatch_batches:
            raise RingSeqError("dispatch_batches=True sends each process a different slice of one batch; with "
                               "ringseq every rank of a sequence group needs the whole batch: leave it off")
        placement = self.device_placement if device_placement is None else device_placement
        prepared = prepare_data_loader(
            data_loader, self.device, num_processes=sp.dp_size, process_index=sp.dp_rank,
            split_batches=self.split_batches, put_on_device=placement, rng_types=self.rng_types.copy(),
            dispatch_batches=False, even_batches=self.even_batches, use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed, non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader)
        self._dataloaders.append(prepared)
        return prepared

    def prepare_deepspeed_(self, *args):
        with _deepspeed_with_sp(sp):
            return cls._prepare_deepspeed(self, *args)

    def gather_for_metrics_(self, input_data, use_gather_object=False):
        if use_gather_object:
            parts = [None] * sp.dp_size
            dist.all_gather_object(parts, input_data, group=sp.dp_group)
            data = [x for part in parts for x in (part if isinstance(part, list) else [part])]
        else:
            data = _gather_replicas(sp, input_data)
        state = self.gradient_state
        if state.end_of_dataloader and state.remainder > 0:  # drop the samples padded in for even batches
            from accelerate.utils import recursively_apply

            keep = state.remainder
            data = data[:keep] if use_gather_object else recursively_apply(lambda t: t[:keep], data)
        return data

    accelerator.prepare_data_loader = types.MethodType(prepare_data_loader_, accelerator)
    accelerator.gather_for_metrics = types.MethodType(gather_for_metrics_, accelerator)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        accelerator._prepare_deepspeed = types.MethodType(prepare_deepspeed_, accelerator)
    return accelerator
