"""The GPU check: ringseq's CUDA path, exact and fast, on one GPU in one 10-minute run, no downloads.

    python benchmarks/gpu_check.py                 # --device cuda (one GPU); needs only torch + ringseq
    python benchmarks/gpu_check.py --device cpu    # the parts that apply on the CPU (CI runs it)
    python benchmarks/gpu_check.py --only ring --lengths 32768 --ranks 8

Checks, most important first (``--budget-s`` stops starting new rows in time; skipped rows say so):

(1) ``ring``     ring efficiency: one kernel call over the whole sequence / the ring of P virtual
                 ranks (threads of one process running ringseq's own ring loop, transfers handed over
                 in memory: NCCL refuses two ranks on one GPU), at 32k and 128k tokens, P = 2, 4, 8,
                 dense / documents / window, one ring vs one per kv head, with a per-step breakdown
                 and the loop under ``set_sync_debug_mode("error")`` (``gpu_speed.check_ring``).
(2) ``blocks``   each block call against the same kernel over the whole sequence: flash, varlen with
                 the same documents, flash with the same window (128, 1024, 4096), flex with the same
                 softcap (``gpu_speed.check_blocks``).
(3) ``kernels``  every backend x feature (dense causal, documents, padding, window, softcap, sinks,
                 GQA) forward and backward on a virtual ring, against a float64 reference by the 2x
                 rule (``ringseq.tolerance``); a backend refuses what it cannot take (recorded, not a
                 failure); the default choice must take everything.
(4) ``model``    a patched tiny Llama (packed documents) training step: loss and gradients against
                 the unpatched model in the same dtype and in float64.
(5) ``compiled`` the patched tiny Llama of (4), then a tiny Qwen3.5-style hybrid (the recurrent op),
                 with every decoder layer compiled (``fullgraph=True``):
                 inductor's default, max-autotune without CUDA graphs and reduce-overhead (CUDA graphs;
                 the ops are tagged ``cudagraph_unsafe``, so inductor leaves them out of them) on CUDA,
                 the default on the CPU: loss and gradients against the unpatched eager model, graph
                 breaks, and the step time against the eager patched model's (docs/compile.md); on the
                 CPU aot_eager only (the row's own code, in seconds; inductor's: benchmarks/compiled.py).
                 Then each model's ``generate`` after ``model.compile()`` (the decode ops; inductor's
                 default on CUDA), fp32: tokens and scores against the unpatched model, decode speed.
(6) ``trainer_fsdp2`` ringseq.Trainer with FSDP2 (``fsdp_config={"version": 2}``) on the GPU: two steps
                 of a patched tiny Llama against the unpatched model's (on the CPU: skipped, the tests
                 run it at 2 and 4 processes).
(7) ``fsdp2_bf16`` FSDP2 per layer and root under torchtitan's bf16 policy (``MixedPrecisionPolicy(bf16, fp32)``),
                 eager and with compiled layers, against the unpatched model in the same arithmetic
                 (``gpu_engines.check_fsdp2_bf16``; the CPU too).
(8) ``entry_bf16`` every entry point (Trainer, Accelerate, SFTTrainer, GRPOTrainer) with its own ``bf16=True``
                 under FSDP2, eager and with ``torch_compile=True``, against the same client without ringseq
                 (``gpu_engines.check_entries_bf16``; GPU only, TRL's rows where TRL is installed).
(9) ``memory``   the longest sequence one device trains in a fixed step budget (2 GiB on CUDA), as
                 ``patch(fit=True)``'s planner predicts it and as measured by bisection, each probe's step
                 peak beside its prediction; fails when the predicted longest length measures over the budget
                 (``gpu_memory.check_memory``; on the CPU reported, not judged).

The first line says where it ran (torch, device, which flash implementation the flash ops run).
Off CUDA FlexAttention runs forward only (torch has no CPU backward for it): (3) checks its forward
there. Prints one JSON line per check and a summary; exits 1 on any exactness failure or a ring
loop that synchronised with the host.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_engines  # noqa: E402
import gpu_memory  # noqa: E402
import gpu_speed  # noqa: E402

import ringseq  # noqa: E402
from ringseq import reference as exact, tolerance  # noqa: E402
from ringseq.attention.kernels import flash_impl  # noqa: E402
from ringseq.attention.masks import TokenInfo, documents  # noqa: E402
from ringseq.attention.virtual import virtual_ring as run_virtual_ring  # noqa: E402

FEATURES = {
    "dense causal": dict(),
    "documents": dict(packed=True),
    "padding": dict(padded=True),
    "window": dict(window=96),
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=True),
    "GQA": dict(K=2),
}


# ---------------------------------------------------------------- inputs and the reference

def positions(B: int, S: int, g) -> torch.Tensor:
    """[B, S] position ids of packed documents of random lengths (about S/6 each)."""
    rows = []
    for _ in range(B):
        pos = []
        while len(pos) < S:
            pos.extend(range(int(torch.randint(S // 16, S // 3, (1,), generator=g))))
        rows.append(pos[:S])
    return torch.tensor(rows)


def left_padding(B: int, S: int, g) -> torch.Tensor:
    mask = torch.ones(B, S, dtype=torch.long)
    for b in range(B):
        mask[b, :int(torch.randint(1, S // 4, (1,), generator=g))] = 0
    return mask


def make_case(B, H, K, S, D, seed, packed=False, padded=False, sinks=False, **features):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, K, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    return dict(q=q, k=k, v=v, dout=dout, sinks=torch.randn(H, generator=g, dtype=torch.float64) if sinks else None,
                pos=positions(B, S, g) if packed else None, pad=left_padding(B, S, g) if padded else None,
                window=features.get("window"), softcap=features.get("softcap"))


def reference(c, dtype, device):
    """(out, dq, dk, dv) by ``ringseq.reference`` in ``dtype`` on ``device``: below float64 what an
    unpatched model runs (SDPA with the dense mask; by hand, as eager does, with a softcap)."""
    q, k, v, dout = (c[n].to(device, dtype) for n in ("q", "k", "v", "dout"))
    return exact.attention(q, k, v, dout, causal=True, window=c["window"], softcap=c["softcap"],
                           sinks=None if c["sinks"] is None else c["sinks"].to(device, dtype),
                           position_ids=c["pos"], attention_mask=c["pad"], sdpa=dtype != torch.float64)[:4]


def _info(c) -> TokenInfo:
    info = TokenInfo(doc=None if c["pos"] is None else documents(c["pos"]),
                     valid=None if c["pad"] is None else c["pad"].bool())
    return TokenInfo(valid=info.valid) if info.doc is not None and not bool(info.doc.any()) else info


def virtual_ring(c, dtype, device, *, P, layout, kernel=None, backward=True, head_groups=1):
    """ringseq's ring loop on P virtual ranks (``ringseq.attention.virtual``): (out, dq, dk, dv) in global order."""
    q, k, v, dout = (c[n].to(device, dtype) for n in ("q", "k", "v", "dout"))
    sinks = None if c["sinks"] is None else c["sinks"].to(device, dtype)
    return run_virtual_ring(q, k, v, dout if backward else None, P=P, layout=layout, info=_info(c), sinks=sinks,
                            window=c["window"], softcap=c["softcap"], kernel=kernel, head_groups=head_groups)


