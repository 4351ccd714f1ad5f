"""The training set-up the planner costs: ZeRO stage and ringseq's memory features."""
from __future__ import annotations

import dataclasses

from ringseq.errors import RingSeqError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Features:
    """What a rank keeps and recomputes."""

    training: bool = True
    """forward + backward (False: one forward, e.g. a prefill)."""
    zero_stage: int = 3
    """DeepSpeed ZeRO stage 0-3: 1 shards optimizer state, 2 also gradients, 3 also weights, over all ranks."""
    fsdp: bool = False
    """The weights are sharded by FSDP2 (``fully_shard`` per layer and root; with ``zero_stage`` 3): the
    root's own parameters (embeddings, head, final norm) stay gathered from its forward to the end of its
    backward and their gradients whole until its reduce-scatter, and a layer is gathered in the step
    beside the one prefetched: all of it is allocated by the step, not held between steps."""
    optimizer: bool = True
    """Adam state and the gradient reduction (False: forward + backward only, as the CPU validation measures)."""
    checkpointing: bool = False
    """Gradient checkpointing of every layer; ringseq keeps the ring's output and log-sum-exp, so the
    recompute never replays the ring (unless ``keep_ring_outputs`` is False)."""
    keep_ring_outputs: bool = True
    """Under checkpointing, ``ringseq.patch(keep_ring_outputs=)``: True keeps each layer's ring output
    and log-sum-exp until backward; False keeps the layer input alone and the recompute replays the
    ring (less memory, one more ring forward per layer)."""
    tiled_mlp: int | None = None
    """MLP computed in this many sequence tiles under checkpointing (``ringseq.patch(tiled_mlp=...)``)."""
    chunked_loss: bool = True
    """Loss computed in slabs of ``ringseq.slabs.slab_tokens(vocab)`` tokens: logits never held for the
    whole shard."""
    offload: bool = False
    """Optimizer state (and with ZeRO-3 the weights) offloaded to host memory."""
    offload_activations: bool = False
    """Under checkpointing, the kept tensors (each layer's input and ring outputs) moved to host
    memory until backward (``gradient_checkpointing_enable(offload=True)`` after ``ringseq.patch``):
    they leave device memory, at the cost of copying them out and back over the host link."""
    micro_batch: int = 1
    """Sequences per step and rank group."""
    head_groups: int | str | None = None
    """Rings per attention call (``ringseq.patch(head_groups=...)``): None or 1 one ring for all heads,
    "kv" one per kv head a rank holds, n: n rings over equal shares. Each ring holds its group's
    buffers only (memory) and pays every step's launches and transfer latency again (time)."""

    def groups(self, k: float) -> int:
        """The rings per call for ``k`` kv heads per rank."""
        if self.head_groups in (None, 1):
            return 1
        return max(int(k), 1) if self.head_groups == "kv" else int(self.head_groups)

    @property
    def replays_ring(self) -> bool:
        """The backward's recompute runs each layer's ring forward again."""
        return self.training and self.checkpointing and not self.keep_ring_outputs

    def __post_init__(self):
        if self.zero_stage not in (0, 1, 2, 3):
            raise RingSeqError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.fsdp and self.zero_stage != 3:
            raise RingSeqError(f"fsdp=True is FSDP2's full sharding (zero_stage 3), got zero_stage {self.zero_stage}")
        if self.tiled_mlp is not None and (isinstance(self.tiled_mlp, bool) or self.tiled_mlp < 1):
            raise RingSeqError(f"tiled_mlp must be a number of tiles >= 1 or None, got {self.tiled_mlp!r}")
        if self.micro_batch < 1:
            raise RingSeqError(f"micro_batch must be >= 1, got {self.micro_batch}")
        hg = self.head_groups
        if not (hg is None or hg == "kv" or (isinstance(hg, int) and not isinstance(hg, bool) and hg >= 1)):
            raise RingSeqError(f'head_groups must be None, "kv" or a positive int, got {hg!r}')
