"""What the client-stack tests share: a tokenizer, a tiny Llama and datasets, all built in code
(no hub), identically in the one-process reference runs and in the launched ringseq runs."""
from __future__ import annotations

import torch

WORDS = [f"w{i}" for i in range(48)]
SPECIAL = ["<pad>", "<eos>", "<unk>", "<user>", "<assistant>"]
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<assistant> {% generation %}"
                 "{{ m['content'] }} <eos>{% endgeneration %} {% else %}<user> {{ m['content'] }} {% endif %}"
                 "{% endfor %}")


def tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    out.chat_template = CHAT_TEMPLATE
    return out


def tiny_llama(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(SPECIAL) + len(WORDS), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None, max_position_embeddings=1024)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(dtype)


# A LLaVA processor and model made in code: the tokenizer knows the image token, the chat template
# renders an image entry as one, CLIP's image processor keeps 8 x 8 pictures, whose 2 x 2 patches
# make 16 placeholder tokens (the class token dropped). (Qwen's processors need torchvision.)
IMAGE_TOKEN = "<image>"
VLM_TEMPLATE = ("{% for m in messages %}{{ '<user> ' if m['role'] == 'user' else '<assistant> ' }}"
                "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }} {% endif %}"
                "{% endfor %}{% if m['role'] == 'assistant' %}<eos> {% endif %}{% endfor %}")


def vlm_processor():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS + [IMAGE_TOKEN])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    text = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   extra_special_tokens={"image_token": IMAGE_TOKEN})
    images = CLIPImageProcessor(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8})
    return LlavaProcessor(image_processor=images, tokenizer=text, patch_size=2, vision_feature_select_strategy="default",
                          image_token=IMAGE_TOKEN, num_additional_image_tokens=1, chat_template=VLM_TEMPLATE)


def tiny_vlm(dtype=torch.float32):
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    text = dict(model_type="llama", vocab_size=len(SPECIAL) + len(WORDS) + 1, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                pad_token_id=0, eos_token_id=1, bos_token_id=None, use_cache=False)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, image_size=8, patch_size=2, projection_dim=32)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=len(SPECIAL) + len(WORDS),
                         image_seq_length=16, vision_feature_layer=-1)
    config.use_cache = False
    # a ZeRO-3 run earlier in the process leaves transformers' DeepSpeed config set, and LLaVA builds its tower and
    # language model through AutoModel.from_config, which would partition them (zero.Init) with other random weights
    # than the reference run's: build it as a fresh process would (the scenario's own arguments set it again)
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    return LlavaForConditionalGeneration(config).to(dtype)


def _words(g, lo, hi):
    n = int(torch.randint(lo, hi, (1,), generator=g))
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())


def dataset(kind: str, n: int, seed: int):
    """``text`` (language modeling), ``prompt_completion`` or ``messages`` (conversational) rows."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    if kind == "text":
        rows = [{"text": _words(g, 8, 40)} for _ in range(n)]
    elif kind == "prompt_completion":
        rows = [{"prompt": _words(g, 4, 20), "completion": _words(g, 4, 20)} for _ in range(n)]
    elif kind == "vlm":  # conversations about one or two small pictures (TRL's vision datasets: messages + images)
        import numpy as np
        from PIL import Image

        rows = []
        for _ in range(n):
            count = int(torch.randint(1, 3, (1,), generator=g))
            pictures = [Image.fromarray(np.asarray(torch.randint(0, 256, (8, 8, 3), generator=g, dtype=torch.uint8)))
                        for _ in range(count)]
            user = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": _words(g, 4, 16)}]
            rows.append({"messages": [{"role": "user", "content": user},
                                      {"role": "assistant", "content": [{"type": "text", "text": _words(g, 4, 16)}]}],
                         "images": pictures})
    elif kind == "messages":
        rows = [{"messages": [{"role": "user", "content": _words(g, 4, 16)},
                              {"role": "assistant", "content": _words(g, 4, 16)}]} for _ in range(n)]
    else:
        raise ValueError(kind)
    return Dataset.from_list(rows)


def named_trainable(model) -> dict:
    """The trainable parameters by name (a PEFT model: its adapter), detached CPU copies."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


