"""The model-parallel-unit object DeepSpeed asks for (``deepspeed.initialize(mpu=...)``).

DeepSpeed reads the method names below (``deepspeed/utils/groups.py``). With a sequence
group present it reduces gradients over ``get_sequence_data_parallel_group`` (sequence x data
ranks), which is what ringseq's gradient rule needs: a gradient summed over the sequence
ranks, averaged over the data ranks. There is no tensor or pipeline parallelism, so those
groups hold this rank alone.
"""
from __future__ import annotations

import torch.distributed as dist


class SequenceParallelMPU:
    def __init__(self, *, group, rank, size, dp_group, dp_rank, dp_size, grad_group):
        self._sp = (group, rank, size)
        self._dp = (dp_group, dp_rank, dp_size)
        self._grad_group = grad_group
        self._alone = None  # made on first use: most users never ask for it

    # sequence parallelism
    def get_sequence_parallel_group(self):
        return self._sp[0]

    def get_sequence_parallel_rank(self):
        return self._sp[1]

    def get_sequence_parallel_world_size(self):
        return self._sp[2]

    # sequence x data: the group over which replicated weights reduce their gradients
    def get_sequence_data_parallel_group(self):
        return self._grad_group

    def get_sequence_data_parallel_rank(self):
        return dist.get_rank(self._grad_group)

    def get_sequence_data_parallel_world_size(self):
        return dist.get_world_size(self._grad_group)

    # data parallelism
    def get_data_parallel_group(self):
        return self._dp[0]

    def get_data_parallel_rank(self):
        return self._dp[1]

    def get_data_parallel_world_size(self):
        return self._dp[2]

    def get_data_parallel_group_ranks(self):
        return dist.get_process_group_ranks(self._dp[0])

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
