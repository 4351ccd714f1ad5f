"""The functions transformers calls: attention refuses what it would otherwise ignore; recurrent
kernels are routed by name."""
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


def test_a_kernel_function_that_is_a_module_is_routed_under_its_name():
    """transformers >= 5.25 makes its recurrent kernel functions instances of the kernels hub's
    ``Func`` module, which have no ``__name__``: the dispatcher calls them as they are outside a
    sharded forward, names them in errors inside one, and puts the same object back."""
    import torch

    from ringseq.patches import mixers

    class Func(torch.nn.Module):
        def forward(self, query, key, value, g, beta, initial_state=None):
            return query * 2

    kernel = Func()
    dispatch = mixers._dispatcher(kernel, "torch_chunk_gated_delta_rule")
    assert dispatch.ringseq_original is kernel and dispatch.__name__ == "torch_chunk_gated_delta_rule"
    x = torch.ones(2)
    assert torch.equal(dispatch(x, x, x, x, x), 2 * x)
    with pytest.raises(RingSeqError, match="torch_chunk_gated_delta_rule was called with a recurrent state"):
        dispatch(x, x, x, x, x, initial_state=x, ringseq=object())
