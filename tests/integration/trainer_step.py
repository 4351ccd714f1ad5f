"""Run as a launcher starts it (deepspeed / torchrun / accelerate launch; the tests run it in their
warm pools with each launcher's variables, tests/conftest.py): ringseq.Trainer's optimizer
steps must move every parameter exactly as single-process steps of the unpatched model on the
same samples, with gradient accumulation, DeepSpeed ZeRO stages or DDP, uneven label counts
(the loss is normalised by the step's tokens over all replicas) and clipping; evaluation must
give the single-process loss; resuming from a checkpoint must end where the uninterrupted run
ends. Every rank asserts.
"""
import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import ringseq
import ringseq.processes
from ringseq.testing import assert_close, assert_refused, assert_updates_close

S, VOCAB, LR, CLIP, MOMENTUM = 64, 64, 0.5, 1.0, 0.9


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def tiny_hybrid():
    """A Qwen3.5-style hybrid (a gated DeltaNet layer, then attention) that remembers for long."""
    from transformers import Qwen3_5ForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.integration.hybrid_configs import hybrid_config, slow_memory

    torch.manual_seed(0)
    config = hybrid_config("qwen3_5")
    config.vocab_size, config.use_cache, config._attn_implementation = VOCAB, False, "sdpa"
    model = Qwen3_5ForCausalLM(config)
    slow_memory(model)
    return model


MODELS = {False: tiny_llama, True: tiny_hybrid}