def _check(verdicts) -> None:
    failed = [str(v) for v in verdicts if not v.ok]
    if failed:
        raise AssertionError("; ".join(failed))


# ---------------------------------------------------------------- the checks

_OUT = [None]  # --out: a file that gets the JSON lines too


def _record(rows, **row):
    line = json.dumps(row)
    print(line, flush=True)
    if _OUT[0]:
        with open(_OUT[0], "a") as f:
            f.write(line + "\n")
    rows.append(row)


def _compare(c, got, dtype, device, backward, refs=None):
    """Max errors of ``got`` (out, dq, dk, dv) by the 2x rule; ``refs``: (float64, plain) if made already."""
    ref, plain = refs or (reference(c, torch.float64, device), reference(c, dtype, device))
    n = 4 if backward else 1
    errors = {}
    for name, g, p, r in list(zip(("out", "dq", "dk", "dv"), got, plain, ref))[:n]:
        errors[name] = float((g.double() - r).abs().max())
        _check([tolerance.within(g.cpu(), p.cpu(), r.cpu(), name)])
    return errors


def check_kernels(args, rows):
    """(3) every backend x feature on a virtual ring, forward and backward (forward only for flex off CUDA);
    then every layout with packed documents, one ring and one per kv head."""
    cuda = args.device == "cuda"
    backends = ["cuda_flash", "cuda_varlen", "flex", "torch", None] if cuda else ["cpu_flash", "flex", "torch", None]
    B, H, S, D, P = (2, 8, 2048, 128, 4) if cuda else (2, 4, 128, 32, 2)
    dtype = torch.bfloat16
    for feature, kw in FEATURES.items():
        c = make_case(B, H, kw.get("K", H), S, D, seed=len(rows), **{k: x for k, x in kw.items() if k != "K"})
        refs = reference(c, torch.float64, args.device), reference(c, dtype, args.device)
        for kernel in backends:
            start = time.perf_counter()
            backward = cuda or kernel != "flex"
            row = dict(check="kernels", feature=feature, kernel=kernel or "auto", device=args.device, backward=backward)
            try:
                got = virtual_ring(c, dtype, args.device, P=P, layout="zigzag", kernel=kernel, backward=backward)
            except ringseq.RingSeqError as exc:
                if kernel is None:
                    raise
                _record(rows, **row, ok=True, refused=str(exc)[:160])
                continue
            row["seconds"] = round(time.perf_counter() - start, 2)  # compiles included: the budget's main risk
            try:
                row["max_error"] = _compare(c, got, dtype, args.device, backward, refs)
                _record(rows, **row, ok=True)
            except AssertionError as exc:
                _record(rows, **row, ok=False, error=str(exc)[:300])
    # every layout, packed documents, one ring and one per kv head, with the default kernels
    c = make_case(B, H, 2, S, D, seed=3, packed=True)
    refs = reference(c, torch.float64, args.device), reference(c, dtype, args.device)
    for layout in ("zigzag", "contiguous", "striped"):
        for groups in (1, 2):
            row = dict(check="kernels", feature="documents, GQA", kernel="auto", layout=layout, head_groups=groups,
                       device=args.device, backward=True)
            got = virtual_ring(c, dtype, args.device, P=P, layout=layout, head_groups=groups)
            try:
                row["max_error"] = _compare(c, got, dtype, args.device, True, refs)
                _record(rows, **row, ok=True)
            except AssertionError as exc:
                _record(rows, **row, ok=False, error=str(exc)[:300])


