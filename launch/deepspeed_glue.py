"""``ringseq.initialize``: ``deepspeed.initialize`` with sequence parallelism.

DeepSpeed gets an mpu built from ringseq's topology (``sp.mpu``). With it, DeepSpeed 0.19.8
ZeRO stages 0, 1 and 2 reduce gradients over the sequence x data group and divide by the
data-parallel size: exactly ringseq's rule (sum over the sequence group, mean over replicas),
checked against a single-process step by tests/integration/test_deepspeed.py.

ZeRO-3 needs two corrections, both measured on DeepSpeed 0.19.8:

* Given an mpu, DeepSpeed partitions a not-yet-partitioned model over
  ``mpu.get_data_parallel_group()`` (data ranks only), while the optimizer reduces over the
  partition group: with a sequence group each rank then trains on its own partial gradient
  (no reduction at all; the loss stays exact, the step does not). ringseq partitions the
  model itself first, over ``sp.grad_group`` (``deepspeed.zero.Init(module=...)``).
* ZeRO-3's ``reduce_scatter`` path averages over the whole partition group, ignoring the
  sequence size (``sp_size`` times too small); its all-reduce path divides by the data size
  only. ringseq sets ``"reduce_scatter": false`` under ZeRO-3 and refuses an explicit ``true``.
"""
from __future__ import annotations

import json

import torch

from ringseq import versions
from ringseq.config import from_ds_config
from ringseq.errors import RingSeqError
from ringseq.topology import resolve


def join_deepspeed_comm() -> None:
    """Let DeepSpeed's comm layer wrap the existing process group, where DeepSpeed is used
    (``ringseq.initialize``, the Trainer or Accelerate with DeepSpeed, ZeRO-3 ``from_pretrained``).

    ZeRO-3's ``zero.Init`` reads the data-parallel size through the comm layer before it
    initialises it, and silently assumes one process when it is not yet initialised. On CPU,
    joining also starts DeepSpeed's shared-memory all-reduce (a compiled op; its first build
    takes a minute), which is why the core never does this.
    """
    import deepspeed.comm as ds_comm
    import torch.distributed as dist

    if not ds_comm.is_initialized():
        ds_comm.init_distributed(dist_backend=dist.get_backend())
    _release_shm_name()


def _release_shm_name() -> None:
    """Remove the name of this rank's DeepSpeed shared-memory buffer; the buffer stays mapped.

    On CPU, DeepSpeed's comm layer (0.19.8) maps one ~69 MB buffer per rank under /dev/shm,
    named by user, MASTER_ADDR, MASTER_PORT and rank, and never unlinks it: every run left its
    buffers behind in RAM (hundreds after a day of tests). Peers open a rank's buffer by name
    only while the comm layer initialises; past this barrier every rank has, so the names can
    go and the memory is freed when the last process exits. Each rank finds its own name (every
    rank's comm layer made one, or none did: on GPU there is none), so all ranks agree on
    whether to meet at the barrier.
    """
    import os

    import torch.distributed as dist

    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}")
    if os.path.exists(name):
        dist.barrier()
        os.unlink(name)


def load_ds_config(config) -> dict:
    """A ds_config given as a dict, a JSON file path, or None (empty)."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    with open(config) as f:
        return json.load(f)


def zero3_ready(model, sp, ds_config: dict) -> dict:
    """Under ZeRO-3 with a sequence group: partition ``model`` over ``sp.grad_group`` and turn
    ZeRO-3's reduce_scatter off (see the module docstring). Returns the config to use."""
    zero = ds_config.get("zero_optimization", {})
    if zero.get("stage", 0) != 3 or sp.size == 1:
        return ds_config
    if zero.get("reduce_scatter") is True:
        raise RingSeqError('ZeRO-3\'s reduce_scatter averages gradients over the sequence ranks too (DeepSpeed '
                           '0.19.8); remove "reduce_scatter": true from zero_optimization (ringseq turns it off)')
    ds_config = {**ds_config, "zero_optimization": {**zero, "reduce_scatter": False}}
    if model is None:
        return ds_config
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    want = dist.get_process_group_ranks(sp.grad_group)
    params = list(model.parameters())
    for p in params:
        if is_zero_param(p) and dist.get_process_group_ranks(p.ds_process_group) != want:
            raise RingSeqError(f"the model is already partitioned by ZeRO-3 over ranks "
                               f"{dist.get_process_group_ranks(p.ds_process_group)}; with sequence parallelism it "
                               f"must be partitioned over {want} (build it outside zero.Init, or pass "
                               f"data_parallel_group=sp.grad_group to deepspeed.zero.Init)")
    if not any(is_zero_param(p) for p in params):  # a partly converted model keeps its (checked) group
        deepspeed.zero.Init(module=model, data_parallel_group=sp.grad_group, config_dict_or_path=ds_config, mpu=sp.mpu)
    return ds_config


def initialize(*, sp=None, model=None, config=None, model_parameters=None, optimizer=None, **kwargs):
    """``deepspeed.initialize(model=..., config=..., ...)`` plus sequence parallelism.

    ``sp`` is a ``SequenceParallel`` from ``ringseq.init``; when omitted it is built from the
    ds_config's ``"ringseq"`` section (``{"sp_size": 2, "ulysses_size": 1, "layout": "zigzag"}``),
    else from ``RINGSEQ_*`` (default: one sequence over all ranks), as ``ringseq.Trainer`` does.
    The model is patched (``ringseq.patch``) if it is not yet. Returns DeepSpeed's
    ``(engine, optimizer, dataloader, lr_scheduler)``.
    """
    import deepspeed

    return initialize_with(deepspeed.initialize, sp=sp, model=model, config=config,
                           model_parameters=model_parameters, optimizer=optimizer, **kwargs)


def initialize_with(ds_initialize, *, sp=None, model=None, config=None, **kwargs):
    """``initialize`` calling ``ds_initialize`` (``deepspeed.initialize``, or the original of it
    while Accelerate's call is routed here by ``ringseq.launch.accelerate_glue``)."""
    versions.require("deepspeed", "ringseq.initialize (its ZeRO-3 partitioning and reductions are corrected for "
                                  "the release measured)")
    import deepspeed

    from ringseq import patch

    # DeepSpeed's comm layer must know the process group before zero.Init reads the data-parallel
    # size (it silently assumes 1 otherwise); joining also releases its /dev/shm buffer name
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend=None)
    join_deepspeed_comm()
    section, ds_config = from_ds_config(load_ds_config(config))
    sp = resolve(sp, section)
    if kwargs.get("mpu") is not None:
        raise RingSeqError("ringseq.initialize provides the mpu itself; do not pass mpu= (nor Accelerate's sp_size)")
    kwargs.pop("mpu", None)
    if model is not None and getattr(model, "_ringseq_patch", None) is None and hasattr(model, "config"):
        patch(model, sp=sp)
    handle = getattr(model, "_ringseq_patch", None)
    if handle is not None:  # what patch(fit=True) costs: the ZeRO stage's shards of gradients and weights
        stage = ds_config.get("zero_optimization", {}).get("stage", 0)
        handle.zero_stage = stage if isinstance(stage, int) and 0 <= stage <= 3 else 0
    ds_config = zero3_ready(model, sp, ds_config)
    engine, opt, loader, sched = ds_initialize(model=model, config=ds_config, mpu=sp.mpu, **kwargs)
    engine.ringseq = sp
    return engine, opt, loader, sched
