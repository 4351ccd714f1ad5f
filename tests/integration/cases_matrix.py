"""The rows of the GPU user's matrix (``matrix.py``) whose entry point is a loop of the user's own, the
Accelerate loop or ``ringseq.Trainer``: one SGD step (lr 1) of a tiny Llama on the replicas' full batches,
run on every rank of a pool as the row says, and its parameter updates against the unpatched model's on the
same batches in the same precision (``reference``) by the 2x rule against float64. SFT and GRPO rows run
through ``client_step.py`` and ``grpo_step.py``, against stock TRL."""
from __future__ import annotations

import contextlib
import copy
import tempfile

import torch
import torch.distributed as dist

import ringseq
from ringseq.testing import assert_updates_close, shared_init

from .cases_engines import topology
from .ds_step import batch_for, lm_loss, tiny_llama
from .matrix import checkpoint, compile_layers, layers_of, parse

BF16 = torch.bfloat16


def autocast(on: bool):
    return torch.autocast("cpu", dtype=BF16) if on else contextlib.nullcontext()


def reference(model, dp: int, S: int, params_dtype, autocast_on: bool, update_dtype=torch.float32) -> dict:
    """One SGD step (lr 1) of the unpatched model in the row's arithmetic: its weights cast to ``params_dtype``
    for the forward and backward (a mixed-precision policy's, a bf16 model's), under bf16 autocast or not; the
    mean over replicas of the full-batch gradients, applied to the weights in ``update_dtype`` (fp32 master
    weights; a bf16 model's own). Returns the parameters after it."""
    master = copy.deepcopy(model).to(update_dtype)
    run = copy.deepcopy(model).to(params_dtype)
    for d in range(dp):
        with autocast(autocast_on):
            loss = lm_loss(run, batch_for(d, S))
        (loss / dp).backward()
    grads = dict(run.named_parameters())
    with torch.no_grad():
        for n, p in master.named_parameters():
            p -= grads[n].grad.to(update_dtype)
    return {n: p.detach() for n, p in master.named_parameters()}


def arithmetic(row: dict) -> tuple:
    """(weights' dtype in the forward, autocast on, master weights' dtype) of a row."""
    precision, entry = row["precision"], row["entry"]
    if precision == "bf16":
        return BF16, False, BF16
    if precision in ("mp", "mp_nocast"):
        # Accelerate's bf16 under FSDP2 (the clients' and prepare_accelerator's) autocasts beside its policy
        return BF16, precision == "mp" and entry != "raw" and row["engine"] in ("fsdp2", "hsdp"), torch.float32
    return torch.float32, precision == "autocast", torch.float32


def gathered(model, engine=None) -> dict:
    """Every parameter's full value, by its unwrapped name (FSDP2's DTensors, ZeRO-3's partitions)."""
    import deepspeed

    out = {}
    for name, p in (engine.module if engine is not None else model).named_parameters():
        with deepspeed.zero.GatheredParameters([p]) if hasattr(p, "ds_id") else torch.no_grad():
            name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
            out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def ds_config(row: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": int(row["engine"][-1])}, "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": row["precision"] == "mp"}}


def mp_policy(row: dict):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if row["precision"] not in ("mp", "mp_nocast"):
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32,
                                cast_forward_inputs=row["precision"] == "mp")


def raw_step(row: dict, sp, model, S: int) -> dict:
    """The user's own loop: ``ringseq.patch``, then the row's checkpointing, compiled layers, engine and
    whole-model compile, one step."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    engine_name, batch = row["engine"], batch_for(sp.dp_rank, S)
    patched = ringseq.patch(model, sp=sp)
    checkpoint(patched, row["checkpointing"])
    if row["compile"] == "layers":
        compile_layers(patched)
    engine = None
    if engine_name.startswith("zero"):
        engine, *_ = ringseq.initialize(sp=sp, model=patched, config=ds_config(row),
                                        optimizer=torch.optim.SGD(patched.parameters(), lr=1.0))
        call = engine
        if row["compile"] == "whole":
            torch._dynamo.reset()
            engine.compile(backend="aot_eager")
    else:
        call = patched
        if engine_name == "ddp":
            call = DistributedDataParallel(patched)
        elif engine_name in ("fsdp2", "hsdp"):
            mesh = sp.meshes["fsdp"]
            for layer in layers_of(patched):
                fully_shard(layer, mesh=mesh, mp_policy=mp_policy(row))
            fully_shard(patched, mesh=mesh, mp_policy=mp_policy(row))
        if row["compile"] == "whole":
            torch._dynamo.reset()
            call = torch.compile(call, backend="aot_eager")
    with autocast(row["precision"] == "autocast"):
        loss = call(**batch).loss
    if engine is not None:
        engine.backward(loss)
        engine.step()
        return gathered(patched, engine)
    loss.backward()
    params = [p for p in patched.parameters()]
    if engine_name == "raw":  # the README's loop: every gradient averaged over all ranks
        for p in params:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
    torch.optim.SGD(params, lr=1.0).step()
    return gathered(patched)


def accelerate_step(row: dict, sp, model, S: int) -> dict:
    """A plain Accelerate loop through ``ringseq.prepare_accelerator``, its plugins made in code as a user
    would: FSDP2 (Accelerate's auto-wrap of the decoder layers, its ``activation_checkpointing``, its bf16
    policy or the user's own), DeepSpeed, ``mixed_precision="bf16"``, ``TorchDynamoPlugin``."""
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin, TorchDynamoPlugin

    engine_name, precision = row["engine"], row["precision"]
    kwargs = {"mixed_precision": "bf16" if precision in ("autocast", "mp") else "no"}
    if engine_name == "fsdp2":
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"], activation_checkpointing=row["checkpointing"] == "engine",
            mixed_precision_policy=mp_policy(row) if precision == "mp_nocast" else None)
    elif engine_name.startswith("zero"):
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=ds_config(row))
    if row["compile"] == "whole":
        torch._dynamo.reset()
        kwargs["dynamo_plugin"] = TorchDynamoPlugin(backend="aot_eager")
    accelerator = ringseq.prepare_accelerator(sp=sp, **kwargs)
    patched = ringseq.patch(model, sp=sp)
    if row["checkpointing"] != "engine":
        checkpoint(patched, row["checkpointing"])
    if row["compile"] == "layers":
        compile_layers(patched)
    wrapped, optimizer = accelerator.prepare(patched, torch.optim.SGD(patched.parameters(), lr=1.0))
    accelerator.backward(wrapped(**batch_for(sp.dp_rank, S)).loss)
    optimizer.step()
    engine = wrapped if engine_name.startswith("zero") else None
    return gathered(accelerator.unwrap_model(wrapped, keep_torch_compile=False), engine)


