"""A failure on one rank inside a patched step under an engine (issue 58, ``ringseq.recovery``): the loop a user
writes around a step that can run out of memory (catch, skip the batch, go on). Every rank raises in the failing
step, at once (the failing rank its own exception, its peers a ``RingSeqError`` naming it), and the next step is
the unpatched model's; or, under an engine whose state cannot be reset, the next step raises ``RingSeqError``
saying so, before any collective. Run on every rank of a pool (one sequence group over the world)."""
from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist

import ringseq
from ringseq.testing import assert_named_close, shared_init

from .ds_step import batch_for, lm_loss, tiny_llama

TIMEOUT = 30.0
"""The group's timeout: every raise must come far sooner (``FAST``)."""
FAST = 8.0


class Injected(MemoryError):
    """The failing rank's own error (an out-of-memory, as a long batch gives)."""


def _wrap(engine: str, model, sp):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if engine == "ddp":  # its defaults (buffers broadcast), and small buckets: several launched in the backward
        return DistributedDataParallel(model, bucket_cap_mb=0.01), None
    if engine in ("fsdp2", "fsdp2_compiled"):
        if engine == "fsdp2_compiled":
            for layer in model.model.layers:
                layer.compile(backend="aot_eager")
        for layer in model.model.layers:
            fully_shard(layer, mesh=sp.meshes["fsdp"])
        fully_shard(model, mesh=sp.meshes["fsdp"])
        return model, None
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True,
                                        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer})), None
    if engine.startswith("zero"):
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                  "zero_optimization": {"stage": int(engine[-1])}, "zero_allow_untested_optimizer": True}
        ds, *_ = ringseq.initialize(sp=sp, model=model, config=config,
                                    optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        return ds, ds
    return model, None


def _grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name.replace("_orig_mod.", "")] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def fails_then_goes_on(engine: str, where: str, target: str, victim: int = 1, sp_size: int | None = None) -> str:
    """Three steps: exact, then ``victim`` fails inside ``target``'s forward or backward, or an evaluation's
    forward (``where``: "forward", "backward", "eval"), then exact
    again with no resync: the gradients of step 3 against the unpatched model's (averaged over the world as the
    engine averages; the raw loop averages by hand). ``sp_size`` below the world: the engine spans several
    sequence groups (replicas, each with a batch of its own), and every rank of every group raises in step 1."""
    sp = shared_init(sp_size=sp_size or dist.get_world_size(), timeout=TIMEOUT)
    base = tiny_llama()
    model = ringseq.patch(copy.deepcopy(base), sp=sp)
    armed = [False]
    me = dist.get_rank()

    def forward_fault(module, args):
        if armed[0] and where in ("forward", "eval") and me == victim:
            raise Injected(f"injected in {target}'s forward")

    def backward_fault(module, grad_in, grad_out):
        if armed[0] and where == "backward" and me == victim:
            raise Injected(f"injected in {target}'s backward")

    module = model.get_submodule(target)
    module.register_forward_pre_hook(forward_fault)
    module.register_full_backward_hook(backward_fault)
    wrapper, ds = _wrap(engine, model, sp)
    S = 16 * sp.size
    what = f"{engine}, rank {victim} failing in {target}'s {where}, rank {me}"
    for step in range(3):
        armed[0] = step == 1
        batch = batch_for(10 * step + sp.dp_rank, S)
        start = time.monotonic()
        try:
            if where == "eval" and armed[0]:  # a forward with no backward (an evaluation)
                with torch.no_grad():
                    wrapper(**batch)
            else:
                loss = wrapper(**batch).loss
                ds.backward(loss) if ds is not None else loss.backward()
            raised = None
        except (Injected, ringseq.RingSeqError) as exc:
            raised = exc
        took = time.monotonic() - start
        if step == 1:
            assert raised is not None, f"{what}: step 1 did not raise"
            if me == victim:
                assert isinstance(raised, Injected), f"{what}: raised {raised!r}, not its own error"
            else:
                assert isinstance(raised, ringseq.RingSeqError) and f"global rank {victim}" in str(raised), \
                    f"{what}: {raised!r}"
            assert took < FAST, f"{what}: raised after {took:.1f} s"
            if engine in ("fsdp1", "zero3"):  # no reset: the next step says so on every rank, before any collective
                try:
                    wrapper(**batch_for(20 + sp.dp_rank, S))
                except ringseq.RingSeqError as exc:
                    assert "cannot go on" in str(exc) and "checkpoint" in str(exc), f"{what}: {exc}"
                    return what
                raise AssertionError(f"{what}: the step after the failure was not refused")
            continue
        assert raised is None, f"{what}: step {step} raised {raised!r}"
        if step == 2:
            got = _grads(model)
            if engine == "raw":
                for g in got.values():
                    dist.all_reduce(g)
                    g /= dist.get_world_size()
            plain, exact = copy.deepcopy(base), copy.deepcopy(base).double()
            for replica in range(sp.dp_size):  # the engine's average over the replicas' batches
                for reference in (plain, exact):
                    (lm_loss(reference, batch_for(20 + replica, S)) / sp.dp_size).backward()
            assert_named_close(got, {n: p.grad for n, p in plain.named_parameters()},
                               {n: p.grad for n, p in exact.named_parameters()}, f"{what}: step 2's gradients")
        if ds is None:
            for p in wrapper.parameters():
                p.grad = None
        else:
            ds.step()
    return what
