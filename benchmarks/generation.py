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
process vs ringseq at P=2 (doubling N from 1024 until the prefill needs more, then stepping back
by a quarter of the last fitting length).

One thread per rank; P = 4 runs 4 processes on this machine's 2 cores (time-sliced): compare at the
same P. Prints JSON lines, writes ``generation.jsonl`` and ``generation.png``. Usage::

    python benchmarks/generation.py                         # N = 4096, 8192; P = 1, 2, 4
    python benchmarks/generation.py --N 1024 --sizes 2 --reps 1 --new 4 --longest --budget-mb 120
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


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1 << 20,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def _prompt(N: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, N), generator=torch.Generator().manual_seed(N))


def measure(kind: str, N: int, reps: int, new: int, memory_only: bool = False) -> dict:
    import ringseq

    P = dist.get_world_size()
    model = _model()
    if kind == "ringseq":
        ringseq.patch(model, sp=ringseq.init(sp_size=P))
    ids = _prompt(N)
    settings = dict(do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True)

    def prefill():
        with torch.no_grad():
            return model.generate(input_ids=ids, max_new_tokens=1, **settings)

    memory = common.slowest(common.step_peak_mb(prefill))
    out = prefill()
    cache = out.past_key_values
    kv = sum((layer.keys.numel() + layer.values.numel()) * layer.keys.element_size() for layer in cache.layers)
    record = dict(kind=kind, P=P, N=N, prefill_mb=round(memory, 1), kv_mb_per_rank=round(common.slowest(kv) / 2**20, 2))
    if memory_only:
        return record
    prefill_ms = common.timed_ms(prefill, reps)
    clock = _Clock()
    with torch.no_grad():
        dist.barrier()
        tokens = model.generate(input_ids=ids, max_new_tokens=new + 1, stopping_criteria=[clock],
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


def longest(kind: str, P: int, budget_mb: float) -> dict:
    """The longest prompt whose prefill fits the budget (per rank)."""
    fits, N = 0, 1024
    while True:
        with common.freed_memory_returned():
            r = common.run_tree(measure, P, 1, kind, N, 1, 0, True)
        if r["prefill_mb"] > budget_mb:
            break
        fits, N = N, 2 * N
    step = max(fits // 4, 256)
    N = fits + step
    while step >= 256 and fits:
        with common.freed_memory_returned():
            r = common.run_tree(measure, P, 1, kind, N, 1, 0, True)
        if r["prefill_mb"] <= budget_mb:
            fits = N
        else:
            step //= 2
        N = fits + step
    return dict(kind=kind, P=P, budget_mb=budget_mb, longest_prompt=fits)


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
    p.add_argument("--out", default=common.RESULTS)
    args = p.parse_args(argv)
    jsonl = common.fresh_file(args.out, "generation.jsonl")
    records = []
    for N in args.N:
        with common.freed_memory_returned():
            base = common.run_tree(measure, 1, 1, "unpatched", N, args.reps, args.new)
        records.append(base)
        common.emit({k: v for k, v in base.items() if k != "tokens"}, jsonl)
        for P in args.sizes:
            with common.freed_memory_returned():
                r = common.run_tree(measure, P, 1, "ringseq", N, args.reps, args.new)
            r["same_tokens"] = r.pop("tokens") == base["tokens"]
            records.append(r)
            common.emit(r, jsonl)
        base.pop("tokens")
    if args.longest:
        for kind, P in (("unpatched", 1), ("ringseq", 2)):
            records.append(longest(kind, P, args.budget_mb))
            common.emit(records[-1], jsonl)
    plot(records, os.path.join(args.out, "generation.png"))


if __name__ == "__main__":
    main()
