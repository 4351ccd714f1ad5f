"""Fine-tune a tiny Qwen3.5-style hybrid (gated DeltaNet layers beside attention) with
``ringseq.Trainer`` over the sequence group, started by torchrun (or ``ringseq launch``).

    torchrun --nproc_per_node 2 examples/hybrid_trainer.py
    ringseq launch --sp 2 --nproc 2 examples/hybrid_trainer.py

Each row is long noise between a key at its start and the same key at its end: predicting the
end needs what the recurrent layers carried across the ranks' shards. Three of every four
layers are gated DeltaNet: ringseq runs them on each rank's tokens from the states their runs
enter with (one all-gather of summaries per layer), the attention layers on the ring. At the end
rank 0 checks the patched model's loss against the unpatched model on the same weights.
"""
import argparse
import copy

import torch
import torch.distributed as dist
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, TrainingArguments

import ringseq


class KeyRecall(torch.utils.data.Dataset):
    """Rows of noise between a key (first token) and the same key (last token); only the last
    token has a label."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(8, vocab, (n, seq_len), generator=g)
        self.ids[:, -1] = self.ids[:, 0] = torch.randint(1, 8, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = torch.full_like(self.ids[i], -100)
        labels[-1] = self.ids[i, -1]
        return {"input_ids": self.ids[i], "labels": labels}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per row (default: %(default)s)")
    parser.add_argument("--out", default="ringseq-hybrid-example", help="Trainer output folder (default: %(default)s)")
    args = parser.parse_args()
    sp = ringseq.init(config=ringseq.config.from_env())  # first: the process group (gloo on CPU)

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                               use_cache=False)  # layer_types: 3 gated DeltaNet layers, then full attention
    model = Qwen3_5ForCausalLM(config)
    unpatched = copy.deepcopy(model)
    training = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=2,
                                 learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to=[],
                                 use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    trainer = ringseq.Trainer(model=model, args=training, sp=sp,
                              train_dataset=KeyRecall(64, args.seq_len, config.vocab_size, seed=1))
    trainer.train()
    losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
    batch = {k: torch.stack([KeyRecall(2, args.seq_len, config.vocab_size, seed=2)[i][k] for i in range(2)])
             for k in ("input_ids", "labels")}
    with torch.no_grad():
        ring = model(**batch).loss.item()  # every rank of the group: the same full batch
    if dist.get_rank() == 0:
        unpatched.load_state_dict({k: v for k, v in ringseq.unpatch(copy.deepcopy(model)).state_dict().items()})
        with torch.no_grad():
            plain = unpatched(**batch).loss.item()
        print(f"training losses over {args.steps} steps (sp {sp.size}, {sp.dp_size} replica(s)): {losses}", flush=True)
        print(f"held-out loss: ringseq {ring:.6f}, unpatched on the same weights {plain:.6f} "
              f"(relative difference {abs(ring - plain) / abs(plain):.1e})", flush=True)
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
