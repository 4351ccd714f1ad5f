"""Patched models under torch.compile, each compiled path against the unpatched eager model.

Compiled as users compile: the whole model (``torch.compile(model)``, ``model.compile()``) or each
decoder layer (``layer.compile(fullgraph=True)``, torchtitan's way, after checkpointing when it
is on). A step on one batch, then a step on another batch of the same shape whose loss and
gradients must be the unpatched model's (by the 2x rule); dynamo's counters must show no graph
break and no graph made by the second step (no recompile)."""
import copy

import torch
import torch.distributed as dist

import ringseq
from ringseq.testing import assert_close, shared_init

from .hf_models import EAGER, check_against, loss_and_grads, make_batch, references, tiny_model
from .hybrid_configs import MOE_FAMILIES

MOE = ("gpt_oss", *MOE_FAMILIES)


def _compile(model, how: str, backend: str):
    """``model`` as it is called after compiling it ``how`` with ``backend``."""
    if how == "model":
        return torch.compile(model, backend=backend)
    if how == "method":
        model.compile(backend=backend)
        return model
    for layer in model.get_decoder().layers:
        layer.compile(fullgraph=True, backend=backend)
    return model


def step(family: str, how: str, kind: str = "plain", ulysses: int = 1, checkpointing: str | None = None,
         tiled_mlp=None, head_groups=None, backend: str = "inductor"):
    """Two steps, each on its own batch of the same shape, each against the unpatched model (the
    first runs while compiling, the second on the compiled graphs). ``checkpointing``: None, or
    transformers' checkpointing with ``keep_ring_outputs`` True ("keep") or False ("replay"; under
    compile both save the ring op's outputs: ``ringseq.attention.keep``); ``backend``: inductor, or
    aot_eager (dynamo and AOT autograd as inductor gets them, the graphs then run eagerly: the same
    tracing, fake implementations and partitioning, without inductor's code generation, which takes
    most of a compile's seconds)."""
    from torch._dynamo.utils import counters

    from ringseq.attention import compiled

    torch._dynamo.reset()
    counters.clear()
    world = dist.get_world_size()
    sp = shared_init(sp_size=world, ulysses_size=ulysses)
    batches = [make_batch(2, 16 * world, kind, seed=seed, left_pad=family not in EAGER) for seed in (1, 0)]
    base, _ = references(family, batches[0])
    model = copy.deepcopy(base)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = ringseq.patch(model, sp=sp, keep_ring_outputs=checkpointing != "replay", tiled_mlp=tiled_mlp,
                          head_groups=head_groups)
    run = _compile(model, how, backend)
    where = (f"{family} compiled ({how}, {backend}) {kind} ulysses {ulysses} checkpointing {checkpointing} "
             f"rank {sp.rank}/{world}")
    for i, batch in enumerate(batches):
        _, refs = references(family, batch)
        model.zero_grad(set_to_none=True)
        before = compiled.kept_graphs()
        loss = run(**batch).loss
        # checkpointed, as eager keeping: the ring's output kept, a recurrent kernel run again in the backward
        kept = compiled.kept_graphs() - before
        assert not checkpointing or not kept, f"{where}: {len(kept)} eager graphs kept"
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        check_against(refs, loss.detach(), grads, sp, f"{where}, step {i + 1}")
        if i == 0:
            graphs = counters["stats"]["unique_graphs"]
    # ringseq adds none; the experts of MoE families (transformers' eager routing) break on nonzero unpatched too
    found = [reason for reason in counters["graph_break"] if family not in MOE or "aten.nonzero" not in reason]
    assert not found, f"{where}: graph breaks: {found}"
    assert graphs >= 1, f"{where}: nothing was compiled"
    # (an MoE's graphs after its experts' break see as many tokens per expert as the routing sent: a new batch
    # recompiles them, unpatched too)
    assert family in MOE or counters["stats"]["unique_graphs"] == graphs, f"{where}: the second step compiled again"
    ringseq.unpatch(model)
    return graphs