# Each scenario: the dataset kind and the SFTConfig settings beside the common ones. SGD, not
# AdamW: a first Adam step moves every weight by ~lr * sign(gradient), so a gradient that is
# zero up to rounding moves by +-lr either way and no rounding-level comparison could hold.
SFT_SCENARIOS = {
    "packing": dict(data="text", packing=True, gradient_accumulation_steps=2, eval=True),
    "padded": dict(data="text", eval=True),
    "padding_free": dict(data="text", padding_free=True, max_length=None),
    "completion": dict(data="prompt_completion"),
    "assistant": dict(data="messages", assistant_only_loss=True),
    "dft": dict(data="text", loss_type="dft", compile=True),  # ringseq's run with torch_compile=True (aot_eager)
    "peft": dict(data="text", peft=True),
    "model_id": dict(data="text", model_id=True),
    "bf16": dict(data="text", bf16=True),
    "vlm": dict(data="vlm", vlm=True, max_length=None, eval=True),
    "vlm_peft": dict(data="vlm", vlm=True, max_length=None, peft=True, gradient_checkpointing=True),
    "vlm_bf16": dict(data="vlm", vlm=True, max_length=None, bf16=True),
    # the references of the GPU user's matrix (matrix.reference_of): stock TRL in a row's arithmetic, two steps (a
    # row checks the configuration, the scenarios above check SFT)
    **{f"matrix_{name}": dict(data="text", max_steps=2, **arithmetic)
       for name, arithmetic in (("fp32", {}), ("autocast", {"bf16": True}), ("bf16", {"model_dtype": "bf16"}),
                                ("bf16_autocast", {"bf16": True, "model_dtype": "bf16"}))},
}
METRICS = ("loss", "entropy", "mean_token_accuracy", "num_tokens", "eval_loss", "eval_entropy",
           "eval_mean_token_accuracy", "eval_accuracy")


def sft_config(name: str, out_dir: str, **extra):
    from trl import SFTConfig

    s = {k: v for k, v in SFT_SCENARIOS[name].items()
         if k not in ("data", "eval", "peft", "model_id", "vlm", "compile", "model_dtype")}
    s.setdefault("bf16", False)
    s.setdefault("max_length", 64)
    s.update(extra)
    return SFTConfig(**{**dict(output_dir=out_dir, max_steps=3, per_device_train_batch_size=2,
                               per_device_eval_batch_size=2, learning_rate=0.5, lr_scheduler_type="constant",
                               optim="sgd", weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, report_to=[],
                               disable_tqdm=True, save_strategy="no", seed=0, dataloader_drop_last=False), **s})


def lora(vlm: bool = False):
    """LoRA on q/v (of a VLM's language model only: a regex over the module names)."""
    from peft import LoraConfig

    targets = r".*language_model.*\.(q_proj|v_proj)" if vlm else ["q_proj", "v_proj"]
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights="gaussian")


def run_clm_preprocess(logits, labels):
    """transformers' examples/pytorch/language-modeling/run_clm.py: preprocess_logits_for_metrics."""
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def run_clm_metrics(eval_preds):
    """run_clm.py's compute_metrics: token accuracy of the shifted predictions (its ``evaluate``
    accuracy metric, written out: the mean of prediction == reference over every position)."""
    preds, labels = eval_preds
    labels = labels[:, 1:].reshape(-1)
    preds = preds[:, :-1].reshape(-1)
    return {"accuracy": float((preds == labels).mean())}


def plain_dtype(spec: dict):
    """The stock run's model dtype for a scenario (its float64 twin is the exact one)."""
    return torch.bfloat16 if spec.get("model_dtype") == "bf16" else torch.float32


def matrix_run(model, row: dict | None) -> dict:
    """A matrix row's settings for a TRL trainer beside its scenario's (matrix.py; ringseq's run only: the
    stock reference computes the same arithmetic eagerly and without checkpointing): the model's layers
    compiled or wrapped as the user would hand them over, and the trainer's own arguments (FSDP's activation
    checkpointing, transformers' checkpointing, ``torch_compile``)."""
    if row is None:
        return {}
    from matrix import checkpoint, compile_layers

    how = row["checkpointing"]
    args = {"gradient_checkpointing": how in ("hf", "hf_reentrant")}  # TRL's configs enable it by default
    if how in ("hf", "hf_reentrant"):
        args["gradient_checkpointing_kwargs"] = {"use_reentrant": how == "hf_reentrant"}
    elif how == "wrapper":
        checkpoint(model, how)
    if row["compile"] == "layers":
        compile_layers(model)
    elif row["compile"] == "whole":
        torch._dynamo.reset()
        args.update(torch_compile=True, torch_compile_backend="aot_eager")
    if row["precision"] == "mp":
        args["bf16"] = True
    return args
