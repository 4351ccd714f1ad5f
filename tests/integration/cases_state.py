"""FSDP2 checkpoints of a patched model through torch.distributed.checkpoint (DCP): saved after a step at
one split of world 4 and resumed in a fresh model at the same split or another (sp 2 -> sp 4 and back,
HSDP -> FSDP2 over every rank and back: DCP reshards the parameters and the optimizer's momentum), the next
step must equal the step the saved run takes next. The two splits sum the same gradients in other orders,
so "equal" is to fp32 rounding: 1e-5 of the step's update. Every rank asserts."""
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import ringseq
from ringseq.testing import shared_init

from .cases_engines import topology
from .ds_step import tiny_llama

S, ROWS = 64, 4  # tokens per row; rows per step over all replicas


def _split(name: str):
    """"sp2" / "sp4": one sequence over 2 / 4 ranks, FSDP2 on the default mesh; "hsdp": sp 2 with pure
    replicas (a user's mesh), FSDP2 as HSDP over sp.meshes["fsdp"]."""
    if name == "hsdp":
        sp = topology("hsdp")
        return sp, {"mesh": sp.meshes["fsdp"]}
    return shared_init(sp_size=int(name[2:])), {}


def _trained(name: str, seed: int):
    """A patched tiny Llama under FSDP2 at the split ``name``, with an SGD optimizer with momentum."""
    sp, mesh = _split(name)
    model = ringseq.patch(tiny_llama() if seed == 0 else _other_weights(), sp=sp)
    for layer in model.model.layers:
        fully_shard(layer, **mesh)
    fully_shard(model, **mesh)
    return sp, model, torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)


def _other_weights():
    model = tiny_llama()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def _step(sp, model, optimizer, step: int) -> None:
    """One optimizer step on the step's rows, dealt evenly over the replicas."""
    rows = torch.randint(0, 64, (ROWS, S), generator=torch.Generator().manual_seed(500 + step))
    mine = rows.chunk(sp.dp_size)[sp.dp_rank]
    model(input_ids=mine, labels=mine).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _params(model) -> dict:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def resume_at(saved: str, resumed: str) -> str:
    """Save at ``saved`` after one step, then: the saved run's next step, and a fresh model at
    ``resumed`` that loads the checkpoint and takes the same step; equal."""
    folder = [tempfile.mkdtemp(prefix="ringseq-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    sp, model, optimizer = _trained(saved, seed=0)
    _step(sp, model, optimizer, 0)
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder[0])
    before = _params(model)
    _step(sp, model, optimizer, 1)
    want = _params(model)

    sp2, fresh, fresh_optimizer = _trained(resumed, seed=1)
    msd, osd = get_state_dict(fresh, fresh_optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=folder[0])
    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _params(fresh)
    for name in before:
        assert torch.equal(loaded[name], before[name]), f"rank {dist.get_rank()}: {name} loaded differently"
    _step(sp2, fresh, fresh_optimizer, 1)
    got = _params(fresh)
    for name in want:  # the two splits sum the gradients in different orders: equal to fp32 rounding
        diff = (got[name] - want[name]).abs().max().item()
        scale = (want[name] - before[name]).abs().max().item()
        assert diff <= 1e-5 * max(scale, 1e-3), f"rank {dist.get_rank()}: {name} differs after resuming {saved} " \
                                                 f"at {resumed} by {diff:.2e} (update {scale:.2e})"
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0], ignore_errors=True)
    return f"{saved} -> {resumed}"
