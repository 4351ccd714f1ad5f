"""Shared fixtures: pools of gloo CPU processes, one per world size, kept for the session."""
import pytest

from ringseq.testing import DistPool

_pools = {}


def pool_for(world_size: int) -> DistPool:
    if world_size not in _pools or not _pools[world_size].alive:  # a failed test may kill a pool
        _pools[world_size] = DistPool(world_size)
    return _pools[world_size]


@pytest.fixture(params=[1, 2, 4], ids=lambda w: f"world{w}")
def pool(request):
    """A running pool of 1, 2 or 4 ranks (each test runs at every world size)."""
    return pool_for(request.param)


@pytest.fixture
def pool2():
    return pool_for(2)


@pytest.fixture
def pool4():
    return pool_for(4)


POOL_FIXTURES = {"pool", "pool2", "pool4"}


def pytest_runtest_setup(item):
    """An integration test that launches its own processes gets the cores to itself: idle pools
    keep gloo threads polling their sockets (a few % of a core per process)."""
    if "integration" in item.path.parts and not POOL_FIXTURES & set(item.fixturenames):
        for p in _pools.values():
            p.close()
        _pools.clear()


def pytest_sessionfinish(session, exitstatus):
    for p in _pools.values():
        p.close()
    _pools.clear()
