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
import ringseq.processes
from ringseq.testing import assert_updates_close


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def lm_loss(model, batch) -> torch.Tensor:
    """The mean next-token loss in the logits' own dtype (transformers' loss casts logits to fp32,
    which would make a float64 reference no more exact than fp32)."""
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)


def reference_step(model, dp: int, S: int, clip: float | None) -> dict:
    """One single-process SGD step (lr 1) on a copy of ``model``: the mean over replicas of the
    full-batch gradients, clipped to ``clip``. Returns the parameters after it."""
    model = copy.deepcopy(model)
    for d in range(dp):
        (lm_loss(model, batch_for(d, S)) / dp).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    return {n: p.detach() for n, p in model.named_parameters()}


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
    parser.add_argument("--clip", type=float, default=1.0,
                        help="gradient_clipping (0: none; a clipped step hides a wrongly scaled gradient)")
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
    # with clipping (DeepSpeed's default, 1.0) the reference clips too, so the test also checks that
    # DeepSpeed measures the norm of the correctly reduced gradient; without it (--clip 0) a
    # gradient of the right direction but the wrong scale is caught as well
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": args.clip,
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

    what = f"ZeRO-{engine.zero_optimization_stage()} sp {sp.size} dp {dp} rank {dist.get_rank()}"
    clip = engine.gradient_clipping()  # as DeepSpeed read it (a shipped config sets its own)
    plain = reference_step(reference, dp, S, clip)
    exact = reference_step(copy.deepcopy(reference).double(), dp, S, clip)
    assert_updates_close(gathered(engine), plain, exact, dict(tiny_llama().named_parameters()), what)
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
    ringseq.processes.exit_now(0)  # no interpreter teardown (see exit_now)
