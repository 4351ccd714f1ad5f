"""Run by ``deepspeed --num_gpus N``: for each case given, one SGD step through ringseq.initialize
must move every parameter exactly as one single-process step on the same samples (gradients
averaged over the data-parallel replicas' full batches), or ringseq must refuse the
configuration with the expected message. The cases run one after another in one process
group (a launch costs more than a case). Every rank asserts."""
import argparse
import copy
import shutil
import tempfile

import deepspeed
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import ringseq
import ringseq.processes
import ringseq.mpu
from ringseq.testing import assert_refused, assert_updates_close


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


def reference_step(model, dp: int, S: int, clip: float | None, autocast: bool = False) -> dict:
    """One single-process SGD step (lr 1) on a copy of ``model``: the mean over replicas of the
    full-batch gradients (``autocast``: computed under bf16 autocast), clipped to ``clip``. Returns
    the parameters after it."""
    model = copy.deepcopy(model)
    for d in range(dp):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = lm_loss(model, batch_for(d, S))
        (loss / dp).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    return {n: p.detach() for n, p in model.named_parameters()}


def batch_for(replica: int, S: int) -> dict:
    ids = torch.randint(0, 64, (2, S), generator=torch.Generator().manual_seed(100 + replica))
    return {"input_ids": ids, "labels": ids}


CASE_KEYS = {"stage", "sp", "clip", "section", "config", "reduce_scatter", "extra", "checkpoint", "refuse", "resume_sp",
             "memory", "engine", "batch", "autocast", "compile"}


def parse_case(text: str) -> dict:
    """``stage=3,clip=0,checkpoint`` -> {"stage": "3", "clip": "0", "checkpoint": True}."""
    case = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in CASE_KEYS:
            raise SystemExit(f"unknown case key {key!r} in {text!r}; known: {sorted(CASE_KEYS)}")
        case[key] = value if value else True
    return case


