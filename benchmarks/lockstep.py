"""What lockstep costs and what a straggler costs a ring, side by side in one run.

For each ring size P and layout: the median fwd+bwd time of one causal ``ring_attention`` call,
the time of the two lockstep agreements that call makes (forward and backward records, each a
gloo all-gather of 64 integers), and ``ringseq.stats`` over the timed calls: which rank the others
waited for and what share of the call they spent waiting for it (a causal ``contiguous`` layout
gives the last rank the most work; ``zigzag`` balances it). Then one rank is made slow by a
sleep before each call (``--delay`` of the call's time): every rank's call grows by about that much,
and ``ringseq.stats`` names that rank.
Prints JSON lines and draws ``lockstep.png``. Usage::

    python benchmarks/lockstep.py                      # P = 2, 4; S = 8192
    python benchmarks/lockstep.py --sizes 2 --S 2048 --reps 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

B, H, K, D = 1, 8, 2, 64


def measure(layout: str, S: int, reps: int, delay_share: float) -> dict:
    import torch.distributed as dist

    import ringseq
    from ringseq import lockstep
    from ringseq.attention.checks import call_record

    sp = ringseq.init(sp_size=dist.get_world_size(), layout=layout)
    pos = ringseq.shard(torch.arange(S), 0, sp=sp)
    q, k, v = (common.tokens(pos, B, h, D, seed).requires_grad_(True) for h, seed in ((H, 1), (K, 2), (K, 3)))
    dout = common.tokens(pos, B, H, D, 4)

    def step():
        ringseq.ring_attention(q, k, v, sp=sp).backward(dout)

    step()  # warm
    ringseq.stats(sp=sp, reset=True)
    call_ms = common.timed_ms(step, reps)
    report = ringseq.stats(sp=sp, reset=True)
    fields = call_record(q, k, v, causal=True, scale=None, window=None, softcap=None, sinks=None, position_ids=None,
                         attention_mask=None, token_info=None, kernel=None, slab_rows=None)
    agree_ms = common.timed_ms(lambda: [lockstep.agree(sp, "ring_attention forward", fields) for _ in range(2)],
                               reps * 5)
    ringseq.stats(sp=sp, reset=True)
    slow = sp.rank == sp.size - 1
    delay_ms = delay_share * call_ms  # well above the machine's noise (tens of ms per call here)

    def slow_step():
        if slow:
            time.sleep(delay_ms / 1e3)
        step()

    delayed_ms = common.timed_ms(slow_step, reps)
    delayed = ringseq.stats(sp=sp, reset=True)
    per_call_wait = report["wait_for_slowest_s"] / max(1, reps) * 1e3
    return dict(P=sp.size, layout=layout, S=S, call_ms=round(call_ms, 2), agree_ms=round(agree_ms, 3),
                agree_share=round(agree_ms / call_ms, 4), slowest_rank=report["slowest_rank"],
                wait_for_slowest_ms_per_call=round(per_call_wait, 2),
                wait_share=round(per_call_wait / call_ms, 3), delay_ms=round(delay_ms, 1),
                delayed_call_ms=round(delayed_ms, 2), delay_cost_ratio=round((delayed_ms - call_ms) / delay_ms, 2),
                delayed_slowest_rank=delayed["slowest_rank"],
                delayed_wait_s=[round(r["wait_s"], 3) for r in delayed["ranks"]],
                wait_s=[round(r["wait_s"], 3) for r in report["ranks"]])


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"P={r['P']}\n{r['layout']}" for r in records]
    x = range(len(records))
    ax.bar([i - 0.2 for i in x], [r["wait_share"] for r in records], width=0.4, label="waiting for the slowest rank")
    ax.bar([i + 0.2 for i in x], [r["agree_share"] for r in records], width=0.4, label="lockstep agreements")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("share of one fwd+bwd ring_attention call")
    ax.set_title(f"causal ring attention, S={records[0]['S']}, gloo on CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layouts", nargs="+", default=["zigzag", "contiguous"])
    parser.add_argument("--S", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--delay", type=float, default=0.25, help="share of a call's time one rank sleeps before it")
    parser.add_argument("--out", default=common.RESULTS)
    args = parser.parse_args(argv)
    jsonl = common.fresh_file(args.out, "lockstep.jsonl")
    records = []
    for P in args.sizes:
        for layout in args.layouts:
            record = common.run_tree(measure, P, 1, layout, args.S, args.reps, args.delay)
            records.append(record)
            line = json.dumps(record)
            print(line, flush=True)
            with open(jsonl, "a") as f:
                f.write(line + "\n")
    plot(records, os.path.join(args.out, "lockstep.png"))
    print(json.dumps({"median_agree_share": statistics.median(r["agree_share"] for r in records)}))


if __name__ == "__main__":
    main()
