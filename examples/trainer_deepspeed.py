"""The HF Trainer with ringseq and DeepSpeed, started by the ``deepspeed`` launcher.

    deepspeed --num_gpus 2 examples/trainer_deepspeed.py                      # ZeRO-2, sp 2
    deepspeed --num_gpus 2 examples/trainer_deepspeed.py --ds-config launch/configs/ds_zero3.json
    deepspeed --num_gpus 4 examples/trainer_deepspeed.py                      # sp 2 x 2 replicas

(``--num_gpus`` starts that many CPU processes when there is no GPU.) The ds_config's
``"ringseq"`` section sets the sequence-parallel size; ``ringseq.Trainer`` is the Trainer: each
sequence group draws one batch per step and shards it, so a step covers
``per_device_train_batch_size x gradient_accumulation_steps x replicas`` sequences.
"""
import argparse
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import ringseq

ROOT = Path(__file__).resolve().parents[1]


class LongSequences(torch.utils.data.Dataset):
    """Random token sequences with a masked prompt of varying length (labels -100 there)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)
        self.prompt = torch.randint(0, seq_len // 4, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[: self.prompt[i]] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ds-config", default=str(ROOT / "launch/configs/ds_zero2.json"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--out", default="ringseq-trainer-example")
    parser.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    args = parser.parse_args()
    with open(args.ds_config) as f:
        ds = json.load(f)
    section, _ = ringseq.config.from_ds_config(ds)
    sp = ringseq.init(config=section or ringseq.config.from_env())  # first: the process group (gloo on CPU)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    training = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=ds["train_micro_batch_size_per_gpu"],
                                 gradient_accumulation_steps=ds["gradient_accumulation_steps"], learning_rate=1e-3, logging_steps=1,
                                 eval_strategy="steps", eval_steps=args.steps, save_strategy="no", report_to=[],
                                 deepspeed=args.ds_config, use_cpu=not torch.cuda.is_available(),
                                 disable_tqdm=True)
    trainer = ringseq.Trainer(model=LlamaForCausalLM(config), args=training, sp=sp,
                              train_dataset=LongSequences(64, args.seq_len, config.vocab_size, seed=1),
                              eval_dataset=LongSequences(4 * sp.dp_size, args.seq_len, config.vocab_size, seed=2))
    trainer.train()
    if trainer.is_world_process_zero():
        print(f"done: {args.steps} steps, sp {sp.size}, replicas {sp.dp_size}, "
              f"eval loss {trainer.state.log_history[-2]['eval_loss']:.4f}", flush=True)
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
