"""A model and data for ``ringseq check`` (the parity checker):

    ringseq check --sp 2 examples/check_model.py

``make_model()`` returns the model you fine-tune (here a tiny random-init Qwen2 with a sliding
window on its upper layers, built from a config: no download), ``make_batches()`` the full
batches you feed it (here packed documents: two per row, positions restarting at each).
"""
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

SEQ, VOCAB = 512, 128


def make_model():
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False, use_sliding_window=True,
                         sliding_window=96, max_window_layers=1, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config)


def make_batches():
    g = torch.Generator().manual_seed(0)
    while True:
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        cut = int(torch.randint(64, SEQ - 64, (1,), generator=g))
        positions = torch.cat([torch.arange(cut), torch.arange(SEQ - cut)]).expand(2, SEQ)
        yield {"input_ids": ids, "labels": ids, "position_ids": positions}
