"""The engine that averages a patched model's gradients, read at every training forward, and what
ringseq's gradient rule (``ringseq.gradients``) needs of it.

Each rank's backward leaves P times its share of every gradient, so an engine is exact when it
averages each gradient over ranks that hold whole sequence groups. ``check(model, sp)`` finds the
engines around a patched model: a wrapper whose ``forward`` called it (DistributedDataParallel,
FSDP1 ``FullyShardedDataParallel``, a DeepSpeed engine, an FSDP2 module above it: the few Python
frames above the patched forward) and FSDP2 states on its own modules. Then:

* **exact as it is**: DistributedDataParallel over whole sequence groups (the world, or a set of
  replicas) with its own average or torch's ``allreduce_hook`` / ``fp16_compress_hook`` /
  ``bf16_compress_hook``; FSDP2 ``fully_shard`` per layer and on the root over whole groups (the
  default world mesh, ``sp.meshes["fsdp"]``, HSDP) with its default divide factor; FSDP1;
  DeepSpeed ZeRO 0-3 without an mpu (``ringseq.initialize``) or with ``sp.mpu``;
* **made exact**: DistributedDataParallel over the data ranks only (``process_group=sp.dp_group``,
  a sequence group's ranks in different DDPs) gets torch's ``allreduce_hook`` over the world, the
  same average over every rank;
* **refused** (``RingSeqError`` at the first training forward, before any work, naming the fix): a
  reduction that would not come out right or that ringseq cannot read: a communication hook,
  custom reduce-scatter or all-reduce hook of the user's; an FSDP2 divide factor other than its
  average; an engine over part of a sequence group; trainable parameters that FSDP2 does not
  manage while it manages others; DeepSpeed given an mpu that declares sequence parallelism.

A model no engine wraps is the raw loop: its owner averages every gradient over all ranks (README).
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import weakref

import torch
import torch.distributed as dist

from . import lockstep, replicas
from .errors import RingSeqError
from .gradients import covers, factor

FRAMES = 64
"""How far above the patched forward a wrapper's ``forward`` is looked for (DDP over PEFT over the
model is about 10 frames up)."""
ENGINE_FIX = ("wrap the model over all ranks (the default), or over ranks that hold whole sequence groups: "
              "fully_shard(..., mesh=sp.meshes['fsdp']) (dp_shard x cp; HSDP where there are pure replicas)")


@dataclasses.dataclass(frozen=True)
class Sharding:
    """How an FSDP engine holds the model, as ``ringseq.planner`` costs it: ZeRO's stage (FSDP2 and
    FSDP1's FULL_SHARD shard parameters, gradients and optimizer states: 3) over ``ranks`` ranks;
    ``fsdp2``: FSDP2's (the planner's ``fsdp``: what it gathers within the step)."""

    stage: int
    ranks: int
    fsdp2: bool = False


def check(model, sp) -> Sharding | None:
    """Pass, widen or refuse the engines around ``model`` (see the module docstring); the sharding of
    an FSDP engine found (None: none, or DeepSpeed's, which ``ringseq.initialize`` records)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    fsdp2 = _fsdp2_class()
    # this step's engines only: a check that refuses them leaves none to recover, on every rank alike
    _found.pop(sp.ranks, None)
    lockstep.widen(sp, None)
    states, fsdp1, ddps, engines = [], [], [], []
    for m in model.modules():
        if isinstance(m, FullyShardedDataParallel):
            fsdp1.append(m)
        elif fsdp2 is not None and isinstance(m, fsdp2):
            states.append(m)
    for wrapper in _callers(sys._getframe(2)):  # above the patched forward
        if isinstance(wrapper, DistributedDataParallel):
            ddps.append(wrapper)
        elif isinstance(wrapper, FullyShardedDataParallel):
            fsdp1.append(wrapper)
        elif fsdp2 is not None and isinstance(wrapper, fsdp2) and all(wrapper is not m for m in states):
            states.append(wrapper)
        elif hasattr(wrapper, "seq_data_parallel_group") and type(wrapper).__module__.startswith("deepspeed"):
            engines.append(wrapper)
    if factor(sp) > 1:  # else every rank holds whole sequences: any engine's average is plain data parallelism
        for ddp in ddps:
            _ddp(ddp, sp)
        for fsdp in fsdp1:
            _fsdp1(fsdp, sp)
        for engine in engines:
            _deepspeed(engine, sp)
        if states:
            _fsdp2(model, states, sp)
    _record(sp, model, ddps, fsdp1, states, engines)
    # an engine over several sequence groups: the step's gates and news reach every rank of the job
    lockstep.widen(sp, replicas.of(sp) if ddps or fsdp1 or states or _found[sp.ranks]["deepspeed"] else None)
    if sp.size > 1:
        _gate_units(model, sp, fsdp1, _found[sp.ranks]["zero3"])
    return _sharding(states, fsdp1)


# --------------------------------------------------------------------------- failures inside a step
_found: dict = {}
"""Per sequence group (its ranks): the engines around its patched model at the last training forward (weak
references) and, once the forward returned (``opened``), the engines' collective counts then."""


def _record(sp, model, ddps, fsdp1, states, engines) -> None:
    roots = [m for m in states if getattr(m._get_fsdp_state(), "_is_root", False)]
    zero3 = any(hasattr(p, "ds_id") for p in model.parameters())
    # DDP's counts as the patched forward begins (after its buffer broadcast): a failed step's bucket all-reduces
    # are counted from them (``recover``; ``opened`` counts them again once the forward returned)
    base = [_ddp_group(d)._get_sequence_number_for_group() for d in ddps] or None
    _found[sp.ranks] = {"ddp": [weakref.ref(d) for d in ddps], "fsdp2": [weakref.ref(r) for r in roots],
                        "fsdp1": bool(fsdp1), "deepspeed": bool(engines) or zero3, "zero3": zero3, "base": base,
                        "model": weakref.ref(model)}


def _live(refs) -> list:
    return [m for m in (r() for r in refs) if m is not None]


def _ddp_group(ddp):
    """The process group DDP reduces its buckets over (a comm hook's, where one has a group as its state)."""
    hooks = list(getattr(ddp, "_comm_hooks", []))
    state = hooks[0][1] if hooks else None
    return state if isinstance(state, dist.ProcessGroup) else (ddp.process_group or dist.group.WORLD)


def opened(sp) -> None:
    """A patched training forward of ``sp`` returned: the DDP groups' collective counts now, from which a failed
    backward's bucket all-reduces are counted (``recover``)."""
    found = _found.get(sp.ranks)
    if found is not None and found["ddp"]:
        found["base"] = [_ddp_group(d)._get_sequence_number_for_group() for d in _live(found["ddp"])]


def _gate_units(model, sp, fsdp1, zero3: bool) -> None:
    """Gates around the units whose collectives run inside a patched step: FSDP units below the root (FSDP2's
    ``fully_shard`` on a layer, FSDP1's wrapped layers) and, under DeepSpeed ZeRO-3, the decoder layers. Before
    a unit's forward (and its all-gather) the group agrees (``lockstep`` kind "layer"); in the backward before the
    unit's own hooks on its output (FSDP2's pre-backward all-gather: "layer backward start"), and after its
    backward, before FSDP2's reduce-scatter ("layer backward"). A rank whose step failed
    in the unit before tells its group (``ringseq.recovery``); without the gates its peers would wait in a
    collective that rank never makes, and neither could go on. With them every rank meets at a gate and raises
    there, the engine's collectives of the step alike on every rank."""
    fsdp2 = _fsdp2_class()
    units = [m for m in model.modules() if m is not model and ((fsdp2 is not None and isinstance(m, fsdp2))
                                                               or any(m is f for f in fsdp1))]
    if zero3:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        units += list(getattr(decoder, "layers", None) or [])
    for unit in units:
        if "_ringseq_gate" not in vars(unit):
            unit._ringseq_gate = (unit.register_forward_pre_hook(functools.partial(_gate, sp), prepend=True),
                                  unit.register_forward_pre_hook(functools.partial(_gate_backward, sp),
                                                                 with_kwargs=True),
                                  unit.register_forward_hook(functools.partial(_gate_backward_start, sp), prepend=True))
    if units and "_ringseq_gate" not in vars(model):  # a group broken by an earlier failure: refused before any
        model._ringseq_gate = (model.register_forward_pre_hook(functools.partial(_refuse_broken, sp), prepend=True),)


@torch.compiler.disable
def _gate(sp, module, args) -> None:
    if lockstep.in_batch():  # a patched forward's decoder (not a generation step's)
        lockstep.gate(sp, "layer")


@torch.compiler.disable
def _gate_backward(sp, module, args, kwargs):
    """The unit's input through ``_Gate``: its backward runs after the unit's (FSDP2's post-backward hooks sit
    on the inputs before this hook ran)."""
    if not (lockstep.in_batch() and torch.is_grad_enabled()):
        return None
    if args and torch.is_tensor(args[0]) and args[0].requires_grad:
        return (_Gate.apply(args[0], sp), *args[1:]), kwargs
    if torch.is_tensor(kwargs.get("hidden_states")) and kwargs["hidden_states"].requires_grad:
        return args, {**kwargs, "hidden_states": _Gate.apply(kwargs["hidden_states"], sp)}
    return None


@torch.compiler.disable
def _gate_backward_start(sp, module, args, output):
    """A hook on the unit's output, registered before the engine's (this forward hook runs before FSDP2's
    post-forward, which registers its pre-backward hooks on the same tensors): the group agrees before the
    unit's backward and its all-gather."""
    if not (lockstep.in_batch() and torch.is_grad_enabled()):
        return None
    first = output if torch.is_tensor(output) else next((t for t in (output if isinstance(output, tuple) else ())
                                                         if torch.is_tensor(t)), None)
    if first is not None and first.requires_grad:
        first.register_hook(functools.partial(_agree_backward_start, sp))
    return None


def _agree_backward_start(sp, grad) -> None:
    lockstep.gate(sp, "layer backward start")


class _Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp):
        ctx.sp = sp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        lockstep.gate(ctx.sp, "layer backward")
        return grad, None


