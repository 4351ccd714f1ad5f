"""The client stacks people fine-tune with, against the same client without ringseq.

    client_step.py reference --out ref.pt SCENARIO...   one process, no ringseq: the stock
                                                         trl.SFTTrainer / transformers.Trainer in
                                                         fp32 ("plain") and float64 ("exact")
    client_step.py ringseq --reference ref.pt SCENARIO... under a launcher: ringseq.SFTTrainer /
                                                         ringseq.Trainer with sp = world size

Scenarios are ``clients_common.SFT_SCENARIOS`` (TRL; ``vlm*``: a tiny LLaVA on TRL's vision
datasets and collator), ``clm`` (transformers' run_clm metrics: ``preprocess_logits_for_metrics``
+ ``compute_metrics``) and ``vlm_trainer`` (the Trainer on the vision collator's batches). Every rank checks, per
scenario: the logged token counts equal; every other logged metric (loss, entropy, token
accuracy, eval loss, eval accuracy) within ``metric_tolerance`` of the float64 run; and what
the optimizer steps changed in the trainable parameters by the 2x rule against float64
(``ringseq.testing.assert_updates_close``).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import matrix  # noqa: E402
from clients_common import (METRICS, SFT_SCENARIOS, dataset, lora, matrix_run, named_trainable,  # noqa: E402
                            plain_dtype, run_clm_metrics, run_clm_preprocess, sft_config, tiny_llama, tiny_vlm,
                            tokenizer, vlm_processor)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def metrics_of(trainer) -> list[dict]:
    return [{k: h[k] for k in METRICS if k in h} for h in trainer.state.log_history if any(k in h for k in METRICS)]


def gathered_trainable(trainer) -> dict:
    import deepspeed

    model = trainer.accelerator.unwrap_model(trainer.model_wrapped, keep_torch_compile=False)
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            with deepspeed.zero.GatheredParameters([p]) if hasattr(p, "ds_id") else torch.no_grad():
                name = name.replace("_checkpoint_wrapped_module.", "")  # torch's checkpoint_wrapper (matrix rows)
                out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
    return out


def clm_blocks(n: int, seed: int, length: int = 64):
    """run_clm's grouped text blocks: fixed-length token rows whose labels are the inputs."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 53, (n, length), generator=g)
    return Dataset.from_list([{"input_ids": row, "labels": row} for row in ids.tolist()])


def make_model(name: str, dtype, model_dir: str | None):
    """The model, an id (a local path) for the model_id scenario, and the peft_config if any."""
    spec = SFT_SCENARIOS.get(name, {})
    if spec.get("model_id") and dtype == torch.float32:
        return model_dir, None
    if spec.get("vlm") or name == "vlm_trainer":
        return tiny_vlm(dtype), (lora(vlm=True) if spec.get("peft") else None)
    return tiny_llama(dtype), (lora() if spec.get("peft") else None)


