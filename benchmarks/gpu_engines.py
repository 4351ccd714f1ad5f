"""The GPU check's engine rows (``gpu_check.py`` (7) and (8)): FSDP2 in bf16 mixed precision as GPU users train.

(7) ``fsdp2_bf16``: a patched tiny Llama under FSDP2 ``fully_shard`` per decoder layer and on the root with
    torchtitan's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (its default input cast), eager
    and with every decoder layer compiled before sharding (inductor on CUDA, aot_eager on the CPU): two SGD steps
    against the unpatched model's in the same arithmetic (bf16 weights in the forward, fp32 master weights) and
    in float64, by the 2x rule on what the steps changed. One process (the CPU too: gloo).
(8) ``entry_bf16``: each entry point with its own ``bf16=True`` under FSDP2, eagerly and with
    ``torch_compile=True`` (torchtitan's default stack): ``ringseq.Trainer``, ``ringseq.prepare_accelerator`` (an
    Accelerate loop), ``ringseq.SFTTrainer``, ``ringseq.GRPOTrainer``, each against the same client without
    ringseq run the same way (same engine, same precision, same data, one process), and both against the same
    client in float64 without bf16, by the 2x rule on what the steps changed (GRPO: the completions equal too).
    Accelerate takes FSDP in one process on a GPU only: on the CPU the row is skipped (tests/integration/
    test_matrix.py runs these configurations at 2 CPU processes); without TRL its rows are skipped.
"""
from __future__ import annotations

import contextlib
import copy
import tempfile

import torch

import ringseq
from ringseq import tolerance

BF16 = torch.bfloat16
LR = 0.5
FSDP2 = {"fsdp": True, "fsdp_config": {"version": 2}}
"""The clients' engine in (8): Accelerate's FSDP2."""


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, use_cache=False, attn_implementation="sdpa", pad_token_id=0,
                       eos_token_id=1, bos_token_id=None)


def _base():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config())


def _rows(S: int, n: int):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(2, 64, (n, S), generator=g)]


def _moved(params: dict, start: dict) -> dict:
    return {n: params[n].detach().double().cpu() - start[n].double() for n in start}


def _full(model) -> dict:
    return {n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""):
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
            for n, p in model.named_parameters()}


def _hand_steps(base, data, device, weights, master):
    """SGD steps (lr ``LR``) of the unpatched model: forward and backward with its weights in ``weights``, each
    step applied to master weights in ``master``. Returns the master weights after them."""
    model = copy.deepcopy(base).to(device, master)
    for sample in data:
        run = copy.deepcopy(model).to(weights)
        run(input_ids=sample["input_ids"][None].to(device), labels=sample["labels"][None].to(device)).loss.backward()
        grads = dict(run.named_parameters())
        with torch.no_grad():
            for n, p in model.named_parameters():
                p -= LR * grads[n].grad.to(master)
    return _full(model)