@torch.compiler.disable
def forward_end(sp) -> None:
    """A forward with no backward to come (an evaluation, a scoring pass) under an engine over replicas ends with
    the job's gate: a failure in one group meets every rank there (a training forward's is the backward's start)."""
    if lockstep.wider(sp) is not None:
        lockstep.gate(sp, "layer")


@torch.compiler.disable
def _refuse_broken(sp, module, args) -> None:
    lockstep.check_broken(sp)
    for scope in sp._replicas:  # the job's scope, where made
        lockstep.check_broken(scope)


def ungate(model) -> None:
    """Remove the gates ``check`` put on the model's units (``ringseq.unpatch``)."""
    for module in model.modules():
        if "_ringseq_gate" in vars(module):
            for handle in vars(module).pop("_ringseq_gate"):
                handle.remove()


def recover(sp, model=None, backward: bool = False, scope=None) -> None:
    """Every rank of a group calls it as it leaves a step that failed on any rank (``ringseq.recovery``): the
    engines around its patched model back to idle, so that the next step's collectives are the same on every
    rank. The ranks first compare their engines' collective counts (one record over the control group):

    - DDP: the gradient buckets the others launched and this rank did not (it failed before their gradients were
      ready) are all-reduced here with zeros, in bucket order, then every rank resets its reducer;
    - FSDP2: with equal counts (the gates see to it), ``reset_iter_state`` on its root and the gradients it
      held unsharded dropped; otherwise the group is broken;
    - FSDP1, DeepSpeed ZeRO-3, and DeepSpeed after a failed backward: their per-step state has no reset
      (ZeRO-3's prefetches, ZeRO's gradient partitions): the group is marked broken, and the next step raises
      ``RingSeqError`` saying to resume from a checkpoint, before any collective.

    After a failed backward every parameter's gradient is dropped on every rank (the step's partial gradients,
    some already reduced, would add into the next step's). ``scope``: the job's ranks over the replicas
    (``ringseq.replicas``) that compare the counts, when a step failed under an engine over them. Raises
    ``RingSeqError`` when the peers do not come."""
    found = _found.get(sp.ranks)
    if found is None:
        return
    model = model if model is not None else found["model"]()
    if backward and model is not None:
        for p in model.parameters():
            p.grad = None
    ddps, roots = _live(found["ddp"]), _live(found["fsdp2"])
    if lockstep.state(sp).broken or not (ddps or roots or found["fsdp1"] or found["deepspeed"]):
        return  # no engine, or none left to match: nothing to compare (a rank may wait at its next batch)
    ddp_groups = [_ddp_group(d) for d in ddps]
    fsdp_groups = list({id(g): g for r in roots for g in _fsdp2_groups(r)}.values())
    counts = [g._get_sequence_number_for_group() for g in ddp_groups + fsdp_groups]
    table = [counts]
    if counts or scope is not None:  # every rank leaving the failed step compares them here (the job's, over replicas)
        table = lockstep.exchange_counts(scope or sp, counts, "the engines' collective counts after a failed step")
    for i, ddp in enumerate(ddps):
        _match_ddp(ddp, ddp_groups[i], [row[i] for row in table], (found["base"] or [None] * len(ddps))[i],
                   backward)
    fsdp_counts = [row[len(ddps):] for row in table]
    why = None
    if roots and any(c != fsdp_counts[0] for c in fsdp_counts):
        why = ("FSDP2's collectives of the failed step differ between the ranks (an explicit prefetch, or units "
               "ringseq does not gate)")
    elif found["fsdp1"]:
        why = "FSDP1 keeps per-step state it cannot reset (use FSDP2, fully_shard, whose reset_iter_state ringseq calls)"
    elif found["zero3"]:
        why = "DeepSpeed ZeRO-3 keeps prefetched parameters and partitioned gradients it cannot reset"
    elif found["deepspeed"] and backward:
        why = "DeepSpeed keeps the failed backward's partitioned gradients and reduction buckets, which it cannot reset"
    if why is None:
        for root in roots:
            _reset_fsdp2(root, sp)
    else:
        lockstep.mark_broken(sp, f"a step failed under an engine that cannot go on: {why}. Resume from the last "
                                 f"checkpoint (every rank restarts)")


