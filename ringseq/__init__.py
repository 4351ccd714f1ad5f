"""ringseq: exact ring attention for fine-tuning Hugging Face models on long sequences.

Public API (see README.md): ``init``, ``SequenceParallel``, ``ring_attention``, ``shard``,
``gather``, ``shard_batch``, ``token_info``, ``loss.cross_entropy``, ``patch``, ``unpatch``,
``config``, ``stats`` (straggler report), ``resync`` (back in step after an error in a raw loop),
``plan`` (cost model), ``RingSeqError``; ``initialize`` (DeepSpeed), ``Trainer`` (HF Trainer),
``SFTTrainer`` and ``GRPOTrainer`` (TRL, the ``trl`` extra) and ``prepare_accelerator``
(Accelerate) import their third-party libraries on first use.
"""
from . import config, loss
from .attention import ring_attention, token_info
from .batch import shard_batch
from .errors import RingSeqError
from .layouts import LAYOUTS
from .lockstep import resync
from .planner import plan
from .sharding import gather, shard
from .stats import stats
from .topology import SequenceParallel, init

__version__ = "0.1.0"

__all__ = ["GRPOTrainer", "LAYOUTS", "RingSeqError", "SFTTrainer", "SequenceParallel", "Trainer", "config", "gather",
           "init", "initialize", "join_deepspeed", "loss", "patch", "plan", "prepare_accelerator", "resync",
           "ring_attention", "shard", "shard_batch", "stats", "token_info", "unpatch"]


def __getattr__(name):
    # classes (users subclass them), imported with their library on first use
    if name == "Trainer":
        from .launch.trainer import Trainer

        return Trainer
    if name == "SFTTrainer":  # needs the trl extra: pip install "ringseq[trl]"
        from .launch.sft_trainer import SFTTrainer

        return SFTTrainer
    if name == "GRPOTrainer":  # needs the trl extra
        from .launch.grpo_trainer import GRPOTrainer

        return GRPOTrainer
    raise AttributeError(f"module 'ringseq' has no attribute {name!r}")


def patch(model, *, sp, chunked_loss: bool = True, tiled_mlp=None, keep_ring_outputs: bool = True,
          split_vision: bool = False, head_groups=None, fit: bool = False, memory_budget=None):
    """Patch a transformers causal LM or vision-language model for sequence parallelism (see
    ``ringseq.patches``); ``fit=True``: the planner picks the memory switches for each length
    (``ringseq.patches.fit``)."""
    from .patches.lifecycle import patch as _patch

    return _patch(model, sp=sp, chunked_loss=chunked_loss, tiled_mlp=tiled_mlp, keep_ring_outputs=keep_ring_outputs,
                  split_vision=split_vision, head_groups=head_groups, fit=fit, memory_budget=memory_budget)


def initialize(*, sp=None, model=None, config=None, model_parameters=None, optimizer=None, **kwargs):
    """``deepspeed.initialize`` with sequence parallelism (see ``ringseq.launch.deepspeed_glue``)."""
    from .launch.deepspeed_glue import initialize as _initialize

    return _initialize(sp=sp, model=model, config=config, model_parameters=model_parameters, optimizer=optimizer,
                       **kwargs)


def join_deepspeed():
    """Join DeepSpeed's comm layer now (see ``ringseq.launch.deepspeed_glue.join_deepspeed_comm``).

    ``ringseq.initialize``, ``ringseq.Trainer`` and Accelerate with DeepSpeed do this themselves.
    Call it only to build a ZeRO-3 model *before* them on CPU: ``from_pretrained`` under a
    ZeRO-3 ``TrainingArguments(use_cpu=True)`` (on GPU, TrainingArguments joins it already).
    """
    from .launch.deepspeed_glue import join_deepspeed_comm

    join_deepspeed_comm()


def unpatch(model):
    """Undo ``patch``: the model is exactly as it was."""
    from .patches.lifecycle import unpatch as _unpatch

    return _unpatch(model)


def prepare_accelerator(accelerator=None, *, sp, **accelerator_kwargs):
    """An ``accelerate.Accelerator`` (given, or made from ``accelerator_kwargs``) that follows
    ``sp`` (see ``ringseq.launch.accelerate_glue``)."""
    from .launch.accelerate_glue import prepare_accelerator as _prepare

    return _prepare(accelerator, sp=sp, **accelerator_kwargs)
