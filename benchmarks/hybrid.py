"""A hybrid model's recurrent layer over P ranks: ringseq's state passing against the head
all-to-all, beside the unpatched layer in one process, in one run.

The layer is a gated DeltaNet mixer of Qwen3.5's shape at a CPU size (transformers'
``Qwen3_5GatedDeltaNet``: hidden 512, 4 key / 8 value heads of 64; its own PyTorch kernels), run
forward + backward on B=1 x N tokens:

- ``unpatched``  the layer on the whole sequence in one process.
- ``state``      ringseq (``ringseq.patch``): each rank runs the layer on its zigzag shard, the
                 recurrence from the state its runs enter with (one all-gather of the runs'
                 summaries; the convolution's halo by another).
- ``heads``      the head all-to-all (PyTorch context parallel's gated-delta path): the same
                 patched layer, but its recurrence kernel exchanges q, k, v, g and beta so that
                 each rank runs the unchanged kernel on the whole sequence for H / P value heads,
                 and the output comes back by a second all-to-all (the convolution keeps its
                 halo). Capped by the head count: P must divide the key heads.

Per configuration: the step's median time over ``--reps`` (the slowest rank), the bytes each rank
sends in a step (tallied from the collectives it makes, ringseq's agreements included), the step
memory (peak resident set above the one before the step), and the output's max error against the
unpatched layer on the same weights.
One thread per rank; P = 4 runs 4 processes on this machine's 2 cores (time-sliced), so compare
the contenders at the same P, not across P. Prints JSON lines, writes ``hybrid.jsonl`` and
``hybrid.png``. Usage::

    python benchmarks/hybrid.py                       # N = 4096, 8192; P = 1, 2, 4
    python benchmarks/hybrid.py --sizes 2 --N 2048 --reps 2
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HIDDEN, HK, HV, DK = 512, 4, 8, 64


def _layer():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_conv_kernel_dim=4,
                               linear_key_head_dim=DK, linear_value_head_dim=DK, linear_num_key_heads=HK,
                               linear_num_value_heads=HV, layer_types=["linear_attention"], use_cache=False)
    model = Qwen3_5ForCausalLM(config)
    with torch.no_grad():  # slow forgetting, as trained long-context layers do
        mixer = model.model.layers[0].linear_attn
        mixer.A_log.fill_(-4.6)
        mixer.dt_bias.fill_(-3.0)
    return model


def _count_sends(box):
    """Tally the bytes this rank sends in torch.distributed's collectives (ring algorithms: an
    all-gather sends its piece P-1 times, an all-reduce 2 (P-1)/P of it, an all-to-all (P-1)/P)."""
    def counted(fn, share, position):
        def call(*args, **kwargs):
            t = args[position]  # the tensor this rank contributes
            P = dist.get_world_size(kwargs.get("group"))
            box[0] += int(t.numel() * t.element_size() * share(P))
            return fn(*args, **kwargs)
        return call

    dist.all_gather = counted(dist.all_gather, lambda P: P - 1, 1)
    dist.all_reduce = counted(dist.all_reduce, lambda P: 2 * (P - 1) / P, 0)
    dist.all_to_all_single = counted(dist.all_to_all_single, lambda P: (P - 1) / P, 1)


def _to_heads(t, sp, layout_order, box):
    """[B, s, H, D] (this rank's tokens, all heads) -> [B, S, H/P, D] (every token, this rank's heads)."""
    P = sp.size
    parts = t.reshape(t.size(0), t.size(1), P, t.size(2) // P, *t.shape[3:]).movedim(2, 0).contiguous()
    got = torch.empty_like(parts)
    dist.all_to_all_single(got, parts, group=sp.group)
    joined = got.movedim(0, 1).reshape(t.size(0), P * t.size(1), t.size(2) // P, *t.shape[3:])
    return joined.index_select(1, layout_order)


def _to_sequence(t, sp, layout_order, box):
    """The inverse of ``_to_heads``."""
    P, B, S = sp.size, t.size(0), t.size(1)
    ordered = torch.empty_like(t)
    ordered[:, layout_order] = t  # back to the ranks' concatenated order
    parts = ordered.reshape(B, P, S // P, *t.shape[2:]).movedim(1, 0).contiguous()
    got = torch.empty_like(parts)
    dist.all_to_all_single(got, parts, group=sp.group)
    return got.movedim(0, 2).reshape(B, S // P, P * t.size(2), *t.shape[3:])


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, sp, order, box, to_heads):
        ctx.args = (sp, order, box, to_heads)
        return (_to_heads if to_heads else _to_sequence)(t, sp, order, box)

    @staticmethod
    def backward(ctx, grad):
        sp, order, box, to_heads = ctx.args
        return (_to_sequence if to_heads else _to_heads)(grad.contiguous(), sp, order, box), None, None, None, None


def _heads_kernel(box):
    """The contender: the recurrence kernel on the whole sequence for this rank's heads."""
    from ringseq.layouts import gather_order

    def kernel(original, batch, query, key, value, g, beta, chunk_size=64, initial_state=None,
               output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        sp = batch.sp
        order = gather_order(sp.layout, batch.padded_length, sp.ring_size)
        full = [_AllToAll.apply(t, sp, order, box, True) for t in (query, key, value, g[..., None], beta[..., None])]
        out, _ = original(full[0], full[1], full[2], g=full[3][..., 0], beta=full[4][..., 0], chunk_size=chunk_size,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
        return _AllToAll.apply(out, sp, order, box, False), None

    return kernel


def measure(kind: str, N: int, reps: int) -> dict:
    import ringseq
    from ringseq.patches import mixers

    P = dist.get_world_size()
    sp = ringseq.init(sp_size=P)
    model = _layer()
    ref_model = _layer()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, N, HIDDEN, generator=g)
    dout = torch.randn(1, N, HIDDEN, generator=g)
    mixer = model.model.layers[0].linear_attn
    box = [0]
    _count_sends(box)
    if kind == "unpatched":
        x, d = hidden.requires_grad_(True), dout
        run = (lambda: mixer(x))
    else:
        ringseq.patch(model, sp=sp)
        if kind == "heads":  # the dispatchers look the sharded kernel up at each call
            mixers.SHARDED["torch_chunk_gated_delta_rule"] = _heads_kernel(box)
        _, batch = ringseq.batch.sharded({"input_ids": torch.zeros(1, N, dtype=torch.long)}, sp=sp)
        x = ringseq.shard(hidden, 1, sp=sp).requires_grad_(True)
        d = ringseq.shard(dout, 1, sp=sp)
        run = (lambda: mixer(x, ringseq=batch))

    def step():
        out = run()
        out.backward(d)
        x.grad = None
        for p in mixer.parameters():
            p.grad = None
        return out

    step()
    box[0] = 0
    step()
    sent_per_step = box[0]
    memory = common.step_peak_mb(step)
    ms = common.timed_ms(step, reps)
    with torch.no_grad():
        out = run()
        full = ringseq.gather(out, 1, sp=sp) if kind != "unpatched" else out
        ref = ref_model.model.layers[0].linear_attn(hidden)
    err = float((full - ref).abs().max())
    return dict(kind=kind, P=P, N=N, ms=round(ms, 1), sent_mb=round(sent_per_step / 2**20, 3),
                step_mb=round(common.slowest(memory), 1), max_err=err)


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for N in sorted({r["N"] for r in records}):
        base = next(r["ms"] for r in records if r["N"] == N and r["kind"] == "unpatched")
        for kind, style in (("state", "-o"), ("heads", "--s")):
            rows = sorted((r for r in records if r["N"] == N and r["kind"] == kind), key=lambda r: r["P"])
            axes[0].plot([r["P"] for r in rows], [r["ms"] / base for r in rows], style, label=f"{kind}, N={N}")
            axes[1].plot([r["P"] for r in rows], [r["sent_mb"] for r in rows], style, label=f"{kind}, N={N}")
    axes[0].set(xlabel="ranks P", ylabel="layer time / one process", title="gated DeltaNet layer, fwd+bwd")
    axes[1].set(xlabel="ranks P", ylabel="MB sent per rank per step", yscale="log", title="bytes moved")
    common.save_figure(fig, axes, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--N", type=int, nargs="*", default=[4096, 8192])
    p.add_argument("--sizes", type=int, nargs="*", default=[2, 4])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=common.RESULTS)
    args = p.parse_args(argv)
    jsonl = common.fresh_file(args.out, "hybrid.jsonl")
    records = []
    for N in args.N:
        records.append(common.run_tree(measure, 1, 1, "unpatched", N, args.reps))
        common.emit(records[-1], jsonl)
        for P in args.sizes:
            for kind in ("state", "heads"):
                records.append(common.run_tree(measure, P, 1, kind, N, args.reps))
                common.emit(records[-1], jsonl)
    plot(records, os.path.join(args.out, "hybrid.png"))


if __name__ == "__main__":
    main()
