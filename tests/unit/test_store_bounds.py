"""Store calls on an error path are bounded (ringseq.peers._Bounded): a store that does not answer
costs the caller its deadline and no more; a slow one that answers late is used again."""
import threading
import time

import pytest

from ringseq import peers


class SlowStore:
    """A store whose calls take ``delay`` seconds (``event``: block until set, as a frozen host)."""

    def __init__(self, delay=0.0, event=None):
        self.delay, self.event, self.data = delay, event, {}

    def _pause(self):
        if self.event is not None:
            self.event.wait()
        time.sleep(self.delay)

    def set(self, key, value):
        self._pause()
        self.data[key] = value

    def get(self, key):
        self._pause()
        return self.data[key]

    def check(self, keys):
        self._pause()
        return all(k in self.data for k in keys)


def test_a_frozen_store_costs_each_call_its_deadline_only():
    frozen = threading.Event()
    store = peers._Bounded(lambda: SlowStore(event=frozen)).within(0.2)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        store.set("a", b"1")
    with pytest.raises(TimeoutError):  # the earlier call still hangs: this one gives up within its own deadline
        store.check(["a"])
    assert time.monotonic() - start < 0.2 * 2 + 0.3
    frozen.set()


def test_a_call_given_up_on_a_slow_store_does_not_block_the_next():
    store = peers._Bounded(lambda: SlowStore(delay=0.15)).within(0.05)
    with pytest.raises(TimeoutError):
        store.set("a", b"1")  # given up at 0.05 s; the store answers at 0.15 s
    store.within(0.5)
    assert store.check(["a"]) and store.get("a") == b"1"  # waits for the late answer, then goes on


def test_writes_given_up_land_in_order_and_reads_given_up_are_dropped():
    """A rank's notes on a slow store: its 'waiting' note, that note's clearing and its failure
    note are each given up at the caller's deadline, yet all land, in the order written (the last
    word on 'waiting' is the clearing); a read given up is never made."""
    frozen = threading.Event()
    slow = SlowStore(event=frozen)
    reads = []
    slow.check = lambda keys: reads.append(keys) or all(k in slow.data for k in keys)
    store = peers._Bounded(lambda: slow).within(0.05)
    assert not store.post("waiting", "1", 0.05)
    with pytest.raises(TimeoutError):
        store.check(["failed"])
    assert not store.post("waiting", "0", 0.0) and not store.post("failed", "it raised", 0.0)
    frozen.set()
    store.flush(2.0)
    assert slow.data == {"waiting": "0", "failed": "it raised"} and reads == []


def test_the_virtual_rings_stand_in_ranks_leave_no_notes():
    """The virtual ring's ranks share one process and have no timeout: a kernel failure there is
    raised as it is, with no store to write to (gpu_check --device cpu runs such failures)."""
    import types

    from ringseq import lockstep

    stand_in = types.SimpleNamespace(ranks=("virtual", 2, 0), size=2)
    assert not peers.shared(stand_in)
    peers.post_failure(stand_in, "a kernel raised")
    assert "failed on another rank" in lockstep.peer_failed(stand_in, "ring_attention #0")
