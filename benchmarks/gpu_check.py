"""The GPU check: ringseq's CUDA path, exact and fast, on one GPU in a few minutes, no downloads.

    python benchmarks/gpu_check.py                 # --device cuda (one GPU)
    python benchmarks/gpu_check.py --device cpu    # the parts that apply on the CPU (CI runs it)

(a) ``kernels``  every backend x feature (dense causal, documents, padding, window, softcap,
                 sinks, GQA) forward and backward on a virtual ring, against a float64 reference
                 by the 2x rule (``ringseq.tolerance``); a backend refuses what it cannot take
                 (recorded, not a failure); the default choice must take everything.
(b) ``speed``    the block kernels' achieved TFLOP/s against plain SDPA flash on the same number
                 of visible (query, key) pairs, forward + backward (bar on CUDA: >= 90%).
(c) ``ring``     a whole ring of P virtual ranks on the one device: P threads running ringseq's
                 own ring loop (``ring_forward``/``ring_backward``) whose transfers are handed
                 over in memory (NCCL refuses two ranks on one GPU); exact against the reference
                 for every layout, and the ring's overhead per step against the same kernel calls
                 run back to back.
(d) ``model``    a patched tiny Llama (packed documents) training step: loss and gradients against
                 the unpatched model in the same dtype and in float64.

Off CUDA FlexAttention runs forward only (torch has no CPU backward for it): (a) checks its
forward there. Prints one JSON line per check and a summary; exits 1 on any exactness failure.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import statistics
import sys
import time
import types

import torch

import ringseq
from ringseq import reference as exact, tolerance
from ringseq.attention import ring
from ringseq.attention.kernels import BlockSpec, for_call
from ringseq.attention.masks import RowMask, TokenInfo, documents
from ringseq.attention.schedule import rank_schedule
from ringseq.attention.virtual import virtual_ring as run_virtual_ring
from ringseq.layouts import global_positions

FEATURES = {
    "dense causal": dict(),
    "documents": dict(packed=True),
    "padding": dict(padded=True),
    "window": dict(window=96),
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=True),
    "GQA": dict(K=2),
}


# ---------------------------------------------------------------- inputs and the reference

def positions(B: int, S: int, g) -> torch.Tensor:
    """[B, S] position ids of packed documents of random lengths (about S/6 each)."""
    rows = []
    for _ in range(B):
        pos = []
        while len(pos) < S:
            pos.extend(range(int(torch.randint(S // 16, S // 3, (1,), generator=g))))
        rows.append(pos[:S])
    return torch.tensor(rows)


def left_padding(B: int, S: int, g) -> torch.Tensor:
    mask = torch.ones(B, S, dtype=torch.long)
    for b in range(B):
        mask[b, :int(torch.randint(1, S // 4, (1,), generator=g))] = 0
    return mask


def make_case(B, H, K, S, D, seed, packed=False, padded=False, sinks=False, **features):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, K, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    return dict(q=q, k=k, v=v, dout=dout, sinks=torch.randn(H, generator=g, dtype=torch.float64) if sinks else None,
                pos=positions(B, S, g) if packed else None, pad=left_padding(B, S, g) if padded else None,
                window=features.get("window"), softcap=features.get("softcap"))


def reference(c, dtype, device):
    """(out, dq, dk, dv) by ``ringseq.reference`` in ``dtype`` on ``device``: below float64 what an
    unpatched model runs (SDPA with the dense mask; by hand, as eager does, with a softcap)."""
    q, k, v, dout = (c[n].to(device, dtype) for n in ("q", "k", "v", "dout"))
    return exact.attention(q, k, v, dout, causal=True, window=c["window"], softcap=c["softcap"],
                           sinks=None if c["sinks"] is None else c["sinks"].to(device, dtype),
                           position_ids=c["pos"], attention_mask=c["pad"], sdpa=dtype != torch.float64)[:4]


def _info(c) -> TokenInfo:
    info = TokenInfo(doc=None if c["pos"] is None else documents(c["pos"]),
                     valid=None if c["pad"] is None else c["pad"].bool())
    return TokenInfo(valid=info.valid) if info.doc is not None and not bool(info.doc.any()) else info


def _shard_rows(layout, S, P, r, device):
    return global_positions(layout, S, P, r).to(device)


def virtual_ring(c, dtype, device, *, P, layout, kernel=None, backward=True):
    """ringseq's ring loop on P virtual ranks (``ringseq.attention.virtual``): (out, dq, dk, dv) in global order."""
    q, k, v, dout = (c[n].to(device, dtype) for n in ("q", "k", "v", "dout"))
    sinks = None if c["sinks"] is None else c["sinks"].to(device, dtype)
    return run_virtual_ring(q, k, v, dout if backward else None, P=P, layout=layout, info=_info(c), sinks=sinks,
                            window=c["window"], softcap=c["softcap"], kernel=kernel)


