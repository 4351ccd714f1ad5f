"""``ringseq.GRPOTrainer``: TRL's ``GRPOTrainer`` with the prompt + completion sequences sharded
over the sequence group (``pip install "ringseq[trl]"``).

A sequence group acts as one TRL process; data-parallel replicas act as TRL's processes:

* **log-probs** - TRL scores completions with its fused LM head (``fused_lm_head=True``). The
  patched forward answers it (``patches.fused_head``): the decoder runs on this rank's shard of
  prompt + completion, TRL's own chunked kernel scores this rank's tokens at GRPO's temperature
  (no [S, V] logits), and the per-token log-probs and entropies are all-gathered into global
  order. Every rank then computes TRL's loss from exactly the one-process numbers; its backward
  gives this rank's share of each gradient (the gradient rule), summed over the group and
  averaged over replicas by the Trainer glue. The policy, the reference model (``beta > 0``:
  patched too, or the PEFT model with its adapter off) and the old policy are scored this way.
* **rollouts** - every rank of a group draws the same prompts (the data is sharded over
  replicas) and generates with the patched model's ``generate`` (prompt prefilled through the
  ring, KV cache sharded, sampling with group rank 0's random state: the same completions on every
  rank, checked at every decode step). TRL seeds each process with ``seed + process index``;
  here a group is seeded with ``seed + replica index``, so with one replica the completions are
  one-process TRL's under the same seed.
* **batch arithmetic** - while TRL counts processes (the slice of a generation batch a process
  keeps, token counts, the DAPO normaliser, reward gathers, metric reductions) it sees one
  process per replica: ``self.accelerator`` answers ``num_processes`` / ``process_index`` /
  ``gather`` / ``reduce`` over the replicas, and so do the ``gather`` / ``gather_object`` its
  module calls. ``generation_batch_size`` counts replicas: ringseq keeps ``steps_per_generation``
  and sets it to ``per_device_train_batch_size x replicas x steps_per_generation``.
* **rewards** - computed once per group, on group rank 0, and broadcast to the group (reward
  *models* run on every rank, since ZeRO-3 needs every rank in their forward, and rank 0's
  result is broadcast all the same).

Refused, each with the fix: vLLM rollouts (served or colocated: not the patched model's
numbers), transformers' continuous batching, Liger kernels, tools / environments / a custom
``rollout_func`` (they would run once per rank of a group), vision-language models (the
patched VLM does not generate yet).
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

from ringseq import lockstep, versions
from ringseq.errors import RingSeqError

from .accelerate_glue import _gather_replicas
from .trainer import SequenceParallelMixin, check_arguments, import_trl, resolve_sp

trl = import_trl("ringseq.GRPOTrainer (it answers TRL's fused LM head)")
from trl.trainer import grpo_trainer as _trl_grpo  # noqa: E402  (after the version check)

logger = logging.getLogger(__name__)


def _refuse(args, kwargs: dict) -> None:
    check_arguments(args, {})
    if args.use_vllm:
        raise RingSeqError("ringseq.GRPOTrainer generates with the patched model (the prompt prefilled through the "
                           "ring); vLLM's rollouts come from another engine whose numbers ringseq cannot match: set "
                           "use_vllm=False")
    if getattr(args, "use_transformers_continuous_batching", False):
        raise RingSeqError("transformers' continuous batching (generate_batch) runs its own paged cache, not ringseq's "
                           "sharded one: set use_transformers_continuous_batching=False")
    if getattr(args, "use_liger_kernel", False):
        raise RingSeqError("Liger kernels replace the model's forward; ringseq's patched forward must stay: "
                           "set use_liger_kernel=False")
    for name in ("tools", "environment_factory", "rollout_func"):
        if kwargs.get(name):
            raise RingSeqError(f"ringseq.GRPOTrainer does not take {name}: it would run once on every rank of a "
                               f"sequence group; train agentic rollouts with trl.GRPOTrainer (without sequence "
                               f"parallelism), or score completions with reward_funcs")


def _refuse_model(model) -> None:
    config = getattr(model, "config", None)
    if config is not None and config.get_text_config() is not config:
        raise RingSeqError("ringseq.GRPOTrainer trains text models: a patched vision-language model does not generate "
                           "(ringseq.unpatch it, or train it with ringseq.SFTTrainer)")


def _replica_batches(args, sp) -> None:
    """TRL sized the generation batch by processes (``args.world_size``); a sequence group is one
    process: keep ``steps_per_generation``, count the batch over replicas."""
    if sp.size == 1:
        return
    per_step = args.per_device_train_batch_size * sp.dp_size
    size = per_step * args.steps_per_generation
    if size != args.generation_batch_size:
        logger.warning("ringseq: generation_batch_size counts data-parallel replicas (%d), not processes (%d): "
                       "%d -> %d (per_device_train_batch_size %d x %d replicas x steps_per_generation %d)",
                       sp.dp_size, args.world_size, args.generation_batch_size, size,
                       args.per_device_train_batch_size, sp.dp_size, args.steps_per_generation)
    if size % args.num_generations:
        raise RingSeqError(f"a generation batch of {size} completions (per_device_train_batch_size "
                           f"{args.per_device_train_batch_size} x {sp.dp_size} replica(s) x steps_per_generation "
                           f"{args.steps_per_generation}; a sequence group counts as one process) does not split into "
                           f"groups of num_generations={args.num_generations}: raise per_device_train_batch_size or "
                           f"steps_per_generation, or lower num_generations")
    evals = args.num_generations_eval or args.num_generations
    if args.eval_strategy != "no" and (args.per_device_eval_batch_size * sp.dp_size) % evals:
        raise RingSeqError(f"the eval batch (per_device_eval_batch_size {args.per_device_eval_batch_size} x "
                           f"{sp.dp_size} replica(s)) does not split into groups of {evals} generations: set "
                           f"per_device_eval_batch_size to a multiple of {evals}")
    args.generation_batch_size = size


class _ReplicaView:
    """``self.accelerator`` as TRL's GRPO code sees it while it counts processes: one process per
    data-parallel replica. Everything else is the Accelerator's own."""

    def __init__(self, accelerator, sp):
        self._accelerator, self._sp = accelerator, sp

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    @property
    def num_processes(self) -> int:
        return self._sp.dp_size

    @property
    def process_index(self) -> int:
        return self._sp.dp_rank

    def gather(self, tensor):
        return _gather(self._sp, tensor)

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        out = tensor.clone()
        if self._sp.dp_size > 1:
            dist.all_reduce(out, group=self._sp.dp_group)
        if reduction == "mean":
            out = out / self._sp.dp_size
        elif reduction != "sum":
            raise RingSeqError(f"this TRL reduces with {reduction!r} while ringseq counts replicas; ringseq supports "
                               f"'sum' and 'mean': install trl>={versions.RANGES['trl'][0]},"
                               f"<{versions.RANGES['trl'][1]}")
        return out * scale


