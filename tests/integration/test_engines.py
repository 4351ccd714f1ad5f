"""One gradient rule under every engine a PyTorch user wraps a patched model in (cases_engines.py):
DDP over the world and over the data ranks, FSDP2 per layer and root on the default mesh and on
``sp.meshes["fsdp"]``, HSDP, FSDP1 and a raw loop's average, at world 2 (sp 2) and world 4 (dp 2 x
sp 2), fp32 and bf16 autocast: gradients, clip_grad_norm_ and the SGD step against the unpatched
model. DeepSpeed's ZeRO 0-3 are tests/integration/test_deepspeed.py's."""
import pytest

from . import cases_engines


@pytest.mark.parametrize("kind", ["raw", "ddp", "ddp_data", "fsdp2", "fsdp2_mesh", "fsdp1"])
def test_a_wrapped_model_trains_as_the_unpatched_one(pool2, pool4, kind):
    for pool in (pool2, pool4):
        for autocast in (False, True):
            pool.run(cases_engines.step, kind, autocast)


def test_hsdp_over_a_users_mesh(pool4):
    """ringseq.init(mesh=) with pure replicas (dp_replicate 2) and a sequence group of 2; FSDP2 as
    HSDP over sp.meshes["fsdp"] = (dp_replicate, dp_shard_cp)."""
    for autocast in (False, True):
        pool4.run(cases_engines.step, "hsdp", autocast)


@pytest.mark.parametrize("case", ["ddp_hook", "fsdp2_divide", "fsdp2_layers_only", "fsdp2_data_mesh"])
def test_a_reduction_ringseq_cannot_make_exact_is_refused(pool2, pool4, case):
    pool2.run(cases_engines.refused, case)
    pool4.run(cases_engines.refused, case)


def test_ddp_over_part_of_a_sequence_group_is_refused(pool4):
    pool4.run(cases_engines.refused, "ddp_half_group")


def test_compiled_layers_under_ddp_and_fsdp2(pool2, pool4):
    """Every decoder layer compiled (fullgraph, the ring one op: docs/compile.md), then wrapped
    (torchtitan's order for FSDP2): the same gradients, norm and step as eager. DDP over 2 replicas,
    FSDP2 in fp32 over 2 replicas, and a hybrid's (Qwen3.5: the ring op and the recurrent op, whose
    convolution and decay parameters FSDP2 shards) under bf16 autocast over one group."""
    pool4.run(cases_engines.step, "ddp", False, True)
    pool4.run(cases_engines.step, "fsdp2_mesh", False, True)
    pool2.run(cases_engines.step, "fsdp2_mesh", True, True, "qwen3_5")