def run_case(case: dict) -> str:
    """One configuration: an SGD step through ringseq.initialize against the single-process
    step, or the RingSeqError it must raise (``refuse=`` words of the message)."""
    sp_size = int(case.get("sp", 2))
    world = dist.get_world_size()
    dp = world // sp_size
    S = 16 * sp_size
    model = tiny_llama()
    reference = copy.deepcopy(model)
    # with clipping (DeepSpeed's default, 1.0) the reference clips too, so the test also checks that
    # DeepSpeed measures the norm of the correctly reduced gradient; without it (clip=0) a
    # gradient of the right direction but the wrong scale is caught as well
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "gradient_clipping": float(case.get("clip", 1.0)),
              "zero_optimization": {"stage": int(case.get("stage", 0))}, "zero_allow_untested_optimizer": True}
    if case.get("reduce_scatter"):
        config["zero_optimization"]["reduce_scatter"] = True
    sp = None
    if case.get("config"):
        config = case["config"]  # ringseq.initialize reads the file and its "ringseq" section
    elif case.get("section"):
        config["ringseq"] = {"sp_size": sp_size, "layout": "zigzag"}
        if case.get("extra"):
            key, value = case["extra"].split(":")
            config["ringseq"][key] = value
    else:
        sp = ringseq.init(sp_size=sp_size)
    if case.get("memory"):  # checkpointed layers keeping ring outputs; MLPs in 3 tiles per shard
        model.gradient_checkpointing_enable()
        model.train()
        ringseq.patch(model, sp=sp, tiled_mlp=3)
    if case.get("refuse"):
        try:
            ringseq.initialize(sp=sp, model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        except ringseq.RingSeqError as err:
            assert case["refuse"] in str(err), f"rank {dist.get_rank()}: refused, but with: {err}"
            return f"refused as expected: {err}"
        raise AssertionError(f"{case} was not refused")
    if case.get("batch"):  # train_batch_size counts sequences over the replicas; DeepSpeed derives the accumulation
        config = {**config, "train_batch_size": int(case["batch"]) * dp}
        del config["gradient_accumulation_steps"]
    # momentum: its first step is plain SGD; after a checkpoint round trip it must carry over
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    if case.get("engine") in ("plain", "mpu", "sequence_mpu"):  # deepspeed.initialize itself, on a patched model
        mpu = {"plain": None, "mpu": sp.mpu, "sequence_mpu": SequenceMPU(sp)}[case["engine"]]
        engine, *_ = deepspeed.initialize(model=ringseq.patch(model, sp=sp), config=config, optimizer=optimizer,
                                          mpu=mpu)
        if case["engine"] == "sequence_mpu":
            assert_refused(lambda: engine(**batch_for(sp.dp_rank, S)), "mpu with sequence parallelism")
            deepspeed.utils.groups.mpu = None  # DeepSpeed keeps an engine's mpu for every later engine of the process
            return "an mpu that declares sequence parallelism is refused"
        engine.ringseq = sp
    elif case.get("engine") == "data":
        return drawn_over_replicas(model, sp, config, optimizer, S)
    else:
        engine, *_ = ringseq.initialize(sp=sp, model=model, config=config, optimizer=optimizer)
    sp = engine.ringseq
    if case.get("batch"):
        assert engine.gradient_accumulation_steps() == int(case["batch"]) // 2, engine.gradient_accumulation_steps()
        return f"train_batch_size {int(case['batch']) * dp}: {engine.gradient_accumulation_steps()} micro-batches"
    if case.get("compile"):  # DeepSpeed's engine.compile(): model.compile() of the patched module (docs/compile.md)
        engine.compile(backend="aot_eager")
    autocast = bool(case.get("autocast"))  # fp32 weights, the forward under torch's bf16 autocast
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = engine(**batch_for(sp.dp_rank, S)).loss
    engine.backward(loss)
    engine.step()

    what = f"ZeRO-{engine.zero_optimization_stage()} sp {sp.size} dp {dp}{' bf16 autocast' if autocast else ''} " \
           f"rank {dist.get_rank()}"
    if case.get("memory"):
        what += " (checkpointing + tiled MLP)"
    if case.get("compile"):
        assert engine.is_compiled, what
        what += " compiled"
    clip = engine.gradient_clipping()  # as DeepSpeed read it (a shipped config sets its own)
    plain = reference_step(reference, dp, S, clip, autocast)
    exact = reference_step(copy.deepcopy(reference).double(), dp, S, clip)
    assert_updates_close(gathered(engine), plain, exact, dict(tiny_llama().named_parameters()), what)
    done = f"ZeRO-{engine.zero_optimization_stage()} sp {sp.size} dp {dp} clip {clip}: parameters match"
    if case.get("checkpoint"):
        checkpoint_round_trip(engine, sp, config, S)
        done += "; checkpoint saved and loaded: next step matches"
    if case.get("resume_sp"):
        resume_at_another_shape(engine, sp, config, S, int(case["resume_sp"]))
        done += f"; resumed at sp {case['resume_sp']}: next step matches"
    return done


def main():
    parser = argparse.ArgumentParser(description="run each case in turn, in one process group")
    parser.add_argument("cases", nargs="+", help="e.g. stage=3,clip=0  config=launch/configs/ds_zero2.json  "
                                                 "stage=3,reduce_scatter,refuse=reduce_scatter")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    for n, text in enumerate(args.cases):
        result = run_case(parse_case(text))
        print(f"rank {dist.get_rank()}: case {n} [{text}] ok: {result}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


class SequenceMPU(ringseq.mpu.SequenceParallelMPU):
    """An mpu that declares sequence parallelism (what ringseq's said before its gradient rule):
    DeepSpeed then sums over the sequence ranks and divides by the replicas."""

    def __init__(self, sp):
        super().__init__()
        self.sp = sp

    def get_sequence_parallel_group(self):
        return self.sp.group

    def get_sequence_parallel_rank(self):
        return self.sp.rank

    def get_sequence_parallel_world_size(self):
        return self.sp.size

    def get_sequence_data_parallel_group(self):
        return dist.group.WORLD

    def get_sequence_data_parallel_rank(self):
        return dist.get_rank()

    def get_sequence_data_parallel_world_size(self):
        return dist.get_world_size()

    def get_data_parallel_group(self):
        return self.sp.dp_group

    def get_data_parallel_rank(self):
        return self.sp.dp_rank

    def get_data_parallel_world_size(self):
        return self.sp.dp_size


def drawn_over_replicas(model, sp, config, optimizer, S) -> str:
    """``ringseq.initialize(training_data=...)``: the ranks of a sequence group draw the same
    batches, the replicas different ones, and a step on them runs."""
    samples = [{k: v[i] for k, v in batch_for(d, S).items()} for d in range(4) for i in range(2)]
    engine, _, loader, _ = ringseq.initialize(sp=sp, model=model, config=config, optimizer=optimizer,
                                              training_data=samples)
    loader.num_local_io_workers = 0  # a pool's rank is a daemon process: no loader workers
    batch = next(iter(loader))
    drawn = [None] * dist.get_world_size()
    dist.all_gather_object(drawn, batch["input_ids"].tolist())
    for g in sp.sequence_groups:
        assert all(drawn[r] == drawn[g[0]] for r in g), f"a sequence group drew different batches: {drawn}"
    firsts = [drawn[g[0]] for g in sp.sequence_groups]
    assert len({str(f) for f in firsts}) == len(firsts), f"replicas drew the same batch: {firsts}"
    engine.backward(engine(**batch).loss)
    engine.step()
    return f"training_data dealt over {sp.dp_size} replica(s)"


def gathered(engine):
    out = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.detach().clone()
    return out


def checkpoint_round_trip(engine, sp, config, S):
    """Save, load into a fresh engine (other weights), then one more step on both: equal."""
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
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0])


