"""The GPU check's speed part (``gpu_check.py``): fair kernel bars and the ring's efficiency.

``blocks``  each block backend's call (forward + backward, ringseq's glue included) against the
            same kernel called directly over the whole sequence with the same mask: dense (flash),
            packed documents (varlen with the same documents, drawn from real length mixes),
            a window of 128, 1024 and 4096 (flash with the same window), softcap (FlexAttention with
            the same score mod). Bar on CUDA: >= 0.9.
``ring``    ring efficiency = one kernel call over the whole sequence / the ring of P virtual ranks
            on the same device (forward + backward, the same total FLOPs), for each length, P, mask
            (dense, documents, window) and head grouping (one ring, or one per kv head). Bars on
            CUDA, one ring: >= 0.9 at 32k tokens and P = 8, >= 0.95 at 128k. Each row breaks the
            ring's time down: GPU time by CUDA events, the ring's own kernel calls run back to back,
            the virtual ring's hand-over (the copies a real transfer would make, timed alone), what
            is left (the ring's own cost: merges, accumulators), the host's time to launch it all,
            and the operations per rank and step outside the kernels (``ring_ops.OpCount``). Each
            row's ring loop also runs under ``torch.cuda.set_sync_debug_mode("error")``.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import balance  # noqa: E402 - real document-length mixes
from ring_ops import OpCount  # noqa: E402

from ringseq.attention.kernels import BlockSpec, for_call  # noqa: E402
from ringseq.attention.masks import RowMask, TokenInfo, documents  # noqa: E402
from ringseq.attention.plan import plan  # noqa: E402
from ringseq.attention.schedule import rank_schedule  # noqa: E402
from ringseq.attention.virtual import VirtualComm, VirtualRing  # noqa: E402
from ringseq.ledger import ledger  # noqa: E402


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps: int, device) -> float:
    """Median wall time of ``fn`` over ``reps`` runs (after one warm-up), synchronised."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def inputs(S: int, H: int, K: int, D: int, device, dtype, seed: int, mask: str, mix: str = "prolong64k"):
    """q, k, v, dout [B=1, heads, S, D] and the batch facts of one mask: dense, documents (packed from
    a real length mix), or window=<w> / softcap."""
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(1, H, S, D, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(1, K, S, D, generator=g).to(device, dtype) for _ in range(2))
    pos = window = softcap = None
    if mask == "documents":
        pos = balance.packed_positions(S, balance.histogram(os.path.join(balance.DATA, f"{mix}.json")), g)[None]
    elif mask.startswith("window"):
        window = int(mask.split("=")[1])
    elif mask == "softcap":
        softcap = 30.0
    info = TokenInfo() if pos is None else TokenInfo(doc=documents(pos))
    return dict(q=q, k=k, v=v, dout=dout, pos=pos, info=info, window=window, softcap=softcap)


def documents_of(pos: torch.Tensor) -> list[int]:
    starts = [0] + [i for i in range(1, pos.size(1)) if int(pos[0, i]) != int(pos[0, i - 1]) + 1]
    return [b - a for a, b in zip(starts, starts[1:] + [pos.size(1)])]


def whole_call(c: dict):
    """Forward + backward of the kernel ringseq's calls use, called directly over the whole sequence."""
    q, k, v, dout = c["q"], c["k"], c["v"], c["dout"]
    B, H, S, D = q.shape
    scale = 1.0 / math.sqrt(D)
    if q.is_cuda and c["softcap"] is not None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        fn = torch.compile(flex_attention)
        mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, S, S, device=q.device)
        cap = c["softcap"]
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

        def run():
            out = fn(*leaves, score_mod=lambda s, b, h, i, j: cap * torch.tanh(s / cap), block_mask=mask,
                     scale=scale, enable_gqa=H != k.size(1))
            out.backward(dout)
        return run
    if q.is_cuda and (c["pos"] is not None or c["window"] is not None):
        lengths = documents_of(c["pos"]) if c["pos"] is not None else [S]
        cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(q.device)
        left = -1 if c["window"] is None else c["window"] - 1
        pack = lambda t: t.transpose(1, 2).reshape(S, t.size(1), D)  # noqa: E731
        qp, kp, vp, dp = (pack(t) for t in (q, k, v, dout))
        rng, unused = torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device)

        def run():
            out, lse, *_ = torch.ops.aten._flash_attention_forward(qp, kp, vp, cu, cu, max(lengths), max(lengths), 0.0,
                                                                   True, False, scale=scale, window_size_left=left,
                                                                   window_size_right=0)
            torch.ops.aten._flash_attention_backward(dp, qp, kp, vp, out, lse, cu, cu, max(lengths), max(lengths), 0.0,
                                                     True, rng, unused, scale=scale, window_size_left=left,
                                                     window_size_right=0)
        return run
    if q.is_cuda:
        def run():
            out, lse, *aux = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)
            torch.ops.aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, aux[0], aux[1], S, S,
                                                                        0.0, True, aux[4], aux[5])
        return run
    # the CPU: aten's CPU flash kernel, the mask (if any) additive over the whole sequence
    from ringseq.reference import visibility

    vis = visibility(S, causal=True, window=c["window"], position_ids=c["pos"])
    additive = None if c["pos"] is None and c["window"] is None else \
        torch.zeros(vis.shape, dtype=q.dtype).masked_fill_(~vis, float("-inf"))[:, None]
    f = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def run():
        out, lse = f(q, k, v, 0.0, additive is None, attn_mask=additive, scale=scale)
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0,
                                                                            additive is None, attn_mask=additive,
                                                                            scale=scale)
    return run