def trainer_step(row: dict, sp, model, S: int) -> dict:
    """``ringseq.Trainer`` with the row in its own arguments: ``bf16=True`` (autocast under DDP, Accelerate's
    policy under FSDP2, DeepSpeed's bf16), ``fsdp`` with FSDP's activation checkpointing, ``deepspeed``,
    ``torch_compile``, ``gradient_checkpointing``; compiled or wrapped layers as the user hands them over."""
    from transformers import TrainingArguments

    from .trainer_step import params_of

    engine_name, precision, how = row["engine"], row["precision"], row["checkpointing"]
    extra = {}
    if engine_name == "fsdp2":
        extra.update(fsdp=True, fsdp_config={"version": 2, "activation_checkpointing": how == "engine"})
    elif engine_name.startswith("zero"):
        extra["deepspeed"] = {**ds_config(row), "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
                              "bf16": {"enabled": "auto"}}
    if row["compile"] == "whole":
        torch._dynamo.reset()
        extra.update(torch_compile=True, torch_compile_backend="aot_eager")
    if how in ("hf", "hf_reentrant"):
        extra.update(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": how == "hf_reentrant"})
    elif how == "wrapper":
        checkpoint(model, how)
    if row["compile"] == "layers":
        compile_layers(model)
    ids = batch_for(sp.dp_rank, S)["input_ids"]
    rows = [{"input_ids": r, "labels": r} for d in range(sp.dp_size) for r in batch_for(d, S)["input_ids"]]
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=ids.size(0), max_steps=1,
                                 learning_rate=1.0, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0,
                                 max_grad_norm=0.0, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
                                 train_sampling_strategy="sequential", bf16=precision in ("autocast", "mp"), **extra)
        trainer = ringseq.Trainer(model=model, args=args, train_dataset=rows, sp=sp)
        trainer.train()
        return params_of(trainer)


STEPS = {"raw": raw_step, "accelerate": accelerate_step, "trainer": trainer_step}


def cell(text: str) -> str:
    """One row on this rank: its step, against the unpatched model's in the same arithmetic."""
    row = parse(text)
    sp = topology("hsdp") if row["engine"] == "hsdp" else shared_init(sp_size=2)
    S = 16 * sp.size
    model = tiny_llama()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    params_dtype, autocast_on, master = arithmetic(row)
    plain = reference(model, sp.dp_size, S, params_dtype, autocast_on, master)
    exact = reference(model, sp.dp_size, S, torch.float64, False, torch.float64)
    if row["precision"] == "bf16":
        model = model.to(BF16)
        start = {n: p.to(BF16) for n, p in start.items()}
    got = STEPS[row["entry"]](row, sp, model, S)
    what = f"{text} rank {dist.get_rank()}"
    assert_updates_close(got, plain, exact, start, f"{what}: parameter updates")
    return what


def refused_compiled_inside() -> str:
    """FSDP's activation checkpointing (``apply_activation_checkpointing``, as Accelerate applies it) around
    decoder layers compiled before: ``RingSeqError`` at the first training forward, on every rank."""
    from ringseq.patches.checkpointing import COMPILED_INSIDE
    from ringseq.testing import assert_refused

    sp = shared_init(sp_size=2)
    model = ringseq.patch(tiny_llama(), sp=sp)
    compile_layers(model)
    checkpoint(model, "engine")
    assert_refused(lambda: model(**batch_for(0, 16 * sp.size)), COMPILED_INSIDE[:60])
    return "refused"