def engine_args(engine, vlm: bool = False) -> dict:
    """TrainingArguments for the engine: None (DDP), a DeepSpeed ZeRO stage (a config whose batch and
    clipping settings follow the TrainingArguments) or "fsdp" (FSDP2, Accelerate's auto-wrap of the
    model's _no_split_modules; LLaVA's names a CLIP text class its model lacks, so its decoder layers
    are named instead)."""
    if engine is None:
        return {}
    if engine == "fsdp":
        layers = {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer", "CLIPEncoderLayer"]} if vlm else {}
        return {"fsdp": True, "fsdp_config": {"version": 2, **layers}}
    return {"deepspeed": {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                          "train_batch_size": "auto", "gradient_clipping": "auto",
                          "zero_optimization": {"stage": int(engine)}, "zero_allow_untested_optimizer": True,
                          "bf16": {"enabled": "auto"}}}


def run_scenario(name: str, *, ringseq_sp=None, dtype=torch.float32, out_dir: str, model_dir: str | None,
                 stage: int | str | None = None, row: dict | None = None):
    """Train (3 steps) and maybe evaluate; return (metrics per logged step, start, end trainable params).
    ``row``: a row of the GPU user's matrix (matrix.py) beside the scenario (its reference's)."""
    import transformers

    import ringseq

    model, peft_config = make_model(name, dtype, model_dir)
    if name == "clm":
        args = transformers.TrainingArguments(
            output_dir=out_dir, max_steps=2, per_device_train_batch_size=2, per_device_eval_batch_size=2,
            learning_rate=0.5, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, logging_steps=1,
            report_to=[], disable_tqdm=True, save_strategy="no", eval_strategy="no", use_cpu=True, seed=0,
            **engine_args(stage, vlm=name == "vlm_trainer"))
        cls = ringseq.Trainer if ringseq_sp else transformers.Trainer
        kw = dict(compute_metrics=run_clm_metrics, preprocess_logits_for_metrics=run_clm_preprocess,
                  train_dataset=clm_blocks(8, 1), eval_dataset=clm_blocks(6, 2))
    elif name == "vlm_trainer":  # the Trainer on TRL's vision collator's batches (pixels beside the tokens)
        from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

        args = transformers.TrainingArguments(
            output_dir=out_dir, max_steps=2, per_device_train_batch_size=2, learning_rate=0.5,
            lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, logging_steps=1, report_to=[],
            disable_tqdm=True, save_strategy="no", use_cpu=True, seed=0, remove_unused_columns=False,
            **engine_args(stage, vlm=name == "vlm_trainer"))
        cls = ringseq.Trainer if ringseq_sp else transformers.Trainer
        kw = dict(train_dataset=dataset("vlm", 8, 1), data_collator=DataCollatorForVisionLanguageModeling(vlm_processor()))
    else:
        import trl

        bf16 = SFT_SCENARIOS[name].get("bf16", False) and dtype != torch.float64
        # compiled under ringseq only: the stock reference's arithmetic is the same, eagerly
        compiled = {"torch_compile": True, "torch_compile_backend": "aot_eager"} \
            if ringseq_sp and SFT_SCENARIOS[name].get("compile") else {}
        engine = engine_args(stage, vlm=SFT_SCENARIOS[name].get("vlm", False))
        if row is not None and row["checkpointing"] == "engine":
            engine["fsdp_config"]["activation_checkpointing"] = True
        args = sft_config(name, out_dir, use_cpu=True, **{"bf16": bf16, **engine, **compiled,
                                                          **matrix_run(model, row)})
        cls = ringseq.SFTTrainer if ringseq_sp else trl.SFTTrainer
        data = SFT_SCENARIOS[name]["data"]
        text = vlm_processor() if SFT_SCENARIOS[name].get("vlm") else tokenizer()
        kw = dict(train_dataset=dataset(data, 16, 1), peft_config=peft_config,
                  processing_class=None if isinstance(model, str) else text)
        if SFT_SCENARIOS[name].get("eval"):
            kw["eval_dataset"] = dataset(data, 6, 2)
    trainer = cls(model=model, args=args, **kw, **({"sp": ringseq_sp} if ringseq_sp else {}))
    start = gathered_trainable(trainer)
    trainer.train()
    if getattr(args, "torch_compile", False):  # it trained the model torch.compile made (Accelerate's dynamo plugin)
        assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule), \
            f"{name}: trained {type(trainer.model_wrapped).__name__}, not a compiled model"
    if kw.get("eval_dataset") is not None:
        trainer.evaluate()  # logs its metrics
    return metrics_of(trainer), start, gathered_trainable(trainer)


def reference(args) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        tiny_llama().save_pretrained(model_dir)
        tokenizer().save_pretrained(model_dir)
        for name in args.scenarios:
            plain = run_scenario(name, dtype=plain_dtype(SFT_SCENARIOS.get(name, {})), out_dir=os.path.join(tmp, name),
                                 model_dir=model_dir)
            exact = run_scenario(name, dtype=torch.float64, out_dir=os.path.join(tmp, name + "64"), model_dir=model_dir)
            results[name] = {"plain": plain, "exact": exact}
            print(f"reference {name}: {plain[0]}", flush=True)
    torch.save(results, args.out)