def _gather(sp, tensor):
    """accelerate's ``gather`` over the replicas (in one replica: the tensor, a scalar as one element)."""
    if sp.dp_size > 1:
        return _gather_replicas(sp, tensor)
    return tensor[None] if tensor.dim() == 0 else tensor


def _gather_object(sp, obj) -> list:
    """accelerate's ``gather_object`` over the replicas: the lists of every replica, concatenated."""
    if sp.dp_size == 1:
        return list(obj)
    parts = [None] * sp.dp_size
    dist.all_gather_object(parts, obj, group=sp.dp_group)
    return [x for part in parts for x in part]


def _share_rewards(sp, rewards: torch.Tensor) -> torch.Tensor:
    """Group rank 0's rewards on every rank of the group (bounded wait, agreed shapes)."""
    lockstep.agree(sp, "rewards", {"completions": rewards.size(0), "reward functions": rewards.size(1)})
    gloo = sp.check_group is not None or not sp.nccl  # the lockstep group is gloo (host memory) when there is one
    t = rewards.detach().to("cpu" if gloo else rewards.device, torch.float32).contiguous()
    work = dist.broadcast(t, src=sp.ranks[0], group=sp.check_group or sp.group, async_op=True)
    lockstep.wait(work, sp, "group rank 0's rewards", peer=sp.ranks[0], gloo=gloo)
    return t.to(rewards.device)


