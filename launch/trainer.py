"""``ringseq.Trainer``: ``transformers.Trainer`` with sequence parallelism.

What changes against the stock Trainer, and why (``SequenceParallelMixin``, shared with
``ringseq.SFTTrainer``):

* the model is patched (``ringseq.patch``): every rank of a sequence group is handed the same
  full batch and keeps its own slice of it, labels shifted on the full sequence first;
* the dataloaders are sharded over data-parallel replicas, not processes
  (``ringseq.launch.accelerate_glue``), so an optimizer step covers
  ``per_device_train_batch_size x gradient_accumulation_steps x dp_size`` samples;
* gradients: the engine's own average over every rank (DDP, FSDP2, DeepSpeed ZeRO 0-3) is exact
  under ringseq's gradient rule (``ringseq.gradients``);
* the token count that normalises the loss (``num_items_in_batch``) is counted once per
  replica: the stock Trainer gathers it from every process, which counts each sequence group's
  batch ``sp_size`` times, and scales the loss by the world size instead of the replicas;
* evaluation gathers one loss per replica, and ``num_input_tokens_seen`` counts each group's
  batch once;
* ``preprocess_logits_for_metrics`` runs on each rank's logits a slab of tokens at a time and
  only its (small) result is gathered, in global token order, for ``compute_metrics``: the
  full-vocabulary logits of a long sequence are never held;
* collators that pad (``pad_to_multiple_of``) pad to a length the layout can split.

Resuming from a checkpoint skips the batches already seen exactly as the stock Trainer does:
the sharded dataloader skips the same batches on every rank of a group.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math

import torch

import transformers

from ringseq import versions
from ringseq.config import from_ds_config, from_env
from ringseq.errors import RingSeqError
from ringseq.layouts import multiple
from ringseq.stats import stats
from ringseq.topology import init, resolve

from .accelerate_fsdp import settle_on_cpu
from .accelerate_glue import prepare_accelerator
from .deepspeed_glue import load_ds_config


def _ds_section(args):
    """The ``"ringseq"`` section of the TrainingArguments' ds_config, or None."""
    return from_ds_config(load_ds_config(getattr(args, "deepspeed", None)))[0]


def resolve_sp(sp, args):
    """``sp`` as given (checked against a ds_config section), else the section, else the
    ``cp_size`` of ``args.parallelism_config`` (Accelerate's context parallelism: ringseq's ring runs
    over its ``cp`` dimension), else RINGSEQ_*."""
    section = _ds_section(args)
    cp = getattr(getattr(args, "parallelism_config", None), "cp_size", None) or 1
    if sp is None and section is None and cp > 1:
        config = from_env()
        if config.sp_size not in (None, cp):
            raise RingSeqError(f"parallelism_config has cp_size={cp} but RINGSEQ_SP_SIZE={config.sp_size}: give one")
        return init(config=dataclasses.replace(config, sp_size=cp))
    return resolve(sp, section)


def import_trl(what: str):
    """TRL, once its version is one ringseq supports (``ringseq.versions``)."""
    versions.require("trl", what)
    import trl

    return trl


def check_arguments(args, kwargs: dict) -> None:
    """Refuse what a sequence-parallel Trainer cannot do exactly, each with the fix."""
    if getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
        raise RingSeqError('train_sampling_strategy="batch_rebalance" deals batches to every process; with '
                           "ringseq a sequence group shares one batch: use random, sequential or group_by_length")
    if args.label_smoothing_factor:
        raise RingSeqError("label smoothing is not available: the patched model computes plain cross-entropy")
    if kwargs.get("compute_loss_func") is not None:
        raise RingSeqError("ringseq.Trainer does not take compute_loss_func: the patched model returns the exact "
                           "global loss, never the full logits; override compute_loss in a subclass instead")
    if kwargs.get("compute_metrics") is not None and kwargs.get("preprocess_logits_for_metrics") is None:
        raise RingSeqError("compute_metrics alone would need the full-vocabulary logits of every token of every "
                           "sequence; pass preprocess_logits_for_metrics too (e.g. lambda logits, labels: "
                           "logits.argmax(-1)): ringseq applies it slab by slab and gathers only its result")