def block_call(c: dict):
    """ringseq's block backend on the whole sequence as one call (the ring's glue included): (run, backend name)."""
    q, k, v, dout = c["q"], c["k"], c["v"], c["dout"]
    B, H, S, D = q.shape
    (pc,) = rank_schedule("contiguous", S, 1, 0, True, c["info"], c["window"]).calls[0]
    mask = RowMask(pc.q, pc.k, c["info"], c["window"], True, B, q.device) if pc.masked else None
    spec = BlockSpec(causal=pc.call.causal, scale=1.0 / math.sqrt(D), softcap=c["softcap"], mask=mask)
    backend = for_call(q, None, spec, S, S)

    def run():
        out, lse, aux = backend.forward(q, k, v, spec)
        lse = lse.to(lse.dtype if backend.exact_lse else torch.float32).contiguous()
        backend.backward(dout, q, k, v, out, lse, aux, spec)
    return run, backend.name


def check_blocks(args, rows, record) -> None:
    cuda = args.device == "cuda"
    S, H, D = (8192, 16, 128) if cuda else (512, 4, 64)
    masks = ["dense", "documents", "window=128", "window=1024", "window=4096", "softcap"]
    for mask in masks:
        if not args.time_left():
            record(rows, check="blocks", mask=mask, ok=True, skipped="time budget")
            continue
        if not cuda and mask == "softcap":
            continue  # the CPU has no fused softcap kernel to compare against
        c = inputs(S, H, H, D, args.device, torch.bfloat16, 2, mask, mix="pile")
        ours, name = block_call(c)
        t_ours, t_same = timed(ours, args.reps, args.device), timed(whole_call(c), args.reps, args.device)
        ratio = t_same / t_ours
        record(rows, check="blocks", mask=mask, kernel=name, S=S, heads=H, D=D, ours_s=round(t_ours, 6),
               same_kernel_s=round(t_same, 6), ratio=round(ratio, 3), bar=0.9 if cuda else None, ok=True,
               fast=ratio >= 0.9 if cuda else None)


def _kernels_back_to_back(vring: VirtualRing, groups: int, device):
    """The ring's own kernel calls (every rank, step, head group and call) run back to back."""
    from ringseq.attention.ring import head_groups as slices

    work = []
    P = vring.P
    for r in range(P):
        q, k, v, dout = vring.inputs[r]
        for hq, hk in slices(q.size(1), k.size(1), groups):
            found = plan(q[:, hq], vring.opts[r])
            for t, step in enumerate(found.work):
                kj, vj = (x[:, hk] for x in vring.inputs[(r - t) % P][1:3])
                for w in step:
                    work.append((w, q[:, hq][:, :, w.q_rows], kj[:, :, w.k_rows], vj[:, :, w.k_rows],
                                 dout[:, hq][:, :, w.q_rows]))

    def run():
        for w, qq, kk, vv, dd in work:
            out, lse, aux = w.kernel.forward(qq, kk, vv, w.spec)
            lse = lse.nan_to_num(neginf=-1e30).to(lse.dtype if w.kernel.exact_lse else torch.float32).contiguous()
            w.kernel.backward(dd, qq, kk, vv, out, lse, aux, w.spec)
    return run


