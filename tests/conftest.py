"""The one harness of the distributed tests: warm pools of gloo CPU processes, one per world size
(and one without a process group, for one-process reference scripts), kept for the session.
A test says the world it needs (``pool``: 1, 2 and 4; ``pool1``, ``pool2``, ``pool4``; ``plain``; ``pools(n)``)
and runs functions (``pool.run``) or launched scripts (``pool.run_script``) in it; a case that
fails, hangs or kills a rank gets its pool rebuilt for the next test (``ringseq.testing.DistPool``).
Launcher, process-death and SIGSTOP tests start their own processes (``tests/launched.py``)."""
import os

import pytest

from ringseq.testing import DistPool

# nothing is downloaded in a test; set before any pool starts (huggingface_hub reads them at import)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

_pools = {}


def pool_for(world_size: int, group: bool = True) -> DistPool:
    key = (world_size, group)
    if key not in _pools or not _pools[key].alive:  # a failed case closes its pool
        _pools[key] = DistPool(world_size, timeout=600.0, group=group)
    return _pools[key]


@pytest.fixture(params=[1, 2, 4], ids=lambda w: f"world{w}")
def pool(request):
    """A running pool of 1, 2 or 4 ranks (each test runs at every world size)."""
    return pool_for(request.param)


@pytest.fixture
def pool1():
    return pool_for(1)


@pytest.fixture
def pool2():
    return pool_for(2)


@pytest.fixture
def pool4():
    return pool_for(4)


@pytest.fixture(scope="session")
def pools():
    """``pools(world_size, group=True)``: the pool of that world (for module-scoped fixtures)."""
    return pool_for


@pytest.fixture
def plain():
    """One process without a process group: a plain ``python script`` (the references)."""
    return pool_for(1, group=False)


POOL_FIXTURES = {"pool", "pool1", "pool2", "pool4", "plain", "pools"}


def _own_processes(item) -> bool:
    return "integration" in item.path.parts and not POOL_FIXTURES & set(item.fixturenames)


def pytest_collection_modifyitems(session, config, items):
    """The tests that start their own processes run last, so the pools start once and are closed
    once (stable: the order within each part is the files')."""
    items.sort(key=_own_processes)


def pytest_runtest_setup(item):
    """A test that launches its own processes gets the cores to itself: idle pools keep gloo
    threads polling their sockets (a few % of a core per process)."""
    if _own_processes(item):
        _close_all()


def pytest_sessionfinish(session, exitstatus):
    _close_all()


def _close_all() -> None:
    for p in _pools.values():  # idle between cases: nothing to finish, so no teardown to wait for
        p.close(force=True)
    _pools.clear()