def metric_tolerance(plain: float, exact: float, half: bool) -> float:
    """How far from the float64 run a logged metric of ringseq's run may be: twice the stock run's
    distance, plus a floor of 32 fp32 roundings of the value (2 bf16 roundings under bf16
    autocast). A logged metric is one number, the mean over a step's tokens of values computed
    through the whole model: the realised rounding errors of two equally accurate runs are two
    draws of a sum of many roundings of either sign, so twice one of them alone is not a bound
    (in fp32, ring vs SDPA differed by up to ~15 roundings on a first step here, before any update;
    under bf16 the per-token values carry a bf16 rounding each). A lost rank, a wrong token count
    or a wrong normalisation moves these metrics by percents."""
    dtype = torch.bfloat16 if half else torch.float32
    roundings = 2 if half else 32
    return 2 * abs(plain - exact) + roundings * torch.finfo(dtype).eps / 2 * max(abs(exact), 1.0)


def check(name: str, got, ref, rank: int) -> None:
    from ringseq.testing import assert_updates_close

    metrics, start, end = got
    (plain_metrics, plain_start, plain_end), (exact_metrics, _, exact_end) = ref["plain"], ref["exact"]
    where = f"rank {rank}: {name}"
    assert [sorted(m) for m in metrics] == [sorted(m) for m in plain_metrics], \
        f"{where}: logged {metrics} but the stock run logged {plain_metrics}"
    for step, (m, p, e) in enumerate(zip(metrics, plain_metrics, exact_metrics)):
        for key in m:
            if key.endswith("num_tokens"):
                assert m[key] == p[key], f"{where}: step {step} {key} {m[key]} != {p[key]}"
                continue
            spec = SFT_SCENARIOS.get(name, {})
            tol = metric_tolerance(p[key], e[key], spec.get("bf16", False) or "model_dtype" in spec)
            assert abs(m[key] - e[key]) <= tol, (f"{where}: step {step} {key} {m[key]!r} vs float64 {e[key]!r} "
                                                 f"(stock fp32 {p[key]!r}): off by {abs(m[key] - e[key]):.2e} > {tol:.2e}")
    assert start.keys() == plain_start.keys() and all(torch.equal(start[k].to(plain_start[k].dtype), plain_start[k])
                                                      for k in start), \
        f"{where}: the trainable parameters started elsewhere than in the stock run"
    assert_updates_close(end, plain_end, exact_end, start, f"{where}: parameter updates", plain_start=plain_start)


def ringseq_run(args) -> None:
    import torch.distributed as dist

    import ringseq
    from ringseq.testing import _Clean

    sp = ringseq.init(sp_size=int(os.environ.get("WORLD_SIZE", "1")))
    refs = torch.load(args.reference, weights_only=False)
    rank = dist.get_rank()
    folder = [tempfile.mkdtemp(prefix="ringseq-clients-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    model_dir = os.path.join(folder[0], "model")
    if rank == 0:
        tiny_llama().save_pretrained(model_dir)
        tokenizer().save_pretrained(model_dir)
    dist.barrier()
    for item in args.scenarios:  # NAME, NAME@STAGE (a DeepSpeed ZeRO stage for this scenario), NAME@fsdp, matrix:ROW
        name, stage, row = matrix.scenario(item)
        clean = _Clean()  # the engine a scenario's arguments chose (Accelerate's state, its environment) ends with it
        got = run_scenario(name, ringseq_sp=sp, out_dir=os.path.join(folder[0], item.replace(":", "_")), model_dir=model_dir,
                           stage=stage or args.stage, row=row, dtype=torch.bfloat16 if row and row["precision"] == "bf16"
                           else torch.float32)
        clean.restore()
        check(name, got, refs[name], rank)
        print(f"rank {rank}: {item} ok: {got[0][-1]}", flush=True)
        dist.barrier()
    if rank == 0:
        shutil.rmtree(folder[0], ignore_errors=True)
    dist.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["reference", "ringseq"])
    parser.add_argument("scenarios", nargs="+")
    parser.add_argument("--out")
    parser.add_argument("--reference")
    parser.add_argument("--stage", type=int, default=None, help="DeepSpeed ZeRO stage (ringseq mode)")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    reference(args) if args.mode == "reference" else ringseq_run(args)


if __name__ == "__main__":
    from ringseq.processes import exit_now

    main()
    exit_now(0)  # no interpreter teardown (see exit_now)
