"""GRPO on long prompts: a tiny Llama learns, by reward alone, to answer with the fact its long
prompt states, its prompt + completion sequences sharded over the sequence group.

    ringseq launch --sp 2 --nproc 2 examples/grpo_retrieval.py
    accelerate launch --multi_gpu --num_processes 2 examples/grpo_retrieval.py   (RINGSEQ_SP_SIZE=2)

Each prompt is ``--prompt-len`` words of noise in which the fact ``key vK`` is stated
``--mentions`` times at random places, and ends with the question ``? key``; the answer is one
word, rewarded 1 when it is the fact's value ``vK`` (one of four; a model that names a value at
random scores 0.25). ``ringseq.GRPOTrainer`` generates with the patched model (the prompt
prefilled through the ring), scores the completions once per group and trains on the sharded
sequences; TRL's loss, logging and optimizer step are its own. Rank 0 writes the mean reward of
every step to ``--out`` (a JSON list) and draws it (``--plot``, with matplotlib). With the
defaults (100 steps, 514-token sequences over 2 ranks, about 2.5 minutes on two CPU cores) the
reward rises from about 0.07 to about 0.70 (docs/grpo_retrieval.png).
"""
import argparse
import json
import os

import torch
import torch.distributed as dist

import ringseq

FILLER = [f"w{i}" for i in range(12)]
VALUES = [f"v{i}" for i in range(4)]
SPECIAL = ["<pad>", "<eos>", "<unk>", "key", "?"]


def tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + VALUES + FILLER)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(SPECIAL) + len(VALUES) + len(FILLER), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None, max_position_embeddings=16384)
    return LlamaForCausalLM(config)


def prompts(n: int, length: int, mentions: int, seed: int):
    """n prompts of ``length`` words: noise, the fact ``key vK`` stated ``mentions`` times at
    random places, and the question at the end."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        words = [FILLER[i] for i in torch.randint(0, len(FILLER), (length - 2 - 2 * mentions,), generator=g)]
        value = VALUES[int(torch.randint(0, len(VALUES), (1,), generator=g))]
        for at in sorted(torch.randint(0, len(words), (mentions,), generator=g).tolist(), reverse=True):
            words[at:at] = ["key", value]
        rows.append({"prompt": " ".join(words + ["?", "key"]), "answer": value})
    return Dataset.from_list(rows)


def retrieved(completions, answer, **kwargs):
    """The share of a completion's words that are the fact's value (one word: 0 or 1)."""
    return [sum(w == a for w in c.split()) / max(len(c.split()), 1) for c, a in zip(completions, answer)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--mentions", type=int, default=16, help="how many times a prompt states its fact")
    parser.add_argument("--out", default="grpo_rewards.json")
    parser.add_argument("--plot", default="grpo_rewards.png")
    args = parser.parse_args()
    sp = ringseq.init()  # the whole world is one sequence group unless RINGSEQ_SP_SIZE says otherwise
    import trl

    config = trl.GRPOConfig(
        output_dir=os.environ.get("TMPDIR", "/tmp") + "/ringseq-grpo-retrieval", max_steps=args.steps,
        per_device_train_batch_size=32, num_generations=8, max_completion_length=1, temperature=1.0,
        learning_rate=3e-3, lr_scheduler_type="constant", beta=0.0, logging_steps=1, report_to=[], save_strategy="no",
        seed=0, use_cpu=True)
    trainer = ringseq.GRPOTrainer(model=tiny_llama(), reward_funcs=retrieved, args=config,
                                  train_dataset=prompts(args.steps * 4, args.prompt_len, args.mentions, seed=1),
                                  processing_class=tokenizer(), sp=sp)
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(rewards, f)
        first, last = sum(rewards[:5]) / len(rewards[:5]), sum(rewards[-5:]) / len(rewards[-5:])
        print(f"reward: first 5 steps {first:.3f} -> last 5 steps {last:.3f} (a value at random "
              f"{1 / len(VALUES):.3f}, retrieval 1.0); sequences of {args.prompt_len + 2} tokens over {sp.size} ranks")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed: no plot")
        else:
            plt.figure(figsize=(6, 3.5))
            plt.plot(range(1, len(rewards) + 1), rewards)
            plt.axhline(1 / len(VALUES), ls="--", c="gray", label="a value at random")
            plt.xlabel("step")
            plt.ylabel("mean reward")
            plt.title(f"GRPO, prompts of {args.prompt_len} words, sp={sp.size}")
            plt.legend()
            plt.tight_layout()
            plt.savefig(args.plot, dpi=120)
            print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
