"""What a family does to its LM head's output before the loss, so that the patched forward's
chunked loss, its logits and its metrics apply it too.

transformers' causal LMs compute ``logits = lm_head(hidden)`` and most stop there; some scale
them (Falcon-H1 multiplies by ``lm_head_multiplier``, the Granite families divide by
``config.logits_scaling``), soft-cap them (Gemma 2 and 3: ``final_logit_softcapping``, handled by
the loss itself) or upcast them (Nemotron-H). A config that names a logit scaling ringseq does
not know for its family is refused (``problems``), never ignored.
"""
from __future__ import annotations

import torch

SCALINGS = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
"""Config fields that scale a head's output in some family."""
GRANITE = ("granite", "granitemoe", "granitemoehybrid", "granitemoeshared")


def finisher(model):
    """The function the family applies to ``lm_head(hidden)`` (None: none), as its forward does."""
    config = model.config.get_text_config()
    kind = getattr(config, "model_type", "")
    if kind == "falcon_h1":
        m = getattr(getattr(model, "model", None), "lm_head_multiplier", getattr(config, "lm_head_multiplier", 1.0))
        return None if m == 1 else (lambda logits: logits * m)
    if kind in GRANITE:
        s = getattr(config, "logits_scaling", 1.0)
        return None if s == 1 else (lambda logits: logits / s)
    return None


def upcasts(model) -> bool:
    """Whether the family returns float32 logits whatever its dtype (Nemotron-H)."""
    return getattr(model.config.get_text_config(), "model_type", "") == "nemotron_h"


def problems(model) -> list[str]:
    config = model.config.get_text_config()
    kind = getattr(config, "model_type", "")
    known = {"falcon_h1": ("lm_head_multiplier",), **{k: ("logits_scaling",) for k in GRANITE}}.get(kind, ())
    odd = [n for n in SCALINGS if n not in known and getattr(config, n, None) not in (None, 1, 1.0)]
    named = ", ".join(f"{n}={getattr(config, n)}" for n in odd)
    return [f"a logit scaling ringseq does not know for {kind} ({named}): its loss would miss it"] if odd else []


def final_softcap(model_config):
    """The final logit softcap of a model's language model (a VLM keeps it in its text config)."""
    return getattr(model_config.get_text_config(), "final_logit_softcapping", None)


def head_logits(model, hidden):
    """The logits the unpatched model returns for ``hidden``: the head, the family's finish, its
    upcast, the final softcap."""
    logits = model.get_output_embeddings()(hidden)
    finish = finisher(model)
    if finish is not None:
        logits = finish(logits)
    if upcasts(model):
        logits = logits.float()
    cap = final_softcap(model.config)
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    return logits
