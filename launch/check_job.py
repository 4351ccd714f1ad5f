"""The job ``ringseq check`` starts on every rank (one sequence group over all of them).

The user's script provides ``make_model()`` (a transformers causal LM) and ``make_batches()``
(full batches: ``input_ids``, ``labels``, optionally ``attention_mask``/``position_ids``).
Rank 0's weights and batches are sent to every rank. Each step runs the patched model across
the ranks (gradients averaged over the group: ringseq's rule) and, on rank 0, the unpatched
model in the same dtype and in float64 on the same weights; all three then take the same SGD
step. ringseq agrees when its error against float64 is at most twice the unpatched model's
own error in the same dtype, plus a floor: the loss and every layer's gradient.
"""
from __future__ import annotations

import argparse
import copy
import json
import runpy

import torch
import torch.distributed as dist

import ringseq
from ringseq import tolerance


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach() for name, p in model.named_parameters() if p.grad is not None}


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
    sp = ringseq.init(config=ringseq.config.from_env())
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
        for p in model.parameters():  # the gradient rule: average each gradient over the ranks
            if p.grad is not None:
                dist.all_reduce(p.grad, group=sp.group)
                p.grad /= sp.size
        if rank == 0:
            plain_out, exact_out = single(**batch), exact(**batch)
            plain_loss, exact_loss = plain_out.loss, exact_out.loss
            plain_loss.backward()
            exact_loss.backward()
            labels = batch["labels"]
            tokens = [tolerance.token_losses(out.logits.detach(), labels) for out in (plain_out, exact_out)]
            # the rule of the tests (ringseq.tolerance): error vs float64 <= 2 x the unpatched model's + 2 roundings
            verdicts = [tolerance.mean_within(loss.detach(), *tokens, tokens[1].mean()),
                        *tolerance.by_layer(grads(model), grads(single), grads(exact))]
            row = {"step": step, "loss_ring": loss.item(), "loss_single": plain_loss.item(),
                   "loss_fp64": exact_loss.item(),
                   "checks": {v.what: {"measure": v.measure, "ring": v.err, "single": v.plain_err, "floor": v.floor,
                                       "ok": v.ok} for v in verdicts}}
            ok = all(v.ok for v in verdicts)
            agree &= ok
            results.append(row)
            report(row, ok)
            sgd(single, args.lr)
            sgd(exact, args.lr)
        sgd(model, args.lr)
    if rank == 0:
        print(f"ringseq check: {len(batches)} steps over {sp.size} ranks, layout {sp.layout}: "
              f"{'ringseq matches the unpatched model' if agree else 'MISMATCH'} "
              f"(rule: error vs float64 <= 2 x the unpatched model's own + two roundings)", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"sp": sp.size, "layout": sp.layout, "agree": agree, "steps": results}, f, indent=1)
    verdict = torch.tensor([1 if agree else 0])
    dist.broadcast(verdict, src=0)
    dist.destroy_process_group()
    return 0 if verdict.item() else 1


def report(row: dict, ok: bool) -> None:
    print(f"step {row['step']}: loss ringseq {row['loss_ring']:.7f}  unpatched {row['loss_single']:.7f}  "
          f"float64 {row['loss_fp64']:.7f}  {'ok' if ok else 'MISMATCH'}", flush=True)
    print(f"  {'error vs float64':32s} {'ringseq':>9s} {'unpatched':>9s} {'floor':>8s}")
    for name, c in row["checks"].items():
        flag = "" if c["ok"] else "  <- MISMATCH"
        what = f"{name} ({'gradient, ' if name != 'loss' else ''}{c['measure']})"
        print(f"  {what:32s} {c['ring']:9.1e} {c['single']:9.1e} {c['floor']:8.1e}{flag}", flush=True)


if __name__ == "__main__":
    from ringseq.processes import exit_now

    exit_now(main())
