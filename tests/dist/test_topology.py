"""Process groups, sharding and refusals, on real gloo process groups."""
import pytest

from ringseq import LAYOUTS

from . import cases


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_gather_roundtrip_and_gradient(pool, layout):
    pool.run(cases.shard_gather_roundtrip, layout)


@pytest.mark.parametrize("sp_size", [1, 2, 4])
def test_groups_on_four_ranks(pool4, sp_size):
    pool4.run(cases.topology, sp_size)


def test_a_device_mesh_in_and_out(pool4):
    pool4.run(cases.mesh_in_and_out)


def test_sp_size_not_dividing_world_names_the_equation(pool4):
    pool4.run(cases.refuses, 3, 1, r"world 4 is not data N x ring 3 x ulysses 1 for any whole N")


def test_ulysses_not_dividing_sp_size(pool4):
    pool4.run(cases.refuses, 4, 3, "ulysses_size 3 must divide sp_size 4")


def test_bad_shapes_are_refused(pool):
    pool.run(cases.refuses_bad_shapes)


def test_groups_follow_nodes_that_interleave_the_ranks(pool4):
    """A launcher that numbers the ranks of two nodes alternately (node of rank r: r % 2): the
    Ulysses groups stay on a node, the sequence group's ranks are not in ascending order, and every
    collective still reads the ranks in sequence order (group rank == sp.rank): a Ulysses x ring
    attention and a hybrid layer's state passing are exact."""
    pool4.run(cases.interleaved_nodes)