def op_against_eager(ulysses: int, mask: str):
    """``ringseq::ring_attention`` (the op the compiled graph calls, here run eagerly through its
    registered autograd) against the eager ``ring_attention`` on the same batch: outputs and the
    gradients of q, k, v and sinks equal to the last bit (the op runs the eager ring), whether it
    keeps its graph or (checkpointed) its output, replayed in the backward. GQA with
    fewer kv heads than Ulysses ranks (kv copies), sinks sliced per Ulysses rank, a window and a
    softcap: every autograd step the eager ring takes inside the op. Then the refusals: a batch
    that is gone, a backward whose forward's graph was forgotten."""
    from ringseq.attention import compiled
    from ringseq.batch import sharded
    from ringseq.testing import assert_refused

    world = dist.get_world_size()
    sp = shared_init(sp_size=world, ulysses_size=ulysses)
    S, H = 24 * world, 4
    full = {"input_ids": torch.zeros(2, S, dtype=torch.long)}
    if mask == "packed":
        full["position_ids"] = torch.cat([torch.arange(S // 3), torch.arange(S - S // 3)]).expand(2, S)
    if mask == "padded":
        full["attention_mask"] = torch.ones(2, S, dtype=torch.long)
        full["attention_mask"][0, S - S // 4:] = 0
    _, batch = sharded(full, sp=sp)
    s = S // world
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, s, 16, generator=g, requires_grad=True) for h in (H, 1, 1))
    sinks = torch.randn(H, generator=g, requires_grad=True)
    kw = dict(scale=0.2, window=S // 2, softcap=4.0, sinks=sinks)
    torch.manual_seed(2)
    dout = torch.randn(2, H, s, 16)
    out = ringseq.ring_attention(q, k, v, sp=sp, token_info=batch.info, **kw)
    out.backward(dout)
    eager = [out.detach()] + [t.grad.clone() for t in (q, k, v, sinks)]
    for which in (batch, batch.in_checkpoint):  # the kept graph; checkpointed, the kept output replayed
        for t in (q, k, v, sinks):
            t.grad = None
        out = compiled.attend(q, k, v, batch=which, **kw)
        out.backward(dout)
        where = f"op ulysses {ulysses} {mask} checkpointed {which.checkpointed} rank {sp.rank}/{world}"
        got = [out.detach()] + [t.grad for t in (q, k, v, sinks)]
        for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), eager, got):
            assert torch.equal(a, b), f"{where}: {name} differs from the eager ring by {(a - b).abs().max():.3e}"
        assert not compiled._pending, f"{where}: the backward left {len(compiled._pending)} kept graphs"

    key = batch.key
    del batch, _
    assert_refused(lambda: compiled.attend(q, k, v, batch=type("Gone", (), {"key": key})(), **kw), "which is gone")
    _, batch = sharded(full, sp=sp)
    out = compiled.attend(q, k, v, batch=batch, **kw)
    with torch.no_grad():  # keeps no graph
        compiled.attend(q, k, v, batch=sharded(full, sp=sp)[1], **kw)
    plain = {**kw, "sinks": sinks.detach()}
    compiled.attend(q.detach(), k.detach(), v.detach(), batch=batch, **plain)  # nothing to differentiate: no graph
    assert len(compiled._pending) == 1, f"{where}: {len(compiled._pending)} graphs kept, not 1"
    later = [sharded(full, sp=sp)[1] for _ in range(compiled.KEEP_BATCHES)]
    outs = [compiled.attend(q, k, v, batch=b, **kw) for b in later]  # the first batch's graph is forgotten
    assert len(compiled._pending) == compiled.KEEP_BATCHES
    assert_refused(lambda: out.backward(dout), "found its forward's graph gone")
    sum(outs).backward(dout)
    assert not compiled._pending
    return where


def wrapped_checkpointing(policy: str):
    """torchtitan's order: every decoder layer wrapped by torch's ``checkpoint_wrapper``, then compiled
    (fullgraph, aot_eager). With ringseq's policy (``policy="save_ring"``: ``context_fn``, the ring op's
    outputs saved) and with none of its own (``"none"``: FSDP's ``apply_activation_checkpointing``, Accelerate's
    ``fsdp_activation_checkpointing``), the step is the unpatched model's and the ops keep no eager graph
    (``patches.checkpointing`` runs the wrapper's region as ringseq's compiled checkpointing, the checkpointed
    twin handed to its layer); unpatch puts the wrapper's own checkpoint back. With another policy of the user's
    (``"other"``) the compiled backward would run the ring again, which the op refuses by name at the first
    backward, on every rank. transformers' checkpoint offload on compiled layers, which they would not apply, is
    refused when they run."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from ringseq.attention import compiled, keep
    from ringseq.testing import assert_refused

    torch._dynamo.reset()
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    batch = make_batch(2, 16 * world, "packed")
    base, refs = references("llama", batch)
    model = ringseq.patch(copy.deepcopy(base), sp=sp)
    policies = {"save_ring": keep.save_ring, "other": lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE}
    extra = {"context_fn": partial(create_selective_checkpoint_contexts, policies[policy])} if policy in policies else {}
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i], **extra)
        layers[i].compile(fullgraph=True, backend="aot_eager")
    where = f"checkpoint_wrapper with policy {policy}, rank {sp.rank}/{world}"
    if policy == "other":
        loss = model(**batch).loss
        assert_refused(loss.backward, "recomputes its ring_attention in the backward")
        compiled._pending.clear()  # the refused step's graphs (a loop would go on; here the case ends)
        # transformers' offload is not applied to compiled layers: refused when the layer runs, not ignored
        torch._dynamo.reset()
        model = ringseq.patch(copy.deepcopy(base), sp=sp)  # then enabled as the Trainer does: ringseq's offload
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "offload": True})
        for layer in model.model.layers:
            layer.compile(fullgraph=True, backend="aot_eager")
        assert_refused(lambda: model(**batch), "is not applied to compiled layers")
        ringseq.unpatch(model)
        return where
    before = compiled.kept_graphs()
    loss = model(**batch).loss
    kept = compiled.kept_graphs() - before  # the wrappers hand their layers the checkpointed twin: no eager graph
    assert not kept, f"{where}: {len(kept)} eager graphs kept"
    loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.detach().clone() for n, p in model.named_parameters()}
    check_against(refs, loss.detach(), grads, sp, where)
    ringseq.unpatch(model)
    assert not any(getattr(m, "checkpoint_fn", None) is not None and getattr(m.checkpoint_fn, "keeps_ring", False)
                   for m in model.modules()), f"{where}: unpatch left ringseq's checkpoint on a wrapper"
    return where


def vlm(family: str, how: str):
    """A vision-language model compiled: its language model's decoder layers (``how="layers"``:
    fullgraph, no graph break) or the whole model (``"model"``: the vision tower and the merge traced
    too; the inputs' agreement and the sharding stay eager, so the graph breaks around them, and the
    family's own code may break it: Qwen's rotary indices read ``.item()``). Two steps (the compiling
    one and the next), each exact against the unpatched model (every parameter's gradient, the vision
    tower's included), each running the ring op of every attention layer (its language model compiled)."""
    from torch._dynamo.utils import counters

    from ringseq.attention import compiled

    from .cases_vlm import vlm_references
    from .vlm_models import make_batch as vlm_batch

    torch._dynamo.reset()
    counters.clear()
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    where = f"{family} compiled ({how}), rank {sp.rank}/{world}"
    for step in range(2):
        batch = vlm_batch(family, 2, 32 * world, seed=step)
        base, refs = vlm_references(family, batch)
        if step == 0:
            model = ringseq.patch(copy.deepcopy(base), sp=sp)
            layers = model.get_decoder().layers
            run = _compile(model, how, "aot_eager")
        first = next(compiled._call_numbers)
        loss, grads = loss_and_grads(run, batch)
        calls = next(compiled._call_numbers) - first - 1
        # (the ops' kept graphs: one a layer for these attention-only language models)
        assert calls == len(layers), f"{where}: {calls} compiled op calls in step {step + 1}, not {len(layers)}"
        check_against(refs, loss, {n.replace("_orig_mod.", ""): g for n, g in grads.items()}, sp,
                      f"{where}, step {step + 1}")
    assert counters["stats"]["unique_graphs"] >= 1, where
    assert how == "model" or not counters["graph_break"], (where, dict(counters["graph_break"]))
    ringseq.unpatch(model)
    return where


def _kernel_calls(s: int, g: torch.Generator):
    """(kernel name, modeling module, positional args, keyword args) of each sharded kernel on
    this rank's ``s`` tokens: a gated delta rule (l2-normed q/k, 2+ chunks a run), Mamba2's scan
    (D, dt_bias, softplus, a dt limit) and a causal convolution with bias and activation."""
    from transformers.models.bamba import modeling_bamba
    from transformers.models.qwen3_5 import modeling_qwen3_5

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).requires_grad_()

    B, H = 2, 2
    delta = ((rand(B, s, H, 8), rand(B, s, H, 8), rand(B, s, H, 16)),
             dict(g=(-torch.rand(B, s, H, generator=g) * 0.05).requires_grad_(),
                  beta=torch.rand(B, s, H, generator=g).requires_grad_(), use_qk_l2norm_in_kernel=True))
    mamba = ((rand(B, s, H, 8), rand(B, s, H, scale=0.5), (-torch.rand(H, generator=g)).requires_grad_(),
              rand(B, s, 1, 4), rand(B, s, 1, 4), 16),
             dict(D=rand(H), dt_bias=rand(H, scale=0.1), dt_softplus=True, dt_limit=(0.0, 4.0)))
    conv = ((rand(B, 12, s), rand(12, 4)), dict(bias=rand(12), activation="silu"))
    return [("torch_chunk_gated_delta_rule", modeling_qwen3_5, *delta, "output_final_state"),
            ("mamba2_chunk_scan", modeling_bamba, *mamba, "return_final_states"),
            ("causal_conv1d_fn", modeling_bamba, *conv, None)]


