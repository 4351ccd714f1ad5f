"""Run by torchrun: ringseq.init, a ring attention and a sharded batch import no training library
(DeepSpeed, transformers, Accelerate, TRL, PEFT): the core stands alone. Every rank asserts."""
import sys

import torch
import torch.distributed as dist

import ringseq
from ringseq.processes import exit_now

sp = ringseq.init(sp_size=dist.get_world_size() if dist.is_initialized() else 2)
q = ringseq.shard(torch.randn(1, 4, 16 * sp.size, 8), 2, sp=sp)
out = ringseq.ring_attention(q, q, q, sp=sp, position_ids=ringseq.shard(torch.arange(16 * sp.size)[None] % 5, 1, sp=sp))
local = ringseq.shard_batch({"input_ids": torch.zeros(1, 16 * sp.size, dtype=torch.long)}, sp=sp)
heavy = sorted(m for m in ("deepspeed", "transformers", "accelerate", "trl", "peft") if m in sys.modules)
assert not heavy, f"rank {dist.get_rank()}: the core imported {heavy}"
print(f"rank {dist.get_rank()}: core only, {out.shape[2]} tokens", flush=True)
exit_now(0)
