"""A patched model wrapped the way PyTorch users wrap one (DistributedDataParallel over the world or
over the data ranks, FSDP2 per layer and root on the default mesh, on ``sp.meshes["fsdp"]`` and as
HSDP, FSDP1), or trained by a raw loop that averages by hand: the gradients after backward, the
norm ``clip_grad_norm_`` returns and the parameters after an SGD step must be the unpatched model's
on the replicas' full batches (gradients averaged over replicas), by the 2x rule, in fp32 and under
bf16 autocast. Run on every rank of a pool (world 2: one sequence group of 2; world 4: 2 replicas x 2).
And the wrappings ringseq refuses, each on every rank, before any work."""
import contextlib
import copy

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.nn.parallel import DistributedDataParallel

import ringseq
from ringseq.testing import assert_close, assert_named_close, assert_refused, assert_updates_close, shared_init

from .ds_step import batch_for, lm_loss, tiny_llama

MAX_NORM = 0.5  # below the tiny model's gradient norm: clipping takes part in the step
_MESHES = {}


def topology(kind: str):
    """The ``SequenceParallel`` of a case: 2 ranks per sequence; HSDP through a user's mesh whose
    replicas are pure replicas (``dp_replicate``) and whose shard dimension is the sequence group."""
    if kind != "hsdp":
        return shared_init(sp_size=2)
    if "hsdp" not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (world // 2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
        _MESHES["hsdp"] = ringseq.init(mesh=mesh)
    return _MESHES["hsdp"]


def wrap(kind: str, model, sp):
    """``model`` (patched) as the user of ``kind`` wraps it; returns what is called."""
    if kind == "raw":
        return model
    if kind == "ddp":
        return DistributedDataParallel(model)
    if kind == "ddp_data":
        return DistributedDataParallel(model, process_group=sp.dp_group)
    if kind in ("fsdp2", "fsdp2_mesh", "hsdp"):
        mesh = {} if kind == "fsdp2" else {"mesh": sp.meshes["fsdp"]}
        for layer in model.model.layers:
            fully_shard(layer, **mesh)
        fully_shard(model, **mesh)
        return model
    if kind == "fsdp1":
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True,
                                        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}))
    raise ValueError(kind)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _named(model, wrapper, kind: str, grads: bool) -> dict:
    """Every parameter's (or gradient's) full tensor, by its unwrapped name."""
    whole = FullyShardedDataParallel.summon_full_params(wrapper, with_grads=grads) if kind == "fsdp1" \
        else contextlib.nullcontext()
    with whole:
        return {n.replace("_fsdp_wrapped_module.", ""): _full(p.grad if grads else p)
                for n, p in model.named_parameters()}


def _reference(model, dp: int, S: int, autocast: bool):
    """The unpatched model's gradients of the replicas' full batches (mean over replicas), their
    norm, and its parameters after one clipped SGD step (lr 1)."""
    model = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        for d in range(dp):
            (lm_loss(model, batch_for(d, S)) / dp).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    return grads, norm, {n: p.detach().clone() for n, p in model.named_parameters()}


def step(kind: str, autocast: bool, compiled: bool = False, family: str = "llama"):
    """One training step of the patched model under ``kind`` against the unpatched references;
    ``compiled``: every decoder layer compiled first (``fullgraph=True``, aot_eager), then wrapped
    (torchtitan's order: compile, then FSDP2); ``family``: the tiny Llama, or a tiny model of
    ``hf_models`` (a hybrid: the recurrent op's parameters, such as the convolution's, under the engine)."""
    from .hf_models import tiny_model

    sp = topology(kind)
    S = 16 * sp.size
    model = tiny_llama() if family == "llama" else tiny_model(family)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain = _reference(model, sp.dp_size, S, autocast)
    exact = _reference(copy.deepcopy(model).double(), sp.dp_size, S, False)
    patched = ringseq.patch(model, sp=sp)
    if compiled:
        torch._dynamo.reset()
        for layer in patched.model.layers:
            layer.compile(fullgraph=True, backend="aot_eager")
    wrapper = wrap(kind, patched, sp)
    params = list(wrapper.parameters())
    optimizer = torch.optim.SGD(params, lr=1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        wrapper(**batch_for(sp.dp_rank, S)).loss.backward()
    if kind == "raw":  # the README's loop: every gradient averaged over all ranks
        for p in params:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
    what = (f"{kind}{' bf16 autocast' if autocast else ''}{' compiled' if compiled else ''} dp {sp.dp_size} x sp "
            f"{sp.size} rank {dist.get_rank()}")
    assert_named_close(_named(model, wrapper, kind, grads=True), plain[0], exact[0], f"{what}: gradients")
    if kind == "fsdp1":
        norm = wrapper.clip_grad_norm_(MAX_NORM)
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    assert_close(_full(norm), plain[1], exact[1], f"{what}: clip_grad_norm_")
    optimizer.step()
    assert_updates_close(_named(model, wrapper, kind, grads=False), plain[2], exact[2], start, f"{what}: update")
    return what


def refused(case: str):
    """A wrapping whose reduction would not come out right, or that ringseq cannot read: refused by
    the first training forward on every rank, the message naming the fix."""
    sp = shared_init(sp_size=2) if case != "ddp_half_group" else shared_init(sp_size=dist.get_world_size())
    model = ringseq.patch(tiny_llama(), sp=sp)
    batch = batch_for(sp.dp_rank, 16 * sp.size)
    if case == "ddp_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        wrapper = DistributedDataParallel(model)
        wrapper.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=None), powerSGD_hook.powerSGD_hook)
        words = "communication hook powerSGD_hook"
    elif case == "ddp_half_group":  # one sequence group of 4; DDP over halves of it
        me = dist.get_rank()
        halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        wrapper = DistributedDataParallel(model, process_group=halves[me // 2])
        words = "split sequence groups"
    elif case == "fsdp2_divide":
        for layer in model.model.layers:
            fully_shard(layer)
        wrapper = fully_shard(model)
        wrapper.set_gradient_divide_factor(1.0)
        words = "remove set_gradient_divide_factor"
    elif case == "fsdp2_layers_only":
        for layer in model.model.layers:
            fully_shard(layer)
        wrapper = model
        words = "fully_shard the root module too"
    elif case == "fsdp2_data_mesh":  # FSDP2 over the data ranks only: the sequence ranks never meet
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(sp.dp_group, "cpu", mesh_dim_names=("dp",))
        wrapper = fully_shard(model, mesh=mesh)
        words = "splits a sequence group"
    else:
        raise ValueError(case)
    assert_refused(lambda: wrapper(**batch), words)
    with torch.no_grad():  # evaluation reduces nothing: not refused
        wrapper(**batch)
    return case