def _match_ddp(ddp, group, counts: list, base, backward: bool) -> None:
    """DDP after a failed step: the bucket all-reduces the other ranks made (their count beyond this rank's)
    made here with zeros, in bucket order, so no collective of the failed step is left unmatched; then the
    reducer reset (its next forward rebuilds its buckets, on every rank alike)."""
    mine = group._get_sequence_number_for_group()
    missing = max(counts) - mine
    if missing and base is not None:
        buckets = ddp.reducer._get_zeros_like_grad_buckets()
        done = mine - base
        works = [ddp.reducer._run_comm_hook(b) for b in buckets[done:done + missing]]
        extra = missing - len(works)
        if extra > 0 and ddp.find_unused_parameters:  # the used-parameter map's all-reduce, after the last bucket
            ddp._match_unused_params_allreduce()
        for work in works:
            work.wait()
    ddp.reducer._reset_state()


def _fsdp2_groups(root) -> list:
    groups = []
    for each in root._get_fsdp_state()._state_ctx.all_states:
        for group in _param_groups_of(each):
            info = group.mesh_info
            for name in ("shard_process_group", "replicate_process_group"):
                pg = getattr(info, name, None)
                if pg is not None:
                    groups.append(pg)
    return groups


def _reset_fsdp2(root, sp) -> None:
    """FSDP2 back to idle: ``reset_iter_state`` on its root (every parameter group resharded, trackers cleared)
    and the gradients it held unsharded dropped (torch leaves them to add into the next step)."""
    if not hasattr(root, "reset_iter_state"):
        lockstep.mark_broken(sp, f"a step failed under FSDP2, whose state torch {torch.__version__} cannot reset "
                                 f"(FSDPModule.reset_iter_state is newer): resume from the last checkpoint")
        return
    root.reset_iter_state()
    for each in root._get_fsdp_state()._state_ctx.all_states:
        for group in _param_groups_of(each):
            for fsdp_param in group.fsdp_params:
                if hasattr(fsdp_param, "_unsharded_param"):
                    fsdp_param._unsharded_param.grad = None
                fsdp_param.unsharded_accumulated_grad = None


