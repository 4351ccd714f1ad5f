"""ringseq's rank grid is DeepSpeed's ProcessTopology(["data", "ring", "ulysses"]), without
importing DeepSpeed in the core: same sequence groups, same axis groups, for every shape."""
import pytest

from ringseq.topology import axis_lists, grid, sequence_lists

SHAPES = [(w, sp, u) for w in (1, 2, 4, 6, 8, 12, 16) for sp in range(1, w + 1) if w % sp == 0
          for u in range(1, sp + 1) if sp % u == 0]


@pytest.mark.parametrize("world,sp,uly", SHAPES)
def test_grid_matches_deepspeed_process_topology(world, sp, uly):
    from deepspeed.runtime.pipe.topology import ProcessTopology

    topo = ProcessTopology(axes=["data", "ring", "ulysses"], dims=[world // sp, sp // uly, uly])
    ranks = grid(world, sp, uly)
    assert sequence_lists(ranks) == [topo.filter_match(data=d) for d in range(world // sp)]
    for axis in ("data", "ring", "ulysses"):
        theirs = topo.get_axis_comm_lists(axis)  # DeepSpeed lists nothing for an axis of size 1
        assert axis_lists(ranks, axis) == (theirs or [[r] for r in range(world)]), axis
    for r in range(world):
        assert [int(c) for c in (ranks == r).nonzero()[0]] == list(topo.get_coord(r))


@pytest.mark.parametrize("nodes,sp,uly,groups,ulysses", [
    # torchrun's order: node 0 holds ranks 0-3, node 1 ranks 4-7; Ulysses on a node, the ring across
    (["a"] * 4 + ["b"] * 4, 8, 2, [[0, 1, 2, 3, 4, 5, 6, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]]),
    # two replicas of sequence groups that each fit in a node: never split across nodes
    (["a"] * 4 + ["b"] * 4, 4, 2, [[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]]),
    # a launcher that interleaves the nodes' ranks: the grid follows the nodes, not the rank numbers
    (["a", "b"] * 4, 4, 2, [[0, 2, 4, 6], [1, 3, 5, 7]], [[0, 2], [4, 6], [1, 3], [5, 7]]),
])
def test_placement_keeps_ulysses_and_sequence_groups_on_a_node(nodes, sp, uly, groups, ulysses):
    ranks = grid(len(nodes), sp, uly, nodes)
    assert sequence_lists(ranks) == groups
    assert axis_lists(ranks, "ulysses") == ulysses


def test_a_ulysses_group_that_cannot_fit_a_node_is_refused():
    from ringseq import RingSeqError

    with pytest.raises(RingSeqError, match=r"would span nodes .* divides the 2 ranks per node"):
        grid(8, 8, 4, ["a"] * 2 + ["b"] * 2 + ["c"] * 2 + ["d"] * 2)
