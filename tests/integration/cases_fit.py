"""``patch(fit=True)``: the planner's switches, per length, exact against the unpatched model."""
import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

import ringseq
from ringseq.patches import fit as fitting
from ringseq.patches.lifecycle import options
from ringseq.planner import fit as planner_fit
from ringseq.testing import shared_init

from .hf_models import check_against, make_batch, references

SHORT, LONG = 16, 128  # tokens per rank: the long shard is two MLP tiles of hidden_size 64


def _budget(model, B: int, short: int, long: int) -> int:
    """A budget no set without checkpointing fits at the long length, that the short one fits
    without checkpointing, and that some checkpointed set fits at the long one (from the planner)."""
    setting = fitting._setting(model, model._ringseq_patch)
    plain = lambda S: min(c.predicted_peak_bytes for c in planner_fit.costed(setting, S, B)  # noqa: E731
                          if not c.switches.checkpointing)
    budget = planner_fit.budget_for(plain(long)) - 1  # fit plans into the budget less its headroom
    assert plain(short) <= planner_fit.plannable(budget), (plain(short), budget)
    assert planner_fit.least(setting, long, B).predicted_peak_bytes <= planner_fit.plannable(budget)
    return budget


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def fit_per_length(family="llama"):
    """One model fitted at a short and a long length: the short one trains without checkpointing,
    the long one with it (the budget says so), both exact; the short length again re-plans nothing;
    stats reports each choice; unpatch restores the layers' checkpointing as it was."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    B = 2
    batches = {n: make_batch(B, n * world, "plain", seed=n) for n in (SHORT, LONG)}
    refs = {n: references(family, b) for n, b in batches.items()}
    base = refs[SHORT][0]
    model = ringseq.patch(copy.deepcopy(base), sp=sp, fit=True, memory_budget=1)
    budget = _budget(model, B, SHORT * world, LONG * world)
    model = ringseq.patch(model, sp=sp, fit=True, memory_budget=budget)  # a new budget: plans afresh
    assert options(model) == {"fit": True, "memory_budget": budget}
    model.train()
    where = f"{family} fit rank {sp.rank}/{world}"
    seen = {}
    for n in (SHORT, LONG, SHORT):
        loss, grads = _step(model, batches[n])
        check_against(refs[n][1], loss, grads, sp, f"{where} S={n * world}")
        report = ringseq.stats(sp=sp)["fit"]
        assert report["length"] == n * world and report["budget_bytes"] == budget, (where, report)
        assert report["predicted_peak_bytes"] <= report["plannable_bytes"] == int(planner_fit.plannable(budget)) \
            and report["measured_peak_bytes"] is None, (where, report)
        seen.setdefault(n, report["switches"])
        assert report["switches"] == seen[n], (where, n, report)
    assert not seen[SHORT]["checkpointing"] and seen[LONG]["checkpointing"], (where, seen)
    assert report["replans"] == 2, (where, report)
    layers = fitting._layers(model)
    assert all("_gradient_checkpointing_func" in vars(layer) for layer in layers), where  # enabled for the long one
    assert layers and not any(layer.gradient_checkpointing for layer in layers), where  # off again for the short one
    again = ringseq.patch(model, sp=sp, **options(model))  # a Trainer's re-patching keeps fit and its choices
    assert again._ringseq_patch.fit.replans == 2, where
    setting = fitting._setting(model, model._ringseq_patch)
    tight = planner_fit.least(setting, LONG * world, B)  # at its least memory, only the leanest set fits
    assert tight.switches.tiled_mlp and (world == 1 or not tight.switches.keep_ring_outputs), (where, tight)
    model = ringseq.patch(model, sp=sp, fit=True, memory_budget=planner_fit.budget_for(tight.predicted_peak_bytes))
    loss, grads = _step(model, batches[LONG])
    check_against(refs[LONG][1], loss, grads, sp, f"{where} S={LONG * world} tight")
    assert ringseq.stats(sp=sp)["fit"]["switches"] == dataclasses.asdict(tight.switches), where
    assert all(mlp._ringseq_tiles is True for mlp in fitting.tiling.mlps(model)), where
    ringseq.unpatch(model)
    assert not any("_gradient_checkpointing_func" in vars(m) or getattr(m, "gradient_checkpointing", False)
                   for m in model.modules()), where
    assert not any("_ringseq_tiles" in vars(m) for m in model.modules()), where


def fit_refuses_what_it_cannot_fit(family="llama"):
    """A budget no set fits is refused on every rank before the step, naming the longest length
    that fits; switches set by hand beside fit=True, a bad budget and MoE MLPs are refused."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    batch = make_batch(1, LONG * world, "plain")
    base = references(family, batch)[0]
    model = ringseq.patch(copy.deepcopy(base), sp=sp, fit=True, memory_budget=1)
    setting = fitting._setting(model, model._ringseq_patch)
    budget = planner_fit.budget_for(planner_fit.least(setting, SHORT * world, 1).predicted_peak_bytes)  # the short
    model = ringseq.patch(model, sp=sp, fit=True, memory_budget=budget)
    model.train()
    with pytest.raises(ringseq.RingSeqError, match="no set of memory switches fits a step of 1 x") as err:
        model(**batch)
    longest = planner_fit.longest(setting, 1, budget, LONG * world)
    assert SHORT * world <= longest < LONG * world, (longest, str(err.value))
    assert f"The longest length that fits is {longest} tokens" in str(err.value), str(err.value)
    assert planner_fit.least(setting, longest + planner_fit.grain(setting), 1).predicted_peak_bytes > \
        planner_fit.plannable(budget)
    with pytest.raises(ringseq.RingSeqError, match="fit=True chooses tiled_mlp, head_groups itself"):
        ringseq.patch(copy.deepcopy(base), sp=sp, fit=True, tiled_mlp=2, head_groups="kv")
    for bad in (0, -5, True, "1GB"):
        with pytest.raises(ringseq.RingSeqError, match="memory_budget is bytes"):
            ringseq.patch(copy.deepcopy(base), sp=sp, fit=True, memory_budget=bad)
    with pytest.raises(ringseq.RingSeqError, match="pass fit=True with it"):
        ringseq.patch(copy.deepcopy(base), sp=sp, memory_budget=10**9)
    from .hf_models import tiny_model

    moe = tiny_model("gpt_oss")
    with pytest.raises(ringseq.RingSeqError, match="mixture-of-experts"):
        ringseq.patch(moe, sp=sp, fit=True)
    assert not hasattr(moe, "_ringseq_patch")
    with torch.no_grad():  # evaluation runs with whatever the last step chose: no plan, no refusal
        model.eval()
        assert model(**make_batch(1, SHORT * world, "plain")).loss is not None


