"""The ring's receive buffers (``ringseq.attention.comm``): two preallocated sets per kind of
transfer, used in turn, so no step allocates and a block is never overwritten while in use; one
set where the caller is done with what it received before it posts again (gradient accumulators)."""
import torch

from ringseq.attention.comm import RingComm


def test_two_buffer_sets_per_kind_used_in_turn():
    comm = RingComm(None, (0, 1, 2, 3), 0, None, "test", None, "cpu")
    kv = [torch.zeros(2, 3), torch.zeros(2, 3), comm.status]
    got = [comm._next_buffers("kv", kv) for _ in range(5)]
    assert all(a is b for a, b in zip(got[0], got[2])) and all(a is b for a, b in zip(got[1], got[3]))
    assert all(a is b for a, b in zip(got[0], got[4]))
    assert not any(a is b for a, b in zip(got[0], got[1]))
    grads = [torch.zeros(2, 3), torch.zeros(2, 3), comm.status]  # same shapes, another kind: its own sets
    assert not any(a is b for g in got[:2] for a, b in zip(g, comm._next_buffers("dkv", grads)))
    wider = [torch.zeros(2, 4), torch.zeros(2, 4), comm.status]  # new shapes: new buffers
    assert comm._next_buffers("kv", wider)[0].shape == (2, 4)


def test_one_buffer_set_when_asked():
    comm = RingComm(None, (0, 1), 0, None, "test", None, "cpu")
    grads = [torch.zeros(2, 3), torch.zeros(2, 3), comm.status]
    got = [comm._next_buffers("dkv", grads, 1) for _ in range(3)]
    assert all(a is b for g in got[1:] for a, b in zip(got[0], g))
    assert not any(a is b for a, b in zip(got[0], comm._next_buffers("kv", grads)))
