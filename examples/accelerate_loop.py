"""An Accelerate training loop with ringseq, started by ``accelerate launch``.

    RINGSEQ_SP_SIZE=2 accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py
    RINGSEQ_SP_SIZE=2 accelerate launch --use_deepspeed --zero_stage 2 --num_processes 2 examples/accelerate_loop.py
    ringseq launch --launcher accelerate --sp 2 --nproc 2 examples/accelerate_loop.py

(``--multi_gpu`` also starts processes on a machine without GPUs.) The two ringseq lines:
``ringseq.init(config=ringseq.config.from_env())`` reads RINGSEQ_* and joins (on CPU: creates, with gloo) the
process group; ``ringseq.prepare_accelerator(sp=sp)`` makes the Accelerator on that group (on
CPU Accelerate would otherwise see one process per rank, with or without DeepSpeed) and makes
its ``prepare`` shard data over replicas and sum gradients over the sequence group. An
existing Accelerator can be passed instead: ``ringseq.prepare_accelerator(accelerator, sp=sp)``.
Do not set Accelerate's own ``sp_size``: ringseq refuses it.
"""
import torch
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

import ringseq


def long_documents(n: int, seq_len: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    docs = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq_len,), generator=g)
        docs.append({"input_ids": ids, "labels": ids})
    return docs


def main(steps: int = 4, seq_len: int = 1024) -> None:
    # first: the process group, RINGSEQ_SP_SIZE (default: all ranks)
    sp = ringseq.init(config=ringseq.config.from_env())
    accelerator = ringseq.prepare_accelerator(sp=sp)  # an Accelerator on ringseq's process group
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = ringseq.patch(LlamaForCausalLM(config), sp=sp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(long_documents(steps * 2 * sp.dp_size, seq_len, config.vocab_size), batch_size=2,
                        shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    for step, batch in enumerate(loader):  # the same full batch on every rank of a sequence group
        loss = model(**batch).loss  # the exact loss of that batch; each rank computed its slice
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.print(f"step {step}: loss {loss.item():.4f} (sp {sp.size}, replicas {sp.dp_size}, "
                          f"{accelerator.distributed_type.value})")
    accelerator.end_training()  # destroys the process group (ringseq.init made the exit wait for gloo's threads)


if __name__ == "__main__":
    main()
