"""What ringseq hands a model's layers (``ShardedBatch``, a decode step's ``DecodeStep``) comes through
every walker an engine runs over a forward's inputs as itself: FSDP2's and FSDP1's input cast, DDP's device
move, Accelerate's ``send_to_device``, DeepSpeed's input walks, pytree, copies; and dynamo reads its key as
a graph input (a new batch is no recompile)."""
import copy
import functools

import pytest
import torch

from ringseq.attention.compiled import batch_of
from ringseq.attention.masks import TokenInfo
from ringseq.batch import ShardedBatch
from ringseq.patches.cache import DecodeStep


def _batch(**changes):
    info = TokenInfo(doc=torch.zeros(1, 8, dtype=torch.int32), valid=torch.ones(1, 8, dtype=torch.bool))
    fields = dict(sp=None, length=8, pad=0, info=info, count=torch.tensor(7), labels=torch.ones(1, 4, dtype=torch.long),
                  attention_mask=torch.ones(1, 4), head_groups=None)
    return ShardedBatch(**{**fields, **changes})


def _walkers():
    """name -> a function that walks an engine's inputs (args, kwargs) the way that engine does."""
    from accelerate.utils import send_to_device
    from deepspeed.runtime.zero.utils import apply_to_tensors_only
    from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
    from torch.distributed.utils import _apply_to_tensors, _recursive_to
    from torch.utils import _pytree

    cast = functools.partial(_cast_fp_tensor, torch.bfloat16)
    return {
        "fsdp input cast": lambda kw: _apply_to_tensors(cast, kw),  # FSDP2's and FSDP1's MixedPrecision
        "ddp device move": lambda kw: _recursive_to(kw, torch.device("meta"), False)[0],
        "accelerate send_to_device": lambda kw: send_to_device(kw, "cpu"),
        "deepspeed zero-3 hooks": lambda kw: apply_to_tensors_only(lambda t: t.clone(), dict(kw)),
        "pytree": lambda kw: _pytree.tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, kw),
        "deepcopy": copy.deepcopy,
        "copy": lambda kw: {k: copy.copy(v) for k, v in kw.items()},
    }


@pytest.mark.parametrize("name", sorted(_walkers()))
def test_every_engine_walker_hands_the_batch_on_as_itself(name):
    batch = _batch()
    step = DecodeStep(sp=None, cache=None, q_pos=torch.arange(3))
    kwargs = {"hidden_states": torch.ones(2, 3), "ringseq": batch, "step": step}
    out = _walkers()[name](kwargs)
    assert out["ringseq"] is batch and out["step"] is step, name
    assert batch_of(int(batch.key)) is batch and batch_of(int(step.key)) is step


def test_the_batch_is_immutable_and_replace_makes_a_new_one():
    batch = _batch()
    with pytest.raises(AttributeError, match="immutable"):
        batch.length = 3
    other = batch.replace(labels=None)
    assert other is not batch and other.labels is None and other.length == batch.length
    assert int(other.key) != int(batch.key) and batch_of(int(other.key)) is other
    assert batch.in_checkpoint.checkpointed and batch.in_checkpoint.in_checkpoint is batch.in_checkpoint
    with pytest.raises(TypeError, match="unknown fields"):
        ShardedBatch(sp=None, length=1, pad=0, info=TokenInfo(), colour="red")
    assert "ShardedBatch(" in repr(batch) and "labels=<torch.int64 (1, 4)>" in repr(batch)


def test_dynamo_reads_the_key_and_compiles_once_for_every_batch():
    """A compiled function that reads what a layer reads of the batch: its key (a graph input) and its
    flags. A new batch of the same shape runs the same graph."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def layer(x, ringseq):
        return x * 2 + ringseq.key + (1 if ringseq.checkpointed else 0)

    x = torch.ones(3)
    for _ in range(3):
        batch = _batch()
        assert torch.equal(layer(x, ringseq=batch), x * 2 + batch.key)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for batches of one shape"
