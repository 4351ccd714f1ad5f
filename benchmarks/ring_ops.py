"""Work per ring step outside the attention kernels: the operations one ``ring_attention`` call makes.

    python benchmarks/ring_ops.py                       # world 2 and 4, dense and packed, bf16
    python benchmarks/ring_ops.py --worlds 2 --cases packed --mixes pile --head-groups 1 kv

On a GPU every operation outside the attention kernels is a kernel launch and a pass over memory,
paid at every ring step of every layer; on the CPU the same operations show as work. This counts
them for one forward + backward of ``ring_attention`` on P gloo ranks (after one call that makes
the batch's plan, as the first layer does for all later ones): every aten and c10d operation
dispatched inside the call, except views, bare allocations (``empty*``) and the attention kernels
themselves; sends and receives count one each. Per ring step = the count over the forward's plus
the backward's ring steps (the busiest rank). Inputs are laid out as transformers hands them over
([B, s, H, D] memory), GQA 8 query / 2 kv heads, D 64, 512 tokens per rank, zigzag; packed rows
are drawn from real document-length mixes (``benchmarks/doc_lengths``). Prints one JSON line per
case, and the ops each case made (``--show``).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import balance  # noqa: E402 - the packed rows of real document-length mixes
import common  # noqa: E402

KERNELS = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
           "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
           "_flash_attention_forward", "_flash_attention_backward", "flex_attention", "flex_attention_backward"}
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
BARS = {"dense": 16, "packed": 24}
"""Issue 36's bars: operations per ring step at world 2 and 4."""


class OpCount(TorchDispatchMode):
    """Counts the memory-writing operations dispatched while active, by name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        view = not func._schema.is_mutable and any(
            r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if not (view or name in ALLOCATIONS or name in KERNELS):
            self.ops[f"{func.namespace}.{name}"] += 1
        return func(*args, **(kwargs or {}))


def _inputs(P: int, case: str, mix: str, seed: int, dtype, B=1, H=8, K=2, s=512, D=64):
    """Full q, k, v, dout in transformers' [B, S, heads, D] layout, and packed position ids (or None)."""
    g = torch.Generator().manual_seed(seed)
    S = s * P
    q, dout = (torch.randn(B, S, H, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, S, K, D, generator=g).to(dtype) for _ in range(2))
    pos = None
    if case == "packed":
        hist = balance.histogram(os.path.join(balance.DATA, f"{mix}.json"))
        pos = torch.stack([balance.packed_positions(S, hist, g) for _ in range(B)])
    return q, k, v, dout, pos


def _count(case: str, mix: str, dtype_name: str, head_groups, layout: str, seed: int) -> dict:
    """One rank's count (runs in a process tree)."""
    import torch.distributed as dist

    import ringseq

    return count(ringseq.init(sp_size=dist.get_world_size(), layout=layout), case, mix, dtype_name, head_groups, seed)


