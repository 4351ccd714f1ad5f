"""The contenders of ``benchmarks/longest.py``: one training step of a Llama (or, with
``--model hybrid``, a Qwen3.5-style hybrid: three gated DeltaNet layers and one attention layer),
unpatched, with ringseq (the switches set by hand, or by ``patch(fit=True)``), or with DeepSpeed ALST as its HF integration and ArcticTraining use it
(each a class with ``forward_backward(N)`` and ``optimizer_step()``, built inside a rank of a
process tree). ALST shards attention layers only; it has no hybrid contender."""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from ringseq.loss import slab_tokens

MODELS = {"bench": dict(vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4),
          "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=2),  # fit_mixed.py --model small
          "tiny": dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4),  # for the suite: the machinery, not figures
          "hybrid": dict(vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, linear_num_key_heads=4,
                         linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                         layer_types=["linear_attention"] * 3 + ["full_attention"])}
MODEL = dict(MODELS[os.environ.get("RINGSEQ_LONGEST_MODEL", "bench")], max_position_embeddings=1 << 20,
             use_cache=False)
DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
             "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}


def build_model():
    """The benchmark's model (a Llama, or the hybrid)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    hybrid = "layer_types" in MODEL
    config = (Qwen3_5TextConfig if hybrid else LlamaConfig)(**MODEL)
    config._attn_implementation = "sdpa"
    return (Qwen3_5ForCausalLM if hybrid else LlamaForCausalLM)(config)


def batch(N: int) -> dict:
    ids = torch.randint(0, MODEL["vocab_size"], (1, N), generator=torch.Generator().manual_seed(N))
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(N)[None]}


# ---- the systems ---------------------------------------------------------------------------------

class Unpatched:
    def __init__(self, P, features):
        self.model = build_model()
        self.model.train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)

    def forward_backward(self, N):
        b = batch(N)
        loss = self.model(input_ids=b["input_ids"], labels=b["labels"]).loss
        loss.backward()
        return loss.item()

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class Ringseq:
    def __init__(self, P, features):
        import ringseq

        sp = ringseq.init(sp_size=P)
        self.sp = sp
        model = build_model()
        if "fit" in features:  # the planner picks every switch for each length, under longest.py's budget
            model.train()
            ringseq.patch(model, sp=sp, fit=True, memory_budget=float(os.environ["RINGSEQ_LONGEST_BUDGET_MB"]) * 2**20)
            self.engine, *_ = ringseq.initialize(sp=sp, model=model, config=DS_CONFIG,
                                                 optimizer=torch.optim.SGD(model.parameters(), lr=1e-4))
            return
        if "ckpt" in features or "replay" in features:
            kwargs = {"offload": True} if "offload" in features else {}
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, **kwargs)
        model.train()
        ringseq.patch(model, sp=sp, chunked_loss="loss" in features, tiled_mlp=True if "tiled" in features else None,
                      keep_ring_outputs="replay" not in features, head_groups="kv" if "groups" in features else None)
        if "fsdp2" in features:  # FSDP2 as torchtitan applies it: every decoder layer, then the root (all ranks)
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            self.model, self.engine = fully_shard(model), None
            self.opt = torch.optim.SGD(model.parameters(), lr=1e-4)
            return
        config = {**DS_CONFIG, "zero_optimization": {"stage": 3 if "zero3" in features else 1}}
        self.engine, *_ = ringseq.initialize(sp=sp, model=model, config=config,
                                             optimizer=torch.optim.SGD(model.parameters(), lr=1e-4))

    def forward_backward(self, N):
        b = batch(N)
        if self.engine is None:
            loss = self.model(input_ids=b["input_ids"], labels=b["labels"]).loss
            loss.backward()
            return loss.item()
        loss = self.engine(input_ids=b["input_ids"], labels=b["labels"]).loss
        self.engine.backward(loss)
        return loss.item()

    def optimizer_step(self):
        if self.engine is None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return
        self.engine.step()

    def fit_report(self) -> dict | None:
        """``ringseq.stats(sp=sp)["fit"]``: the switches fit chose for the last step (None without fit)."""
        import ringseq

        return ringseq.stats(sp=self.sp)["fit"]


class Alst:
    """DeepSpeed ALST as its HF integration and ArcticTraining use it."""

    def __init__(self, P, features):
        import deepspeed
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        deepspeed.init_distributed(dist_backend="gloo")
        model = build_model()
        self.mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=P, micro_batch_size=1,
            seq_length_is_variable=True)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        for layer in model.model.layers:
            layer.mlp.forward = _alst_tiled_mlp(layer.mlp)
        self.engine, *_ = deepspeed.initialize(model=model, config=DS_CONFIG, mpu=self.mpu,
                                               optimizer=torch.optim.SGD(model.parameters(), lr=1e-4))
        self.P = P

    def _shard(self, N):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        loader = torch.utils.data.DataLoader([{k: v[0] for k, v in batch(N).items()}], batch_size=1)
        group = self.mpu.get_sequence_parallel_group()
        adapter = UlyssesSPDataLoaderAdapter(loader, sp_rank=dist.get_rank(group), sp_group=group,
                                             sp_world_size=self.P, device=torch.device("cpu"))
        return next(iter(adapter))  # every rank holds the same sample: the first micro-batch is it

    def optimizer_step(self):
        self.engine.step()

    def forward_backward(self, N):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

        b = self._shard(N)
        model = self.engine.module
        hidden = model.model(input_ids=b["input_ids"], position_ids=b["position_ids"]).last_hidden_state
        labels = b["shift_labels"]
        vocab = MODEL["vocab_size"]

        def loss_sum(m, h, y):
            return torch.nn.functional.cross_entropy(m.lm_head(h).view(-1, vocab).float(), y.view(-1),
                                                     ignore_index=-100, reduction="sum")

        # ArcticTraining sizes tiles at about 1 GiB of logits, which on this budget would be most of it: here
        # its tiles hold as many tokens as ringseq's loss slabs (its best setting at this size, and like with like)
        shards = max(1, math.ceil(labels.numel() / slab_tokens(vocab)))
        local = TiledFusedLogitsLoss.apply(loss_sum, model, hidden, labels, None, shards, [model.lm_head.weight],
                                           "sum")
        group = self.mpu.get_sequence_parallel_group()
        count = (labels != -100).sum().float()
        total = count.clone()
        dist.all_reduce(total, group=group)
        sums = torch.distributed.nn.functional.all_gather(local, group=group)  # differentiable, as ArcticTraining
        loss = torch.stack(sums).sum() / total
        self.engine.backward(loss)
        return loss.item()


def _alst_tiled_mlp(mlp):
    """ALST's tiled MLP forward (its docstring's example): one tile per hidden_size tokens."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    cls_forward = type(mlp).forward

    def forward(x):
        shards = max(1, math.ceil(x.size(-2) / x.size(-1)))
        return TiledMLP.apply(lambda m, t: cls_forward(m, t), mlp, x, shards, list(mlp.parameters()))

    return forward


KINDS = {"unpatched": Unpatched, "ringseq": Ringseq, "alst": Alst}
