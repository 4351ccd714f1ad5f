"""TRL's GRPO with ringseq against one-process TRL on the same prompts.

    grpo_step.py reference --out ref.pt SCENARIO...    one process, no ringseq: the stock
                                                        trl.GRPOTrainer in fp32 ("plain") and
                                                        float64 ("exact")
    grpo_step.py ringseq --reference ref.pt SCENARIO... under a launcher: ringseq.GRPOTrainer with
                                                        sp = world size (one sequence group)

Data-parallel replicas: ``reference`` under ``accelerate launch`` runs TRL's own data
parallelism (ref.pt.replicaR per process) and ``ringseq --sp-size 2 --reference
'ref.pt.replica{replica}'`` on twice the processes checks each replica against TRL's process.

Each scenario trains a tiny Llama two optimizer steps (two micro-batches each) on prompts of 24-72
words, with a reward for naming two words; ``vlm``: a tiny LLaVA (its processor made in code) on
conversational prompts with two pictures each. Every rank checks, per scenario: the prompts and
completions of every generation equal the plain run's token for token (same seed: a sequence
group acts as one TRL process); every per-token log-prob and entropy TRL computed (old policy,
reference, policy) by the 2x rule against the float64 run; the logged metrics (rewards and
completion lengths equal, loss / kl / entropy / clip ratios / grad norm within
``client_step.metric_tolerance``); what the steps changed in the trainable parameters by the
2x rule (``ringseq.testing.assert_updates_close``).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client_step import engine_args, gathered_trainable, metric_tolerance  # noqa: E402
import matrix  # noqa: E402
from clients_common import WORDS, lora, matrix_run, plain_dtype, tiny_llama, tokenizer  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

# the settings of each scenario beside the common ones (model_id: TRL loads the policy, and the
# reference model of beta > 0, from a saved model; peft: LoRA, whose reference is the adapter off)
SCENARIOS = {
    "grpo": dict(loss_type="grpo", eval=True),
    "bnpo_ref": dict(loss_type="bnpo", beta=0.1, model_id=True),
    # ringseq's run with torch_compile=True (aot_eager): compiled checkpointed layers, generation eager
    "dr_grpo": dict(loss_type="dr_grpo", gradient_checkpointing=True, reward_model=True, compile=True),
    "dapo_iterations": dict(loss_type="dapo", num_iterations=2, beta=0.05, model_id=True),
    "peft": dict(loss_type="grpo", beta=0.05, peft=True),
    "bf16": dict(loss_type="dapo", bf16=True),
    # a LLaVA on conversational prompts with two pictures each (TRL's multimodal GRPO: its processor, its
    # image fields through generate and the fused LM head)
    "vlm": dict(loss_type="grpo", vlm=True),
    # the references of the GPU user's matrix (matrix.reference_of): stock TRL in a row's arithmetic, one step of
    # one group (a row checks the configuration, the scenarios above check GRPO)
    **{f"matrix_{name}": dict(loss_type="grpo", max_steps=1, gradient_accumulation_steps=1, max_completion_length=8,
                              **arithmetic)
       for name, arithmetic in (("fp32", {}), ("autocast", {"bf16": True}), ("bf16", {"model_dtype": "bf16"}),
                                ("bf16_autocast", {"bf16": True, "model_dtype": "bf16"}))},
}
EQUAL = ("reward", "reward_std", "rewards/", "frac_reward_zero_std", "completions/", "num_tokens")
CLOSE = ("loss", "kl", "entropy", "clip_ratio/region_mean", "grad_norm")


CALLS = [0]  # how many times this process computed rewards


def compared(key: str) -> bool:
    return key.removeprefix("eval_").startswith(EQUAL + CLOSE)


def reward_two_words(completions, **kwargs):
    """Reward for naming w3 and w5, with a little for length (so a group's rewards differ); a
    conversational completion is scored by its text."""
    CALLS[0] += 1
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [("w3" in c.split()) + ("w5" in c.split()) + 0.05 * len(c.split()) for c in texts]


def reward_model():
    """A tiny Llama scoring sequences (fp32 in every run: its rewards are data, like the function's)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=len(WORDS) + 5, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0)
    return LlamaForSequenceClassification(config)


def prompts(n: int, seed: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        count = int(torch.randint(24, 72, (1,), generator=g))
        rows.append({"prompt": " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (count,), generator=g))})
    return Dataset.from_list(rows)


def image_prompts(n: int, seed: int):
    """Conversational prompts of 8-24 words after two 8 x 8 pictures (TRL's vision datasets:
    ``prompt`` messages and ``images``)."""
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    from clients_common import _words

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        pictures = [Image.fromarray(np.asarray(torch.randint(0, 256, (8, 8, 3), generator=g, dtype=torch.uint8)))
                    for _ in range(2)]
        content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": _words(g, 8, 24)}]
        rows.append({"prompt": [{"role": "user", "content": content}], "images": pictures})
    return Dataset.from_list(rows)


def recording(base):
    """``base`` (a GRPO trainer class) keeping what a check needs: every generation's prompt and
    completion ids, every per-token log-prob / entropy pass, in call order."""

    class Recorded(base):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            self.seen.append(("tokens", torch.cat([out["prompt_ids"], out["completion_ids"]], 1).cpu()))
            return out

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            self.seen.append(("logps", logps.detach().cpu()))
            if entropies is not None:
                self.seen.append(("entropy", entropies.detach().cpu()))
            return logps, entropies, aux

    Recorded.seen = None
    return Recorded


def run_scenario(name: str, *, sp=None, dtype=torch.float32, out_dir: str, model_dir: str, stage=None, row=None):
    """Two optimizer steps; returns (what was seen, logged metrics, start, end trainable params,
    reward calls). ``row``: a row of the GPU user's matrix (matrix.py) beside the scenario (its reference's)."""
    import trl

    import ringseq

    spec = SCENARIOS[name]
    settings = {k: v for k, v in spec.items()
                if k not in ("model_id", "peft", "eval", "reward_model", "vlm", "compile", "model_dtype")}
    if sp is not None and spec.get("compile"):  # the stock reference runs eagerly: the same arithmetic
        settings.update(torch_compile=True, torch_compile_backend="aot_eager")
    bf16 = settings.pop("bf16", False) and dtype != torch.float64
    if spec.get("model_id"):
        model = model_dir
    elif spec.get("vlm"):
        from clients_common import tiny_vlm

        model = tiny_vlm(dtype)
    else:
        model = tiny_llama(dtype)
    engine = engine_args(stage, vlm=spec.get("vlm", False))
    if row is not None:
        if row["checkpointing"] == "engine":
            engine["fsdp_config"]["activation_checkpointing"] = True
        settings.update(matrix_run(model, row))
        bf16 = settings.pop("bf16", bf16)
    args = trl.GRPOConfig(**{
        **dict(output_dir=out_dir, max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
               num_generations=4, max_completion_length=12, temperature=0.9, learning_rate=0.5, optim="sgd",
               lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, report_to=[],
               disable_tqdm=True, save_strategy="no", seed=0, per_device_eval_batch_size=4, use_cpu=True, bf16=bf16,
               model_init_kwargs={"dtype": dtype} if spec.get("model_id") else None),
        **engine, **settings})
    cls = recording(ringseq.GRPOTrainer if sp is not None else trl.GRPOTrainer)
    rewards = dict(reward_funcs=reward_two_words)
    if spec.get("reward_model"):  # a model beside the function: TRL runs it on the prompt + completion texts
        rewards = dict(reward_funcs=[reward_two_words, reward_model()], reward_processing_classes=[None, tokenizer()])
    if spec.get("vlm"):
        from clients_common import vlm_processor

        data, processing = image_prompts(16, 1), vlm_processor()
    else:
        data, processing = prompts(16, 1), tokenizer()
    trainer = cls(model=model, args=args, train_dataset=data, **rewards,
                  eval_dataset=prompts(2, 2) if spec.get("eval") else None,
                  processing_class=processing, peft_config=lora() if spec.get("peft") else None,
                  **({"sp": sp} if sp is not None else {}))
    trainer.seen, CALLS[0] = [], 0
    start = gathered_trainable(trainer)
    trainer.train()
    if args.torch_compile:  # it trained the model torch.compile made (Accelerate's dynamo plugin)
        assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule), \
            f"{name}: trained {type(trainer.model_wrapped).__name__}, not a compiled model"
    if spec.get("eval"):
        trainer.evaluate()  # generates for the eval prompts and logs eval_loss, eval_reward, ...
    logged = [{k: v for k, v in h.items() if compared(k)} for h in trainer.state.log_history
              if "loss" in h or "eval_loss" in h]
    return trainer.seen, logged, start, gathered_trainable(trainer), CALLS[0]


def grpo_config(out_dir: str, **settings):
    import trl

    settings = {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 4, **settings}
    return trl.GRPOConfig(output_dir=out_dir, report_to=[], use_cpu=True, **settings)


def make_trainer(sp, args, model=None, **kwargs):
    import ringseq

    return ringseq.GRPOTrainer(model=tiny_llama() if model is None else model, reward_funcs=reward_two_words,
                               args=args, train_dataset=prompts(4, 1), processing_class=tokenizer(), sp=sp, **kwargs)


def refusals(out_dir: str) -> None:
    """What ringseq.GRPOTrainer refuses in one process, each with the fix."""
    import ringseq
    from ringseq.testing import assert_refused

    sp = ringseq.init(sp_size=1)
    assert_refused(lambda: make_trainer(sp, grpo_config(out_dir, use_vllm=True)), "set use_vllm=False")
    assert_refused(lambda: make_trainer(sp, grpo_config(out_dir, use_liger_kernel=True)), "set use_liger_kernel=False")
    assert_refused(lambda: make_trainer(sp, grpo_config(out_dir), tools=[reward_two_words]), "does not take tools")
    assert_refused(lambda: make_trainer(sp, grpo_config(out_dir), rollout_func=lambda p, t: {}),
            "does not take rollout_func")
    print("refusals ok", flush=True)


def reference(args) -> None:
    """One process; or, under a launcher, TRL's own data parallelism (one process per replica:
    each process saves what it saw to ``OUT.replicaR``)."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # without a GPU Accelerate finds no backend by itself: DDP over gloo
        from accelerate import PartialState

        PartialState(cpu=True)
    rank = dist.get_rank() if world > 1 else 0
    work = args.out + ".work"
    model_dir = os.path.join(work, "model")
    if rank == 0:
        tiny_llama().save_pretrained(model_dir)
    if world > 1:
        dist.barrier()
    results = {}
    for name in args.scenarios:
        plain = run_scenario(name, dtype=plain_dtype(SCENARIOS[name]), out_dir=os.path.join(work, name),
                             model_dir=model_dir)
        exact = run_scenario(name, dtype=torch.float64, out_dir=os.path.join(work, name + "64"), model_dir=model_dir)
        tokens = [[t for kind, t in run[0] if kind == "tokens"] for run in (plain, exact)]
        assert len(tokens[0]) == len(tokens[1]) and all(map(torch.equal, *tokens)), \
            f"{name}: the float64 run sampled other completions than the fp32 run"
        results[name] = {"plain": plain, "exact": exact}
        print(f"reference {name}: {plain[1][-1]}", flush=True)
    torch.save(results, args.out if world == 1 else f"{args.out}.replica{rank}")
    if world > 1:
        dist.barrier()
    elif args.refusals:
        refusals(work)  # last: it joins a process group of one
    if rank == 0:
        shutil.rmtree(work, ignore_errors=True)


def check(name: str, got, ref, rank: int, group_rank: int) -> None:
    from ringseq.testing import assert_close, assert_updates_close

    seen, logged, start, end, calls = got
    (plain_seen, plain_logged, plain_start, plain_end, plain_calls), (exact_seen, exact_logged, _, exact_end, _) = \
        ref["plain"], ref["exact"]
    where = f"rank {rank}: {name}"
    # rewards once per group, on its rank 0; with a reward model, on every rank (ZeRO-3 needs them all)
    once = plain_calls if group_rank == 0 or SCENARIOS[name].get("reward_model") else 0
    assert calls == once, f"{where}: computed rewards {calls} times, not {once}"
    assert [k for k, _ in seen] == [k for k, _ in plain_seen], f"{where}: {[k for k, _ in seen]} passes"
    for i, ((kind, t), (_, p), (_, e)) in enumerate(zip(seen, plain_seen, exact_seen)):
        if kind == "tokens":
            assert torch.equal(t, p), f"{where}: generation {i}: other prompts or completions than TRL's\n{t}\n{p}"
        else:  # FSDP2's bf16 policy casts the model's outputs to bf16 (output_dtype): the stock values so rounded
            assert_close(t, p.to(t.dtype), e.double(), f"{where}: pass {i} ({kind})")
    assert [sorted(m) for m in logged] == [sorted(m) for m in plain_logged], \
        f"{where}: logged {logged} but the stock run logged {plain_logged}"
    for step, (m, p, e) in enumerate(zip(logged, plain_logged, exact_logged)):
        for key in m:
            if key.removeprefix("eval_").startswith(EQUAL):
                assert m[key] == p[key], f"{where}: step {step} {key} {m[key]} != {p[key]}"
                continue
            spec = SCENARIOS[name]
            tol = metric_tolerance(p[key], e[key], spec.get("bf16", False) or "model_dtype" in spec)
            assert abs(m[key] - e[key]) <= tol, (f"{where}: step {step} {key} {m[key]!r} vs float64 {e[key]!r} (stock "
                                                 f"fp32 {p[key]!r}): off by {abs(m[key] - e[key]):.2e} > {tol:.2e}")
    assert start.keys() == plain_start.keys() and all(torch.equal(start[k].to(plain_start[k].dtype), plain_start[k])
                                                      for k in start), \
        f"{where}: the trainable parameters started elsewhere than in the stock run"
    assert_updates_close(end, plain_end, exact_end, start, f"{where}: parameter updates", plain_start=plain_start)


def ringseq_run(args) -> None:
    import torch.distributed as dist

    import ringseq
    from ringseq.testing import _Clean, assert_refused

    world = int(os.environ.get("WORLD_SIZE", "1"))
    sp = ringseq.init(sp_size=args.sp_size or world)
    # one-process TRL, or (a path with {replica}) TRL's process of this rank's replica
    refs = torch.load(args.reference.format(replica=sp.dp_rank), weights_only=False)
    rank = dist.get_rank()
    folder = [tempfile.mkdtemp(prefix="ringseq-grpo-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    model_dir = os.path.join(folder[0], "model")
    if rank == 0:
        tiny_llama().save_pretrained(model_dir)
    dist.barrier()
    for item in args.scenarios:  # NAME, NAME@STAGE (a DeepSpeed ZeRO stage), NAME@fsdp (FSDP2) or matrix:ROW
        name, stage, row = matrix.scenario(item)
        clean = _Clean()  # the engine a scenario's arguments chose (Accelerate's state, its environment) ends with it
        got = run_scenario(name, sp=sp, out_dir=os.path.join(folder[0], item.replace(":", "_")), model_dir=model_dir,
                           stage=stage or None, row=row,
                           dtype=torch.bfloat16 if row and row["precision"] == "bf16" else torch.float32)
        clean.restore()
        check(name, got, refs[name], rank, sp.rank)
        print(f"rank {rank}: {item} ok: {got[1][-1]}", flush=True)
        dist.barrier()
    # a sequence group is one process: per_device_train_batch_size x replicas completions per step (TRL would
    # count 4, one per process) do not make groups of 4
    settings = dict(per_device_train_batch_size=4 // world, gradient_accumulation_steps=1)
    assert_refused(lambda: make_trainer(sp, grpo_config(folder[0], **settings)),
            "does not split into groups of num_generations=4")
    print(f"rank {rank}: group refusals ok", flush=True)
    if rank == 0:
        shutil.rmtree(folder[0], ignore_errors=True)
    dist.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["reference", "ringseq"])
    parser.add_argument("scenarios", nargs="+")
    parser.add_argument("--out")
    parser.add_argument("--reference")
    parser.add_argument("--sp-size", type=int, default=None, help="ringseq mode: default the world size")
    parser.add_argument("--refusals", action="store_true", help="reference mode: then check the refusals")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    reference(args) if args.mode == "reference" else ringseq_run(args)


if __name__ == "__main__":
    from ringseq.processes import exit_now

    main()
    exit_now(0)  # no interpreter teardown (see exit_now)