def _world_of_one():
    """A one-process world as a launcher makes it (its variables set: Accelerate then sees a distributed
    job, as on a node of several GPUs)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from ringseq.processes import free_port
        os.environ["MASTER_PORT"] = str(free_port())
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    return ringseq.init(sp_size=1)


def _tiny_llama(args, rows, check: str):
    """(4) and (5)'s world of one, model and batch: sp, S, a tiny Llama's config, its weights, a row
    of S tokens packed from documents; None (the row recorded as skipped) without transformers."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        _record(rows, check=check, ok=True, skipped="transformers is not installed")
        return None
    S = 2048 if args.device == "cuda" else 256
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False, attn_implementation="sdpa")
    base = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, S), generator=g)
    return _world_of_one(), S, config, base, {"input_ids": ids, "labels": ids, "position_ids": positions(1, S, g)}


def _tiny_hybrid(args, rows, check: str):
    """As ``_tiny_llama``, a tiny Qwen3.5-style hybrid (a gated DeltaNet layer, then attention) of the
    same width; None (the row recorded as skipped) without a transformers that has the family."""
    try:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    except ImportError:
        _record(rows, check=check, model="tiny qwen3_5", ok=True, skipped="this transformers has no Qwen3.5")
        return None
    S = 2048 if args.device == "cuda" else 256
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                               linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
                               use_cache=False, attn_implementation="sdpa")
    base = Qwen3_5ForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, S), generator=g)
    return _world_of_one(), S, config, base, {"input_ids": ids, "labels": ids}


