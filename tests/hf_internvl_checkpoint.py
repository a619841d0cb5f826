"""A tiny random InternVL checkpoint directory for tests (nothing downloaded).

``make_internvl_checkpoint(dir)`` writes what an OpenGVLab/InternVL3-*-hf repo holds, shrunk:
config.json (InternVLConfig: InternViT at ``tile`` px with 14-pixel patches, pixel shuffle 0.5,
a Qwen2 text model), model.safetensors, the tokenizer (the shipped BPE plus <img>, </img> and
<IMG_CONTEXT> as special tokens, named start / end / context image token as HF's InternVL
tokenizers name them; the hub repos' chat template, INTERNVL below), preprocessor_config.json
from HF's own PIL GotOcr2 image processor (tiles of ``tile`` px, ImageNet mean / std, up to
``max_patches`` tiles) and processor_config.json with the processor's image_seq_length (the
processor itself cannot be saved without torchvision, see ../shared/notes/model-families.md).
``initializer_range`` 0.2 (not HF's 0.02) makes activations large enough that a wrong mask or
wrong position ids changes the loss visibly; InternViT's CLS token and position embeddings,
which HF initializes to zero, are redrawn with std 0.2 so that they matter too.
"""
from __future__ import annotations

import json
from pathlib import Path

PATCH = 14

# OpenGVLab/InternVL3-*-hf's chat template (transformers' convert_internvl_weights_to_hf writes it)
INTERNVL = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)
IMAGE_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>"}


def make_internvl_checkpoint(directory, initializer_range: float = 0.2, seed: int = 0, tile: int = 56,
                             max_patches: int = 6, text: dict | None = None, vision: dict | None = None,
                             image_processor: dict | None = None) -> Path:
    """Write the checkpoint into ``directory`` and return it; ``text`` / ``vision`` / ``image_processor``
    override config and processor fields (the benchmark widens the model with them)."""
    import torch
    from transformers import (
        GotOcr2ImageProcessorPil,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLVisionConfig,
        Qwen2Config,
    )

    from tests.hf_checkpoints import small_text_config, start_checkpoint

    d, tok = start_checkpoint(directory, list(IMAGE_TOKENS.values()), INTERNVL, extra_special_tokens=IMAGE_TOKENS)
    text_cfg = Qwen2Config(**small_text_config(tok, initializer_range, 4096, text))
    vision_cfg = InternVLVisionConfig(**{**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=tile,
        patch_size=PATCH, initializer_range=initializer_range, layer_scale_init_value=1.0), **(vision or {})})
    per_tile = (tile // PATCH) ** 2 // 4
    config = InternVLConfig(vision_config=vision_cfg, text_config=text_cfg, downsample_ratio=0.5,
                            image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=per_tile,
                            tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config)
    with torch.no_grad():  # HF zero-initializes these: redraw them so a wrong tile order shows
        emb = model.model.vision_tower.embeddings
        emb.cls_token.normal_(0.0, 0.2)
        emb.position_embeddings.normal_(0.0, 0.2)
    model.save_pretrained(d, safe_serialization=True)

    processor_kw = dict(size={"height": tile, "width": tile}, crop_to_patches=False, min_patches=1,
                        max_patches=max_patches, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    processor_kw.update(image_processor or {})
    GotOcr2ImageProcessorPil(**processor_kw).save_pretrained(d)
    (d / "processor_config.json").write_text(json.dumps({"image_seq_length": per_tile,
                                                        "processor_class": "InternVLProcessor"}))
    return d
