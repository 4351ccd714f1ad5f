"""The job ``ringseq check`` starts on every rank (one sequence group over all of them).

The user's script provides ``make_model()`` (a transformers causal LM) and ``make_batches()``
(full batches: ``input_ids``, ``labels``, optionally ``attention_mask``/``position_ids``).
Rank 0's weights and batches are sent to every rank. Each step runs the patched model across
the ranks (gradients summed over the group: ringseq's rule) and, on rank 0, the unpatched
model in the same dtype and in float64 on the same weights; all three then take the same SGD
step. ringseq agrees when its error against float64 is at most twice the unpatched model's
own error in the same dtype, plus a floor: the loss and every layer's gradient.
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import runpy

import torch
import torch.distributed as dist

import ringseq

FLOOR = 1e-6  # relative error below which a difference is rounding in any dtype


def layer_of(name: str) -> str:
    """Group a parameter name by decoder layer (``layers.3``) or top-level module (``lm_head``)."""
    found = re.search(r"layers\.(\d+)\.", name)
    if found:
        return f"layers.{found.group(1)}"
    parts = [p for p in name.split(".") if p not in ("model", "weight", "bias")]
    return parts[0] if parts else name


def grads_by_layer(model) -> dict[str, torch.Tensor]:
    groups: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            groups.setdefault(layer_of(name), []).append(p.grad.detach().double().flatten())
    return {k: torch.cat(v) for k, v in groups.items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def sgd(model, lr: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad.to(p.dtype)
    model.zero_grad(set_to_none=True)


def load_script(path: str):
    found = runpy.run_path(path, run_name="__ringseq_check__")
    missing = [n for n in ("make_model", "make_batches") if not callable(found.get(n))]
    if missing:
        raise ringseq.RingSeqError(f"{path} must define {' and '.join(missing)}(): make_model() returns a "
                                   f"transformers causal LM, make_batches() an iterable of full batches")
    return found["make_model"], found["make_batches"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("script")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    args = parser.parse_args(argv)
    sp = ringseq.config.from_env().init()
    rank = dist.get_rank()
    make_model, make_batches = load_script(args.script)

    torch.manual_seed(0)
    model = make_model()
    for p in model.parameters():  # rank 0's weights everywhere
        dist.broadcast(p.data, src=0)
    batches = [None]
    if rank == 0:
        batches = [[b for _, b in zip(range(args.steps), make_batches())]]
    dist.broadcast_object_list(batches, src=0)
    batches = batches[0]
    if len(batches) < args.steps:
        raise ringseq.RingSeqError(f"make_batches() gave {len(batches)} batches; --steps is {args.steps}")
    single = copy.deepcopy(model) if rank == 0 else None
    exact = copy.deepcopy(model).double() if rank == 0 else None
    ringseq.patch(model, sp=sp)

    results, agree = [], True
    for step, batch in enumerate(batches):
        loss = model(**batch).loss
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=sp.group)
        if rank == 0:
            plain_loss = single(**batch).loss
            plain_loss.backward()
            exact_loss = exact(**batch).loss
            exact_loss.backward()
            ring_g, plain_g, exact_g = grads_by_layer(model), grads_by_layer(single), grads_by_layer(exact)
            row = {"step": step, "loss_ring": loss.item(), "loss_single": plain_loss.item(),
                   "loss_fp64": exact_loss.item(),
                   "loss_err_ring": abs(loss.item() - exact_loss.item()) / abs(exact_loss.item()),
                   "loss_err_single": abs(plain_loss.item() - exact_loss.item()) / abs(exact_loss.item()),
                   "grads": {k: {"ring": rel(ring_g[k], exact_g[k]), "single": rel(plain_g[k], exact_g[k])}
                             for k in exact_g}}
            ok = row["loss_err_ring"] <= 2 * row["loss_err_single"] + FLOOR and all(
                g["ring"] <= 2 * g["single"] + FLOOR for g in row["grads"].values())
            agree &= ok
            results.append(row)
            report(row, ok)
            sgd(single, args.lr)
            sgd(exact, args.lr)
        sgd(model, args.lr)
    if rank == 0:
        print(f"ringseq check: {len(batches)} steps over {sp.size} ranks, layout {sp.layout}: "
              f"{'ringseq matches the unpatched model' if agree else 'MISMATCH'} "
              f"(rule: error vs float64 <= 2 x the unpatched model's own + {FLOOR:g})", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"sp": sp.size, "layout": sp.layout, "agree": agree, "steps": results}, f, indent=1)
    verdict = torch.tensor([1 if agree else 0])
    dist.broadcast(verdict, src=0)
    dist.destroy_process_group()
    return 0 if verdict.item() else 1


def report(row: dict, ok: bool) -> None:
    print(f"step {row['step']}: loss ringseq {row['loss_ring']:.7f}  unpatched {row['loss_single']:.7f}  "
          f"float64 {row['loss_fp64']:.7f}   rel. error ringseq {row['loss_err_ring']:.1e}  "
          f"unpatched {row['loss_err_single']:.1e}  {'ok' if ok else 'MISMATCH'}", flush=True)
    print(f"  {'gradient rel. error vs float64':32s} {'ringseq':>9s} {'unpatched':>9s}")
    for name, g in row["grads"].items():
        flag = "" if g["ring"] <= 2 * g["single"] + FLOOR else "  <- MISMATCH"
        print(f"  {name:32s} {g['ring']:9.1e} {g['single']:9.1e}{flag}", flush=True)


if __name__ == "__main__":
    from ringseq.processes import exit_now

    exit_now(main())
