"""A tiny random LLaVA-OneVision checkpoint directory for tests (nothing downloaded).

``make_llava_onevision_checkpoint(dir)`` writes what a llava-hf/llava-onevision-*-hf repo holds, shrunk:
config.json (LlavaOnevisionConfig: a SigLIP tower at ``tile`` px with 14-pixel patches, no pooling head,
vision_feature_select_strategy 'full', layer -1; a Qwen2 text model; image_grid_pinpoints of up to
4 x 4 tiles; vision_aspect_ratio 'anyres_max_2' so that big grids are pooled), model.safetensors, the
tokenizer (the shipped BPE plus ``<image>`` and ``<video>``; ONEVISION below, the hub repos' chat
template shortened), preprocessor_config.json from HF's own PIL LlavaOnevisionImageProcessor and
processor_config.json with the processor's num_image_tokens / strategy / aspect setting (the processor
itself cannot be saved without torchvision, see ../shared/notes/model-families.md).
``initializer_range`` 0.2 (not HF's 0.02) makes activations large enough that a wrong mask or wrong
position ids changes the loss visibly; image_newline is redrawn with std 0.2 so it matters too.
"""
from __future__ import annotations

import json
from pathlib import Path

PATCH = 14

# llava-hf/llava-onevision-qwen2-*-ov-hf's chat template shortened (no video branch, no generation tags; the
# generation prompt ends as an assistant turn starts, so that renders are incremental)
ONEVISION = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\n' + content['text'] }}"
    "{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
)


def pinpoints(tile: int, most: int = 4) -> list[list[int]]:
    """Every (rows x cols) grid of ``tile`` px crops with rows, cols <= ``most``, as [h, w] (HF's order)."""
    return [[r * tile, c * tile] for r in range(1, most + 1) for c in range(1, most + 1)]


def make_llava_onevision_checkpoint(directory, initializer_range: float = 0.2, seed: int = 0, tile: int = 42,
                                    anyres_max: int = 2, grid_most: int = 4, text: dict | None = None,
                                    vision: dict | None = None,
                                    image_processor: dict | None = None) -> Path:
    """Write the checkpoint into ``directory`` and return it; ``text`` / ``vision`` / ``image_processor``
    override config and processor fields (the benchmark widens the model with them); ``grid_most``: the most
    crops per side of the pinpoints."""
    import torch
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessorPil,
        Qwen2Config,
        SiglipVisionConfig,
    )

    from tests.hf_checkpoints import small_text_config, start_checkpoint

    d, tok = start_checkpoint(directory, ["<image>", "<video>"], ONEVISION)
    text_cfg = Qwen2Config(**small_text_config(tok, initializer_range, 8192, text))
    vision_cfg = SiglipVisionConfig(**{**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=tile,
        patch_size=PATCH, vision_use_head=False), **(vision or {})})
    grid = pinpoints(tile, grid_most)
    config = LlavaOnevisionConfig(
        vision_config=vision_cfg, text_config=text_cfg, image_token_index=tok.convert_tokens_to_ids("<image>"),
        video_token_index=tok.convert_tokens_to_ids("<video>"), image_grid_pinpoints=grid,
        vision_aspect_ratio=f"anyres_max_{anyres_max}", vision_feature_select_strategy="full",
        vision_feature_layer=-1, initializer_range=initializer_range, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(config)
    with torch.no_grad():
        model.model.image_newline.normal_(0.0, 0.2)
        for m in model.model.vision_tower.modules():  # SigLIP's init ignores initializer_range: make it count
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Embedding)):
                m.weight.normal_(0.0, initializer_range)
    model.save_pretrained(d, safe_serialization=True)

    processor_kw = dict(size={"height": tile, "width": tile}, image_grid_pinpoints=grid)
    processor_kw.update(image_processor or {})
    LlavaOnevisionImageProcessorPil(**processor_kw).save_pretrained(d)
    g = tile // PATCH
    (d / "processor_config.json").write_text(json.dumps({
        "num_image_tokens": g * g, "vision_feature_select_strategy": "full",
        "vision_aspect_ratio": f"anyres_max_{anyres_max}", "processor_class": "LlavaOnevisionProcessor"}))
    return d
