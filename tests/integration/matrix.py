"""The configurations GPU users train with, as a pairwise covering set (docs/testing.md, "The GPU user's matrix").

Five factors: the engine, the precision, what is compiled, the checkpointing and the entry point. The full
product is 2,250 cells, most of them impossible (an entry point brings its own engine; FSDP2's mixed-precision
policy needs FSDP2); of the feasible cells, ``ROWS`` is a set in which every feasible pair of values of two
factors appears at least once, built greedily from the cells every entry point must run whatever the pairs
need (``FORCED``: its own ``bf16=True`` under FSDP2, and ``torch_compile=True`` beside it: torchtitan's
default stack). No process is started here: ``cases_matrix`` runs the rows, ``test_matrix`` says where.

Values:

- engine: ``raw`` (no engine: the README's loop averages by hand), ``ddp``, ``fsdp2`` (per layer, then the
  root), ``hsdp`` (FSDP2 over a user's mesh: 2 pure replicas x a sequence group of 2), ``zero2``, ``zero3``;
- precision: ``fp32``; ``autocast`` (fp32 weights under bf16 autocast; an entry point's ``bf16=True`` under
  DDP); ``mp`` (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` with its default input
  cast, as torchtitan applies it; an entry point's ``bf16=True`` under FSDP2, Accelerate's policy with its
  autocast; DeepSpeed's ``bf16.enabled``); ``mp_nocast`` (the same policy with ``cast_forward_inputs=False``);
  ``bf16`` (a bf16 model);
- compile: ``off``, ``layers`` (each decoder layer, before the engine wraps it: torchtitan's order),
  ``whole`` (the model, or the engine around it; an entry point's ``torch_compile=True``);
- checkpointing: ``off``; ``hf_reentrant`` and ``hf`` (transformers' ``gradient_checkpointing_enable``,
  reentrant or not); ``wrapper`` (torch's ``checkpoint_wrapper`` on each decoder layer under ringseq's
  ``save_ring`` policy, torchtitan's way); ``engine`` (FSDP's own: torch's ``apply_activation_checkpointing``,
  what Accelerate's ``fsdp_activation_checkpointing`` applies);
- entry: ``raw`` (``ringseq.patch`` and the user's own loop; DeepSpeed through ``ringseq.initialize``),
  ``trainer`` (``ringseq.Trainer``), ``accelerate`` (``ringseq.prepare_accelerator`` and a plain Accelerate
  loop), ``sft`` (``ringseq.SFTTrainer``), ``grpo`` (``ringseq.GRPOTrainer``).
"""
from __future__ import annotations

import functools
import itertools

FACTORS = {
    "engine": ("raw", "ddp", "fsdp2", "hsdp", "zero2", "zero3"),
    "precision": ("fp32", "autocast", "mp", "mp_nocast", "bf16"),
    "compile": ("off", "layers", "whole"),
    "checkpointing": ("off", "hf_reentrant", "hf", "wrapper", "engine"),
    "entry": ("raw", "trainer", "accelerate", "sft", "grpo"),
}
NAMES = tuple(FACTORS)
CLIENTS = ("trainer", "sft", "grpo")
"""The entry points that take their precision, engine and compilation from their own arguments."""

FORCED = tuple({"engine": "fsdp2", "precision": "mp", "compile": compile_, "entry": entry}
               for entry in FACTORS["entry"] for compile_ in ("off", "whole"))
"""Every entry point with its own bf16 under FSDP2, eager and compiled whole (torchtitan's default stack); the
checkpointing of these rows is the greedy choice."""


def why_not(cell: dict) -> str | None:
    """Why a cell cannot be run as it is named (None: it can)."""
    engine, precision, compile_, checkpointing, entry = (cell[n] for n in NAMES)
    fsdp, zero = engine in ("fsdp2", "hsdp"), engine.startswith("zero")
    if engine == "raw" and entry != "raw":
        return "an entry point wraps the model in an engine of its own (DDP at least)"
    if engine == "hsdp" and entry != "raw":
        return "HSDP over a user's mesh is the raw loop's (the clients' FSDP2 shards over every rank)"
    if precision == "mp_nocast" and not (fsdp and entry in ("raw", "accelerate")):
        return "the input cast is a setting of FSDP2's policy, which only the raw loop and Accelerate's plugin take"
    if precision == "mp" and not (fsdp or zero):
        return "a mixed-precision policy is FSDP2's (DeepSpeed: bf16.enabled)"
    if precision == "autocast" and entry != "raw" and engine != "ddp":
        return "an entry point's bf16=True is autocast under DDP only (FSDP2: its policy; DeepSpeed: bf16.enabled)"
    if precision == "bf16" and zero:
        return "DeepSpeed's bf16 is bf16.enabled (precision mp)"
    if checkpointing == "engine" and not fsdp:
        return "the engine's own checkpointing is FSDP's"
    if checkpointing == "engine" and compile_ == "layers" and entry != "raw":
        return ("the clients wrap layers the user compiled already: refused by name (test_matrix), as its recompute "
                "would compile the layer anew")
    return None