def recurrent_op_against_eager():
    """``ringseq::recurrent`` (what a hybrid's compiled layer calls, here run eagerly through its
    registered autograd) against the eager sharded kernel on the same batch, to the last bit:
    outputs, every input's gradient (the exchanges' summing backwards included) and, as a
    generation's prefill asks for it, the state after the whole sequence. A call with an argument
    the op does not carry (a starting state) is left to the eager path."""
    from ringseq.batch import sharded
    from ringseq.patches import compiled_mixers, mixers

    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    S = 160 * world
    _, batch = sharded({"input_ids": torch.zeros(2, S, dtype=torch.long)}, sp=sp)
    g = torch.Generator().manual_seed(3 + sp.rank)
    for name, module, args, kwargs, final in _kernel_calls(S // world, g):
        dispatch = mixers._dispatcher(getattr(module, name), name)
        where = f"{name} op rank {sp.rank}/{world}"
        results = []
        for path in ("eager", "op"):
            for t in (*args, *kwargs.values()):
                if isinstance(t, torch.Tensor):
                    t.grad = None
            out = (dispatch(*args, ringseq=batch, **kwargs) if path == "eager"
                   else compiled_mixers.call(dispatch.ringseq_number, batch, args, kwargs))
            out = out[0] if isinstance(out, tuple) else out
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)))
            grads = [t.grad.clone() for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            state = None
            if final:
                with torch.no_grad():
                    state = (dispatch(*args, ringseq=batch, **kwargs, **{final: True}) if path == "eager" else
                             compiled_mixers.call(dispatch.ringseq_number, batch, args, {**kwargs, final: True}))
            results.append((out.detach(), grads, state))
        (out, grads, state), (out_op, grads_op, state_op) = results
        assert torch.equal(out, out_op), f"{where}: out differs by {(out - out_op).abs().max():.3e}"
        for i, (a, b) in enumerate(zip(grads, grads_op)):
            assert torch.equal(a, b), f"{where}: gradient {i} differs by {(a - b).abs().max():.3e}"
        if final:
            for a, b in zip(state, state_op):
                assert torch.equal(a, b), f"{where}: the prefill's {'output' if a is state[0] else 'state'} differs"
            starting = {"initial_state" if name != "mamba2_chunk_scan" else "initial_states": state[1]}
            assert compiled_mixers.call(dispatch.ringseq_number, batch, args, {**kwargs, **starting}) \
                is NotImplemented, f"{where}: a call with a starting state went to the op"
    from ringseq.attention import compiled
    assert not compiled._pending, f"rank {sp.rank}: the backwards left {len(compiled._pending)} kept graphs"
    return world


def a_recurrent_failure_reaches_every_rank(steps: int = 3):
    """A training loop that catches errors and skips the step, on a hybrid (Qwen3.5-style) under
    ``torch.compile(model)``: at step 1 the last rank's gated delta rule fails inside
    ``ringseq::recurrent``, before its exchange. Every rank raises in that step (the failing rank its
    own MemoryError, its peers a RingSeqError naming it), and the other steps are the unpatched model's."""
    from ringseq import recurrent

    torch._dynamo.reset()
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    base = tiny_model("qwen3_5")
    model = ringseq.patch(copy.deepcopy(base), sp=sp)
    run = torch.compile(model, backend="aot_eager")
    victim = sp.rank == world - 1
    original, armed = recurrent.state_passing, [False]

    def state_passing(*args, **kwargs):
        if victim and armed[0]:
            raise MemoryError("injected: the delta rule ran out of memory")
        return original(*args, **kwargs)

    recurrent.state_passing = state_passing
    outcome = {}
    try:
        for step in range(steps):
            armed[0] = step == 1
            try:
                model.zero_grad(set_to_none=True)
                loss = run(**make_batch(2, 16 * world, "packed", seed=step)).loss
                loss.backward()
                outcome[step] = loss.detach()
            except (ringseq.RingSeqError, MemoryError) as exc:
                outcome[step] = exc
    finally:
        recurrent.state_passing = original
    where = f"rank {sp.rank}/{world}"
    raised = outcome[1]
    assert isinstance(raised, MemoryError if victim else ringseq.RingSeqError), (where, raised)
    assert victim or f"global rank {sp.ranks[-1]}" in str(raised), (where, str(raised))
    for s in (0, 2):
        ref = loss_and_grads(copy.deepcopy(base), make_batch(2, 16 * world, "packed", seed=s))[0]
        assert torch.is_tensor(outcome[s]) and abs(outcome[s].item() - ref.item()) <= 1e-5 * abs(ref.item()), \
            (where, s, outcome[s], ref)
    ringseq.unpatch(model)
    return where


def varying_lengths(family: str, lengths=(16, 24, 32)):
    """``torch.compile(model)`` (aot_eager) on rows of growing length (per rank), each step exact
    against the unpatched model: dynamo makes at most 2 graphs in all (the first length static, then
    one with dynamic shapes that every later length reuses), the ops' fake implementations taking
    symbolic sizes."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    made = []
    for i, n in enumerate(lengths):
        batch = make_batch(2, n * world, "packed", seed=i)
        base, refs = references(family, batch)
        if i == 0:
            model = ringseq.patch(copy.deepcopy(base), sp=sp)
            run = torch.compile(model, backend="aot_eager")
        loss, grads = loss_and_grads(run, batch)
        check_against(refs, loss, {k.replace("_orig_mod.", ""): g for k, g in grads.items()}, sp,
                      f"{family} compiled, {n * world} tokens, rank {sp.rank}/{world}")
        made.append(counters["stats"]["unique_graphs"])
    assert made[-1] <= 2 and not counters["graph_break"], (family, made, dict(counters["graph_break"]))
    ringseq.unpatch(model)
    return made


def router_logits_compiled(family: str = "qwen3_5_moe"):
    """A hybrid MoE asked for its router logits (ringseq's router loss then passes
    ``output_router_logits`` down to every layer's kernels): under ``torch.compile(model)`` every
    recurrent kernel still runs as ``ringseq::recurrent`` (one op call per gated DeltaNet's
    convolution and delta rule, one ring op per attention layer), and the loss and gradients equal
    the eager patched model's (itself against the unpatched model's router loss: test_hybrid_models)."""
    from ringseq.attention import compiled

    torch._dynamo.reset()
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    base = tiny_model(family)
    batch = {**make_batch(2, 16 * world, "packed"), "output_router_logits": True}
    eager = ringseq.patch(copy.deepcopy(base), sp=sp)
    loss, grads = loss_and_grads(eager, batch)
    model = ringseq.patch(copy.deepcopy(base), sp=sp)
    first = next(compiled._call_numbers)
    got, got_grads = loss_and_grads(torch.compile(model, backend="aot_eager"), batch)
    calls = next(compiled._call_numbers) - first - 1
    types = model.config.get_text_config().layer_types
    expected = types.count("full_attention") + 2 * types.count("linear_attention")
    where = f"{family} compiled with router logits, rank {sp.rank}/{world}"
    assert calls == expected, f"{where}: {calls} op calls kept a graph, not {expected} (a kernel went eager)"
    torch.testing.assert_close(got, loss, msg=where)
    for name, g in grads.items():
        torch.testing.assert_close(got_grads[f"_orig_mod.{name}"], g, msg=f"{where}: {name}")
    for m in (eager, model):
        ringseq.unpatch(m)
    return where


def generation(family: str, how: str, fail_at: int | None = None, backend: str = "aot_eager", vlm: bool = False):
    """``generate`` on a patched model compiled ``how`` ("method": ``model.compile()``, "forward":
    ``model.forward = torch.compile(model.forward)``, "layers": each decoder layer's ``compile()``, as a
    training job compiles them before GRPO's generation): its tokens are the unpatched fp32 model's and
    the float64 model's, every step's scores within the 2x rule of the unpatched fp32 model's against
    float64; every decode step's attention is the op (``patches.compiled_decode``); compiled whole, no graph
    break and at most 2 graphs (the first step's, then one with the cache's length dynamic; compiled layers
    run the prefill's cache keeping eagerly, a break in the prefill's layer graph). Then, with
    ``fail_at``, a second generate where the last rank's decode partial fails at that call: every
    rank raises in that step (the failing rank its own error, its peers a RingSeqError naming it).
    ``vlm``: a vision-language model on a prompt with images (the decode step through its inner
    model, its language model compiled with the rest)."""
    from torch._dynamo.utils import counters

    import ringseq.patches.compiled_decode as compiled_decode
    from ringseq.attention import decode

    from .cases_generation import SETTINGS, _generating, prompt

    torch._dynamo.reset()
    counters.clear()
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    S, new = (32 * world - 1 if vlm else 21 * world + 3), 6
    if vlm:
        from .cases_vlm import in_dtype
        from .cases_vlm_generation import _generating as _vlm_generating, vlm_prompt
        from .vlm_models import tiny_model as tiny_vlm

        inputs = vlm_prompt(family, S)
        base = _vlm_generating(tiny_vlm(family, torch.float64))
    else:
        ids, mask = prompt(2, S, left_pad=family not in EAGER)
        inputs = dict(input_ids=ids, attention_mask=mask)
        base = _generating(tiny_model(family, torch.float64))

    def given(dtype):
        return in_dtype(inputs, dtype) if vlm else inputs

    plain = {dtype: copy.deepcopy(base).to(dtype).generate(**given(dtype), max_new_tokens=new, **SETTINGS)
             for dtype in (torch.float64, torch.float32)}
    model = ringseq.patch(copy.deepcopy(base).float(), sp=sp)
    if how == "method":
        model.compile(backend=backend)
    elif how == "layers":
        for layer in model.model.layers:
            layer.compile(backend=backend)
    else:
        model.forward = torch.compile(model.forward, backend=backend)
    calls, original = [0], compiled_decode.decode_attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    compiled_decode.decode_attention = counted
    try:
        got = model.generate(**given(torch.float32), max_new_tokens=new, **SETTINGS)
    finally:
        compiled_decode.decode_attention = original
    where = f"{family} generate compiled ({how}, {backend}) rank {sp.rank}/{world}"
    assert torch.equal(got.sequences, plain[torch.float32].sequences), f"{where}: {got.sequences[:, S:]}"
    assert torch.equal(got.sequences, plain[torch.float64].sequences), f"{where}: float64 decodes other tokens"
    for i, (g, p, r) in enumerate(zip(got.scores, plain[torch.float32].scores, plain[torch.float64].scores)):
        assert_close(g, p, r, f"{where} scores of step {i}")
    attention = sum(1 for layer in got.past_key_values.layers if hasattr(layer, "positions"))
    assert calls[0] >= (new - 1) * attention > 0, f"{where}: {calls[0]} decode ops for {new - 1} steps"
    if how != "layers":
        assert not counters["graph_break"], f"{where}: graph breaks: {dict(counters['graph_break'])}"
        assert 1 <= counters["stats"]["unique_graphs"] <= 2, f"{where}: {counters['stats']['unique_graphs']} graphs"
    if fail_at is not None:
        _a_decode_failure(model, given(torch.float32), fail_at, sp, where, decode)
    ringseq.unpatch(model)
    if vlm and how == "method":  # a VLM's generate also takes a torch.compile'd forward (its signature: the prefill)
        other = ringseq.patch(copy.deepcopy(base).float(), sp=sp)
        other.forward = torch.compile(other.forward, backend=backend)
        first = other.generate(**given(torch.float32), max_new_tokens=1, **SETTINGS)
        assert torch.equal(first.sequences, plain[torch.float32].sequences[:, :S + 1]), f"{where}: compiled forward"
        ringseq.unpatch(other)
    return where


def _a_decode_failure(model, inputs: dict, fail_at: int, sp, where: str, decode) -> None:
    from .cases_generation import SETTINGS

    victim, original, seen = sp.rank == sp.size - 1, decode.partial, [0]

    def partial(*args, **kwargs):
        seen[0] += 1
        if victim and seen[0] == fail_at:
            raise MemoryError("injected: decode attention ran out of memory")
        return original(*args, **kwargs)

    decode.partial = partial
    try:
        model.generate(**inputs, max_new_tokens=4, **SETTINGS)
        raised = None
    except (ringseq.RingSeqError, MemoryError) as exc:
        raised = exc
    finally:
        decode.partial = original
    assert isinstance(raised, MemoryError if victim else ringseq.RingSeqError), (where, raised)
    assert victim or f"global rank {sp.ranks[-1]}" in str(raised), (where, str(raised))