def check_model(args, rows):
    """(4) a patched tiny Llama step (packed documents) against the unpatched one."""
    made = _tiny_llama(args, rows, "model")
    if made is None:
        return
    sp, S, config, base, batch = made
    from transformers import LlamaForCausalLM

    def step(dtype, patched):
        model = LlamaForCausalLM(copy.deepcopy(config)).to(args.device, dtype)  # patch() edits its config
        model.load_state_dict(base.state_dict())
        if patched:
            model = ringseq.patch(model, sp=sp)
        loss = model(**{n: t.to(args.device) for n, t in batch.items()}).loss
        loss.backward()
        return loss.detach().cpu(), {n: p.grad.detach().cpu() for n, p in model.named_parameters()}

    dtype = torch.bfloat16
    row = dict(check="model", model="tiny llama", S=S, device=args.device, dtype="bf16")
    try:
        (loss, grads), (plain_loss, plain_grads), (ref_loss, ref_grads) = (
            step(dtype, True), step(dtype, False), step(torch.float64, False))
        _check([tolerance.within(loss, plain_loss, ref_loss.double(), "loss"),
                *tolerance.by_layer(grads, plain_grads, ref_grads)])
        _record(rows, **row, ok=True)
    except AssertionError as exc:
        _record(rows, **row, ok=False, error=str(exc)[:300])


def check_compiled(args, rows):
    """(5) the patched tiny Llama's step (packed documents), then a tiny hybrid's (the ring op and the
    recurrent op), with their decoder layers compiled, each mode, against the unpatched eager model
    (same dtype and float64); its time against the eager patched step's."""
    for name, make in (("tiny llama", _tiny_llama), ("tiny qwen3_5", _tiny_hybrid)):
        made = make(args, rows, "compiled")
        if made is not None:
            _compiled_rows(args, rows, name, *made)
            if args.device == "cuda" or name == "tiny llama":  # the CPU: the row's code once (tests/ run the rest)
                _compiled_generate(args, rows, name, *made)


