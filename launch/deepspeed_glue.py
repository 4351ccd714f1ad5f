"""``ringseq.initialize``: ``deepspeed.initialize`` with sequence parallelism.

By ringseq's gradient rule (``ringseq.gradients``) each rank's backward leaves P times its share
of every gradient, so DeepSpeed runs as plain data parallelism over every rank: no mpu, so ZeRO
0-3 average each gradient over the world and ZeRO partitions over the world (a model built under
``zero.Init`` or transformers' ZeRO-3 ``from_pretrained`` is already partitioned so). Checked
against a single-process step by tests/integration/test_deepspeed.py. DeepSpeed therefore counts
every rank as a replica; ringseq counts a sequence group as one, so a ``train_batch_size`` in the
config (sequences per step over the replicas) is handed to DeepSpeed times ``sp_size``, and a
``training_data`` loader is dealt over the replicas, not the ranks.
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


def initialize(*, sp=None, model=None, config=None, model_parameters=None, optimizer=None, **kwargs):
    """``deepspeed.initialize(model=..., config=..., ...)`` plus sequence parallelism.

    ``sp`` is a ``SequenceParallel`` from ``ringseq.init``; when omitted it is built from the
    ds_config's ``"ringseq"`` section (``{"sp_size": 2, "ulysses_size": 1, "layout": "zigzag"}``),
    else from ``RINGSEQ_*`` (default: one sequence over all ranks), as ``ringseq.Trainer`` does.
    The model is patched (``ringseq.patch``) if it is not yet. ``train_batch_size`` counts the
    sequences of a step over the replicas (a sequence group holds one at a time), as
    ``per_device_train_batch_size x gradient_accumulation_steps x replicas``. Returns DeepSpeed's
    ``(engine, optimizer, dataloader, lr_scheduler)``.
    """
    import deepspeed

    return initialize_with(deepspeed.initialize, sp=sp, model=model, config=config,
                           model_parameters=model_parameters, optimizer=optimizer, **kwargs)


def initialize_with(ds_initialize, *, sp=None, model=None, config=None, batch_over: str = "replicas", **kwargs):
    """``initialize`` calling ``ds_initialize`` (``deepspeed.initialize``, or the original of it
    while Accelerate's call is routed here by ``ringseq.launch.accelerate_glue``). ``batch_over``:
    whether the config's ``train_batch_size`` counts sequences over the "replicas" (a user's config)
    or over the "ranks" (Accelerate's, made from its process count: DeepSpeed's own count)."""
    versions.require("deepspeed", "ringseq.initialize (its reductions are read for the release measured)")
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
        raise RingSeqError("ringseq.initialize gives DeepSpeed no mpu (every rank is data-parallel under ringseq's "
                           "gradient rule); do not pass mpu= (nor Accelerate's sp_size)")
    kwargs.pop("mpu", None)
    if model is not None and getattr(model, "_ringseq_patch", None) is None and hasattr(model, "config"):
        patch(model, sp=sp)
    handle = getattr(model, "_ringseq_patch", None)
    if handle is not None:  # what patch(fit=True) costs: the ZeRO stage's shards of gradients and weights
        stage = ds_config.get("zero_optimization", {}).get("stage", 0)
        handle.zero_stage = stage if isinstance(stage, int) and 0 <= stage <= 3 else 0
    if batch_over == "replicas" and isinstance(ds_config.get("train_batch_size"), int):
        ds_config = {**ds_config, "train_batch_size": ds_config["train_batch_size"] * sp.size}
    data = kwargs.pop("training_data", None)
    engine, opt, loader, sched = ds_initialize(model=model, config=ds_config, **kwargs)
    if data is not None:  # every rank of a sequence group draws the same batches
        from torch.utils.data.distributed import DistributedSampler

        loader = engine.deepspeed_io(data, collate_fn=kwargs.get("collate_fn"), data_sampler=DistributedSampler(
            data, num_replicas=sp.dp_size, rank=sp.dp_rank))
        engine.training_dataloader = loader
    engine.ringseq = sp
    return engine, opt, loader, sched
