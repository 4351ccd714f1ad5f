"""Patched models under torch.compile (cases_compiled.py): the ring as one custom op per attention
layer (``ringseq.attention.compiled``), each recurrent layer's sharded kernel as another
(``ringseq.patches.compiled_mixers``). Every compiled path against the unpatched eager model by
the 2x rule on two steps (the compiling one and the next), with no graph break ringseq adds and no
recompile on the second batch of the same shape; the ops against the eager paths to the last bit;
checkpointing under compile without ringseq's policy refused by name.
Inductor compiles take tens of seconds here (its first in a process about 20 s, more when 4
processes compile at once on 2 cores), so one case uses it (a hybrid's checkpointed layers: both ops,
and the selective checkpointing whose freed buffers inductor reuses), and the others run under
aot_eager (the same tracing and autograd partitioning, the graphs then run eagerly); inductor's own
speed and the varying lengths are benchmarks/compiled.py's."""
import pytest

from . import cases_batches, cases_compiled

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.mark.parametrize("ulysses,mask", [(1, "packed"), (2, "padded")])
def test_the_op_is_the_eager_ring(pool2, pool4, ulysses, mask):
    pool2.run(cases_compiled.op_against_eager, ulysses, mask)
    pool4.run(cases_compiled.op_against_eager, ulysses, mask)


def test_the_whole_model_compiled(pool2, pool4):
    """torch.compile(model) on packed documents (world 2) and model.compile() on padding (world 4)."""
    pool2.run(cases_compiled.step, "llama", "model", "packed", backend="aot_eager")
    pool4.run(cases_compiled.step, "llama", "method", "padded", backend="aot_eager")


def test_each_layer_compiled_with_fullgraph(pool2, pool4):
    """torchtitan's way: every decoder layer compiled alone with fullgraph=True. Gemma 2 (softcap,
    alternating windows, padding), GQA Llama under Ulysses 2 x ring 2 with head groups, Mistral's
    window over packed documents with tiled MLP."""
    pool2.run(cases_compiled.step, "gemma2", "layers", "padded", backend="aot_eager")
    pool4.run(cases_compiled.step, "llama", "layers", "packed", 2, None, None, "kv", backend="aot_eager")
    pool4.run(cases_compiled.step, "mistral", "layers", "packed", 1, None, True, backend="aot_eager")


# under -m slow (10-15 s): experts under torch.compile(model) run in test_hybrids_compiled (Kimi Linear), sinks inside
# the op in test_the_op_is_the_eager_ring, alternating windows in compiled layers in test_each_layer_compiled_with_fullgraph
@pytest.mark.slow
def test_sinks_and_experts_compiled(pool2):
    """gpt-oss (sinks, MoE, alternating windows): its experts break the graph on their own (unpatched
    too); ringseq adds no break. (Sinks under Ulysses: the op's test.)"""
    pool2.run(cases_compiled.step, "gpt_oss", "model", "padded", backend="aot_eager")


def test_vlms_compiled(pool2):
    """Gemma 3 (bidirectional image-token blocks in the ring's masks): its language model's layers
    compiled with fullgraph; Qwen2.5-VL (3-D rotary positions) under torch.compile(model), the vision
    tower traced with it. Exact, every parameter's gradient; the language model's rings run as ops."""
    pool2.run(cases_compiled.vlm, "gemma3", "layers")
    pool2.run(cases_compiled.vlm, "qwen2_5_vl", "model")


def test_the_recurrent_op_is_the_eager_path(pool2, pool4):
    """``ringseq::recurrent`` against the eager sharded kernels, to the last bit: a gated delta rule,
    Mamba2's scan and a causal convolution; outputs, gradients, a prefill's final state."""
    pool2.run(cases_compiled.recurrent_op_against_eager)
    pool4.run(cases_compiled.recurrent_op_against_eager)


