"""What ringseq can patch exactly, checked before anything is changed.

Tested families (tiny random-init configs in tests/integration): Llama, Mistral, Qwen2, Qwen3,
Gemma 2, Gemma 3 text, Phi-3, gpt-oss, the hybrids of ``HYBRID_FAMILIES`` (their recurrent
layers sharded by ``patches.mixers``) and the vision-language models of ``VLM_FAMILIES`` (their
language model sharded, ``patches.vision``). Other decoder-only families pass when every feature they
use is one ringseq reproduces; anything else is listed in one ``RingSeqError``.
"""
from __future__ import annotations

import re

import torch
import transformers

from ringseq import versions
from ringseq.errors import RingSeqError
from ringseq.planner.model_spec import ATTENTION_TYPES, RECURRENT_TYPES, layer_types as model_layer_types

from . import logits as logit_maps, vision
from .mixers import MIXERS

HYBRID_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid", "kimi_linear", "nemotron_h",
                   "granitemoehybrid", "falcon_h1", "bamba", "zamba2", "lfm2", "lfm2_moe")
VLM_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "gemma3", "llava", "idefics3", "smolvlm")
TESTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt_oss", *HYBRID_FAMILIES,
                   *VLM_FAMILIES)
OTHER_TYPES = {"moe", "mlp"}  # nemotron_h's blocks without a sequence mixer
LAYER_TYPES = ATTENTION_TYPES | RECURRENT_TYPES | OTHER_TYPES
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
    """Module types that mix tokens along the sequence other than softmax attention and that
    ringseq cannot shard: causal convolutions (nn.Conv1d) and state-space / recurrent blocks
    outside the mixers ``patches.mixers`` shards exactly."""
    modules = dict(model.named_modules())
    covered = [path for path, m in modules.items() if type(m).__name__ in MIXERS]
    found = set()
    for path, module in modules.items():
        name = type(module).__name__
        if name in MIXERS or hasattr(module, "is_causal"):  # a mixer ringseq shards, or transformers' attention
            continue
        if any(path.startswith(c + ".") or c.startswith(path + ".") or not path for c in covered):
            continue  # inside a mixer ringseq shards (its convolution), or holding one (a decoder layer)
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
    if getattr(config, "audio_config", None) is not None:
        found.append("audio models (ringseq shards text and vision-language models)")
    elif getattr(config, "vision_config", None) is not None and not vision.is_sharded_vlm(model):
        found.append(f"{type(model).__name__} keeps its vision tower and language model in a way ringseq does not "
                     f"know (it shards VLMs whose inner model calls its language model on the merged embeddings: "
                     f"{', '.join(VLM_FAMILIES)})")
    if model.get_output_embeddings() is None:
        found.append(f"{type(model).__name__} has no language-model head (use a *ForCausalLM class)")
    if not model._can_set_attn_implementation():
        found.append(f"{type(model).__name__} does not route attention through transformers' AttentionInterface")
    layer_types = set(model_layer_types(config.get_text_config()))
    if layer_types - LAYER_TYPES:
        found.append(f"layer types {sorted(layer_types - LAYER_TYPES)} (ringseq shards {sorted(LAYER_TYPES)})")
    elif layer_types & RECURRENT_TYPES and not any(type(m).__name__ in MIXERS for m in model.modules()):
        found.append(f"layer types {sorted(layer_types & RECURRENT_TYPES)} run in modules ringseq does not know: "
                     f"it shards the recurrent layers of {', '.join(sorted(set(MIXERS.values())))} "
                     f"({', '.join(HYBRID_FAMILIES)})")
    decoder = model.get_decoder()  # a VLM's vision tower attends bidirectionally and is never sharded
    mixers = sequence_mixers(decoder)
    if mixers:
        found.append(f"sequence-mixing layers ringseq cannot shard ({', '.join(mixers)}): a state-space, "
                     f"convolution or recurrent layer it does not know would mix only this rank's tokens; ringseq "
                     f"shards {', '.join(sorted(MIXERS))}")
    bidirectional = [name for name, m in decoder.named_modules() if getattr(m, "is_causal", True) is False]
    text = config.get_text_config()
    if getattr(text, "use_bidirectional_attention", False) or getattr(text, "is_causal", True) is False:
        found.append("bidirectional attention (ringseq patches causal decoders)")
    elif bidirectional:
        found.append(f"bidirectional attention in {', '.join(bidirectional[:3])}"
                     f"{' ...' if len(bidirectional) > 3 else ''} (is_causal=False; ringseq patches causal decoders)")
    chunk = getattr(text, "attention_chunk_size", None)
    if chunk:
        found.append(f"chunked attention (attention_chunk_size={chunk}, Llama 4: a query sees only the keys of its "
                     f"own {chunk}-token chunk), which ringseq does not reproduce")
    found += logit_maps.problems(model)
    local = _rope_types(text) & LOCAL_ROPE
    if local:
        found.append(f"rope scaling {sorted(local)} (it reads the largest local position id, which differs "
                     f"per rank; use a static rope scaling such as 'linear', 'yarn' or 'llama3')")
    return found


def check(model) -> None:
    found = problems(model)
    if found:
        listing = "\n  - ".join(found)
        raise RingSeqError(f"ringseq cannot patch {type(model).__name__} ({config_name(model)}) exactly:\n"
                           f"  - {listing}")


def config_name(model) -> str:
    return getattr(model.config, "model_type", "unknown model type")