def check_fsdp2_bf16(args, rows, record, world_of_one):
    """(7) FSDP2 with torchtitan's bf16 policy, eager and with compiled layers, in one process."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    sp = world_of_one()
    S = 1024 if args.device == "cuda" else 64
    base, data = _base(), _rows(S, 2)
    start = {n: p.detach() for n, p in base.named_parameters()}
    plain = _moved(_hand_steps(base, data, args.device, BF16, torch.float32), start)
    exact = _moved(_hand_steps(base, data, args.device, torch.float64, torch.float64), start)
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    for compiled in (False, True):
        row = dict(check="fsdp2_bf16", model="tiny llama", S=S, device=args.device, compiled_layers=compiled)
        if not args.time_left():
            record(rows, **row, ok=True, skipped="out of time (--budget-s)")
            continue
        try:
            torch._dynamo.reset()
            model = ringseq.patch(copy.deepcopy(base).to(args.device), sp=sp)
            if compiled:
                for layer in model.model.layers:
                    layer.compile(**({} if args.device == "cuda" else {"backend": "aot_eager"}))
            for layer in model.model.layers:
                fully_shard(layer, mesh=sp.meshes["fsdp"], mp_policy=policy)
            fully_shard(model, mesh=sp.meshes["fsdp"], mp_policy=policy)
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            for sample in data:
                optimizer.zero_grad()
                model(**{k: v[None].to(args.device) for k, v in sample.items()}).loss.backward()
                optimizer.step()
            failed = [str(v) for v in tolerance.by_layer(_moved(_full(model), start), plain, exact) if not v.ok]
            assert not failed, "; ".join(failed)
            record(rows, **row, ok=True, steps=len(data))
        except Exception as exc:
            record(rows, **row, ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")


# ---------------------------------------------------------------- (8) the entry points
def _trainer(patched: bool, sp, base, data, out: str, device: str, dtype, bf16: bool, compiled: bool):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=1, max_steps=len(data), learning_rate=LR,
                             lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, max_grad_norm=0.0,
                             report_to=[], save_strategy="no", disable_tqdm=True, bf16=bf16, **FSDP2,
                             **_compiling(compiled))
    model = copy.deepcopy(base).to(device, dtype)
    cls = ringseq.Trainer if patched else Trainer
    trainer = cls(model=model, args=args, train_dataset=data, **({"sp": sp} if patched else {}))
    trainer.train()
    return _full(trainer.accelerator.unwrap_model(trainer.model_wrapped, keep_torch_compile=False))


def _accelerate(patched: bool, sp, base, data, out: str, device: str, dtype, bf16: bool, compiled: bool):
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, TorchDynamoPlugin

    kwargs = dict(mixed_precision="bf16" if bf16 else "no")
    if FSDP2:
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                               transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    if compiled:
        kwargs["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor" if device == "cuda" else "aot_eager")
    accelerator = ringseq.prepare_accelerator(sp=sp, **kwargs) if patched else Accelerator(**kwargs)
    model = copy.deepcopy(base).to(device, dtype)
    if patched:
        model = ringseq.patch(model, sp=sp)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    for sample in data:
        optimizer.zero_grad()
        accelerator.backward(model(**{k: v[None].to(accelerator.device) for k, v in sample.items()}).loss)
        optimizer.step()
    return _full(accelerator.unwrap_model(model, keep_torch_compile=False))


def _sft(patched: bool, sp, base, data, out: str, device: str, dtype, bf16: bool, compiled: bool):
    import trl
    from datasets import Dataset

    args = trl.SFTConfig(output_dir=out, per_device_train_batch_size=1, max_steps=len(data), learning_rate=LR,
                         lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, max_grad_norm=0.0, report_to=[],
                         save_strategy="no", disable_tqdm=True, bf16=bf16, gradient_checkpointing=False,
                         max_length=None, **FSDP2, **_compiling(compiled))
    rows = Dataset.from_list([{"input_ids": r["input_ids"].tolist()} for r in data])
    cls = ringseq.SFTTrainer if patched else trl.SFTTrainer
    trainer = cls(model=copy.deepcopy(base).to(device, dtype), args=args, train_dataset=rows,
                  processing_class=_tokenizer(), **({"sp": sp} if patched else {}))
    trainer.train()
    return _full(trainer.accelerator.unwrap_model(trainer.model_wrapped, keep_torch_compile=False))


def _grpo(patched: bool, sp, base, data, out: str, device: str, dtype, bf16: bool, compiled: bool):
    import trl
    from datasets import Dataset

    args = trl.GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                          max_steps=1, learning_rate=LR, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0,
                          max_grad_norm=0.0, report_to=[], save_strategy="no", disable_tqdm=True, seed=0, bf16=bf16,
                          gradient_checkpointing=False, **FSDP2, **_compiling(compiled))
    words = _tokenizer()
    prompts = Dataset.from_list([{"prompt": words.decode(r["input_ids"][:48].tolist())} for r in data] * 2)
    cls = ringseq.GRPOTrainer if patched else trl.GRPOTrainer
    seen = []

    def reward(completions, **kwargs):
        seen.append(list(completions))
        return [len(c) / 10 + ("w3" in c) for c in completions]

    trainer = cls(model=copy.deepcopy(base).to(device, dtype), args=args, train_dataset=prompts, reward_funcs=reward,
                  processing_class=words, **({"sp": sp} if patched else {}))
    trainer.train()
    return _full(trainer.accelerator.unwrap_model(trainer.model_wrapped, keep_torch_compile=False)), seen


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>"] + [f"w{i}" for i in range(2, 64)])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _compiling(compiled: bool) -> dict:
    return {"torch_compile": True} if compiled else {}


ENTRIES = {"trainer": _trainer, "accelerate": _accelerate, "sft": _sft, "grpo": _grpo}


def check_entries_bf16(args, rows, record, world_of_one):
    """(8) every entry point with bf16=True under FSDP2, eager and compiled, against the client without ringseq."""
    for entry, run in ENTRIES.items():
        for compiled in (False, True):
            row = dict(check="entry_bf16", entry=entry, model="tiny llama", device=args.device, compiled=compiled)
            if args.device != "cuda":
                record(rows, **row, ok=True, skipped="Accelerate takes FSDP in one process on a GPU only; "
                                                     "tests/integration/test_matrix.py runs it at 2 CPU processes")
                continue
            if entry in ("sft", "grpo") and not _has_trl():
                record(rows, **row, ok=True, skipped="trl is not installed")
                continue
            if not args.time_left():
                record(rows, **row, ok=True, skipped="out of time (--budget-s)")
                continue
            try:
                record(rows, **row, **_entry_row(run, entry, compiled, args.device, world_of_one))
            except Exception as exc:
                record(rows, **row, ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")


def _entry_row(run, entry: str, compiled: bool, device: str, world_of_one) -> dict:
    sp = world_of_one()
    S = 512
    base, data = _base(), _rows(S, 2)
    start = {n: p.detach() for n, p in base.named_parameters()}
    results = {}
    for name, patched, dtype, bf16 in (("ringseq", True, torch.float32, True), ("stock", False, torch.float32, True),
                                       ("float64", False, torch.float64, False)):
        torch._dynamo.reset()
        with tempfile.TemporaryDirectory() as out, _fresh_accelerate():
            results[name] = run(patched, sp, base, data, out, device, dtype, bf16, compiled and name != "float64")
    if entry == "grpo":  # the same completions (one sequence group samples as one process), then the updates
        assert results["ringseq"][1] == results["stock"][1], "ringseq's completions differ from stock TRL's"
        results = {k: v[0] for k, v in results.items()}
    moved = [_moved(results[k], start) for k in ("ringseq", "stock", "float64")]
    failed = [str(v) for v in tolerance.by_layer(*moved) if not v.ok]
    assert not failed, "; ".join(failed)
    return {"ok": True, "S": S}


@contextlib.contextmanager
def _fresh_accelerate():
    """Each run makes its own Accelerator: Accelerate's shared state (and the environment the clients set for
    it) is put back after it."""
    import os

    env = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _has_trl() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True