def resume_at_another_shape(engine, sp, config, S, sp_size):
    """Save at this sp_size, resume in a fresh engine at another one (same world; more or fewer
    replicas), then one more step of the same global batch on both: equal to fp32 rounding (1e-5 of the
    step's update). DeepSpeed partitions ZeRO over every rank whatever sp_size is, and the weights are
    replicated over the sequence group, so the checkpoint loads as it is; the new shape deals the
    global batch's rows over its replicas, in micro-batches of at most 2 (accumulated)."""
    folder = [tempfile.mkdtemp(prefix="ringseq-reshape-")]
    dist.broadcast_object_list(folder, src=0)
    engine.save_checkpoint(folder[0], tag="step1")
    new_sp = ringseq.init(sp_size=sp_size)
    rows = torch.cat([batch_for(d + 7, S)["input_ids"] for d in range(sp.dp_size)])  # the old replicas' rows
    mine = rows.chunk(new_sp.dp_size)[new_sp.dp_rank]
    micro = min(2, mine.size(0))
    reshaped = {k: v for k, v in config.items() if k != "train_batch_size"}
    reshaped.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=mine.size(0) // micro)
    fresh = tiny_llama()
    other, *_ = ringseq.initialize(sp=new_sp, model=fresh, config=reshaped,
                                   optimizer=torch.optim.SGD(fresh.parameters(), lr=1.0, momentum=0.9))
    other.load_checkpoint(folder[0], tag="step1")
    before = gathered(engine)
    engine.backward(engine(**batch_for(sp.dp_rank + 7, S)).loss)
    engine.step()
    for part in mine.split(micro):
        other.backward(other(input_ids=part, labels=part).loss)
        other.step()
    a, b = gathered(engine), gathered(other)
    for name in a:  # the two shapes sum gradients in different orders: equal to fp32 rounding
        diff = (a[name] - b[name]).abs().max().item()
        scale = (a[name] - before[name]).abs().max().item()
        assert diff <= 1e-5 * max(scale, 1e-3), f"rank {dist.get_rank()}: {name} differs after resuming at sp " \
                                                 f"{sp_size} by {diff:.2e} (update {scale:.2e})"
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0])


if __name__ == "__main__":
    main()
    ringseq.processes.exit_now(0)  # no interpreter teardown (see exit_now)