class GRPOTrainer(SequenceParallelMixin, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` whose log-prob passes and updates run with the sequence sharded over
    ``sp`` (a ``SequenceParallel`` from ``ringseq.init``; None: the ``"ringseq"`` section of
    ``args.deepspeed`` or ``RINGSEQ_*``). Create ``sp`` before the ``GRPOConfig``. ``model`` may
    be a model, a PEFT model or an id/path TRL loads; it (and the reference model) is patched
    after TRL has prepared it. ``per_device_train_batch_size`` counts completions per sequence
    group. Every other argument is TRL's; see the module docstring for what is refused."""

    def __init__(self, model=None, reward_funcs=None, args=None, *rest, sp=None, **kwargs):
        from ringseq import patch, unpatch
        from ringseq.patches.lifecycle import options

        versions.require_feature("generation", "ringseq.GRPOTrainer (its rollouts are the patched model's generate)")
        self.sp = resolve_sp(sp, args)
        if args is None:  # TRL's default, made here so that its batch sizes can count replicas
            name = model if isinstance(model, str) else model.config._name_or_path
            args = trl.GRPOConfig(f"{str(name).split('/')[-1] or 'model'}-GRPO")
        _refuse(args, kwargs)
        _refuse_model(None if isinstance(model, str) else model)
        _replica_batches(args, self.sp)
        chosen = {} if isinstance(model, str) else options(model)
        if chosen:
            unpatch(model)  # TRL installs its fused head on the plain model; ringseq patches after it
        if args.deepspeed:  # TRL wraps the reference model in its own DeepSpeed engine inside __init__, before
            from .deepspeed_glue import join_deepspeed_comm  # the Trainer does: DeepSpeed must see the world

            join_deepspeed_comm()
        with self._module_calls(seeding=True):
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
        from ringseq.patches.fused_head import configure

        head = dict(temperature=self.temperature, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32)
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        _refuse_model(base)  # a model TRL loaded from an id
        configure(patch(base, sp=self.sp, **chosen), **head)
        if self.ref_model is not None:
            configure(patch(self.accelerator.unwrap_model(self.ref_model), sp=self.sp, **chosen), **head)

    @contextlib.contextmanager
    def _module_calls(self, seeding: bool = False):
        """TRL's GRPO module calls ``gather`` / ``gather_object`` (and ``set_seed`` in its
        ``__init__``) by name: over the replicas, a group seeded as one process, for the call."""
        from accelerate.utils import set_seed

        sp = self.sp
        names = ("gather", "gather_object", "set_seed")
        missing = [name for name in names if not hasattr(_trl_grpo, name)]
        if missing:
            raise RingSeqError(f"TRL {trl.__version__}'s GRPO module has no {missing}, which ringseq.GRPOTrainer makes "
                               f"count replicas: install trl>={versions.RANGES['trl'][0]},<{versions.RANGES['trl'][1]}")
        saved = {name: getattr(_trl_grpo, name) for name in names}

        def seed(value, device_specific=False, deterministic=False):
            set_seed(value + (sp.dp_rank if device_specific else 0), deterministic=deterministic)

        _trl_grpo.gather = lambda tensor: _gather(sp, tensor)
        _trl_grpo.gather_object = lambda obj: _gather_object(sp, obj)
        if seeding:
            _trl_grpo.set_seed = seed
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(_trl_grpo, name, value)

    @contextlib.contextmanager
    def _one_process_per_group(self):
        """While TRL's GRPO code runs: ``self.accelerator`` and its module's gathers count replicas."""
        if isinstance(self.accelerator, _ReplicaView) or self.sp.size == 1:
            yield
            return
        real = self.accelerator
        self.accelerator = _ReplicaView(real, self.sp)
        try:
            with self._module_calls():
                yield
        finally:
            self.accelerator = real

    def _prepare_inputs(self, generation_batch):
        with self._one_process_per_group():
            return super()._prepare_inputs(generation_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with self._one_process_per_group():
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """Rewards once per group (reward models: on every rank), group rank 0's for all."""
        if self.sp.size == 1:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        models = any(isinstance(f, torch.nn.Module) for f in self.reward_funcs)
        if models or self.sp.rank == 0:
            try:
                rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            except BaseException as exc:
                lockstep.mark_failed(self.sp, f"a reward function: {type(exc).__name__}: {exc}")
                raise
        else:
            rows = len(prompts) * self.sp.dp_size  # every replica's completions, as TRL's gather returns them
            rewards = torch.empty(rows, len(self.reward_funcs), device=self.accelerator.device)
        return _share_rewards(self.sp, rewards)
