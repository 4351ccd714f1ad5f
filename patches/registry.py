"""Registration of ringseq's attention with transformers (no function is overwritten).

Why registration and not assignment: transformers looks attention up through
``AttentionInterface`` and masks through ``AttentionMaskInterface``; both keep a class-level
mapping that ``register`` updates. Item assignment into a mask mapping instance is silently
ignored, and an implementation whose name has no registered mask function makes transformers
skip mask creation altogether, which would silently drop padding. So both are registered.

Why the name "ringseq": transformers branches on substrings of the implementation name
("flash", "sdpa", "flex_attention", "paged|", "/" for hub kernels) to pick input preparation
and mask formats; a name with none of them gets exactly the generic path we rely on.
"""
from __future__ import annotations

from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from .hf_attention import attention_forward, mask_function

NAME = "ringseq"


def register() -> None:
    """Make ``attn_implementation="ringseq"`` available (idempotent)."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_function)
