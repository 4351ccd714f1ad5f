"""One gradient rule under every engine a PyTorch user wraps a patched model in (cases_engines.py):
DDP over the world and over the data ranks, FSDP2 per layer and root on the default mesh and on
``sp.meshes["fsdp"]``, HSDP, FSDP1 and a raw loop's average, at world 4 (dp 2 x sp 2): gradients,
clip_grad_norm_ and the SGD step against the unpatched model. Precisions, compile and checkpointing under
these engines (one sequence group): test_matrix.py. DeepSpeed's ZeRO 0-3: tests/integration/test_deepspeed.py."""
import pytest

from . import cases_engines


# 2 replicas x a sequence group of 2, in fp32: each engine's average over replicas and sequence ranks. One sequence
# group, precisions, compile and checkpointing: the GPU user's matrix (test_matrix.py), which has no FSDP1: its
# bf16 autocast here
@pytest.mark.parametrize("kind", ["raw", "ddp", "ddp_data", "fsdp2", "fsdp2_mesh", "fsdp1"])
def test_a_wrapped_model_trains_as_the_unpatched_one(pool2, pool4, kind):
    pool4.run(cases_engines.step, kind, False)
    if kind == "fsdp1":
        pool2.run(cases_engines.step, kind, True)


def test_hsdp_over_a_users_mesh(pool4):
    """ringseq.init(mesh=) with pure replicas (dp_replicate 2) and a sequence group of 2; FSDP2 as
    HSDP over sp.meshes["fsdp"] = (dp_replicate, dp_shard_cp): its norm and step (HSDP's precisions, compile and
    checkpointing: test_matrix.py)."""
    pool4.run(cases_engines.step, "hsdp", False)


@pytest.mark.parametrize("case", ["ddp_hook", "fsdp2_divide", "fsdp2_layers_only", "fsdp2_data_mesh"])
def test_a_reduction_ringseq_cannot_make_exact_is_refused(pool2, pool4, case):
    pool2.run(cases_engines.refused, case)
    pool4.run(cases_engines.refused, case)


def test_ddp_over_part_of_a_sequence_group_is_refused(pool4):
    pool4.run(cases_engines.refused, "ddp_half_group")


def test_compiled_layers_of_a_hybrid_under_fsdp2(pool2):
    """Every decoder layer of a hybrid compiled (fullgraph, the ring op and the recurrent op: docs/compile.md),
    then wrapped (torchtitan's order), under bf16 autocast: the same gradients, norm and step as eager, the
    recurrent op's convolution and decay parameters sharded by FSDP2 (a dense model's compiled layers under every
    engine: test_matrix.py)."""
    pool2.run(cases_engines.step, "fsdp2_mesh", True, True, "qwen3_5")
