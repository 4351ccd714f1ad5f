"""Does the unpatched model keep packed documents apart? Asked of transformers itself.

transformers isolates packed documents (position ids restarting at 0) only when a model hands
its position ids to mask creation, and not every model does (in 5.23 gpt-oss, Mistral and
Phi-3 do not: their documents see each other). ringseq must do what the unpatched model does,
so at patch time it runs the decoder's own mask creation on a 4-token packed probe (position
ids 0, 1, 0, 1, zero embeddings: no weight is read) and stops at the first mask requested:
transformers turns off its "plain causal" shortcut exactly when it detected packing.
"""
from __future__ import annotations

import contextvars

import torch

from ringseq.errors import RingSeqError

_PROBING = contextvars.ContextVar("ringseq_document_probe", default=False)


class _Probe(Exception):
    def __init__(self, packed: bool):
        super().__init__("ringseq document probe")
        self.packed = packed


def probe_mask_call(kwargs: dict) -> None:
    """Called by ringseq's mask function: during a probe, report and stop the forward (a probe
    runs eagerly, at patch time: under ``torch.compile`` there is none to read)."""
    if not torch.compiler.is_compiling() and _PROBING.get():
        raise _Probe(packed=not kwargs.get("allow_is_causal_skip", True))


def isolates_documents(model) -> bool:
    """True when the unpatched model's masks keep packed documents apart (model must already
    use attn_implementation="ringseq")."""
    decoder = model.get_decoder()
    weight = model.get_input_embeddings().weight
    config = model.config.get_text_config()
    embeds = torch.zeros(1, 4, config.hidden_size, dtype=weight.dtype, device=weight.device)
    position_ids = torch.tensor([[0, 1, 0, 1]], device=weight.device)
    if "mrope_section" in (getattr(config, "rope_parameters", None) or {}):
        # Qwen VL text models read packing from a leading row of text positions ([4, B, S]; ringseq.batch)
        position_ids = position_ids[None].expand(4, 1, 4)
    token = _PROBING.set(True)
    try:
        with torch.no_grad():
            decoder(inputs_embeds=embeds, position_ids=position_ids, use_cache=False)
    except _Probe as probe:
        return probe.packed
    finally:
        _PROBING.reset(token)
    raise RingSeqError(f"{type(model).__name__} built no attention mask through transformers' mask interface; "
                       f"ringseq cannot tell how it treats packed documents")
