"""Ring attention against a float64 single-process reference, at world sizes 1, 2 and 4."""
import pytest

from ringseq import LAYOUTS

from . import cases


@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_reference(pool, layout):
    pool.run(cases.attention_matrix, layout)


def test_head_groups_that_do_not_divide_the_kv_heads_are_refused(pool):
    pool.run(cases.head_group_refusals)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_dims(pool, layout):
    pool.run(cases.head_dims, layout)


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_torch_kernel_matches_reference(pool, layout):
    pool.run(cases.attention_matrix, layout, kernel="torch")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bytes_per_ring_step(pool, layout, dtype):
    pool.run(cases.traffic, layout, dtype)


@pytest.mark.parametrize("case,mix", [("dense", None), ("packed", "prolong64k"), ("packed", "pile")])
def test_little_work_per_ring_step(pool2, pool4, case, mix):
    pool2.run(cases.ops_per_ring_step, case, mix)
    pool4.run(cases.ops_per_ring_step, case, mix)