def test_hybrids_compiled(pool2):
    """Hybrids, each recurrent layer's sharded kernel one op: Kimi Linear (KDA, MLA attention, MoE)
    under torch.compile(model), packed; Bamba (Mamba2) layers with fullgraph under checkpointing
    that saves the ops' outputs, padded; Qwen3.5-MoE asked for its router logits, every kernel still an op."""
    pool2.run(cases_compiled.step, "kimi_linear", "model", "packed", backend="aot_eager")
    pool2.run(cases_compiled.step, "bamba", "layers", "padded", 1, "replay", backend="aot_eager")
    pool2.run(cases_compiled.router_logits_compiled)


# 25 s, under -m slow: hybrids under Ulysses x ring run eagerly in test_hybrid_models.py, the recurrent op runs the
# eager kernels' code (test_the_recurrent_op_is_the_eager_path, world 2 and 4), compiled hybrid layers run above
@pytest.mark.slow
def test_hybrids_compiled_under_ulysses_and_varying_lengths(pool2, pool4):
    """Qwen3.5 (gated DeltaNet) layers with fullgraph under Ulysses 2 x ring 2, packed; Qwen3.5 whole on packed rows
    of three lengths (at most 2 graphs: a recompile's cost, which benchmarks/compiled.py measures)."""
    pool4.run(cases_compiled.step, "qwen3_5", "layers", "packed", 2, backend="aot_eager")
    pool2.run(cases_compiled.varying_lengths, "qwen3_5")


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_a_failure_inside_the_compiled_ring_reaches_every_rank(pool4, backward):
    """The last rank's kernel fails after the ring's last transfer, in a compiled model's step: every
    rank raises in that step (its own error, or a RingSeqError naming it), the loop skips it and the
    next steps are the unpatched model's."""
    pool4.run(cases_batches.a_failure_after_the_last_transfer_reaches_every_rank_in_its_step, backward,
              compiled=True)


def test_a_failure_inside_the_recurrent_op_reaches_every_rank(pool2):
    """The last rank's gated delta rule fails inside a compiled hybrid's recurrent op, before its
    exchange: every rank raises in that step (its own error, or a RingSeqError naming it), the loop
    skips it and the next step is the unpatched model's."""
    pool2.run(cases_compiled.a_recurrent_failure_reaches_every_rank)


def test_checkpointed_layers_compiled(pool2, pool4):
    """transformers' checkpointing under compile: the ops' outputs saved, the rest recomputed
    (keep_ring_outputs either way): a hybrid's layers with inductor (the one inductor case: both ops,
    inductor reusing the buffers the selective checkpointing frees), a whole model; torchtitan's
    checkpoint_wrapper with ringseq's policy and with none (FSDP's own checkpointing); with another policy of the
    user's, refused at the first backward; offload refused."""
    pool2.run(cases_compiled.step, "qwen3_5", "layers", "padded", 1, "keep")  # inductor: both ops, saved
    pool4.run(cases_compiled.step, "llama", "model", "packed", 1, "replay", backend="aot_eager")
    for policy in ("save_ring", "none", "other"):
        pool2.run(cases_compiled.wrapped_checkpointing, policy)


def test_generation_compiled(pool2):
    """generate on a compiled patched model: each decode step's attention is the op, tokens and scores
    the unpatched model's; a dense model (``model.compile()``; then the last rank's decode attention
    fails mid-generation: every rank raises in that step) and a hybrid whose attention block is one
    module shared by two layers (Zamba2, ``torch.compile(model.forward)``), and a dense model whose decoder
    layers were compiled one by one (a training job's ``layer.compile()`` before GRPO generates). World 4: the
    eager decode path's tests (test_generation.py); the ops run the same code."""
    pool2.run(cases_compiled.generation, "llama", "method", fail_at=3)
    pool2.run(cases_compiled.generation, "zamba2", "forward")
    pool2.run(cases_compiled.generation, "llama", "layers")


def test_vlm_generation_compiled(pool2):
    """generate on a compiled patched VLM (Qwen2.5-VL, images in the prompt, ``model.compile()``): the
    decode step through its inner model, its language model's attention the op, against the unpatched
    model; then with ``model.forward = torch.compile(model.forward)`` (the prefill's token: the
    signature generate checks the inputs by)."""
    pool2.run(cases_compiled.generation, "qwen2_5_vl", "method", vlm=True)
