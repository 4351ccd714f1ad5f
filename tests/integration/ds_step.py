"""Run by ``deepspeed --num_gpus N``: one SGD step through ringseq.initialize must move every
parameter exactly as one single-process step on the same samples (gradients averaged over the
data-parallel replicas' full batches). Every rank asserts."""
import argparse
import copy

import deepspeed
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import ringseq
import ringseq.testing


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def batch_for(replica: int, S: int) -> dict:
    ids = torch.randint(0, 64, (2, S), generator=torch.Generator().manual_seed(100 + replica))
    return {"input_ids": ids, "labels": ids}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=None)
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--section", action="store_true", help="configure through the ds_config section")
    parser.add_argument("--config", help="a ds_config file with a ringseq section (replaces --stage's config)")
    parser.add_argument("--expect-refusal", action="store_true", help="ringseq must refuse this configuration")
    parser.add_argument("--section-extra", default=None, help='an extra key=value for the "ringseq" section')
    parser.add_argument("--reduce-scatter", action="store_true", help='set zero_optimization "reduce_scatter": true')
    parser.add_argument("--checkpoint", action="store_true",
                        help="save after the step, load into a fresh engine, take one more step on both")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    dp = world // args.sp
    S = 16 * args.sp
    model = tiny_llama()
    reference = copy.deepcopy(model)
    # gradient clipping (DeepSpeed's default, 1.0) stays on: the reference clips too, so the test
    # also checks that DeepSpeed measures the norm of the correctly reduced gradient
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": args.stage}, "zero_allow_untested_optimizer": True}
    if args.reduce_scatter:
        config["zero_optimization"]["reduce_scatter"] = True
    if args.config:
        config, sp = args.config, None  # ringseq.initialize reads the file and its "ringseq" section
    elif args.section:
        config["ringseq"] = {"sp_size": args.sp, "layout": "zigzag"}
        if args.section_extra:
            key, value = args.section_extra.split("=")
            config["ringseq"][key] = value
        sp = None
    else:
        sp = ringseq.init(sp_size=args.sp)
    if args.expect_refusal:
        try:
            ringseq.initialize(sp=sp, model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        except ringseq.RingSeqError as err:
            print(f"rank {dist.get_rank()}: refused as expected: RingSeqError: {err}", flush=True)
            return
        raise AssertionError(f"ZeRO-{args.stage} {config} was not refused")
    # momentum: its first step is plain SGD; after a checkpoint round trip it must carry over
    engine, *_ = ringseq.initialize(sp=sp, model=model, config=config,
                                    optimizer=torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9))
    sp = engine.ringseq
    loss = engine(**batch_for(sp.dp_rank, S)).loss
    engine.backward(loss)
    engine.step()

    # the single-process step: mean over replicas of the full-batch gradients, clipped, SGD lr 1
    for d in range(dp):
        (reference(**batch_for(d, S)).loss / dp).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    with torch.no_grad():
        for p in reference.parameters():
            p -= p.grad
    want = dict(reference.named_parameters())
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            got = p.detach().clone()
        moved = (want[name].detach() - dict(tiny_llama().named_parameters())[name].detach()).abs().max()
        assert torch.allclose(got, want[name].detach(), rtol=1e-4, atol=1e-6), \
            f"stage {engine.zero_optimization_stage()} rank {dist.get_rank()}: {name} off by {(got - want[name]).abs().max():.2e} " \
            f"(a step moved it by {moved:.2e})"
    print(f"rank {dist.get_rank()}: ZeRO-{engine.zero_optimization_stage()} sp {sp.size} dp {dp}: parameters match",
          flush=True)
    if args.checkpoint:
        checkpoint_round_trip(engine, sp, config, S)
    dist.destroy_process_group()


def gathered(engine):
    out = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.detach().clone()
    return out


def checkpoint_round_trip(engine, sp, config, S):
    """Save, load into a fresh engine (other weights), then one more step on both: equal."""
    import tempfile

    folder = [tempfile.mkdtemp(prefix="ringseq-ckpt-")]
    dist.broadcast_object_list(folder, src=0)
    engine.save_checkpoint(folder[0], tag="step1")
    torch.manual_seed(1)
    fresh = tiny_llama()
    for p in fresh.parameters():
        p.data.normal_()
    other, *_ = ringseq.initialize(sp=sp, model=fresh, config=config,
                                   optimizer=torch.optim.SGD(fresh.parameters(), lr=1.0, momentum=0.9))
    other.load_checkpoint(folder[0], tag="step1")
    for e in (engine, other):
        e.backward(e(**batch_for(sp.dp_rank + 7, S)).loss)
        e.step()
    a, b = gathered(engine), gathered(other)
    for name in a:
        assert torch.equal(a[name], b[name]), f"rank {dist.get_rank()}: {name} differs after the checkpoint " \
                                              f"round trip by {(a[name] - b[name]).abs().max():.2e}"
    print(f"rank {dist.get_rank()}: checkpoint saved and loaded under sp {sp.size}: next step matches", flush=True)
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(folder[0])


if __name__ == "__main__":
    main()
    ringseq.testing.exit_now(0)  # no interpreter teardown (see exit_now)
