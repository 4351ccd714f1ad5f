"""A plain training loop with ringseq, started by torchrun.

    torchrun --nproc_per_node 2 examples/torchrun_loop.py
    ringseq launch --sp 2 --nproc 2 examples/torchrun_loop.py     # the same, settings via RINGSEQ_*
    ringseq launch --launcher deepspeed --sp 2 --nproc 2 examples/torchrun_loop.py
    ringseq launch --launcher accelerate --sp 2 --nproc 2 examples/torchrun_loop.py

Every rank of a sequence group loads the same full batch; ``shard_batch`` keeps this rank's
slice (labels shifted first), the patched model runs on it, ``loss.cross_entropy`` returns the
global loss, and every gradient is averaged over all ranks (ringseq's gradient rule: what DDP,
FSDP2 and DeepSpeed do too) before the optimizer step.
"""
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import ringseq


def main(steps: int = 5, seq_len: int = 1024) -> None:
    sp = ringseq.init(config=ringseq.config.from_env())  # RINGSEQ_SP_SIZE etc.; unset: one sequence over all ranks
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = ringseq.patch(LlamaForCausalLM(config), sp=sp)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        # the same full batch on every rank of a sequence group; different ones across replicas
        g = torch.Generator().manual_seed(step * 1000 + sp.dp_rank)
        ids = torch.randint(0, 256, (2, seq_len), generator=g)
        local = ringseq.shard_batch({"input_ids": ids, "labels": ids}, sp=sp)
        labels = local.pop("labels")
        loss = ringseq.loss.cross_entropy(model(**local).logits, labels, sp=sp)
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():  # the gradient rule: average over all ranks, as DDP does
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        optimizer.step()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