def _compiled_generate(args, rows, name, sp, S, config, base, batch):
    """``generate`` on the patched model after ``model.compile()`` (the decode ops), fp32: its tokens the
    unpatched eager model's, every step's scores within the 2x rule against float64; decode speed against
    the eager patched model's (a generate of ``new`` + 1 tokens minus one of 1 token)."""
    from torch._dynamo.utils import counters

    mode, new = ("default", 16) if args.device == "cuda" else ("aot_eager", 4)  # the CPU: the row's code, in seconds
    row = dict(check="compiled", model=name, part="generate", S=S, device=args.device, dtype="fp32", mode=mode)
    if not args.time_left():
        _record(rows, **row, ok=True, skipped="out of time (--budget-s)")
        return
    ids = batch["input_ids"].to(args.device)

    def model_of(dtype, patched):
        cfg = copy.deepcopy(config)
        cfg.use_cache = True
        model = type(base)(cfg).to(args.device, dtype).eval()
        model.load_state_dict(base.state_dict())
        return ringseq.patch(model, sp=sp) if patched else model

    def generate(model, n=new + 1):
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=n, do_sample=False, pad_token_id=0,
                                 return_dict_in_generate=True, output_scores=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return out

    def decode_s(model):
        best = float("inf")
        for _ in range(args.reps):
            start = time.perf_counter()
            generate(model)
            middle = time.perf_counter()
            generate(model, 1)
            best = min(best, (middle - start) - (time.perf_counter() - middle))
        return best

    try:
        plain, ref = generate(model_of(torch.float32, False)), generate(model_of(torch.float64, False))
        eager = model_of(torch.float32, True)
        eager_s = decode_s(eager)
        torch._dynamo.reset()
        counters.clear()
        model = model_of(torch.float32, True)
        model.compile(**({"backend": "aot_eager"} if mode == "aot_eager" else {}))
        start = time.perf_counter()
        got = generate(model)
        first = time.perf_counter() - start
        breaks = sum(counters["graph_break"].values())
        assert breaks == 0, f"{breaks} graph breaks: {dict(counters['graph_break'])}"
        assert torch.equal(got.sequences, plain.sequences), "the compiled model decodes other tokens"
        _check([tolerance.within(g.float().cpu(), p.float().cpu(), r.cpu(), f"scores of step {i}")
                for i, (g, p, r) in enumerate(zip(got.scores, plain.scores, ref.scores))])
        _record(rows, **row, ok=True, first_generate_s=round(first, 2), graphs=counters["stats"]["unique_graphs"],
                compiled_over_eager_decode_speed=round(eager_s / decode_s(model), 3))
        ringseq.unpatch(eager)
    except Exception as exc:  # an inductor failure is this row's finding, not the end of the check
        _record(rows, **row, ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")


def _compiled_rows(args, rows, name, sp, S, config, base, batch):
    from torch._dynamo.utils import counters

    batch = {n: t.to(args.device) for n, t in batch.items()}
    dtype = torch.bfloat16

    def model_of(dtype, patched, mode=None):
        model = type(base)(copy.deepcopy(config)).to(args.device, dtype)
        model.load_state_dict(base.state_dict())
        if patched:
            model = ringseq.patch(model, sp=sp)
        if mode == "aot_eager":
            for layer in model.model.layers:
                layer.compile(fullgraph=True, backend="aot_eager")
        elif mode is not None:
            for layer in model.model.layers:
                layer.compile(fullgraph=True, mode=None if mode == "default" else mode)
        return model

    def step(model):
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return loss.detach().float().cpu(), {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}

    def seconds(model):
        best = float("inf")
        for _ in range(args.reps):
            start = time.perf_counter()
            step(model)
            best = min(best, time.perf_counter() - start)
        return best

    plain_loss, plain_grads = step(model_of(dtype, False))
    ref_loss, ref_grads = step(model_of(torch.float64, False))
    eager = model_of(dtype, True)
    step(eager)
    eager_s = seconds(eager)
    # off CUDA the row checks its own code under aot_eager (dynamo and AOT autograd, no inductor: seconds)
    modes = ["default", "max-autotune-no-cudagraphs", "reduce-overhead"] if args.device == "cuda" else ["aot_eager"]
    for mode in modes:
        if not args.time_left():
            _record(rows, check="compiled", model=name, mode=mode, ok=True, skipped="out of time (--budget-s)")
            continue
        row = dict(check="compiled", model=name, S=S, device=args.device, dtype=str(dtype)[6:], mode=mode)
        try:
            torch._dynamo.reset()
            counters.clear()
            model = model_of(dtype, True, mode)
            start = time.perf_counter()
            step(model)  # the compile
            first = time.perf_counter() - start
            loss, grads = step(model)
            breaks = sum(counters["graph_break"].values())
            assert breaks == 0, f"{breaks} graph breaks: {dict(counters['graph_break'])}"
            _check([tolerance.within(loss, plain_loss, ref_loss.double(), "loss"),
                    *tolerance.by_layer(grads, plain_grads, ref_grads)])
            _record(rows, **row, ok=True, first_step_s=round(first, 2), graphs=counters["stats"]["unique_graphs"],
                    compiled_over_eager_speed=round(eager_s / seconds(model), 3))
        except Exception as exc:  # an inductor failure is this row's finding, not the end of the check
            _record(rows, **row, ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
    ringseq.unpatch(eager)


def check_trainer_fsdp2(args, rows):
    """(6) ringseq.Trainer under TrainingArguments(fsdp=True, fsdp_config={"version": 2}): Accelerate's FSDP2 on
    the GPU (its units, DTensor parameters, the fused loss beside a sharded head, the engine check) for two
    SGD steps of a patched tiny Llama, against the same steps of the unpatched model in fp32 and float64."""
    row = dict(check="trainer_fsdp2", model="tiny llama", device=args.device)
    if args.device != "cuda":  # one process: Accelerate takes FSDP on a GPU only (2 and 4 CPU processes: the tests)
        _record(rows, **row, ok=True, skipped="FSDP2 through Accelerate in one process needs a GPU; "
                                                "tests/integration/test_trainer.py runs it at 2 and 4 CPU processes")
        return
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    sp = _world_of_one()
    S, steps, lr = 1024, 2, 0.5
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (steps, S), generator=g)]

    def reference(dtype):
        model = copy.deepcopy(base).to(dtype)
        for sample in data:
            model.zero_grad()
            model(input_ids=sample["input_ids"][None], labels=sample["labels"][None]).loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * p.grad
        return {n: p.detach() for n, p in model.named_parameters()}

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, per_device_train_batch_size=1, max_steps=steps, learning_rate=lr,
                                  lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, max_grad_norm=0.0,
                                  report_to=[], save_strategy="no", disable_tqdm=True, fsdp=True,
                                  fsdp_config={"version": 2})
        trainer = ringseq.Trainer(model=copy.deepcopy(base).to(args.device), args=targs, train_dataset=data, sp=sp)
        trainer.train()
        got = {n: p.full_tensor().detach().cpu() if hasattr(p, "full_tensor") else p.detach().cpu()
               for n, p in trainer.accelerator.unwrap_model(trainer.model_wrapped).named_parameters()}
    start = {n: p.detach().double() for n, p in base.named_parameters()}
    plain, ref = reference(torch.float32), reference(torch.float64)
    moved = [{n: t[n].double() - start[n] for n in start} for t in (got, plain, ref)]
    try:
        assert trainer.is_fsdp_enabled and trainer.accelerator.is_fsdp2, "the Trainer did not run FSDP2"
        _check(tolerance.by_layer(*moved))
        _record(rows, **row, ok=True, S=S, steps=steps)
    except AssertionError as exc:
        _record(rows, **row, ok=False, error=str(exc)[:300])


