"""The ring's hop buffers (``ringseq.attention.comm``): one flat buffer per hop holding every tensor
of a block and its status, two preallocated receive buffers per kind of transfer used in turn, so
no step allocates and a block is never overwritten while in use; views of a buffer are the block's
tensors in the ring's layout."""
import torch

from ringseq.attention.comm import Block, RingComm, first_parts


def test_two_receive_buffers_per_kind_used_in_turn():
    comm = RingComm(None, (0, 1, 2, 3), 0, None, "test", None, "cpu")
    got = [comm.buffer("kv", 13, torch.bfloat16) for _ in range(5)]
    assert got[0] is got[2] is got[4] and got[1] is got[3] and got[0] is not got[1]
    assert all(b.numel() == 13 and b.dtype == torch.bfloat16 for b in got)
    grads = comm.buffer("dkv", 13, torch.float32)  # same size, another kind: its own buffers
    assert grads is not got[0] and grads is not got[1] and grads.dtype == torch.float32
    assert comm.buffer("kv", 17, torch.bfloat16).numel() == 17  # a new size: new buffers


def test_a_block_is_views_of_one_buffer_in_the_rings_layout():
    k = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 4, 3, 5).transpose(1, 2)  # [B, K, s, D] view
    v = -torch.arange(2 * 3 * 4 * 6, dtype=torch.float32).reshape(2, 4, 3, 6).transpose(1, 2)
    parts = first_parts([k, v], k.dtype, failed=False)
    flat = torch.cat([p.reshape(-1) for p in parts])  # what the receiver's one buffer holds
    block = Block(flat, (tuple(k.shape), tuple(v.shape)))
    assert torch.equal(block.views[0], k) and torch.equal(block.views[1], v)
    assert block.views[0].data_ptr() == flat.data_ptr()  # no copy: views of the buffer
    assert block.status.item() == 0 and first_parts([k, v], k.dtype, failed=True)[-1].item() == 1
    assert flat.numel() == Block.numel(block.shapes)
    block.status.fill_(1)  # a rank that failed marks what it sends on
    assert flat[-1].item() == 1 and torch.equal(block.views[0], k)


def test_zeroed_accumulators_add_in_one_pass():
    shapes = ((1, 2, 3, 4), (1, 2, 3, 4))
    own, other = Block.zeros(shapes, torch.float32, "cpu"), Block.zeros(shapes, torch.float32, "cpu")
    other.views[0].fill_(2.0)
    other.status.fill_(1)
    own.flat.add_(other.flat)  # dK, dV and the status in one operation
    assert torch.equal(own.views[0], torch.full((1, 2, 3, 4), 2.0)) and own.status.item() == 1
    assert not own.views[1].any()
