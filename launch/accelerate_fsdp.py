"""Accelerate's FSDP2 and its context parallelism (``ParallelismConfig(cp_size=N)``) under ringseq.

* **FSDP2 runs as Accelerate runs it.** The gradient rule (``ringseq.gradients``) makes FSDP2's
  own average over ``dp_shard x cp`` exact, so Accelerate's FSDP2 code is used unchanged: its
  auto-wrap per decoder layer, embeddings, head and root; its mixed precision, activation
  checkpointing, ``cpu_ram_efficient_loading`` and state-dict types.
* **On a machine without an accelerator** Accelerate never takes FSDP: its FSDP branch sits under
  its GPU states, so on the CPU it settles as MULTI_CPU, drops the FSDP plugin without a word and
  wraps the model in DDP. Before the Accelerator is made, ``settle_on_cpu`` gives Accelerate's
  shared state the kind it has on GPUs (MULTI_GPU, over ringseq's gloo group, device cpu), so its
  FSDP2 path runs on gloo as it runs on NCCL. This is what the tests run, and what a CPU job gets.
* **cp_size is ringseq's ring.** Accelerate's context parallelism is torch's SDPA ring with a
  causal mask only, attached as hooks that drop the attention mask and shard the batch in place.
  ringseq runs its own ring over the same ``cp`` mesh dimension instead: the sequence group is
  Accelerate's ``cp`` group (checked), FSDP2 shards over Accelerate's ``dp_shard_cp`` as before,
  and torch's context-parallel hooks are never attached (``no_torch_context_parallel``): never two
  rings. ``ringseq.Trainer`` builds ``sp`` from ``TrainingArguments(parallelism_config=...)``.
"""
from __future__ import annotations

import contextlib
import os
import types

import torch
import torch.distributed as dist

from ringseq.errors import RingSeqError


def wants_fsdp(fsdp_plugin=None, parallelism_config=None) -> bool:
    """Whether the Accelerator about to be made is to run FSDP (its plugin, ``accelerate launch
    --use_fsdp``'s variable, or context parallelism, which Accelerate runs under FSDP2 only)."""
    cp = parallelism_config is not None and getattr(parallelism_config, "cp_size", 1) > 1
    return fsdp_plugin is not None or cp or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def _version(fsdp_plugin) -> int | None:
    """The FSDP version asked for: the plugin's (an object, or the Trainer's plugin arguments), else
    ``accelerate launch --fsdp_version``'s variable (Accelerate's default: 1); None without FSDP."""
    if isinstance(fsdp_plugin, dict):
        return int(fsdp_plugin.get("fsdp_version", 1))
    if fsdp_plugin is not None:
        return int(fsdp_plugin.fsdp_version or 1)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return int(os.environ.get("FSDP_VERSION", "1"))
    return None


def settle_on_cpu(fsdp_plugin=None, parallelism_config=None) -> None:
    """On CPU with several processes, before the Accelerator that is to run FSDP is made: Accelerate's
    shared state as on GPUs (see the module docstring)."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    if torch.cuda.is_available() or dist.get_world_size() == 1 or not wants_fsdp(fsdp_plugin, parallelism_config):
        return
    if _version(fsdp_plugin) == 1:
        raise RingSeqError("FSDP version 1 through Accelerate needs a GPU (Accelerate places its units on the "
                           "accelerator device); on the CPU use FSDP2 (fsdp_config={'version': 2}, Accelerate's "
                           "default), or wrap the model in torch's FullyShardedDataParallel yourself")
    state = PartialState(cpu=True) if not PartialState._shared_state else PartialState()
    if state.distributed_type == DistributedType.MULTI_CPU:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def check_context_parallel(accelerator, sp) -> None:
    """Accelerate's ``cp`` dimension must be ringseq's sequence group; its other parallelisms are refused."""
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is None:
        return
    for name, what in (("sp_size", "DeepSpeed's Ulysses (ALST)"), ("tp_size", "tensor parallelism")):
        if getattr(pc, name, 1) > 1:
            raise RingSeqError(f"Accelerate's parallelism_config has {name}={getattr(pc, name)} ({what}); ringseq "
                               f"splits the sequence itself: unset it, and give ringseq's size as cp_size (or sp= / "
                               f"RINGSEQ_SP_SIZE)")
    if pc.cp_size > 1:
        if pc.cp_size != sp.size:
            raise RingSeqError(f"Accelerate's parallelism_config has cp_size={pc.cp_size} but ringseq's sequence "
                               f"group has {sp.size} ranks: give one size (ringseq.Trainer takes it from "
                               f"parallelism_config when sp= is not given)")
        mesh = accelerator.torch_device_mesh
        ranks = sorted(dist.get_process_group_ranks(mesh["cp"].get_group()))
        if ranks != sorted(sp.ranks):
            raise RingSeqError(f"Accelerate's cp group on this rank is {ranks} but ringseq's sequence group is "
                               f"{sorted(sp.ranks)}: build sp from the same mesh, ringseq.init(mesh="
                               f"accelerator.torch_device_mesh)")


def no_torch_context_parallel(accelerator) -> None:
    """Accelerate's ``prepare`` must not attach torch's context-parallel hooks to the model, and
    ``maybe_context_parallel`` must not shard the batch: ringseq's patched model shards it."""
    accelerator._prepare_cp = lambda *args: args

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
        yield

    accelerator.maybe_context_parallel = types.MethodType(maybe_context_parallel, accelerator)