def _param_groups_of(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.12: one group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return groups


def _sharding(states, fsdp1) -> Sharding | None:
    """FSDP2's shard dimension (the largest of the model's groups), else FSDP1's shard group, else None."""
    sizes = [getattr(g.mesh_info, "shard_mesh_size", 1) for m in states for g in _param_groups(m)]
    if sizes:
        return Sharding(stage=3 if max(sizes) > 1 else 0, ranks=max(sizes), fsdp2=max(sizes) > 1)
    if fsdp1:
        from torch.distributed.fsdp import ShardingStrategy

        stage = {ShardingStrategy.NO_SHARD: 0, ShardingStrategy.SHARD_GRAD_OP: 2}.get(fsdp1[-1].sharding_strategy, 3)
        return Sharding(stage=stage, ranks=fsdp1[-1].process_group.size())
    return None


def _callers(frame):
    """The modules whose ``forward`` (or DDP's ``_run_ddp_forward``) is on the stack from ``frame``
    up, innermost first, each once."""
    seen = set()
    for _ in range(FRAMES):
        if frame is None:
            return
        code = frame.f_code
        if code.co_name in ("forward", "_run_ddp_forward") and code.co_argcount and code.co_varnames[0] == "self":
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module) and id(owner) not in seen:
                seen.add(id(owner))
                yield owner
        frame = frame.f_back


