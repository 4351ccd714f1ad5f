"""The few numbers of a decoder-only model the planner needs, from a config, a dict or config.json."""
from __future__ import annotations

import dataclasses
import json
import os

from ringseq.errors import RingSeqError

REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Shapes of a Llama-like causal LM (letters of ``ringseq.shapes``)."""

    d: int
    """hidden size"""
    F: int
    """MLP intermediate size (gated: gate, up, down)"""
    L: int
    """layers"""
    H: int
    """query heads"""
    K: int
    """kv heads"""
    D: int
    """head dim"""
    V: int
    """vocabulary"""
    tied: bool = False
    """input and output embeddings shared"""

    @property
    def layer_params(self) -> int:
        """Matmul weights of one layer: q, k, v, o projections and the gated MLP."""
        return 2 * self.d * self.H * self.D + 2 * self.d * self.K * self.D + 3 * self.d * self.F

    @property
    def params(self) -> int:
        """All parameters (norm weights included)."""
        embed = self.V * self.d * (1 if self.tied else 2)
        return self.L * (self.layer_params + 2 * self.d) + embed + self.d


def model_spec(model) -> ModelSpec:
    """``model``: a transformers config (or anything with its attributes), a dict of its fields,
    a path to config.json (or its folder), or a ``ModelSpec``."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, (str, os.PathLike)):
        path = os.path.join(model, "config.json") if os.path.isdir(model) else model
        if not os.path.isfile(path):
            raise RingSeqError(f"no model config at {path!r}: give a config.json path, a dict or a transformers config")
        with open(path) as f:
            model = json.load(f)
    fields = dict(model) if isinstance(model, dict) else {k: getattr(model, k) for k in dir(model)
                                                        if not k.startswith("_") and k in
                                                        REQUIRED + ("num_key_value_heads", "head_dim",
                                                                    "tie_word_embeddings", "text_config")}
    if "text_config" in fields and "hidden_size" not in fields:  # multimodal wrappers keep the LM inside
        return model_spec(fields["text_config"])
    missing = [k for k in REQUIRED if fields.get(k) is None]
    if missing:
        raise RingSeqError(f"model config lacks {missing}: give a Llama-style config with {list(REQUIRED)} "
                           "(num_key_value_heads and head_dim optional)")
    H = int(fields["num_attention_heads"])
    K = int(fields.get("num_key_value_heads") or H)
    D = int(fields.get("head_dim") or fields["hidden_size"] // H)
    if H % K:
        raise RingSeqError(f"num_attention_heads {H} is not a multiple of num_key_value_heads {K}")
    return ModelSpec(d=int(fields["hidden_size"]), F=int(fields["intermediate_size"]),
                     L=int(fields["num_hidden_layers"]),
                     H=H, K=K, D=D, V=int(fields["vocab_size"]), tied=bool(fields.get("tie_word_embeddings", False)))
