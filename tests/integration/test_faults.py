"""A caught failure on one rank under the engines GPU users train with (cases_faults.py, ringseq.recovery): every
rank raises in that step at once, the next step is the unpatched model's, or an engine that cannot be reset says
so at the next step. World 2 (one sequence group over the world); FSDP2 at world 4 too."""
import pytest

from . import cases_faults

CASES = [  # engine, forward or backward, the module that fails on rank 1
    ("raw", "backward", "model.layers.0.mlp"),
    ("ddp", "forward", "model.layers.0.mlp"),
    ("ddp", "backward", "model.layers.0.mlp"),
    ("ddp", "backward", "model.layers.1.self_attn.q_proj"),
    ("ddp", "backward", "model.embed_tokens"),
    ("fsdp2", "forward", "model.layers.0.mlp"),
    ("fsdp2", "forward", "model.layers.1.self_attn.q_proj"),
    ("fsdp2", "backward", "model.norm"),
    ("fsdp2", "backward", "model.layers.0.self_attn.q_proj"),
    ("fsdp2", "backward", "model.embed_tokens"),
    ("fsdp2_compiled", "forward", "model.layers.0.mlp"),
    ("fsdp2_compiled", "backward", "model.layers.1.mlp"),
    ("fsdp1", "forward", "model.layers.0.mlp"),
    ("zero3", "forward", "model.layers.0.mlp"),
]


@pytest.mark.parametrize("engine,where,target", CASES)
def test_a_caught_failure_fails_every_rank_and_the_next_step_is_exact(pool2, engine, where, target):
    pool2.run(cases_faults.fails_then_goes_on, engine, where, target)


def test_fsdp2_over_four_ranks(pool4):
    pool4.run(cases_faults.fails_then_goes_on, "fsdp2", "backward", "model.layers.1.mlp", 2)


# the engine over two sequence groups (sp 2 at world 4, replicas with batches of their own): the other group's
# ranks raise in the same step too, at the job's next gate or the backward's end (ringseq.replicas)
REPLICAS = [  # engine, forward or backward, the module that fails, on which rank
    ("ddp", "forward", "model.layers.0.mlp", 1),
    ("ddp", "eval", "model.layers.1.mlp", 0),
    ("fsdp2", "eval", "model.layers.1.mlp", 2),
    ("ddp", "backward", "model.layers.1.self_attn.q_proj", 2),
    ("fsdp2", "forward", "model.layers.1.mlp", 3),
    ("fsdp2", "backward", "model.layers.0.mlp", 0),
    ("fsdp2_compiled", "backward", "model.embed_tokens", 1),
    ("zero3", "forward", "model.layers.1.mlp", 2),
]


@pytest.mark.parametrize("engine,where,target,victim", REPLICAS)
def test_over_replicas_every_group_fails_and_goes_on(pool4, engine, where, target, victim):
    pool4.run(cases_faults.fails_then_goes_on, engine, where, target, victim, 2)