def count(sp, case: str, mix: str | None, dtype_name: str = "bfloat16", head_groups=1, seed: int = 0) -> dict:
    """Operations per ring step of one ``ring_attention`` forward + backward on the group of ``sp``
    (every rank calls it; the busiest rank's count is returned on all)."""
    import torch.distributed as dist

    import ringseq
    from ringseq.attention.masks import TokenInfo
    from ringseq.attention.schedule import rank_schedule

    P, layout = sp.size, sp.layout
    dtype = getattr(torch, dtype_name)
    q, k, v, dout, pos = _inputs(P, case, mix, seed, dtype)
    local = [ringseq.shard(t, 1, sp=sp).transpose(1, 2).requires_grad_(True) for t in (q, k, v)]
    grad = ringseq.shard(dout, 1, sp=sp).transpose(1, 2)
    info = ringseq.token_info(sp, position_ids=ringseq.shard(pos, 1, sp=sp)) if pos is not None else None

    def call():
        for t in local:
            t.grad = None
        ringseq.ring_attention(*local, sp=sp, token_info=info, head_groups=head_groups).backward(grad)

    call()  # the batch's plan, made once for every layer
    counter = OpCount()
    with counter:
        call()
    steps = rank_schedule(layout, q.size(1), P, sp.ring_rank, True, info or TokenInfo(), None).steps
    total = sum(counter.ops.values())
    every = [None] * P
    dist.all_gather_object(every, (total, steps, dict(counter.ops)), group=sp.group)
    busiest = max(range(P), key=lambda r: every[r][0] / max(1, 2 * every[r][1]))
    total, steps, ops = every[busiest]
    return dict(total_ops=total, ring_steps=steps, ops_per_step=round(total / (2 * steps), 2), busiest_rank=busiest,
                ops=dict(sorted(ops.items(), key=lambda x: -x[1])))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    p.add_argument("--cases", nargs="+", choices=["dense", "packed"], default=["dense", "packed"])
    p.add_argument("--mixes", nargs="+", choices=balance.MIXES, default=list(balance.MIXES))
    p.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float32"], default=["bfloat16"])
    p.add_argument("--head-groups", nargs="+", default=["1"],
                   help="1 (one ring), kv (one per kv head), a number, or default (ring_attention's own default)")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", action="store_true", help="print which operations each case made")
    p.add_argument("--label", default="", help="a name for this run's rows (e.g. the commit measured)")
    p.add_argument("--out", default=common.RESULTS)
    args = p.parse_args(argv)
    path = os.path.join(args.out, "ring_ops.jsonl")
    os.makedirs(args.out, exist_ok=True)  # rows are appended: runs of several versions sit side by side
    over = 0
    for world in args.worlds:
        for case in args.cases:
            for mix in (args.mixes if case == "packed" else [None]):
                for dtype in args.dtypes:
                    for groups in args.head_groups:
                        hg = {"kv": "kv", "default": None}[groups] if groups in ("kv", "default") else int(groups)
                        got = common.run_tree(_count, world, 1, case, mix, dtype, hg, args.layout, args.seed)
                        ops = got.pop("ops")
                        bar = BARS[case] if groups == "1" else None
                        row = dict(run=args.label, world=world, case=case, mix=mix, dtype=dtype, head_groups=groups,
                                   layout=args.layout, **got, bar=bar, within=None if bar is None else
                                   got["ops_per_step"] <= bar)
                        over += row["within"] is False
                        line = json.dumps(row)
                        print(line, flush=True)
                        with open(path, "a") as f:
                            f.write(line + "\n")
                        if args.show:
                            print("   ", ops, flush=True)
    plot(path, os.path.join(args.out, "ring_ops.png"))
    return 1 if over else 0


def plot(jsonl: str, png: str) -> None:
    """Operations per ring step by case, one bar per run and head grouping (bf16 rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(jsonl) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if r["dtype"] == "bfloat16"]
    cases = list(dict.fromkeys((r["world"], r["case"], r["mix"]) for r in rows))
    series = list(dict.fromkeys((r.get("run", ""), r["head_groups"]) for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(cases)), 4))
    width = 0.8 / max(1, len(series))
    for n, (run, groups) in enumerate(series):
        got = {(r["world"], r["case"], r["mix"]): r["ops_per_step"] for r in rows
               if (r.get("run", ""), r["head_groups"]) == (run, groups)}
        xs = [i + n * width for i, c in enumerate(cases) if c in got]
        ax.bar(xs, [got[c] for c in cases if c in got], width,
               label=f"{run or 'this run'}, head_groups={groups}")
    for bar, name in ((16, "dense bar"), (24, "packed bar")):
        ax.axhline(bar, color="grey", linestyle=":", linewidth=1)
        ax.text(len(cases) - 0.5, bar, name, va="bottom", ha="right", fontsize=8, color="grey")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels([f"P={w} {c}" + (f"\n{m}" if m else "") for w, c, m in cases], fontsize=8)
    ax.set_ylabel("operations per ring step\n(outside the attention kernels)")
    ax.set_title("One ring_attention forward + backward, bf16, 512 tokens per rank, zigzag")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
