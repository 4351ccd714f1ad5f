"""Run by ``accelerate launch`` (DDP, FSDP2 or DeepSpeed): one SGD step of a plain Accelerate loop with
``ringseq.prepare_accelerator`` must move every parameter exactly as one single-process step on
the same samples (each replica's batch mean, averaged over replicas, clipped as DeepSpeed clips).
Every rank asserts."""
import copy
import shutil
import tempfile

import torch
import torch.distributed as dist
from ds_step import batch_for, reference_step, tiny_llama
from torch.utils.data import DataLoader

import ringseq
import ringseq.processes
from ringseq.testing import assert_updates_close


def main():
    sp = ringseq.init(config=ringseq.config.from_env())
    accelerator = ringseq.prepare_accelerator(sp=sp)
    S, dp = 16 * sp.size, sp.dp_size
    model = tiny_llama()
    reference = copy.deepcopy(model)
    samples = [{k: v[i] for k, v in batch_for(d, S).items()} for d in range(dp) for i in range(2)]
    loader = DataLoader(samples, batch_size=2)  # batch d (samples 2d, 2d+1) goes to replica d
    model, optimizer, loader = accelerator.prepare(ringseq.patch(model, sp=sp),
                                                   torch.optim.SGD(model.parameters(), lr=1.0), loader)
    batch = next(iter(loader))
    accelerator.backward(model(**batch).loss)
    optimizer.step()

    clip = None
    if accelerator.distributed_type.value == "DEEPSPEED":
        clip = accelerator.deepspeed_plugin.deepspeed_config.get("gradient_clipping")
    import deepspeed

    def params():
        out = {}
        for name, p in accelerator.unwrap_model(model).named_parameters():
            with deepspeed.zero.GatheredParameters([p]) if hasattr(p, "ds_id") else torch.no_grad():
                out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()  # FSDP2: DTensor
        return out

    got = params()
    plain = reference_step(reference, dp, S, clip)
    exact = reference_step(copy.deepcopy(reference).double(), dp, S, clip)
    assert_updates_close(got, plain, exact, dict(tiny_llama().named_parameters()), f"rank {dist.get_rank()}")
    pc = accelerator.parallelism_config
    cp = pc.cp_size if pc is not None else 1
    hooked = [n for n, m in accelerator.unwrap_model(model).named_modules()  # Accelerate's _attach_context_parallel_hooks
              if any(getattr(h, "__name__", "") == "_self_attn_pre_forward_hook" for h in m._forward_pre_hooks.values())]
    assert not hooked, f"torch's context-parallel hooks were attached to {hooked}: two rings"
    print(f"rank {dist.get_rank()}: accelerate {accelerator.distributed_type.value} cp {cp} sp {sp.size} dp {dp} "
          f"clip {clip}: parameters match", flush=True)
    # Accelerate's own save and resume: a step after load_state equals the step after save_state
    folder = [tempfile.mkdtemp(prefix="ringseq-accelerate-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    optimizer.zero_grad()
    accelerator.save_state(folder[0])
    later = {k: v.roll(1, 0) for k, v in batch.items()}
    for _ in range(2):
        accelerator.backward(model(**later).loss)
        optimizer.step()
        optimizer.zero_grad()
        after = params()
        if _ == 0:
            first = after
            accelerator.load_state(folder[0])
    for name in first:
        assert torch.equal(first[name], after[name]), f"rank {dist.get_rank()}: {name} differs after load_state"
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0], ignore_errors=True)
    print(f"rank {dist.get_rank()}: save_state / load_state: the next step matches", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
    ringseq.processes.exit_now(0)  # no interpreter teardown (see exit_now)