def _check(verdicts) -> None:
    failed = [str(v) for v in verdicts if not v.ok]
    if failed:
        raise AssertionError("; ".join(failed))


# ---------------------------------------------------------------- the checks

def _record(rows, **row):
    print(json.dumps(row), flush=True)
    rows.append(row)


def _compare(c, got, dtype, device, backward, refs=None):
    """Max errors of ``got`` (out, dq, dk, dv) by the 2x rule; ``refs``: (float64, plain) if made already."""
    ref, plain = refs or (reference(c, torch.float64, device), reference(c, dtype, device))
    n = 4 if backward else 1
    errors = {}
    for name, g, p, r in list(zip(("out", "dq", "dk", "dv"), got, plain, ref))[:n]:
        errors[name] = float((g.double() - r).abs().max())
        _check([tolerance.within(g.cpu(), p.cpu(), r.cpu(), name)])
    return errors


def check_kernels(args, rows):
    """(a) every backend x feature on a virtual ring, forward and backward (forward only for flex off CUDA)."""
    cuda = args.device == "cuda"
    backends = ["cuda_flash", "cuda_varlen", "flex", "torch", None] if cuda else ["cpu_flash", "flex", "torch", None]
    B, H, S, D, P = (2, 8, 2048, 128, 4) if cuda else (2, 4, 128, 32, 2)
    dtype = torch.bfloat16
    for feature, kw in FEATURES.items():
        c = make_case(B, H, kw.get("K", H), S, D, seed=len(rows), **{k: x for k, x in kw.items() if k != "K"})
        refs = reference(c, torch.float64, args.device), reference(c, dtype, args.device)
        for kernel in backends:
            start = time.perf_counter()
            backward = cuda or kernel != "flex"
            row = dict(check="kernels", feature=feature, kernel=kernel or "auto", device=args.device, backward=backward)
            try:
                got = virtual_ring(c, dtype, args.device, P=P, layout="zigzag", kernel=kernel, backward=backward)
            except ringseq.RingSeqError as exc:
                if kernel is None:
                    raise
                _record(rows, **row, ok=True, refused=str(exc)[:160])
                continue
            row["seconds"] = round(time.perf_counter() - start, 2)  # compiles included: the budget's main risk
            try:
                row["max_error"] = _compare(c, got, dtype, args.device, backward, refs)
                _record(rows, **row, ok=True)
            except AssertionError as exc:
                _record(rows, **row, ok=False, error=str(exc)[:300])


