"""The few numbers of a decoder-only model the planner needs, from a config, a dict or config.json."""
from __future__ import annotations

import dataclasses
import json
import os

from ringseq.errors import RingSeqError

REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecurrentSpec:
    """The recurrent layers of a hybrid (gated DeltaNet / KDA, Mamba2, short convolutions)."""

    kind: str
    """"delta" (a K x V state per head), "mamba2" (P x N per head) or "conv" (no state)."""
    layers: int
    heads: int
    """Value heads (delta), heads (Mamba2)."""
    key_heads: int
    """Key heads (delta; the head all-to-all needs P to divide them), Mamba2's heads."""
    rows: int
    """State rows per head: the key dim (delta), the state size N (Mamba2)."""
    cols: int
    """State columns per head: the value dim (delta), the head dim (Mamba2)."""
    channels: int
    """Channels of the causal convolution in front (its halo: width - 1 tokens of them)."""
    width: int
    chunk: int = 64
    """Tokens per chunk of the family's kernel (the delta rule's 64; Mamba2's mamba_chunk_size)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Shapes of a Llama-like causal LM, or of a hybrid whose ``recurrent`` layers take the place of
    some attention layers (letters of ``ringseq.shapes``)."""

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
    recurrent: RecurrentSpec | None = None
    """A hybrid's recurrent layers."""
    attention: int | None = None
    """Layers with softmax attention (None: all L; a hybrid's pattern says: Falcon-H1 has attention
    beside Mamba2 in every layer, Nemotron-H blocks of only an MLP have none)."""

    @property
    def attention_layers(self) -> int:
        return self.L if self.attention is None else self.attention

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
    wanted = REQUIRED + ("num_hidden_layers", "num_key_value_heads", "head_dim", "tie_word_embeddings", "text_config")
    fields = dict(model) if isinstance(model, dict) else {k: getattr(model, k) for k in dir(model)
                                                        if not k.startswith("_") and k in wanted + HYBRID}
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
    L = int(fields.get("num_hidden_layers") or len(layer_types(fields)))
    if L < 1:
        raise RingSeqError("model config lacks num_hidden_layers (or a layer_types list)")
    return ModelSpec(d=int(fields["hidden_size"]), F=int(fields["intermediate_size"]), L=L,
                     H=H, K=K, D=D, V=int(fields["vocab_size"]), tied=bool(fields.get("tie_word_embeddings", False)),
                     recurrent=recurrent_spec(fields, L), attention=attention_layers(fields, L))


HYBRID = ("layer_types", "layers_block_type", "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim",
          "linear_value_head_dim", "linear_conv_kernel_dim", "linear_num_heads", "linear_head_dim", "mamba_n_heads",
          "mamba_num_heads", "mamba_d_head", "mamba_head_dim", "mamba_d_state", "ssm_state_size", "mamba_d_conv",
          "conv_kernel", "mamba_expand", "mamba_d_ssm", "mamba_n_groups", "n_groups", "conv_L_cache", "model_type",
          "attn_layer_indices", "mamba_chunk_size", "chunk_size", "n_mamba_heads", "mamba_headdim", "mamba_ngroups")
RECURRENT_TYPES = {"linear_attention", "mamba", "conv", "hybrid"}
ATTENTION_TYPES = {"full_attention", "sliding_attention", "attention", "hybrid"}
"""Layer kinds of the families' ``layer_types`` / ``layers_block_type`` (``hybrid``: both at once,
Falcon-H1); ``patches.checks`` reads the same sets."""


def layer_types(fields) -> list:
    """A config's layer kinds (a dict of its fields or the config), under either name families use."""
    for name in ("layer_types", "layers_block_type"):
        value = fields.get(name) if isinstance(fields, dict) else getattr(fields, name, None)
        if isinstance(value, (list, tuple)) and value:
            return list(value)
    return []


def attention_layers(fields: dict, L: int) -> int | None:
    """Layers with softmax attention, when a hybrid's pattern says (None: all of them)."""
    types = layer_types(fields)
    if fields.get("model_type") == "falcon_h1":
        return L
    if fields.get("attn_layer_indices") is not None and not types:  # bamba
        return len(fields["attn_layer_indices"])
    return sum(t in ATTENTION_TYPES for t in types) if types else None


def recurrent_spec(fields: dict, L: int) -> RecurrentSpec | None:
    """The recurrent layers a config describes (its layer pattern and its family's fields)."""
    types = layer_types(fields)
    layers = sum(t in RECURRENT_TYPES for t in types)
    if fields.get("model_type") == "falcon_h1":
        layers = L  # Mamba2 beside attention in every layer
    if fields.get("attn_layer_indices") is not None and not types:  # bamba
        layers = L - len(fields["attn_layer_indices"])
    if not layers:
        return None
    d = int(fields["hidden_size"])
    if fields.get("linear_num_value_heads") or fields.get("linear_num_heads"):  # gated DeltaNet, KDA
        heads = int(fields.get("linear_num_value_heads") or fields["linear_num_heads"])
        key_heads = int(fields.get("linear_num_key_heads") or heads)
        dk = int(fields.get("linear_key_head_dim") or fields["linear_head_dim"])
        dv = int(fields.get("linear_value_head_dim") or fields.get("linear_head_dim") or dk)
        return RecurrentSpec(kind="delta", layers=layers, heads=heads, key_heads=key_heads, rows=dk, cols=dv,
                             channels=2 * key_heads * dk + heads * dv,
                             width=int(fields.get("linear_conv_kernel_dim") or 4))
    mamba_heads = fields.get("mamba_n_heads") or fields.get("mamba_num_heads") or fields.get("n_mamba_heads")
    if mamba_heads:
        heads = int(mamba_heads)
        inner = int(fields.get("mamba_d_ssm") or fields.get("mamba_expand", 2) * d)
        dh = fields.get("mamba_d_head") or fields.get("mamba_head_dim") or fields.get("mamba_headdim")
        dh = int(dh) if isinstance(dh, int) else inner // heads
        n = int(fields.get("mamba_d_state") or fields.get("ssm_state_size") or 128)
        groups = int(fields.get("mamba_n_groups") or fields.get("n_groups") or fields.get("mamba_ngroups") or 1)
        return RecurrentSpec(kind="mamba2", layers=layers, heads=heads, key_heads=heads, rows=n, cols=dh,
                             channels=heads * dh + 2 * groups * n,
                             width=int(fields.get("mamba_d_conv") or fields.get("conv_kernel") or 4),
                             chunk=int(fields.get("mamba_chunk_size") or fields.get("chunk_size") or 256))
    if fields.get("conv_L_cache"):
        return RecurrentSpec(kind="conv", layers=layers, heads=1, key_heads=1, rows=0, cols=0, channels=d,
                             width=int(fields["conv_L_cache"]))
    raise RingSeqError("the config has recurrent layers of a family the planner does not know")
