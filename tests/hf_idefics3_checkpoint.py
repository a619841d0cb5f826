"""A tiny random Idefics3 / SmolVLM checkpoint directory for tests (nothing downloaded).

``make_idefics3_checkpoint(dir, model_type)`` writes what a HuggingFaceTB/SmolVLM-* (``smolvlm``) or
HuggingFaceM4/Idefics3-* (``idefics3``) repo holds, shrunk: config.json (a SigLIP tower at ``side`` px
with 8-px patches, pixel shuffle ``scale_factor`` 2, a Llama text model), model.safetensors, the
tokenizer (the shipped BPE plus ``<fake_token_around_image>``, ``<image>``, ``<global-img>``,
``<row_i_col_j>`` (i, j <= 6) and ``<end_of_utterance>`` as special tokens; SmolVLM's chat template),
preprocessor_config.json from HF's own PIL image processor (longest edge ``tiles * side``, views of
``side`` px, mean / std 0.5, Lanczos) and processor_config.json with the processor's image_seq_len
(the processor itself cannot be saved without torchvision and num2words, see
../shared/notes/model-families.md). ``initializer_range`` 0.2 (not HF's 0.02) makes activations large
enough that a wrong mask, wrong positions or images given to the wrong sample move the loss by nats.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

PATCH = 8

# transformers' SmolVLM DEFAULT_CHAT_TEMPLATE (HuggingFaceTB/SmolVLM-* ship the same)
SMOLVLM = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'] is string %}"
    "{{': ' + message['content']}}{% else %}{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}"
    "{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}"
    "{% endif %}"
)
SPECIAL = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]


def make_idefics3_checkpoint(directory, model_type: str = "smolvlm", initializer_range: float = 0.2, seed: int = 0,
                             side: int = 48, tiles: int = 4, splitting: bool = False, patch: int = PATCH,
                             text: dict | None = None,
                             vision: dict | None = None, image_processor: dict | None = None) -> Path:
    """Write the checkpoint into ``directory`` and return it; ``text`` / ``vision`` / ``image_processor``
    override config and processor fields (the benchmark widens the model with them)."""
    import torch
    from tokenizers import AddedToken
    from transformers import AutoConfig, AutoModelForImageTextToText

    from ray_mmbatch.data.text.tokenizer import load_tokenizer
    from tests.hf_checkpoints import small_text_config

    if model_type == "smolvlm":
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil as Pil
    elif model_type == "idefics3":
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil as Pil
    else:
        raise ValueError(f"model_type must be smolvlm or idefics3, got {model_type!r}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = copy.deepcopy(load_tokenizer(""))  # a copy: load_tokenizer's instance is shared and cached
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL], special_tokens=True)
    if tok.pad_token is None:
        tok.add_special_tokens({"pad_token": "<|pad|>"})
    tok.chat_template = SMOLVLM
    tok.save_pretrained(d)

    text_cfg = small_text_config(tok, initializer_range, 4096, {"model_type": "llama", **(text or {})})
    vision_cfg = {**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         image_size=side, patch_size=patch, initializer_range=initializer_range), **(vision or {})}
    per_image = (side // patch) ** 2 // 4
    config = AutoConfig.for_model(model_type, vision_config=vision_cfg, text_config=text_cfg, scale_factor=2,
                                  image_token_id=tok.convert_tokens_to_ids("<image>"),
                                  initializer_range=initializer_range, tie_word_embeddings=False,
                                  pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    model.save_pretrained(d, safe_serialization=True)

    processor_kw = dict(size={"longest_edge": tiles * side}, max_image_size={"longest_edge": side}, resample=1,
                        do_image_splitting=splitting, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    processor_kw.update(image_processor or {})
    Pil(**processor_kw).save_pretrained(d)
    proc = "SmolVLMProcessor" if model_type == "smolvlm" else "Idefics3Processor"
    (d / "processor_config.json").write_text(json.dumps({"image_seq_len": per_image, "processor_class": proc}))
    return d