def _timed(fn, reps):
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _block_call(c, kernel, dtype, device):
    """(fn running one block call forward + backward with ``kernel``, visible pairs of the call)."""
    q, k, v, dout = (c[n].to(device, dtype) for n in ("q", "k", "v", "dout"))
    B, H, S, D = q.shape
    info = TokenInfo(doc=None if c["pos"] is None else documents(c["pos"]))
    (pc,) = rank_schedule("contiguous", S, 1, 0, True, info, c["window"]).calls[0]
    mask = RowMask(pc.q, pc.k, info, c["window"], True, B, device) if pc.masked else None
    spec = BlockSpec(causal=True, scale=1.0 / math.sqrt(D), softcap=c["softcap"], mask=mask)
    backend = for_call(q, kernel, spec, S, S)
    pairs = (mask.rows(0, S).sum().item() if mask is not None else B * S * (S + 1) // 2) * H

    def run():
        out, lse, aux = backend.forward(q, k, v, spec)
        backend.backward(dout, q, k, v, out, lse.masked_fill(lse == float("-inf"), float("inf")), aux, spec)
    return run, pairs, backend.name


def check_speed(args, rows):
    """(b) achieved TFLOP/s of the block kernels against SDPA flash on the same visible pairs."""
    cuda = args.device == "cuda"
    B, H, S, D = (1, 16, 8192, 128) if cuda else (1, 4, 512, 64)
    dtype = torch.bfloat16 if cuda else torch.float32
    dense = make_case(B, H, H, S, D, seed=1)
    q, k, v, dout = (dense[n].to(args.device, dtype).requires_grad_(n != "dout") for n in ("q", "k", "v", "dout"))
    backend = contextlib.nullcontext()
    if cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = sdpa_kernel(SDPBackend.FLASH_ATTENTION)

    def sdpa():
        with backend:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)
    flops = lambda pairs: 4 * D * pairs * 3.5  # noqa: E731 - forward 4 D per pair, backward 2.5x that
    t_sdpa = _timed(sdpa, args.reps)
    tf_sdpa = flops(B * H * S * (S + 1) // 2) / t_sdpa / 1e12
    for feature in ("dense causal", "documents", "window", "softcap"):
        kw = FEATURES[feature]
        c = make_case(B, H, H, S, D, seed=2, **kw)
        run, pairs, name = _block_call(c, None, dtype, args.device)
        t = _timed(run, args.reps)
        tf = flops(pairs) / t / 1e12
        ratio = tf / tf_sdpa
        bar = cuda and feature != "softcap"  # SDPA has no softcap: that row is for information
        _record(rows, check="speed", feature=feature, kernel=name, tflops=round(tf, 2), sdpa_flash_tflops=round(tf_sdpa, 2),
                ratio=round(ratio, 3), bar=0.9 if bar else None, ok=True, fast=ratio >= 0.9 if bar else None)


def check_ring(args, rows):
    """(c) a ring of P virtual ranks per layout: exact, and its overhead per ring step."""
    cuda = args.device == "cuda"
    B, H, K, S, D, P = (1, 8, 2, 8192, 128, 4) if cuda else (1, 4, 2, 256, 32, 4)
    dtype = torch.bfloat16
    for layout in ("zigzag", "contiguous", "striped"):
        c = make_case(B, H, K, S, D, seed=3, packed=True)
        row = dict(check="ring", layout=layout, P=P, S=S, device=args.device)
        got = virtual_ring(c, dtype, args.device, P=P, layout=layout)
        try:
            row["max_error"] = _compare(c, got, dtype, args.device, True)
            row["ok"] = True
        except AssertionError as exc:
            row.update(ok=False, error=str(exc)[:300])
        t_ring = _timed(lambda: virtual_ring(c, dtype, args.device, P=P, layout=layout), args.reps)
        t_kernels, steps = _kernels_only(c, dtype, args.device, P, layout)
        row.update(ring_s=round(t_ring, 5), kernels_s=round(t_kernels, 5), steps=steps,
                   overhead_per_step_s=round((t_ring - t_kernels) / (P * steps), 6))
        _record(rows, **row)


def _kernels_only(c, dtype, device, P, layout):
    """The time of the ring's own kernel calls (every rank, step and call, forward + backward)
    run back to back, and the ring's step count."""
    q, k, v, dout = (c[n].to(device, dtype) for n in ("q", "k", "v", "dout"))
    B, H, S, D = q.shape
    info = TokenInfo(doc=documents(c["pos"]))
    work = []
    for r in range(P):
        opts = ring.RingOptions(group=None, ranks=tuple(range(P)), r=r, layout=layout, causal=True,
                                scale=1.0 / math.sqrt(D), info=info,
                                sp=types.SimpleNamespace(ranks=("virtual", P, r), size=P, stats=False))
        sched = ring._Schedule(q[:, :, _shard_rows(layout, S, P, r, device)], opts, 0)
        for t, calls in enumerate(sched.work):
            j = (r - t) % P
            qi, ki = _shard_rows(layout, S, P, r, device), _shard_rows(layout, S, P, j, device)
            for call, kernel, spec in calls:
                qs, ks = qi[call.q_rows], ki[call.k_rows]
                work.append((kernel, spec, *(x.contiguous() for x in (q[:, :, qs], k[:, :, ks], v[:, :, ks], dout[:, :, qs]))))

    def run():
        for kernel, spec, qq, kk, vv, dd in work:
            out, lse, aux = kernel.forward(qq, kk, vv, spec)
            kernel.backward(dd, qq, kk, vv, out, lse.masked_fill(lse == float("-inf"), float("inf")), aux, spec)
    return _timed(run, 3), sched.steps


def check_model(args, rows):
    """(d) a patched tiny Llama step (packed documents) against the unpatched one."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        _record(rows, check="model", ok=True, skipped="transformers is not installed")
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from ringseq.processes import free_port
        os.environ["MASTER_PORT"] = str(free_port())
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    sp = ringseq.init(sp_size=1)
    S = 2048 if args.device == "cuda" else 256
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False, attn_implementation="sdpa")
    base = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, S), generator=g)
    batch = {"input_ids": ids, "labels": ids, "position_ids": positions(1, S, g)}

    def step(dtype, patched):
        model = LlamaForCausalLM(copy.deepcopy(config)).to(args.device, dtype)  # patch() edits its config
        model.load_state_dict(base.state_dict())
        if patched:
            model = ringseq.patch(model, sp=sp)
        loss = model(**{n: t.to(args.device) for n, t in batch.items()}).loss
        loss.backward()
        return loss.detach().cpu(), {n: p.grad.detach().cpu() for n, p in model.named_parameters()}

    dtype = torch.bfloat16
    row = dict(check="model", model="tiny llama", S=S, device=args.device, dtype="bf16")
    try:
        (loss, grads), (plain_loss, plain_grads), (ref_loss, ref_grads) = (
            step(dtype, True), step(dtype, False), step(torch.float64, False))
        _check([tolerance.within(loss, plain_loss, ref_loss.double(), "loss"),
                *tolerance.by_layer(grads, plain_grads, ref_grads)])
        _record(rows, **row, ok=True)
    except AssertionError as exc:
        _record(rows, **row, ok=False, error=str(exc)[:300])


CHECKS = {"kernels": check_kernels, "speed": check_speed, "ring": check_ring, "model": check_model}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--only", nargs="*", choices=list(CHECKS), default=list(CHECKS))
    p.add_argument("--reps", type=int, default=None, help="timing repetitions (default: 10 on CUDA, 2 on the CPU)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --device cpu for the CPU part", file=sys.stderr)
        return 2
    args.reps = args.reps or (10 if args.device == "cuda" else 2)
    if args.device == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    rows, start = [], time.perf_counter()
    for name in args.only:
        CHECKS[name](args, rows)
    failed = [r for r in rows if not r["ok"]]
    slow = [r for r in rows if r.get("fast") is False]
    print(json.dumps({"summary": True, "device": args.device, "checks": len(rows), "exactness_failures": len(failed),
                      "below_speed_bar": len(slow), "seconds": round(time.perf_counter() - start, 1)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
