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
