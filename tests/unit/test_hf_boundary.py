"""The attention function transformers calls refuses what it would otherwise ignore."""
import pytest
import torch

from ringseq import RingSeqError
from ringseq.patches.hf_attention import attention_forward


class _Layer(torch.nn.Module):
    is_causal = True


def call(**kwargs):
    q = torch.zeros(1, 2, 4, 8)
    return attention_forward(_Layer(), q, q, q, None, **kwargs)


@pytest.mark.parametrize("kwargs,words", [
    (dict(is_causal=False), "is_causal=False"),
    (dict(output_attentions=True), "output_attentions=True"),
    (dict(position_bias=torch.zeros(1)), "does not read: position_bias"),
    (dict(cu_seq_lens_q=torch.zeros(2), max_length_q=4), "cu_seq_lens_q, max_length_q"),
])
def test_unread_arguments_are_refused(kwargs, words):
    with pytest.raises(RingSeqError, match=words):
        call(**kwargs)


def test_arguments_transformers_always_passes_are_accepted():
    # they pass the argument check; without a patched model's batch the call then says so (use_cache: the
    # layer has used its cache before attention is called, as in generation)
    for use_cache in (False, True):
        with pytest.raises(RingSeqError, match="needs the model patched"):
            call(position_ids=torch.arange(4)[None], use_cache=use_cache, is_causal=True, output_attentions=None,
                 position_bias=None)
