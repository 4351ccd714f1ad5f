"""Where a training step's memory goes: the tiny Llama of ``planner_validate.py``, one rank's view.

For each (N, P) a fresh process tree (one thread per rank, gloo) runs the step
``planner_validate.py`` measures (unpatched at P = 1, ``ringseq.patch`` at P > 1; ``--chunked``
forces the choice of loss) and reports, on the rank with the largest peak:

``rss_mb``        the first step's peak resident set above the baseline after the model was built
                  (what ``planner_validate.py`` and ``model_memory.py`` record);
``tensor_mb``     the peak of live tensor bytes in a second, identical step, from
                  ``torch.profiler``'s allocation events (``profile_memory=True``), above the tensors
                  alive before it;
``saved_mb``      the bytes autograd saves for backward in that step (``saved_tensors_hooks``, each
                  storage once), per layer (``saved_layer_mb``, layer 0) and in all;
``grads_mb``      the parameter gradients; ``peak_op``: the operator running at the tensor peak;
``slack``         rss_mb / tensor_mb - 1: what the allocator and the process hold beyond live tensors.

Not a figure the planner reads; evidence for its memory model (docs/planner.md). Usage::

    flock /tmp/ringseq-cpu.lock python benchmarks/memory_profile.py --lengths 2048 4096 --sizes 1 2 4
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import model_memory  # noqa: E402


def _saved_bytes(model, run):
    """Run ``run()`` and count the storages autograd saves, by the layer (or '-') that saved them."""
    where = ["-"]
    seen: dict[int, tuple[str, int]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, str(i))))
        hooks.append(layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, "-")))

    def pack(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and t.device.type == "cpu":
            st = t.untyped_storage()
            seen.setdefault(st.data_ptr(), (where[0], st.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    for h in hooks:
        h.remove()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    by: dict[str, int] = {}
    for ptr, (w, n) in seen.items():
        if ptr not in params:
            by[w] = by.get(w, 0) + n
    return by


def _tensor_peak(run):
    """(peak live tensor bytes above the start, name of the op running then) of ``run()``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = prof.profiler.kineto_results.events()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = peak = 0
    at = 0
    for t, n in mem:
        live += n
        if live > peak:
            peak, at = live, t
    ops = [e for e in events if e.name() != "[memory]" and e.start_ns() <= at <= e.end_ns()]
    op = min(ops, key=lambda e: e.duration_ns()).name() if ops else "?"
    return peak, op


def measure(N: int, chunked: bool | None) -> dict:
    import ringseq

    P = dist.get_world_size()
    model = model_memory.tiny_llama()
    if P > 1 or chunked:
        ringseq.patch(model, sp=ringseq.init(sp_size=P), chunked_loss=chunked is not False)
    ids = torch.randint(0, 2048, (1, N), generator=torch.Generator().manual_seed(1))
    base = common.rss_mb()
    out = {}

    def forward():
        out["loss"] = model(input_ids=ids, labels=ids).loss

    def step():
        forward()
        out.pop("loss").backward()

    step()
    rss = common.peak_rss_mb() - base
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    peak, op = _tensor_peak(step)
    model.zero_grad(set_to_none=True)
    saved = _saved_bytes(model, forward)
    out.pop("loss").backward()
    model.zero_grad(set_to_none=True)
    MB = 2**20
    mine = dict(rss_mb=round(rss, 1), tensor_mb=round(peak / MB, 1), saved_mb=round(sum(saved.values()) / MB, 1),
                saved_layer_mb=round(saved.get("0", 0) / MB, 2), saved_outside_mb=round(saved.get("-", 0) / MB, 2),
                grads_mb=round(grads / MB, 1), peak_op=op, slack=round(rss * MB / peak - 1, 3))
    worst = common.slowest(rss)
    # the rank with the largest resident peak reports (ties: the lowest rank)
    rank = torch.tensor([dist.get_rank() if rss == worst else P], dtype=torch.int64)
    if P > 1:
        dist.all_reduce(rank, op=dist.ReduceOp.MIN)
    box = [mine]
    if P > 1:
        objs = [None] * P
        dist.all_gather_object(objs, mine)
        box = [objs[int(rank.item())]]
    return dict(N=N, P=P, chunked_loss=P > 1 if chunked is None else chunked, **box[0])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--chunked", choices=("auto", "yes", "no"), default="auto",
                        help="the loss: auto = unpatched full logits at P = 1, chunked beyond")
    parser.add_argument("--out", default=None, help="also append the lines to this jsonl file")
    args = parser.parse_args(argv)
    chunked = {"auto": None, "yes": True, "no": False}[args.chunked]
    for N in args.lengths:
        for P in args.sizes:
            common.emit(common.run_tree(measure, P, 1, N, chunked), args.out)


if __name__ == "__main__":
    main()