def _handover(vring: VirtualRing, device) -> tuple:
    """(run, bytes, hops) of the virtual ring's hand-over copies alone: one copy per hop of the same
    buffers (what a real transfer writes into its receive buffer)."""
    sent = []
    real = VirtualComm.post

    def post(self, parts, step, shift=1, kind="kv"):
        sent.append((sum(p.numel() for p in parts), parts[0].dtype))
        return real(self, parts, step, shift, kind)

    VirtualComm.post = post
    try:
        vring.run()
        vring.settle()
    finally:
        VirtualComm.post = real
    blocks = [torch.empty(n, device=device, dtype=dtype) for n, dtype in sent]
    return (lambda: [b.clone() for b in blocks]), sum(b.numel() * b.element_size() for b in blocks), len(blocks)


def _ops_per_step(vring: VirtualRing, hops: int) -> float:
    """Operations outside the kernels per rank and ring step, the hand-over copies (one per hop) left out."""
    counters = [OpCount() for _ in range(vring.P)]  # a dispatch mode is per thread: one per rank
    vring.run(within=lambda r: counters[r])
    vring.settle()
    steps = sum(plan(vring.inputs[r][0], vring.opts[r]).steps for r in range(vring.P)) * 2
    return (sum(sum(c.ops.values()) for c in counters) - hops) / steps


def _sync_free(vring: VirtualRing, device) -> str | None:
    """None when the ring loop runs with no host synchronisation, else what synchronised."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.set_sync_debug_mode("error")
    try:
        vring.run()
    except RuntimeError as exc:
        return str(exc).splitlines()[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    vring.settle()
    return None


def check_ring(args, rows, record) -> None:
    cuda = args.device == "cuda"
    H, K, D = (32, 8, 128) if cuda else (4, 2, 64)
    lengths = args.lengths or ([32768, 131072] if cuda else [1024])
    for S in lengths:
        for mask in ("dense", "documents", "window=4096" if cuda else "window=128"):
            c = inputs(S, H, K, D, args.device, torch.bfloat16, 3, mask)
            whole = None
            for P in args.ranks or ([2, 4, 8] if cuda else [2, 4]):
                for groups in (1, K):
                    row = dict(check="ring", S=S, P=P, mask=mask, head_groups="one ring" if groups == 1 else
                               "one per kv head", heads=H, kv_heads=K, D=D)
                    if not args.time_left():
                        record(rows, **row, ok=True, skipped="time budget")
                        continue
                    if whole is None:
                        whole = timed(whole_call(c), args.reps, args.device)
                    layout = "contiguous" if mask.startswith("window") else "zigzag"
                    vring = VirtualRing(c["q"], c["k"], c["v"], c["dout"], P=P, layout=layout, info=c["info"],
                                        window=c["window"], head_groups=groups, stats=True)
                    row.update(_ring_row(vring, groups, whole, args))
                    bar = {32768: 0.9, 131072: 0.95}.get(S) if cuda and groups == 1 and (S, P) in (
                        (32768, 8), (131072, 8)) else None
                    record(rows, **row, bar=bar, ok=row["sync_free"] is None,
                           fast=None if bar is None else row["efficiency"] >= bar)
                    del vring


def _ring_row(vring: VirtualRing, groups: int, whole: float, args) -> dict:
    device = args.device
    cuda = torch.device(device).type == "cuda"
    hand, hand_bytes, hops = _handover(vring, device)

    def ring_run():
        vring.run()
        vring.settle()
    t_ring = timed(ring_run, args.reps, device)
    books = [ledger(o.sp) for o in vring.opts]
    before = [(b.compute_s, b.wait_s) for b in books]
    sync(device)
    start = time.perf_counter()
    if cuda:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
    vring.run()
    host = time.perf_counter() - start
    if cuda:
        end.record()
    sync(device)
    gpu = begin.elapsed_time(end) / 1e3 if cuda else time.perf_counter() - start
    vring.settle()
    t_kernels = timed(_kernels_back_to_back(vring, groups, device), args.reps, device)
    t_hand = timed(hand, args.reps, device)
    steps = sum(plan(vring.inputs[r][0], vring.opts[r]).steps for r in range(vring.P))
    return dict(efficiency=round(whole / t_ring, 3), whole_call_s=round(whole, 5), ring_s=round(t_ring, 5),
                gpu_s=round(gpu, 5), kernels_s=round(t_kernels, 5), handover_s=round(t_hand, 5),
                ring_own_s=round(gpu - t_kernels - t_hand, 5), host_launch_s=round(host, 5),
                host_compute_s=round(sum(b.compute_s - a for b, (a, _) in zip(books, before)), 5),
                host_wait_s=round(sum(b.wait_s - w for b, (_, w) in zip(books, before)), 5),
                ring_steps=steps // vring.P, handover_bytes=hand_bytes, hops=hops,
                ops_per_rank_step=round(_ops_per_step(vring, hops), 2), sync_free=_sync_free(vring, device))
