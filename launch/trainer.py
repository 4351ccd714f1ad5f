"""``ringseq.Trainer``: ``transformers.Trainer`` with sequence parallelism.

What changes against the stock Trainer, and why:

* the model is patched (``ringseq.patch``): every rank of a sequence group is handed the same
  full batch and keeps its own slice of it, labels shifted on the full sequence first;
* the dataloaders are sharded over data-parallel replicas, not processes
  (``ringseq.launch.accelerate_glue``), so an optimizer step covers
  ``per_device_train_batch_size x gradient_accumulation_steps x dp_size`` samples;
* gradients are summed over the sequence group and averaged over replicas (DeepSpeed through
  ringseq's mpu, DDP through a communication hook), under ZeRO 0-3;
* the token count that normalises the loss (``num_items_in_batch``) is counted once per
  replica: the stock Trainer gathers it from every process, which counts each sequence group's
  batch ``sp_size`` times, and scales the loss by the world size instead of the replicas;
* evaluation gathers one loss per replica, and ``num_input_tokens_seen`` counts each group's
  batch once.

Resuming from a checkpoint skips the batches already seen exactly as the stock Trainer does:
the sharded dataloader skips the same batches on every rank of a group.
"""
from __future__ import annotations

import functools
import inspect

import transformers

from ringseq.config import from_ds_config, from_env
from ringseq.errors import RingSeqError

from .accelerate_glue import prepare_accelerator
from .deepspeed_glue import load_ds_config


def _ds_section(args):
    """The ``"ringseq"`` section of the TrainingArguments' ds_config, or None."""
    return from_ds_config(load_ds_config(getattr(args, "deepspeed", None)))[0]


def resolve_sp(sp, args):
    """``sp`` as given (checked against a ds_config section), else the section, else RINGSEQ_*."""
    section = _ds_section(args)
    if sp is None:
        return (section or from_env()).init()
    if section is not None:
        section.check_matches(sp)
    return sp


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` that trains ``model`` with sequence parallelism over ``sp``.

    ``sp``: a ``SequenceParallel`` from ``ringseq.init``; when None, the ``"ringseq"`` section of
    ``args.deepspeed`` or the ``RINGSEQ_*`` variables (default: one sequence over all ranks).
    Create it (``ringseq.init``) before the ``TrainingArguments`` when several processes run, so
    Accelerate finds the process group. Raises ``RingSeqError`` for what ringseq cannot do
    exactly: label smoothing, a custom ``compute_loss_func``, ``compute_metrics`` on logits (the
    patched model never holds the full logits), the ``batch_rebalance`` sampler (it deals batches
    per process), Accelerate's own sequence parallelism.
    """

    def __init__(self, model=None, args=None, *rest, sp=None, **kwargs):
        self.sp = resolve_sp(sp, args)  # first: TrainingArguments must find the process group
        if args is None:
            args = transformers.TrainingArguments(output_dir="tmp_trainer")  # the stock Trainer's default
        if getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
            raise RingSeqError('train_sampling_strategy="batch_rebalance" deals batches to every process; with '
                               "ringseq a sequence group shares one batch: use random, sequential or group_by_length")
        if args.label_smoothing_factor:
            raise RingSeqError("label smoothing is not available: the patched model computes plain cross-entropy")
        for name in ("compute_loss_func", "compute_metrics", "preprocess_logits_for_metrics"):
            if kwargs.get(name) is not None:
                raise RingSeqError(f"ringseq.Trainer does not take {name}: the patched model returns the exact loss, "
                                   f"never the full logits; evaluate the loss, or unpatch to predict")
        from ringseq import patch

        if model is not None:
            patch(model, sp=self.sp)
        if kwargs.get("model_init") is not None:
            user_init = kwargs["model_init"]
            kwargs["model_init"] = functools.wraps(user_init)(lambda *a: patch(user_init(*a), sp=self.sp))
        super().__init__(model, args, *rest, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        prepare_accelerator(self.accelerator, sp=self.sp)
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(self.gather_function,
                                                     use_gather_object=self.args.eval_use_gather_object)

    def get_total_train_batch_size(self, args) -> int:
        return self._train_batch_size * args.gradient_accumulation_steps * self.sp.dp_size

    def _get_num_items_in_batch(self, batch_samples, device):
        count = super()._get_num_items_in_batch(batch_samples, device)
        if count is not None and self.args.average_tokens_across_devices and self.args.world_size > 1:
            count = count / self.sp.size  # gathered from every process: each group's batch sp_size times
        return count

    def _track_num_input_tokens(self, inputs):
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)  # gathered from every process: each batch sp_size times
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self.sp.size

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if num_items_in_batch is not None:
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
        outputs = model(**inputs)
        if outputs.loss is None:
            raise RingSeqError(f"the batch has no labels (keys {sorted(inputs)}); ringseq.Trainer trains on labels")
        loss = outputs.loss
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # normalised by every replica's tokens; replicas are then averaged: undo that mean
            loss = loss * self.sp.dp_size
        return (loss, outputs) if return_outputs else loss