def samples(n, seed):
    """Samples whose label counts differ (a masked prefix of varying length)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (S,), generator=g)
        labels = ids.clone()
        labels[: (7 * i) % (S // 2)] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def token_loss_sum(model, sample):
    logits = model(input_ids=sample["input_ids"][None]).logits[0, :-1].double()
    target = sample["labels"][1:]
    keep = target != -100
    return torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum"), keep.sum()


def reference_steps(model, data, per_step, steps):
    """Single-process SGD steps with momentum (torch's rule): each covers the next ``per_step``
    samples, loss normalised by their valid tokens, gradient clipped to CLIP. The momentum makes
    a resumed run depend on the optimizer state restored from the checkpoint."""
    velocity = {}
    for step in range(steps):
        batch = data[step * per_step:(step + 1) * per_step]
        count = sum(token_loss_sum(model, s)[1] for s in batch)
        model.zero_grad()
        for s in batch:
            (token_loss_sum(model, s)[0] / count).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        with torch.no_grad():
            for p in model.parameters():
                velocity[p] = p.grad.clone() if p not in velocity else MOMENTUM * velocity[p] + p.grad
                p -= LR * velocity[p]
    return model


def reference_eval(model, data, dp):
    """The Trainer's eval loss: per eval step (one sample per replica) the token-weighted mean,
    then the mean over steps."""
    with torch.no_grad():
        losses = []
        for i in range(0, len(data), dp):
            sums, counts = zip(*(token_loss_sum(model, s) for s in data[i:i + dp]))
            losses.append(sum(sums) / sum(counts))
    return sum(losses) / len(losses)


def named(model):
    return {n: p.detach() for n, p in model.named_parameters()}


def params_of(trainer):
    import deepspeed

    out = {}
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped, keep_torch_compile=False)
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]) if hasattr(p, "ds_id") else _nothing():
            name = name.replace("_checkpoint_wrapped_module.", "")  # FSDP's activation checkpointing wrapper
            out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()  # FSDP2: DTensor
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def make_trainer(case, sp, out_dir, steps, train, evaluation, **extra):
    ds = None
    if case.stage is not None:
        ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": case.stage}, "zero_allow_untested_optimizer": True}
        if case.section:
            ds["ringseq"] = {"sp_size": case.sp}
    if case.fsdp:  # FSDP2 as the Trainer runs it (Accelerate's auto-wrap of _no_split_modules, then the root)
        extra["fsdp"] = True
        extra["fsdp_config"] = {"version": 2, "activation_checkpointing": case.ac, "cpu_ram_efficient_loading": case.ramload,
                                "state_dict_type": "SHARDED_STATE_DICT" if case.sharded else "FULL_STATE_DICT"}
    if case.cp:  # Accelerate's context parallelism: ringseq's ring over its cp dimension, sp made from it
        from accelerate.parallelism_config import ParallelismConfig

        extra["parallelism_config"] = ParallelismConfig(cp_size=case.sp, dp_shard_size=dist.get_world_size() // case.sp)
    targs = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=1, per_device_eval_batch_size=1,
                              gradient_accumulation_steps=case.gas, max_steps=steps, learning_rate=LR,
                              lr_scheduler_type="constant", optim="sgd", optim_args=f"momentum={MOMENTUM}",
                              max_grad_norm=CLIP, weight_decay=0.0,
                              train_sampling_strategy="sequential", logging_steps=1, report_to=[],
                              save_strategy="steps", save_steps=1, deepspeed=ds, use_cpu=True,
                              disable_tqdm=True, dataloader_drop_last=False, include_num_input_tokens_seen="all",
                              gradient_checkpointing=case.checkpointing, **extra,
                              **({"torch_compile_backend": "aot_eager"} if case.compile else {}))
    # after TrainingArguments: under ZeRO-3 from_pretrained then builds the model partitioned; on CPU
    # TrainingArguments(use_cpu=True) does not start DeepSpeed's comm layer, which zero.Init needs
    if case.pretrained and case.stage is not None:
        ringseq.join_deepspeed()
    model = LlamaForCausalLM.from_pretrained(case.pretrained) if case.pretrained else MODELS[case.hybrid]()
    if case.fit:  # patch(fit=True) under a budget that only the planner's leanest set of switches fits
        from ringseq.patches import fit as fitting
        from ringseq.planner import fit as planner_fit

        ringseq.patch(model, sp=sp, fit=True)
        setting = dataclasses.replace(fitting._setting(model, model._ringseq_patch), zero_stage=case.stage or 0)
        ringseq.patch(model, sp=sp, fit=True,
                      memory_budget=planner_fit.budget_for(planner_fit.least(setting, S, 1).predicted_peak_bytes))
    # plain SGD through args.optim: with DeepSpeed the Trainer ignores optimizers=(...)
    return ringseq.Trainer(model=model, args=targs, train_dataset=train, eval_dataset=evaluation,
                           sp=None if case.section or case.cp else sp)


def stock_trainer_is_refused(sp, train):
    """The stock Trainer deals each process its own samples: the patched model must refuse the mix
    and point to ringseq.Trainer."""
    from transformers import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=1, max_steps=1, report_to=[],
                                 use_cpu=True, disable_tqdm=True, save_strategy="no")
        trainer = Trainer(model=ringseq.patch(tiny_llama(), sp=sp), args=args, train_dataset=train)
        try:
            trainer.train()
        except ringseq.RingSeqError as err:
            assert "use ringseq.Trainer" in str(err), err
            print(f"rank {dist.get_rank()}: stock Trainer refused: {err}", flush=True)
            return
        raise AssertionError("a stock Trainer trained a patched model on different batches per rank")


CASE_KEYS = {"stage", "section", "resume", "pretrained", "checkpointing", "hybrid", "fit", "fsdp", "ac", "ramload",
             "sharded", "cp", "refuse", "compile"}
REFUSALS = {  # a configuration, and the words of the RingSeqError it must raise on every rank
    "fsdp1": "FSDP version 1 through Accelerate needs a GPU",
    "cp_mismatch": "cp_size=2 but ringseq's sequence group has 1 ranks",
}


def parse_case(text: str, sp_size: int, gas: int) -> argparse.Namespace:
    """``stage=3,resume,section`` -> a namespace with every case key (absent: None / False)."""
    case = argparse.Namespace(stage=None, section=False, resume=False, pretrained=False, checkpointing=False,
                              hybrid=False, fit=False, fsdp=False, ac=False, ramload=False, sharded=False, cp=False,
                              refuse=None, compile=False, sp=sp_size, gas=gas)
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in CASE_KEYS:
            raise SystemExit(f"unknown case key {key!r} in {text!r}; known: {sorted(CASE_KEYS)}")
        setattr(case, key, int(value) if key == "stage" else value if key == "refuse" else True)
    return case


def refused(case, sp, out_dir: str) -> None:
    """A configuration ringseq.Trainer refuses (``REFUSALS``), on every rank, before training."""
    from accelerate.parallelism_config import ParallelismConfig

    extra = {"fsdp1": {"fsdp": True, "fsdp_config": {"version": 1}},
             "cp_mismatch": {"parallelism_config": ParallelismConfig(cp_size=2, dp_shard_size=dist.get_world_size() // 2),
                             "fsdp": True, "fsdp_config": {"version": 2}}}
    own = ringseq.init(sp_size=1) if case.refuse == "cp_mismatch" else sp
    train = samples(2, seed=1)
    args = TrainingArguments(output_dir=out_dir, report_to=[], use_cpu=True, **extra[case.refuse])
    assert_refused(lambda: ringseq.Trainer(model=tiny_llama(), args=args, train_dataset=train, sp=own).train(),
                   REFUSALS[case.refuse])
    print(f"rank {dist.get_rank()}: {case.refuse} refused as expected", flush=True)


def run_case(case, sp, out_dir: str) -> None:
    if case.refuse:
        return refused(case, sp, out_dir)
    rank = dist.get_rank()
    dp, steps = sp.dp_size, 3
    train, evaluation = samples(steps * case.gas * dp, seed=1), samples(2 * dp, seed=2)
    if case.pretrained:
        case.pretrained = os.path.join(out_dir, "pretrained")
        if rank == 0:
            tiny_llama().save_pretrained(case.pretrained)
        dist.barrier()
    trainer = make_trainer(case, sp, out_dir, steps, train, evaluation)
    trainer.train()
    got = params_of(trainer)
    eval_loss = trainer.evaluate()["eval_loss"]
    seen = trainer.state.num_input_tokens_seen
    assert seen == steps * case.gas * dp * S, f"rank {rank}: {seen} input tokens counted, not {steps * case.gas * dp * S}"

    engine = f"stage {case.stage}" if case.stage is not None else "FSDP2" if case.fsdp else "DDP"
    engine += "".join(f" {k}" for k in ("cp", "ac", "ramload", "sharded", "hybrid", "compile") if getattr(case, k))
    what = f"rank {rank}: Trainer sp {sp.size} dp {dp} {engine}"
    if case.compile:  # the Trainer trained the model torch.compile made (Accelerate's dynamo plugin)
        assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule), \
            f"{what}: the Trainer trained {type(trainer.model_wrapped).__name__}, not a compiled model"
    if case.fsdp:
        assert trainer.is_fsdp_enabled and trainer.accelerator.is_fsdp2, f"{what}: the Trainer dropped FSDP2"
    if case.fit:  # the Trainer kept fit through its re-patching; fit costed DeepSpeed's stage
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        assert model._ringseq_patch.zero_stage == (case.stage or 0), what
        chosen = ringseq.stats(sp=sp)["fit"]
        assert chosen["switches"]["checkpointing"] and chosen["replans"] == 1, (what, chosen)
        what += f" fit ({chosen['described']})"
    build = MODELS[case.hybrid]
    plain = reference_steps(build(), train, case.gas * dp, steps)
    exact = reference_steps(build().double(), train, case.gas * dp, steps)
    start = dict(build().named_parameters())
    assert_updates_close(got, named(plain), named(exact), start, f"{what}: parameter updates")
    want = [reference_eval(m, evaluation, dp) for m in (plain, exact)]
    assert_close(torch.tensor(eval_loss, dtype=torch.float32), want[0].float(), want[1], f"{what}: eval loss")
    print(f"{what} gas {case.gas}: parameters match, eval loss {eval_loss:.6f} matches", flush=True)
    if case.resume:
        dist.barrier()
        resumed = make_trainer(case, sp, out_dir + "/resumed", steps, train, evaluation)
        resumed.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-1"))
        again = params_of(resumed)
        for name in got:
            assert torch.equal(again[name], got[name]), \
                f"rank {rank}: resumed {name} off by {(again[name] - got[name]).abs().max():.2e}"
        print(f"rank {rank}: resumed from checkpoint-1: parameters match", flush=True)
    dist.barrier()


def main():
    parser = argparse.ArgumentParser(description="run each case in turn, in one process group")
    parser.add_argument("cases", nargs="*", default=[""],
                        help="e.g. stage=2,resume  stage=3,resume,section,checkpointing  hybrid  (none: DDP)")
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--gas", type=int, default=2)
    parser.add_argument("--stock-first", action="store_true",
                        help="first check that a stock transformers.Trainer on a patched model is refused")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()

    sp = ringseq.init(sp_size=args.sp)  # before TrainingArguments: Accelerate must find the process group
    if args.stock_first:
        stock_trainer_is_refused(sp, samples(4, seed=1))
    for n, text in enumerate(args.cases):
        with tempfile.TemporaryDirectory() as tmp:
            out_dir = [tmp]
            dist.broadcast_object_list(out_dir, src=0)  # one directory for all ranks (checkpoints)
            run_case(parse_case(text, args.sp, args.gas), sp, out_dir[0])
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    ringseq.processes.exit_now(0)  # no interpreter teardown (see exit_now)