def feasible() -> list[dict]:
    cells = [dict(zip(NAMES, values)) for values in itertools.product(*FACTORS.values())]
    return [c for c in cells if why_not(c) is None]


def pairs(cell: dict) -> set:
    return {(a, cell[a], b, cell[b]) for a, b in itertools.combinations(NAMES, 2)}


def _cost(cell: dict) -> int:
    """What a row costs, roughly: clients and world 4 more than the raw loop, compiling more than not."""
    return (cell["entry"] != "raw") * 3 + (cell["entry"] == "grpo") * 3 + (cell["engine"] == "hsdp") * 2 \
        + (cell["compile"] != "off") * 2


def covering() -> list[dict]:
    """A cell for each of ``FORCED``, then the feasible cell that covers the most pairs not yet covered
    (the cheaper on ties), until every feasible pair is covered: greedy, deterministic."""
    cells = feasible()
    need = set().union(*map(pairs, cells))
    rows = []
    for partial in [*FORCED, *([{}] * len(cells))]:
        if not need:
            break
        fits = [c for c in cells if all(c[k] == v for k, v in partial.items())]
        best = max(fits, key=lambda c: (len(pairs(c) & need), -_cost(c)))
        rows.append(best)
        need -= pairs(best)
    return rows


def name(row: dict) -> str:
    return "-".join(row[n] for n in NAMES)


def parse(text: str) -> dict:
    return dict(zip(NAMES, text.split("-")))


ROWS = covering()


def rows_for(entry: str, world: int | None = None) -> list[str]:
    """The rows of one entry point (``world``: those that run at that world size: HSDP needs 4), by name."""
    return [name(r) for r in ROWS if r["entry"] == entry and (world is None or (r["engine"] == "hsdp") == (world == 4))]


def reference_of(row: dict) -> str:
    """The stock TRL run a TRL row is checked against (client_step.py, grpo_step.py), by its arithmetic:
    ``matrix_fp32``, ``matrix_autocast`` (``bf16=True``: fp32 weights under autocast), ``matrix_bf16`` (a bf16
    model) or ``matrix_bf16_autocast`` (a bf16 model under autocast: Accelerate's bf16 policy under FSDP2, which
    computes with bf16 weights under autocast). A mixed-precision row updates fp32 master weights, which no
    one-process stock run has: its reference updates its bf16 weights instead, whose rounding the 2x rule then
    allows (the bf16 equivalent)."""
    precision = row["precision"]
    if precision == "mp":
        return "matrix_bf16_autocast" if row["engine"] in ("fsdp2", "hsdp") else "matrix_bf16"
    return f"matrix_{precision}"


def scenario(item: str) -> tuple[str, str | int | None, dict | None]:
    """A TRL script's scenario argument -> (the scenario whose reference it is checked against, the engine as
    ``stage_of`` names it, the matrix row or None): ``NAME``, ``NAME@STAGE`` (a ZeRO stage or ``fsdp``) or
    ``matrix:ROW`` (a row of this matrix)."""
    if item.startswith("matrix:"):
        row = parse(item.removeprefix("matrix:"))
        return reference_of(row), stage_of(row), row
    name, _, stage = item.partition("@")
    return name, stage or None, None


def stage_of(row: dict):
    """The engine as client_step.py / grpo_step.py name it: None (DDP), "fsdp" (FSDP2) or a ZeRO stage."""
    return {"ddp": None, "fsdp2": "fsdp", "zero2": 2, "zero3": 3}[row["engine"]]


# how a row is applied to a model (here, so that the launched TRL scripts share it)

def layers_of(model):
    return model.model.layers


def checkpoint(model, how: str) -> None:
    """The row's activation checkpointing, on the unwrapped model (before compiling and sharding)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (apply_activation_checkpointing,
                                                                             checkpoint_wrapper)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if how in ("hf", "hf_reentrant"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": how == "hf_reentrant"})
    elif how == "wrapper":  # torchtitan's: each layer in torch's wrapper under ringseq's policy
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        from ringseq.attention.keep import save_ring

        policy = functools.partial(create_selective_checkpoint_contexts, save_ring)
        layers = layers_of(model)
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer, context_fn=policy)
    elif how == "engine":  # FSDP's own, as Accelerate's fsdp_activation_checkpointing applies it
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    model.train()


def compile_layers(model) -> None:
    import torch

    torch._dynamo.reset()
    for layer in layers_of(model):
        layer.compile(backend="aot_eager")
