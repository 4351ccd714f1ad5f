"""Long-prompt generation: ringseq's sharded prefill and decode against the unpatched model's
``generate`` in one process, in one run.

The model is a Llama of a CPU size (hidden 256, 4 layers, 8 query / 2 key-value heads of 32,
fp32; transformers' own modeling code, sdpa in the unpatched model). A prompt of B=1 x N random
tokens:

- ``unpatched``  ``model.generate`` in one process (its prefill computes the last token's logits only).
- ``ringseq``    ``ringseq.patch(model)`` then the same ``model.generate`` call on every rank of a
                 group of P: the prompt prefilled through the ring, each rank keeping its own
                 tokens' keys and values, new tokens' attention merged over the group.

Per configuration: the prefill's time (``generate`` of one new token; median of ``--reps``, the
slowest rank), decode tokens/s (``--new`` tokens after the first, timed token to token), the KV-cache bytes each
rank holds after the prompt, the prefill's memory (peak resident set above the one before it,
the largest rank's), and whether the new tokens equal the unpatched model's (greedy).

``--longest``: the longest prompt whose prefill fits ``--budget-mb`` per rank, unpatched in one
process vs ringseq at each of ``--longest-sizes`` (P=2 by default; doubling N from 1024 until the
prefill needs more, then stepping back by a quarter of the last fitting length).

``--model vlm``: a Qwen2.5-VL whose language model is that Llama's size (mRoPE) with a small
vision tower, a picture of 16 placeholder tokens in every 256 prompt tokens: the unpatched
model's ``generate`` against the patched one (the vision tower on the whole prompt on every rank,
the language model on the ring). Writes ``generation_vlm.jsonl`` / ``.png``.

One thread per rank; P = 4 runs 4 processes on this machine's 2 cores (time-sliced): compare at the
same P. Prints JSON lines, writes ``generation.jsonl`` and ``generation.png``. Usage::

    python benchmarks/generation.py                         # N = 4096, 8192; P = 1, 2, 4
    python benchmarks/generation.py --N 1024 --sizes 2 --reps 1 --new 4 --longest --budget-mb 120
    python benchmarks/generation.py --model vlm --N 4096 8192 --sizes 2 4 --longest --longest-sizes 2 4
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

VOCAB = 512


IMAGE, START, END = VOCAB - 3, VOCAB - 2, VOCAB - 1  # the VLM's placeholder and its brackets
GRID = (1, 8, 8)  # a picture of 8 x 8 patches of 4 x 4 pixels: 16 placeholder tokens after the 2 x 2 merge
PICTURE_EVERY = 256  # a picture in every run of this many prompt tokens


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "vlm":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        text = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1 << 20,
                    rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1e4})
        vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=4, spatial_merge_size=2,
                      temporal_patch_size=2, out_hidden_size=256, window_size=8, fullatt_block_indexes=[1])
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=0,
                                  vision_start_token_id=START, vision_end_token_id=END)
        return Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation="sdpa").eval()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1 << 20,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def _prompt(kind: str, N: int) -> dict:
    """B=1 x N random tokens; the VLM's hold a picture (16 placeholders) in every 256."""
    g = torch.Generator().manual_seed(N)
    ids = torch.randint(3, IMAGE, (1, N), generator=g)
    if kind != "vlm":
        return {"input_ids": ids}
    tokens = GRID[1] * GRID[2] // 4
    types = torch.zeros(1, N, dtype=torch.int32)
    starts = range(8, N - tokens - 2, PICTURE_EVERY)
    for at in starts:
        ids[0, at - 1], ids[0, at:at + tokens], ids[0, at + tokens] = START, IMAGE, END
        types[0, at:at + tokens] = 1
    n = len(starts)
    return {"input_ids": ids, "mm_token_type_ids": types, "image_grid_thw": torch.tensor([GRID] * n),
            "pixel_values": torch.randn(n * GRID[1] * GRID[2], 3 * 2 * 4 * 4, generator=g)}


def measure(kind: str, N: int, reps: int, new: int, memory_only: bool = False, model_kind: str = "llama") -> dict:
    import ringseq

    P = dist.get_world_size()
    model = _model(model_kind)
    model.generation_config.use_cache = True
    if kind == "ringseq":
        ringseq.patch(model, sp=ringseq.init(sp_size=P))
    inputs = _prompt(model_kind, N)
    settings = dict(do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True)

    def prefill():
        with torch.no_grad():
            return model.generate(**inputs, max_new_tokens=1, **settings)

    memory = common.slowest(common.step_peak_mb(prefill))
    out = prefill()
    cache = out.past_key_values
    kv = sum((layer.keys.numel() + layer.values.numel()) * layer.keys.element_size() for layer in cache.layers)
    record = dict(kind=kind, model=model_kind, P=P, N=N, prefill_mb=round(memory, 1), kv_mb_per_rank=round(common.slowest(kv) / 2**20, 2))
    if memory_only:
        return record
    prefill_ms = common.timed_ms(prefill, reps)
    clock = _Clock()
    with torch.no_grad():
        dist.barrier()
        tokens = model.generate(**inputs, max_new_tokens=new + 1, stopping_criteria=[clock],
                                **settings).sequences[0, N:]
    decode_s = common.slowest(clock.times[-1] - clock.times[0])  # the new tokens after the first
    return dict(record, prefill_ms=round(prefill_ms, 1), decode_tok_s=round(new / decode_s, 1),
                tokens=tokens.tolist())