def _ranks(group) -> set[int]:
    return set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _fsdp2_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2 in this namespace
        return None
    return FSDPModule


def _mean_hooks() -> tuple:
    """torch's DDP hooks that average over their state's group (the world when None)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.allreduce_hook, default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook


def _ddp(ddp, sp) -> None:
    """DDP averages each bucket over its process group, or a known hook over the hook's group."""
    hooks = list(getattr(ddp, "_comm_hooks", []))
    named = str(ddp._get_ddp_logging_data().get("comm_hook") or "")
    if not hooks and named and named not in ("BuiltinCommHookType.ALLREDUCE", "BuiltinCommHookType.FP16_COMPRESS"):
        hooks = [(None, None)]  # a hook registered where ringseq cannot see it
    if len(hooks) > 1 or (hooks and hooks[0][0] not in _mean_hooks()):
        name = named or getattr(hooks[0][0], "__qualname__", "?")
        raise RingSeqError(f"DistributedDataParallel has the communication hook {name}, whose reduction ringseq "
                           f"cannot read; ringseq's gradient rule needs each gradient averaged over all ranks "
                           f"(ringseq.gradients): register no hook (DDP's own average), or torch's allreduce_hook, "
                           f"fp16_compress_hook or bf16_compress_hook")
    ranks = _ranks(hooks[0][1] if hooks else ddp.process_group)
    if covers(ranks, sp):
        return
    data_only = len(ranks & set(sp.ranks)) == 1 and all(len(ranks & set(g)) == 1 for g in sp.sequence_groups)
    if hooks or not data_only:
        raise RingSeqError(f"DistributedDataParallel averages over global ranks {sorted(ranks)}, which split sequence "
                           f"groups {sorted(g for g in sp.sequence_groups if not set(g) <= ranks)}: a gradient "
                           f"must be averaged over every rank of a sequence group (ringseq.gradients); {ENGINE_FIX}")
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    try:  # over the data ranks only: the same average over every rank instead
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    except RuntimeError as err:
        raise RingSeqError(f"DistributedDataParallel over the data ranks {sorted(ranks)} needs its average over "
                           f"every rank, which ringseq sets with a communication hook before the first backward; "
                           f"torch refused it ({err}): wrap the model over all ranks instead") from err


