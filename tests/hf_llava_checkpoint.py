"""A tiny random LLaVA-1.5 checkpoint directory for tests (nothing downloaded).

``make_llava_checkpoint(dir)`` writes what a llava-hf/llava-1.5-*-hf repo holds, shrunk:
config.json (LlavaConfig: CLIP vision tower at ``image_size`` with 14-pixel patches, a Llama
text model), model.safetensors, the tokenizer (the shipped BPE plus an ``<image>`` special
token, chat template tests/chat_templates.LLAVA) and preprocessor_config.json from HF's own
CLIP image processor (shortest edge to S, centre crop S x S, bicubic, CLIP mean/std).
``initializer_range`` 0.2 (not HF's 0.02) makes activations large enough that a wrong mask or
wrong position ids changes the loss visibly, so the exactness tests can fail.
"""
from __future__ import annotations

from pathlib import Path

PATCH = 14


def make_llava_checkpoint(directory, initializer_range: float = 0.2, seed: int = 0, image_size: int = 56,
                          select_strategy: str = "default", image_processor: dict | None = None) -> Path:
    """Write the checkpoint into ``directory`` and return it; ``image_processor`` overrides processor fields."""
    import torch
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    from tests.chat_templates import LLAVA
    from tests.hf_checkpoints import small_text_config, start_checkpoint

    d, tok = start_checkpoint(directory, ["<image>"], LLAVA)

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=image_size, patch_size=PATCH, projection_dim=32,
                              initializer_range=initializer_range)
    text = LlamaConfig(**small_text_config(tok, initializer_range, 512))
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                         image_seq_length=(image_size // PATCH) ** 2 + (select_strategy == "full"),
                         vision_feature_select_strategy=select_strategy, vision_feature_layer=-2,
                         initializer_range=initializer_range)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.save_pretrained(d, safe_serialization=True)

    processor_kw = {"size": {"shortest_edge": image_size}, "crop_size": {"height": image_size, "width": image_size}}
    processor_kw.update(image_processor or {})
    CLIPImageProcessorPil(**processor_kw).save_pretrained(d)
    return d