class _Clock:
    """A stopping criterion that never stops: the time each new token is ready."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.size(0), dtype=torch.bool)


def longest(kind: str, P: int, budget_mb: float, model_kind: str = "llama") -> dict:
    """The longest prompt whose prefill fits the budget (per rank)."""
    fits, N = 0, 1024
    while True:
        with common.freed_memory_returned():
            r = common.run_tree(measure, P, 1, kind, N, 1, 0, True, model_kind)
        if r["prefill_mb"] > budget_mb:
            break
        fits, N = N, 2 * N
    step = max(fits // 4, 256)
    N = fits + step
    while step >= 256 and fits:
        with common.freed_memory_returned():
            r = common.run_tree(measure, P, 1, kind, N, 1, 0, True, model_kind)
        if r["prefill_mb"] <= budget_mb:
            fits = N
        else:
            step //= 2
        N = fits + step
    return dict(kind=kind, model=model_kind, P=P, budget_mb=budget_mb, longest_prompt=fits)


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    rows = [r for r in records if "prefill_ms" in r]
    for N in sorted({r["N"] for r in rows}):
        base = next(r for r in rows if r["N"] == N and r["kind"] == "unpatched")
        ring = sorted((r for r in rows if r["N"] == N and r["kind"] == "ringseq"), key=lambda r: r["P"])
        Ps = [r["P"] for r in ring]
        axes[0].plot(Ps, [r["prefill_ms"] / base["prefill_ms"] for r in ring], "-o", label=f"N={N}")
        axes[1].plot(Ps, [r["decode_tok_s"] / base["decode_tok_s"] for r in ring], "-o", label=f"N={N}")
        axes[2].plot(Ps, [r["kv_mb_per_rank"] / base["kv_mb_per_rank"] for r in ring], "-o", label=f"N={N}")
    axes[0].set(xlabel="ranks P", ylabel="prefill time / unpatched", title="prefill (generate 1 token)")
    axes[1].set(xlabel="ranks P", ylabel="decode tokens/s / unpatched", title="decode")
    axes[2].set(xlabel="ranks P", ylabel="KV bytes per rank / unpatched", title="cache per rank")
    common.save_figure(fig, axes, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--N", type=int, nargs="*", default=[4096, 8192])
    p.add_argument("--sizes", type=int, nargs="*", default=[1, 2, 4])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--new", type=int, default=16, help="decode tokens timed after the prefill")
    p.add_argument("--longest", action="store_true", help="also search the longest prompt within --budget-mb")
    p.add_argument("--budget-mb", type=float, default=400.0)
    p.add_argument("--model", choices=("llama", "vlm"), default="llama",
                   help="vlm: a Qwen2.5-VL of the same language-model size, a picture in every 256 prompt tokens")
    p.add_argument("--longest-sizes", type=int, nargs="*", default=[2],
                   help="the group sizes whose longest prompt --longest searches (the unpatched model's too)")
    p.add_argument("--out", default=common.RESULTS)
    args = p.parse_args(argv)
    name = "generation" if args.model == "llama" else f"generation_{args.model}"
    jsonl = common.fresh_file(args.out, f"{name}.jsonl")
    records = []
    for N in args.N:
        with common.freed_memory_returned():
            base = common.run_tree(measure, 1, 1, "unpatched", N, args.reps, args.new, False, args.model)
        records.append(base)
        common.emit({k: v for k, v in base.items() if k != "tokens"}, jsonl)
        for P in args.sizes:
            with common.freed_memory_returned():
                r = common.run_tree(measure, P, 1, "ringseq", N, args.reps, args.new, False, args.model)
            r["same_tokens"] = r.pop("tokens") == base["tokens"]
            records.append(r)
            common.emit(r, jsonl)
        base.pop("tokens")
    if args.longest:
        for kind, P in (("unpatched", 1), *(("ringseq", P) for P in args.longest_sizes)):
            records.append(longest(kind, P, args.budget_mb, args.model))
            common.emit(records[-1], jsonl)
    plot(records, os.path.join(args.out, f"{name}.png"))

if __name__ == "__main__":
    main()