def _fsdp1(fsdp, sp) -> None:
    if getattr(fsdp, "_comm_hook", None) is not None:
        raise RingSeqError(f"FullyShardedDataParallel has the communication hook {fsdp._comm_hook.__qualname__}, "
                           f"whose reduction ringseq cannot read: register none (FSDP's own average)")
    ranks = _ranks(fsdp.process_group)
    if not covers(ranks, sp):
        raise RingSeqError(f"FullyShardedDataParallel shards over global ranks {sorted(ranks)}, which split a "
                           f"sequence group: a gradient must be averaged over every rank of a sequence group "
                           f"(ringseq.gradients); {ENGINE_FIX}")


def _deepspeed(engine, sp) -> None:
    if getattr(engine, "sequence_parallel_size", 1) > 1:
        raise RingSeqError(f"DeepSpeed was given an mpu with sequence parallelism (size "
                           f"{engine.sequence_parallel_size}): it then sums over the sequence ranks itself, while "
                           f"ringseq's gradient rule wants its plain average over all ranks. Pass no mpu (or "
                           f"sp.mpu): ringseq.initialize does")
    groups = [engine.seq_data_parallel_group]
    groups += list({id(g): g for p in engine.module.parameters()
                    if (g := getattr(p, "ds_process_group", None)) is not None}.values())
    for group in groups:
        if not covers(_ranks(group), sp):
            raise RingSeqError(f"DeepSpeed reduces or partitions over global ranks {sorted(_ranks(group))}, which "
                               f"split a sequence group: build the model outside zero.Init(data_parallel_group=...) "
                               f"or over all ranks, and pass no mpu")


def _param_groups(module):
    return _param_groups_of(module._get_fsdp_state())


def _fsdp2(model, modules, sp) -> None:
    """FSDP2 averages over its mesh (shard x replicate), divided by the divide factor if set."""
    managed = set()
    for module in modules:
        for group in _param_groups(module):
            ranks = set(group.mesh_info.mesh.mesh.flatten().tolist())
            name = type(module).__name__
            if not covers(ranks, sp):
                raise RingSeqError(f"fully_shard({name}) reduces over the mesh of global ranks {sorted(ranks)}, which "
                                   f"splits a sequence group: a gradient must be averaged over every rank of a "
                                   f"sequence group (ringseq.gradients); {ENGINE_FIX}")
            divide = getattr(group, "gradient_divide_factor", None)
            if divide is not None and divide != len(ranks):
                raise RingSeqError(f"fully_shard({name}) has its gradient divide factor set to {divide:g}; ringseq's "
                                   f"gradient rule needs FSDP2's own average over its {len(ranks)} ranks (each "
                                   f"rank's gradient is already P x its share of its replica's loss): remove "
                                   f"set_gradient_divide_factor")
            comm = getattr(group, "_reduce_scatter_comm", None)  # torch's own ones average
            custom = getattr(group, "_all_reduce_hook", None) is not None or (
                comm is not None and not type(comm).__module__.startswith("torch.distributed"))
            if custom:
                raise RingSeqError(f"fully_shard({name}) reduces with an all-reduce hook or a reduce-scatter of the "
                                   f"user's, whose result ringseq cannot read: set none (FSDP2's own average)")
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                managed.add((id(info.module), info.param_name))
                managed.update(zip(map(id, getattr(info, "shared_modules", ())), getattr(info, "shared_param_names", ())))
    loose = [f"{prefix}.{name}".lstrip(".") for prefix, m in model.named_modules() for name, p in m._parameters.items()
             if p is not None and p.requires_grad and (id(m), name) not in managed]
    if loose:
        raise RingSeqError(f"FSDP2 manages some parameters of the model but not {loose[:3]}"
                           f"{' and more' if len(loose) > 3 else ''}: nothing would average their gradients. "
                           f"fully_shard the root module too (fully_shard(model) after its layers)")