class SequenceParallelMixin:
    """What a ``transformers.Trainer`` (or a TRL trainer built on it) needs for a sequence group
    ``self.sp``: data over replicas, token counts once per replica, metrics slab by slab."""

    def create_accelerator_and_postprocess(self) -> None:
        settle_on_cpu(getattr(self.args, "fsdp_plugin_args", None), getattr(self.args, "parallelism_config", None))
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
        if torch.is_tensor(count):  # the stock count divides by cp_size, for torch's ring's in-place shards
            count = count * self.get_cp_size()
        if count is not None and self.args.average_tokens_across_devices and self.args.world_size > 1:
            count = count / self.sp.size  # gathered from every process: each group's batch sp_size times
        return count

    def _prepare_context_parallel_inputs(self, model, inputs):
        """The patched model shards the full batch itself: torch's context parallelism never runs."""
        return contextlib.nullcontext, inputs

    def _track_num_input_tokens(self, inputs):
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)  # gathered from every process: each batch sp_size times
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self.sp.size

    def _pad_collator_to_layout(self) -> None:
        """A collator that pads to a multiple pads to one the layout can split too (the patched
        forward pads any other length itself)."""
        collator = self.data_collator
        if hasattr(collator, "pad_to_multiple_of") and not getattr(collator, "padding_free", False):
            m = multiple(self.sp.layout, self.sp.ring_size, self.sp.ulysses_size)
            current = collator.pad_to_multiple_of or 1
            collator.pad_to_multiple_of = current * m // math.gcd(current, m)

    def log(self, logs: dict, *args, **kwargs) -> None:
        """Every log (all ranks log at the same steps) also reports the ring's straggler:
        ``ringseq/slowest_rank`` (group rank the others waited for),
        ``ringseq/wait_for_slowest_s`` and ``ringseq/work_max_over_mean`` (the busiest rank's
        attention work over the mean) since the last log (``ringseq.stats``)."""
        if self.sp.size > 1:
            report = stats(sp=self.sp, reset=True)
            logs = {**logs, "ringseq/slowest_rank": report["slowest_rank"],
                    "ringseq/wait_for_slowest_s": round(report["wait_for_slowest_s"], 4),
                    "ringseq/work_max_over_mean": round(report["work_max_over_mean"], 4)}
        super().log(logs, *args, **kwargs)

    def _replica_loss(self, loss, num_items_in_batch):
        """The stock Trainers multiply a loss normalised by every replica's tokens by the number of
        processes (DDP then averages over all of them); ringseq's gradients are averaged over the
        replicas only, so the factor is the number of replicas."""
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            return loss * self.sp.dp_size
        return loss


class Trainer(SequenceParallelMixin, transformers.Trainer):
    """``transformers.Trainer`` that trains ``model`` with sequence parallelism over ``sp``.

    ``sp``: a ``SequenceParallel`` from ``ringseq.init``; when None, the ``"ringseq"`` section of
    ``args.deepspeed`` or the ``RINGSEQ_*`` variables (default: one sequence over all ranks).
    Create it (``ringseq.init``) before the ``TrainingArguments`` when several processes run, so
    Accelerate finds the process group. ``compute_metrics`` works together with
    ``preprocess_logits_for_metrics`` (applied token by token on each rank's shard). Raises
    ``RingSeqError`` for what ringseq cannot do exactly: label smoothing, a custom
    ``compute_loss_func``, ``compute_metrics`` on full logits, the ``batch_rebalance`` sampler
    (it deals batches per process), Accelerate's own sequence parallelism, a model given by name.
    """

    def __init__(self, model=None, args=None, *rest, sp=None, **kwargs):
        if isinstance(model, str):
            raise RingSeqError(f"ringseq.Trainer takes a model object, as transformers.Trainer does: load "
                               f"{model!r} with AutoModelForCausalLM.from_pretrained first (ringseq.SFTTrainer "
                               f"also takes a model id)")
        self.sp = resolve_sp(sp, args)  # first: TrainingArguments must find the process group
        if args is None:
            args = transformers.TrainingArguments(output_dir="tmp_trainer")  # the stock Trainer's default
        check_arguments(args, kwargs)
        # applied inside the patched forward, slab by slab; the stock loop must not apply it again
        self._logits_fn = kwargs.pop("preprocess_logits_for_metrics", None)
        from ringseq import patch
        from ringseq.patches.lifecycle import options

        if model is not None:
            patch(model, sp=self.sp, **options(model))  # a model the user patched keeps its options
        if kwargs.get("model_init") is not None:
            user_init = kwargs["model_init"]
            kwargs["model_init"] = functools.wraps(user_init)(lambda *a: patch(user_init(*a), sp=self.sp))
        super().__init__(model, args, *rest, **kwargs)
        self._pad_collator_to_layout()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if num_items_in_batch is not None:
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
        if return_outputs and self._logits_fn is not None:
            inputs = {**inputs, "logits_fn": self._logits_fn}
        outputs = model(**inputs)
        if outputs.loss is None:
            raise RingSeqError(f"the batch has no labels (keys {sorted(inputs)}); ringseq.Trainer trains on labels")
        loss = self._replica_loss(outputs.loss, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss
