"""Patched models of every tested family against the unpatched model on the whole sequence."""
import pytest

from . import cases_batches, cases_memory, cases_parity
from .hf_models import FAMILIES


@pytest.mark.parametrize("family,layout", [(family, layout) for family in FAMILIES for layout in ("zigzag", "contiguous")])
def test_family_matches_unpatched(pool2, pool4, family, layout):
    pool2.run(cases_parity.parity, family, layout)
    if layout == "zigzag":  # world 4 once per family; the contiguous layout at world 4 runs in the packed cases
        pool4.run(cases_parity.parity, family, layout)


@pytest.mark.parametrize("family,kind", [
    ("llama", "packed"), ("llama", "padded"), ("mistral", "packed"), ("mistral", "padded"), ("gemma2", "packed"),
    ("gemma2", "padded"), ("gpt_oss", "packed"), ("gpt_oss", "padded")])
def test_packed_and_padded_batches(pool2, pool4, family, kind):
    pool2.run(cases_parity.parity, family, "zigzag", kind)
    pool4.run(cases_parity.parity, family, "contiguous", kind)


@pytest.mark.parametrize("dtype,family,kind", [
    ("bf16", "llama", "packed"), ("fp16", "gemma2", "plain"), ("fp16", "llama", "packed"),
    ("bf16", "qwen2", "plain"), ("fp16", "qwen2", "plain"), ("bf16", "gemma2", "plain"), ("bf16", "gpt_oss", "padded"),
    ("fp16", "gpt_oss", "padded")])
def test_autocast_matches_unpatched_under_autocast(pool2, family, kind, dtype):
    pool2.run(cases_parity.autocast_parity, family, dtype, kind)


@pytest.mark.parametrize("layout,kind", [("zigzag", "plain"), ("striped", "packed"), ("contiguous", "padded")])
def test_lengths_the_layout_cannot_split_are_padded(pool2, pool4, layout, kind):
    pool2.run(cases_parity.parity, "llama", layout, kind, 16, 3)
    pool4.run(cases_parity.parity, "mistral", layout, kind, 16, 5)


@pytest.mark.parametrize("order", ["patch_then_peft", "peft_then_patch"])
def test_peft_adapters_in_either_order(pool2, pool4, order):
    pool2.run(cases_parity.peft_in_either_order, order)
    pool4.run(cases_parity.peft_in_either_order, order)


def test_unpatch_restores_the_model(pool2):
    pool2.run(cases_parity.unpatch_restores)


def test_unsupported_models_are_refused(pool2):
    pool2.run(cases_parity.refuses_unsupported_models)


@pytest.mark.parametrize("family,tiled_mlp,reentrant,offload,enable_first,keep,head_groups", [
    ("llama", None, False, False, True, True, None), ("gemma2", None, True, False, False, True, None),
    ("llama", 3, False, True, False, True, None),
    ("qwen3", 2, True, False, True, True, None),
    ("llama", None, False, False, False, False, "kv")])
def test_gradient_checkpointing_never_replays_the_ring(pool2, pool4, family, tiled_mlp, reentrant, offload,
                                                       enable_first, keep, head_groups):
    """Checkpointed layers (torch's reentrant and non-reentrant checkpoint, enabled before or after
    patching, transformers' offload option) keep their ring outputs: the backward makes exactly the
    ring posts of the non-checkpointed backward; with tiled MLPs too; exact against the unpatched model.
    keep_ring_outputs=False replays each layer's ring, exactly; patch's head_groups ("kv": one ring
    per kv head) reach the forward, the replay and the backward."""
    args = (family, tiled_mlp, reentrant, offload, enable_first, keep, head_groups)
    pool2.run(cases_memory.gradient_checkpointing, *args)
    if family == "llama" and keep:
        pool4.run(cases_memory.gradient_checkpointing, *args)


def test_tiled_mlp_refuses_what_it_cannot_tile(pool2):
    pool2.run(cases_memory.tiled_mlp_refusals)


def test_manual_path_with_shard_batch(pool2, pool4):
    pool2.run(cases_batches.manual_path)
    pool4.run(cases_batches.manual_path)


def test_chunked_loss_is_exact(pool2):
    pool2.run(cases_memory.chunked_loss_is_exact)


def test_different_batches_in_a_group_are_refused(pool2, pool4):
    pool2.run(cases_batches.different_batches_are_refused)
    pool4.run(cases_batches.different_batches_are_refused)


@pytest.mark.parametrize("case", ["backward", "skipped batch"])
def test_ranks_out_of_step_resync_at_the_next_batch(pool2, case):
    pool2.run(cases_batches.out_of_step_ranks_resync_at_the_next_batch, case)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_a_failure_after_the_last_transfer_reaches_every_rank_in_its_step(pool2, pool4, backward):
    pool2.run(cases_batches.a_failure_after_the_last_transfer_reaches_every_rank_in_its_step, backward)
    pool4.run(cases_batches.a_failure_after_the_last_transfer_reaches_every_rank_in_its_step, backward)


def test_labels_without_a_target_give_nan_as_unpatched(pool2, pool4):
    pool2.run(cases_batches.labels_without_a_target_give_nan)
    pool4.run(cases_batches.labels_without_a_target_give_nan)


def test_a_patched_model_can_be_copied(pool2):
    pool2.run(cases_batches.copies_of_a_patched_model)