CHECKS = {"ring": lambda args, rows: gpu_speed.check_ring(args, rows, _record),
          "blocks": lambda args, rows: gpu_speed.check_blocks(args, rows, _record),
          "kernels": check_kernels, "model": check_model, "compiled": check_compiled,
          "trainer_fsdp2": check_trainer_fsdp2,
          "fsdp2_bf16": lambda args, rows: gpu_engines.check_fsdp2_bf16(args, rows, _record, _world_of_one),
          "entry_bf16": lambda args, rows: gpu_engines.check_entries_bf16(args, rows, _record, _world_of_one),
          "memory": lambda args, rows: gpu_memory.check_memory(args, rows, _record, _world_of_one)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--only", nargs="*", choices=list(CHECKS), default=list(CHECKS))
    p.add_argument("--reps", type=int, default=None, help="timing repetitions (default: 3 on CUDA, 2 on the CPU)")
    p.add_argument("--lengths", nargs="*", type=int, default=None, help="ring: tokens (default 32768 131072 on CUDA)")
    p.add_argument("--ranks", nargs="*", type=int, default=None, help="ring: virtual ranks (default 2 4 8 on CUDA)")
    p.add_argument("--memory-probes", type=int, default=None,
                   help="memory: steps measured (default: 8 on CUDA, 3 on the CPU)")
    p.add_argument("--budget-s", type=float, default=540.0, help="start no new row after this many seconds")
    p.add_argument("--out", default=None, help="also write the JSON lines to this file")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --device cpu for the CPU part", file=sys.stderr)
        return 2
    args.reps = args.reps or (3 if args.device == "cuda" else 2)
    args.memory_probes = args.memory_probes or (8 if args.device == "cuda" else 3)
    if args.device == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    rows, start = [], time.perf_counter()
    args.time_left = lambda: time.perf_counter() - start < args.budget_s
    _OUT[0] = args.out
    if args.out:
        open(args.out, "w").close()
    _record(rows, check="where", ok=True, torch=torch.__version__, device=_device_name(args.device),
            flash=flash_impl.ensure(torch.device("cuda")) if args.device == "cuda" else flash_impl.describe())
    for name in args.only:
        CHECKS[name](args, rows)
    failed = [r for r in rows if not r["ok"]]
    slow = [r for r in rows if r.get("fast") is False]
    skipped = [r for r in rows if r.get("skipped")]
    print(json.dumps({"summary": True, "device": args.device, "checks": len(rows), "failures": len(failed),
                      "below_speed_bar": len(slow), "skipped": len(skipped),
                      "seconds": round(time.perf_counter() - start, 1)}))
    return 1 if failed else 0


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


if __name__ == "__main__":
    sys.exit(main())
