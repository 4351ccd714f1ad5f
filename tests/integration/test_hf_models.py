"""Patched models of every tested family against the unpatched model on the whole sequence."""
import pytest

from . import cases_hf


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("family", cases_hf.FAMILIES)
def test_family_matches_unpatched(pool2, pool4, family, layout):
    pool2.run(cases_hf.parity, family, layout)
    pool4.run(cases_hf.parity, family, layout)


@pytest.mark.parametrize("kind", ["packed", "padded"])
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_packed_and_padded_batches(pool2, pool4, family, kind):
    pool2.run(cases_hf.parity, family, "zigzag", kind)
    pool4.run(cases_hf.parity, family, "contiguous", kind)


def test_unpatch_restores_the_model(pool2):
    pool2.run(cases_hf.unpatch_restores)


def test_unsupported_models_are_refused(pool2):
    pool2.run(cases_hf.refuses_unsupported_models)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_gradient_checkpointing(pool2, family):
    pool2.run(cases_hf.gradient_checkpointing, family)


def test_manual_path_with_shard_batch(pool2, pool4):
    pool2.run(cases_hf.manual_path)
    pool4.run(cases_hf.manual_path)


def test_chunked_loss_is_exact(pool2):
    pool2.run(cases_hf.chunked_loss_is_exact)


def test_different_batches_in_a_group_are_refused(pool2, pool4):
    pool2.run(cases_hf.different_batches_are_refused)
    pool4.run(cases_hf.different_batches_are_refused)
