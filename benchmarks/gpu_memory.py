"""The GPU check's memory row (``gpu_check.py`` (9)): the longest sequence one device trains in a fixed step budget,
as ``patch(fit=True)``'s planner predicts it and as measured.

A Llama in a world of one: on CUDA 8 layers of width 1024, vocabulary 32,000, bf16, a step budget of 2 GiB (about
73k tokens and a second a step on an H100, as the planner predicts); on the CPU a tiny one in fp32, its budget what
the planner's leanest switches need at 2,048 tokens. The planner's longest length is ``ringseq.planner.fit.longest``:
the last length on the layout's grid at which its leanest set of switches (``fit.least``) fits the budget less fit's
headroom. Each probe trains one step of a fresh copy patched with ``fit=True`` and a budget that admits just the
leanest set at that length, so fit applies that set, and measures the step's peak (CUDA: allocated bytes above those
held before it, the gradients included; the CPU: the resident set's high-water mark above the step's start, after
one warm-up step, glibc told to give freed blocks back, ``common.return_freed_memory``). The measured longest is the
last probed length whose peak is within the fixed budget, found by bisection around the predicted one.

The row fails on CUDA when the step at the predicted longest length measures over the budget: fit would call that
length safe and the device would run out. On the CPU it reports without judging: the tiny model's steps (10-25 MB)
measure from 10% under to 6% over the planner, a spread wider than fit's headroom, which was measured on the
benchmark model at 448 MB (docs/memory.md, "Fit within its budget").
"""
from __future__ import annotations

import copy
import os
import sys

import torch

import ringseq
from ringseq.planner import fit as planner_fit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

GIB, MIB = 2**30, 2**20


def _model(cuda: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    if cuda:
        config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                             num_attention_heads=16, num_key_value_heads=4, use_cache=False, attn_implementation="sdpa")
    else:
        config = LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16 if cuda else torch.float32)


def _setting(sp, base, device):
    """The planner's view of the device, as fit builds it (one short step of a patched copy)."""
    model = copy.deepcopy(base).to(device)
    ringseq.patch(model, sp=sp, fit=True, memory_budget=GIB)
    ids = torch.zeros(1, 64, dtype=torch.long, device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    return model._ringseq_patch.fit.setting


def _peak(sp, base, setting, N: int, device) -> float:
    """Bytes one step of N tokens adds at its peak, under the leanest set of switches at N (applied by fit)."""
    model = copy.deepcopy(base).to(device)
    need = planner_fit.least(setting, N, 1).predicted_peak_bytes
    ringseq.patch(model, sp=sp, fit=True, memory_budget=planner_fit.budget_for(need))
    g = torch.Generator().manual_seed(N)
    ids = torch.randint(0, model.config.vocab_size, (1, N), generator=g).to(device)

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    try:
        if device.type == "cuda":
            step()  # the first step plans and builds what steps keep (the kernels' workspaces)
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            return float(torch.cuda.max_memory_allocated() - before)
        return common.step_peak_mb(step) * MIB
    finally:
        ringseq.unpatch(model)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def check_memory(args, rows, record, world_of_one):
    """(9) the longest sequence in a fixed step budget on one device: predicted against measured."""
    row = dict(check="memory", device=args.device)
    try:
        import transformers  # noqa: F401
    except ImportError:
        record(rows, **row, ok=True, skipped="transformers is not installed")
        return
    cuda = args.device == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        common.return_freed_memory()
    sp = world_of_one()
    base = _model(cuda)
    setting = _setting(sp, base, device)
    grain = planner_fit.grain(setting)
    budget = 2 * GIB if cuda else planner_fit.least(setting, 2048, 1).predicted_peak_bytes
    predicted = planner_fit.longest(setting, 1, budget, 1 << 24)
    if predicted < 2 * grain:
        record(rows, **row, ok=False, error=f"the planner fits no length of two grains ({2 * grain} tokens) in "
                                            f"{budget / MIB:.0f} MiB")
        return
    probes = []

    def fits(N: int) -> bool:
        peak = _peak(sp, base, setting, N, device)
        probes.append(dict(tokens=N, measured_mb=round(peak / MIB, 1),
                           predicted_mb=round(planner_fit.least(setting, N, 1).predicted_peak_bytes / MIB, 1)))
        return peak <= budget

    at_predicted = fits(predicted)
    lo, hi = (predicted, 2 * predicted) if at_predicted else (predicted // 2 // grain * grain, predicted)
    if at_predicted and fits(hi):
        lo, hi = hi, None  # longer than twice the prediction: the search stops there
    elif not at_predicted and not fits(lo):
        lo, hi = 0, lo
    for _ in range(args.memory_probes - len(probes)):
        if hi is None or hi - lo <= grain:
            break
        mid = (lo + hi) // 2 // grain * grain
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    over = probes[0]["measured_mb"] * MIB / budget - 1
    record(rows, **row, ok=at_predicted or not cuda, model=f"llama d={base.config.hidden_size} "
           f"L={base.config.num_hidden_layers} {str(next(base.parameters()).dtype)[6:]}",
           budget_mb=round(budget / MIB, 1), predicted_longest=predicted, measured_longest=lo,
           measured_bound=hi, measured_over_predicted=round(lo / predicted, 3) if predicted else None,
           peak_at_predicted_over_budget=round(over, 4), judged=cuda, probes=probes)
