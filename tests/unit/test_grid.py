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