def fit_under_fsdp2(family="llama"):
    """fit under FSDP2 (fully_shard per layer and root, the default world mesh): the planner costs it as
    ZeRO-3 over FSDP2's shard dimension (every rank here: sharded gradients, the gathered layers, their
    traffic), found at the first training forward; the step under the chosen switches is exact. Both
    replicas take the same batch (their mean is its gradient)."""
    from torch.distributed.fsdp import fully_shard

    from ringseq.engines import Sharding

    world = dist.get_world_size()
    sp = shared_init(sp_size=2)
    batch = make_batch(2, LONG * 2, "plain", seed=3)
    base, refs = references(family, batch)
    model = ringseq.patch(copy.deepcopy(base), sp=sp, fit=True, memory_budget=10**12)
    unsharded = fitting._setting(model, model._ringseq_patch)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    handle = model._ringseq_patch
    assert handle.sharding == Sharding(stage=3, ranks=world, fsdp2=True), handle.sharding
    setting = handle.fit.setting
    assert (setting.zero_stage, setting.fsdp, setting.gpus) == (3, True, world), setting
    choice = handle.fit.current
    alone = planner_fit.costed(dataclasses.replace(unsharded, zero_stage=0), LONG * 2, 2)
    same = next(c for c in alone if c.switches == choice.switches)
    assert choice.predicted_peak_bytes > same.predicted_peak_bytes, (choice, same)  # FSDP2's gathers in the step
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    check_against(refs, loss.detach(), grads, sp, f"{family} fit FSDP2 rank {dist.get_rank()}/{world}")
