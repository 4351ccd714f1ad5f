"""``patch(model, sp=sp, fit=True)``: the planner sets the memory switches before each step.

Before a training forward (the model in training mode, gradients on, no cache) of a length it has
not planned, the patched forward asks ``ringseq.planner.fit.choose`` for the fastest set of
switches whose predicted step memory fits the budget, and applies it: the chunked loss,
checkpointing of every decoder layer (keeping ring outputs, or replaying the ring), the MLPs in
tiles of hidden_size tokens, one ring per kv head, and on a GPU the kept tensors in host memory.
Each switch is one ``patch`` offers by hand, exact as it is; fit only chooses.

What is patched, and why: the MLPs get ringseq's tiled forward once (``patches.tiled_mlp``; one
tile, that is the MLP itself, when a step needs no tiles); checkpointing is enabled once through
transformers (``activation_checkpointing_enable``, or ``gradient_checkpointing_enable`` in
releases before that name; non-reentrant) the first time a step needs it, and each decoder
layer's ``gradient_checkpointing`` flag is set per step: fit owns it, so checkpointing enabled by
the user or the Trainer's ``gradient_checkpointing=True`` is overridden step by step. ``unpatch``
puts the flags and checkpoint functions back as they were.

Every rank of a group must run the same switches (head groups and the replayed ring change the
ring's calls): the choice depends only on the batch's shape and the budget, which all ranks agree
on (the budget: the smallest rank's). With data-parallel replicas, whose lengths differ, the
replicas agree on the longest shape each step (one small all-reduce), since DeepSpeed's
reductions and ZeRO-3's gathers follow the backward's order.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch
import torch.distributed as dist

from ringseq.errors import RingSeqError
from ringseq.planner import fit as planner_fit, hardware, model_spec

from . import mixers, tiled_mlp as tiling, vision

log = logging.getLogger("ringseq")
MARGIN = 0.05
"""Of a device's memory, kept free when fit reads the free memory itself: the caching allocator's blocks
and what else the process allocates (the planner's error is ``planner.fit.HEADROOM`` of the budget, on top)."""


def check(model, chunked_loss, tiled_mlp, keep_ring_outputs, head_groups, memory_budget, split_vision) -> None:
    """Refuse what fit cannot plan, before anything changes."""
    given = [name for name, value, default in (("chunked_loss", chunked_loss, True), ("tiled_mlp", tiled_mlp, None),
                                               ("keep_ring_outputs", keep_ring_outputs, True),
                                               ("head_groups", head_groups, None)) if value != default]
    if given:
        raise RingSeqError(f"fit=True chooses {', '.join(given)} itself, for each length: drop "
                           f"{'it' if len(given) == 1 else 'them'}, or patch with fit=False to set the switches by hand")
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float))
                                      or memory_budget <= 0):
        raise RingSeqError(f"memory_budget is bytes a training step may add per rank (a positive number), got "
                           f"{memory_budget!r}")
    unplanned = None
    if split_vision or vision.plan(model, False) is not None:
        unplanned = "a vision-language model (the vision tower's memory)"
    elif mixers.has_recurrent_layers(model):
        unplanned = "a hybrid's recurrent layers"
    if unplanned is None:
        try:
            tiling.mlps(model)
        except RingSeqError:
            unplanned = "mixture-of-experts (or other non-dense) MLPs"
    if unplanned is not None:
        raise RingSeqError(f"fit=True plans the memory of dense decoder models; the planner does not model {unplanned}: "
                           f"patch with fit=False and set chunked_loss, tiled_mlp, keep_ring_outputs and head_groups "
                           f"(and gradient checkpointing) by hand; `ringseq plan` predicts a step's memory")
    model_spec(model.config.get_text_config())  # raises for a config the planner cannot read


@dataclasses.dataclass(eq=False)
class Fit:
    """The fit state of one patched model (``PatchHandle.fit``)."""

    memory_budget: float | None
    """As given to ``patch`` (None: read from the device at the first step)."""
    budget: float | None = None
    """Bytes, agreed by the group at the first step."""
    setting: planner_fit.Setting | None = None
    chosen: dict = dataclasses.field(default_factory=dict)
    """(B, S planned at) -> Choice, or None where no set fits."""
    replans: int = 0
    planning_s: float = 0.0
    current: planner_fit.Choice | None = None
    bucket_top: int = 0
    checkpoint_state: list = dataclasses.field(default_factory=list)
    """(module, its gradient_checkpointing flag, its checkpoint function or None) before fit's first step."""

    def __deepcopy__(self, memo):  # a copied model plans for itself, from the same budget
        return Fit(memory_budget=self.memory_budget)


def install(model, handle, memory_budget) -> None:
    tiling.install(model, 1)
    handle.fit = Fit(memory_budget=memory_budget)


def remove(model, handle) -> None:
    """Undo what fit changed: the MLPs' tiled forward, the checkpointing it enabled."""
    tiling.uninstall(model)
    for module, flag, fn in handle.fit.checkpoint_state:
        module.gradient_checkpointing = flag
        if fn is None:
            vars(module).pop("_gradient_checkpointing_func", None)
        else:
            module._gradient_checkpointing_func = fn
    handle.fit = None


