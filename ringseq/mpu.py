"""The model-parallel unit DeepSpeed may be given (``deepspeed.initialize(mpu=sp.mpu)``).

By ringseq's gradient rule (``ringseq.gradients``) every rank's backward leaves P times its share
of each gradient, so the plain average over all ranks is exact: DeepSpeed must treat every rank as
data-parallel, reduce over the world and divide by the world size, under every ZeRO stage (ZeRO-3
then also partitions over the world). That is what DeepSpeed does without an mpu, and what this
one says: it declares no sequence parallelism (an mpu that did would make DeepSpeed sum over the
sequence ranks and divide by the replicas only), and no tensor or pipeline parallelism.
``ringseq.initialize`` passes none; this exists so that code that passes ``sp.mpu`` stays exact.
"""
from __future__ import annotations

import torch.distributed as dist


class SequenceParallelMPU:
    def __init__(self):
        self._alone = None  # made on first use: most users never ask for it

    # data parallelism: every rank
    def get_data_parallel_group(self):
        return dist.group.WORLD

    def get_data_parallel_rank(self):
        return dist.get_rank()

    def get_data_parallel_world_size(self):
        return dist.get_world_size()

    def get_data_parallel_group_ranks(self):
        return list(range(dist.get_world_size()))

    # no tensor or pipeline parallelism: groups of one
    def get_model_parallel_group(self):
        if self._alone is None:
            self._alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        return self._alone

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self):
        return dist.get_rank()
