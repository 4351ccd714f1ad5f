"""``ringseq.SFTTrainer``: TRL's ``SFTTrainer`` with sequence parallelism (``pip install "ringseq[trl]"``).

TRL's SFTTrainer computes its loss and its logged metrics (``entropy``, ``mean_token_accuracy``,
``num_tokens``) from a fused LM head that it installs on the model's forward and that calls the
decoder directly. ringseq lets TRL set everything up (model from an id, PEFT adapter, collator,
packing), then patches the base model: the patched forward answers ``fused_lm_head=True``
itself (``ringseq.patches.fused_head``), returning the per-token fields of the whole sequence
on every rank, so TRL's own loss and metrics are the one-process ones. What the sequence group
changes in the Trainer underneath is ``ringseq.launch.trainer.SequenceParallelMixin``.

Supported: ``packing`` (TRL's padding-free packing with position ids), ``padding_free``,
``completion_only_loss`` and ``assistant_only_loss`` (their labels), both loss types (``nll``,
``dft``), gradient accumulation, evaluation, a ``peft_config``, a model given as an id or path,
``bf16``/``fp16``, DDP and DeepSpeed ZeRO 0-3, the MoE router auxiliary loss
(``router_aux_loss_coef``: that of the whole sequence, ``patches.router_loss``), hybrid models,
vision-language models on TRL's vision datasets (messages + images, its vision collator: the
images are encoded on the full batch, ``patches.vision``). Refused by name:
``compute_loss_func``, label smoothing, ``compute_metrics`` / ``preprocess_logits_for_metrics``
(TRL deprecates them; its own metrics are logged), Liger kernels.
"""
from __future__ import annotations

from ringseq.errors import RingSeqError

from .trainer import SequenceParallelMixin, check_arguments, import_trl, resolve_sp

trl = import_trl("ringseq.SFTTrainer (it answers TRL's fused LM head)")


def _refuse(args, kwargs: dict) -> None:
    check_arguments(args, {k: v for k, v in kwargs.items() if k != "compute_metrics"})
    for name in ("compute_metrics", "preprocess_logits_for_metrics"):
        if kwargs.get(name) is not None:
            raise RingSeqError(f"ringseq.SFTTrainer does not take {name} (TRL deprecates it: its logits come from an "
                               f"extra forward); TRL logs entropy and mean_token_accuracy itself, or use "
                               f"ringseq.Trainer, whose metrics run slab by slab")
    if getattr(args, "use_liger_kernel", False):
        raise RingSeqError("Liger kernels replace the model's forward; ringseq's patched forward must stay: "
                           "set use_liger_kernel=False")


class SFTTrainer(SequenceParallelMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` that trains with sequence parallelism over ``sp`` (a ``SequenceParallel``
    from ``ringseq.init``; None: the ``"ringseq"`` section of ``args.deepspeed`` or ``RINGSEQ_*``).
    ``model`` may be a model, a PEFT model, or an id/path TRL loads; it is patched after TRL has
    prepared it. Every other argument is TRL's."""

    def __init__(self, model=None, args=None, *rest, sp=None, **kwargs):
        from ringseq import patch, unpatch
        from ringseq.patches.lifecycle import options

        self.sp = resolve_sp(sp, args)  # first: TrainingArguments must find the process group
        if args is not None:
            _refuse(args, kwargs)
        chosen = {} if isinstance(model, str) else options(model)  # a model the user patched keeps its options
        if chosen:
            unpatch(model)  # TRL installs its fused head on the plain model; ringseq patches after it
        super().__init__(model, args, *rest, **kwargs)
        patch(self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model, sp=self.sp,
              **chosen)
        self._pad_collator_to_layout()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # TRL multiplies the token loss by every process (DDP averages over all of them) and then adds the
            # MoE router loss, a per-micro-batch mean; ringseq's gradients are averaged over the replicas only
            aux = 0.0
            if self.aux_loss_enabled and getattr(outputs, "aux_loss", None) is not None:
                aux = self.router_aux_loss_coef * outputs.aux_loss / self.current_gradient_accumulation_steps
            loss = self._replica_loss((loss - aux) / self.accelerator.num_processes, num_items_in_batch) + aux
        return (loss, outputs) if return_outputs else loss