def _layers(model) -> list:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _setting(model, handle) -> planner_fit.Setting:
    sp = handle.sp
    cuda = next(model.parameters()).device.type == "cuda"
    dtype = next(model.parameters()).dtype
    hw = hardware(_preset() if cuda else "cpu")
    hw = dataclasses.replace(hw, bytes=torch.finfo(dtype).bits // 8 if dtype.is_floating_point else hw.bytes)
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count() if cuda else world) or world)
    U = sp.size // sp.ring_size
    stage, shards, fsdp = handle.zero_stage, world, False  # DeepSpeed shards over the world; FSDP its dimension
    if handle.sharding is not None:
        stage, shards, fsdp = handle.sharding.stage, handle.sharding.ranks, handle.sharding.fsdp2
    return planner_fit.Setting(spec=model_spec(model.config.get_text_config()), hw=hw, zero_stage=stage, fsdp=fsdp,
                               ring=sp.ring_size, ulysses=U, gpus=shards, per_node=max(1, min(per_node, world)),
                               layout=sp.layout, may_tile=True, may_offload=cuda)


def _preset() -> str:
    name = torch.cuda.get_device_name().lower()
    for preset in ("h200", "h100", "a100"):
        if preset in name:
            return preset
    return "h100"  # the nearest preset: the choice ranks sets by time, the memory is counted as on any device


def _own_budget(model, setting) -> float:
    """This rank's budget: ``memory_budget``, else the free memory less the margin (and, on a GPU,
    the optimizer state torch's optimizers make at their first step)."""
    fit = model._ringseq_patch.fit
    if fit.memory_budget is not None:
        return float(fit.memory_budget)
    if setting.may_offload:  # a GPU
        free, total = torch.cuda.mem_get_info()
        free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()  # the caching allocator's own
        from ringseq.planner.memory import states

        f = setting.features(planner_fit.Switches(), 1, 1)
        optimizer = states(setting.spec, f, setting.hw.bytes, setting.gpus)["optimizer"]
        return free - MARGIN * total - optimizer
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        raise RingSeqError("fit=True on CPU reads the host's available memory from /proc/meminfo, which this "
                           "machine lacks: pass memory_budget= (bytes a step may add per rank)") from None
    return available * (1 - MARGIN) / setting.per_node


def _agree(sp, budget: float | None, B: int, S: int, device) -> tuple[float | None, int, int]:
    """The smallest budget and the largest shape over the ranks that must run the same switches."""
    replicas = sp.dp_size > 1
    if (budget is None and not replicas) or (sp.size == 1 and not replicas) or not dist.is_initialized():
        return budget, B, S
    t = torch.tensor([-(budget if budget is not None else -1.0), float(B), float(S)], dtype=torch.float64,
                     device=device)
    group = None if replicas else sp.group  # replicas: the whole world; else the sequence group
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return (None if budget is None else -float(t[0])), int(t[1]), int(t[2])


def before_step(model, handle, B: int, S: int) -> None:
    """Plan (once per bucket) and apply the switches for a training step of B x S tokens."""
    fit = handle.fit
    device = next(model.parameters()).device
    if device.type != "cuda" and dist.is_initialized() and dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    started = time.perf_counter()
    if fit.setting is None:
        fit.setting = _setting(model, handle)
    own = _own_budget(model, fit.setting) if fit.budget is None else None
    agreed, B, S = _agree(handle.sp, own, B, S, device)
    if fit.budget is None:
        fit.budget = agreed
    top = planner_fit.bucket(S, planner_fit.grain(fit.setting))
    planned = False
    for at in (top, S):  # the bucket's top; where no set fits it, the length itself
        if (B, at) not in fit.chosen:  # None: known not to fit
            fit.chosen[(B, at)] = planner_fit.choose(fit.setting, at, B, fit.budget)
            planned = True
        choice, top = fit.chosen[(B, at)], at
        if choice is not None:
            break
    fit.planning_s += time.perf_counter() - started
    if choice is None:
        raise RingSeqError(planner_fit.refusal(fit.setting, S, B, fit.budget))
    if planned:
        fit.replans += 1
        if handle.sp.rank == 0:
            log.info("ringseq fit: %d x %d tokens (planned at %d): %s; predicted step peak %.0f MiB of %.0f MiB, "
                     "%.3g s/step", B, S, top, choice.switches.describe(), choice.predicted_peak_bytes / 2**20,
                     fit.budget / 2**20, choice.predicted_step_s)
    apply(model, handle, choice.switches)
    fit.current, fit.bucket_top = choice, top
    planner_fit.reports[handle.sp.ranks] = planner_fit.report(choice, fit.budget, top, fit.replans, fit.planning_s)
    _track_peak(handle, device)


def _track_peak(handle, device) -> None:
    """On a GPU, start this step's peak count (``ringseq.stats`` reads the peak since this forward)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        planner_fit.peaks[handle.sp.ranks] = (device, torch.cuda.memory_allocated(device))


def apply(model, handle, sw: planner_fit.Switches) -> None:
    """Set the switches on the patched model."""
    base = vision.transformers_model(model)
    layers = _layers(base)
    fit = handle.fit
    if not fit.checkpoint_state:  # as the model was: put back by ``remove``
        fit.checkpoint_state = [(m, m.gradient_checkpointing, vars(m).get("_gradient_checkpointing_func"))
                                for m in base.modules() if hasattr(m, "gradient_checkpointing")]
    if sw.checkpointing and not any("_gradient_checkpointing_func" in vars(layer) for layer in layers):
        enable = getattr(base, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # transformers releases before the new name
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in layers:
        layer.gradient_checkpointing = sw.checkpointing
    handle.chunked_loss, handle.keep_ring_outputs = sw.chunked_loss, sw.keep_ring_outputs
    handle.head_groups, handle.offload = sw.head_groups, sw.offload_activations
    for mlp in tiling.mlps(model):
        mlp._ringseq_tiles = True if sw.tiled_mlp else 1
