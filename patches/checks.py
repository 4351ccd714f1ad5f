"""What ringseq can patch exactly, checked before anything is changed.

Tested families (tiny random-init configs in tests/integration): Llama, Mistral, Qwen2, Qwen3,
Gemma 2, Gemma 3 text, Phi-3, gpt-oss. Other decoder-only families pass when every feature
they use is one ringseq reproduces; anything else is listed in one ``RingSeqError``.
"""
from __future__ import annotations

import re

import torch
import transformers

from ringseq import versions
from ringseq.errors import RingSeqError

TESTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt_oss")
LAYER_TYPES = {"full_attention", "sliding_attention"}
# rope variants that size their frequencies from the largest position id the layer sees:
# each rank sees only its shard, so ranks would disagree with each other and with one device
LOCAL_ROPE = {"dynamic", "longrope"}


def _rope_types(config) -> set[str]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        return {p.get("rope_type", p.get("type", "default")) for p in params.values()}
    return {params.get("rope_type", params.get("type", "default"))} if isinstance(params, dict) else set()


# Class-name fragments of layers that mix tokens along the sequence without attention (state
# spaces, linear attention, recurrences); older configs do not list them in layer_types.
# Case-sensitive CamelCase fragments, so that e.g. "GptOss" does not read as "SSM".
MIXER_NAMES = re.compile(r"Mamba|SSM|Ssm[A-Z]|Mixer|DeltaNet|LinearAttention|Rwkv|RWKV|Retention|Hyena|ShortConv|"
                         r"Xlstm|xLSTM")


def sequence_mixers(model) -> list[str]:
    """Module types that mix tokens along the sequence other than softmax attention: causal
    convolutions (nn.Conv1d) and state-space / recurrent blocks."""
    found = set()
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, torch.nn.Conv1d) or MIXER_NAMES.search(name):
            found.add(name)
    return sorted(found)


def problems(model) -> list[str]:
    """Everything about ``model`` that ringseq cannot compute exactly (empty: patchable)."""
    config = model.config
    found = []
    # CI runs the HF tests on the oldest and the newest transformers of the range
    found += [p for p in (versions.problem("transformers", transformers.__version__),) if p]
    if type(model).__module__.startswith("peft"):
        found += [p for p in (versions.problem("peft"),) if p]
    if getattr(config, "is_encoder_decoder", False):
        found.append("encoder-decoder models (only decoder-only causal LMs are supported)")
    if any(getattr(config, name, None) is not None for name in ("vision_config", "audio_config")):
        found.append("multimodal models (patch the text model, e.g. Gemma3ForCausalLM)")
    if model.get_output_embeddings() is None:
        found.append(f"{type(model).__name__} has no language-model head (use a *ForCausalLM class)")
    if not model._can_set_attn_implementation():
        found.append(f"{type(model).__name__} does not route attention through transformers' AttentionInterface")
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - LAYER_TYPES:
        found.append(f"layer types {sorted(layer_types - LAYER_TYPES)} (linear-attention, Mamba or other "
                     f"non-softmax layers; supported: {sorted(LAYER_TYPES)})")
    mixers = sequence_mixers(model)
    if mixers:
        found.append(f"sequence-mixing layers other than attention ({', '.join(mixers)}): a state-space, "
                     f"convolution or recurrent layer would mix only this rank's tokens")
    bidirectional = [name for name, m in model.named_modules() if getattr(m, "is_causal", True) is False]
    if getattr(config, "use_bidirectional_attention", False) or getattr(config, "is_causal", True) is False:
        found.append("bidirectional attention (ringseq patches causal decoders)")
    elif bidirectional:
        found.append(f"bidirectional attention in {', '.join(bidirectional[:3])}"
                     f"{' ...' if len(bidirectional) > 3 else ''} (is_causal=False; ringseq patches causal decoders)")
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk:
        found.append(f"chunked attention (attention_chunk_size={chunk}, Llama 4: a query sees only the keys of its "
                     f"own {chunk}-token chunk), which ringseq does not reproduce")
    local = _rope_types(config) & LOCAL_ROPE
    if local:
        found.append(f"rope scaling {sorted(local)} (it reads the largest local position id, which differs "
                     f"per rank; use a static rope scaling such as 'linear', 'yarn' or 'llama3')")
    if getattr(config, "output_router_logits", False):
        found.append("output_router_logits=True (the router auxiliary loss would be computed on local "
                     "tokens only); set config.output_router_logits = False")
    return found


def check(model) -> None:
    found = problems(model)
    if found:
        listing = "\n  - ".join(found)
        raise RingSeqError(f"ringseq cannot patch {type(model).__name__} ({config_name(model)}) exactly:\n"
                           f"  - {listing}")


def config_name(model) -> str:
    return getattr(model.config, "model_type", "unknown model type")
