"""Tiny random Qwen-VL checkpoint directories for tests (nothing downloaded); what the other families' makers
(tests/hf_*_checkpoint.py) share: ``start_checkpoint``, ``small_text_config``.

``make_qwen_checkpoint(dir, model_type)`` writes what a Qwen/Qwen2-VL, Qwen2.5-VL or Qwen3-VL
repo holds, shrunk: config.json (text model 64 wide, 2 layers, 4 heads of 16 with an M-RoPE
section that sums to 8; vision tower 2 blocks of 32), model.safetensors, the tokenizer (the
shipped BPE, whose <|im_start|> / <|vision_start|> / <|image_pad|> / <|vision_end|> ids the
config names, plus a <|video_pad|> for video_token_id; chat template tests/chat_templates.QWEN2_VL)
and preprocessor_config.json from HF's own Qwen2-VL PIL image processor with small
min/max pixels (4 .. 64 merged tokens per image). Family specifics kept: Qwen2.5-VL's windowed
vision attention (block 0 windowed, block 1 full), Qwen3-VL's 16-pixel patches, learned
position grid, deepstack features into both text layers and interleaved M-RoPE.
``initializer_range`` 0.2 (not HF's 0.02) makes activations large enough that a wrong mask or
wrong position ids changes the loss visibly, so the exactness tests can fail.
"""
from __future__ import annotations

import copy
from pathlib import Path

QWEN_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
_QWEN3 = ("qwen3_vl", "qwen3_vl_moe")  # MoE: Qwen3-VL's vision side and layout, 4 experts of 32, top 2, every layer
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 2, 4, 2, 16


def _text_config(model_type: str, vocab: int, tok, init: float) -> dict:
    mrope = ({"mrope_section": [4, 2, 2], "mrope_interleaved": True} if model_type in _QWEN3
             else {"mrope_section": [2, 3, 3]})  # sums to HEAD_DIM / 2
    text = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=2048,
                initializer_range=init, rms_norm_eps=1e-6, pad_token_id=tok.pad_token_id,
                bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **mrope})
    if model_type in _QWEN3:
        text["head_dim"] = HEAD_DIM
    if model_type == "qwen3_vl_moe":
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    return text


def _vision_config(model_type: str, init: float) -> dict:
    if model_type == "qwen2_vl":
        return dict(depth=2, embed_dim=32, hidden_size=HIDDEN, mlp_ratio=2, num_heads=2, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, initializer_range=init)
    if model_type == "qwen2_5_vl":
        # window 56 px = 2x2 merged tokens: images of more than one window really are windowed
        return dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=HIDDEN, window_size=56,
                    fullatt_block_indexes=[1], initializer_range=init)
    return dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                temporal_patch_size=2, out_hidden_size=HIDDEN, num_position_embeddings=64,
                deepstack_visual_indexes=[0, 1], initializer_range=init)


def start_checkpoint(directory, special: list[str], chat_template: str, **kwargs):
    """(the checkpoint directory, made; its tokenizer): the shipped BPE (a fresh copy: load_tokenizer's is shared)
    plus ``special`` tokens, a pad token if it has none and ``chat_template``, saved there; ``kwargs`` go to
    from_pretrained."""
    from transformers import PreTrainedTokenizerFast

    from ray_mmbatch.data.text.tokenizer import SHIPPED_TOKENIZER

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = PreTrainedTokenizerFast.from_pretrained(str(SHIPPED_TOKENIZER), **kwargs)
    tok.add_special_tokens({"additional_special_tokens": list(special)})
    if tok.pad_token is None:
        tok.add_special_tokens({"pad_token": "<|pad|>"})
    tok.chat_template = chat_template
    tok.save_pretrained(d)
    return d, tok


def save_random_model(d: Path, model_type: str, text_config: dict, vision_config: dict, initializer_range: float,
                      seed: int, ids: dict):
    """A random ``model_type`` model (untied embeddings; ``ids``: config.json's token ids) drawn with ``seed`` and saved
    into ``d``; returns its config."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model(model_type, text_config=text_config, vision_config=vision_config,
                                  initializer_range=initializer_range, tie_word_embeddings=False, **ids)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(d, safe_serialization=True)
    return config


def small_text_config(tok, initializer_range: float, max_positions: int, overrides: dict | None = None) -> dict:
    """The text model's config fields of the tiny checkpoints (64 wide, 2 layers, 4 heads, 2 KV heads, untied
    embeddings over the whole tokenizer ``tok``), ``overrides`` last (the benchmarks widen the model)."""
    return {**dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                   initializer_range=initializer_range, pad_token_id=tok.pad_token_id, tie_word_embeddings=False),
            **(overrides or {})}


def make_qwen_checkpoint(directory, model_type: str, initializer_range: float = 0.2, seed: int = 0,
                         image_processor: dict | None = None, text: dict | None = None) -> Path:
    """Write the checkpoint into ``directory`` and return it; ``image_processor`` overrides processor fields,
    ``text`` text_config fields (benchmarks/bench_train.py widens the model)."""
    from tokenizers import AddedToken
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ray_mmbatch.data.text.tokenizer import load_tokenizer
    from tests.chat_templates import QWEN2_VL

    if model_type not in QWEN_MODEL_TYPES:
        raise ValueError(f"model_type must be one of {QWEN_MODEL_TYPES}, got {model_type!r}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = copy.deepcopy(load_tokenizer(""))  # a copy: load_tokenizer's instance is shared and cached
    tok.add_tokens([AddedToken("<|video_pad|>", special=True, normalized=False)], special_tokens=True)
    tok.chat_template = QWEN2_VL
    tok.save_pretrained(d)

    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    vocab = -(-len(tok) // 8) * 8  # HF checkpoints pad the vocabulary beyond the tokenizer, too
    text_config = {**_text_config(model_type, vocab, tok, initializer_range), **(text or {})}
    vision_config = dict(_vision_config(model_type, initializer_range),
                         **({"out_hidden_size": text_config["hidden_size"]} if model_type in _QWEN3 else {}))
    config = save_random_model(d, model_type, text_config, vision_config, initializer_range, seed, ids)

    patch = config.vision_config.patch_size
    factor = patch * config.vision_config.spatial_merge_size
    processor_kw = {"patch_size": patch, "merge_size": config.vision_config.spatial_merge_size,
                    "temporal_patch_size": config.vision_config.temporal_patch_size,
                    "size": {"shortest_edge": 4 * factor * factor, "longest_edge": 64 * factor * factor}}
    if model_type in _QWEN3:
        processor_kw.update(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    processor_kw.update(image_processor or {})
    Qwen2VLImageProcessorPil(**processor_kw).save_pretrained(d)
    return d


# ------------------------------------------------------------------ Qwen3.5 (issue 45)
# Qwen/Qwen3.5-*'s chat template as the hub repos ship it, tools left out (no test data calls tools): every
# message's text trimmed; an assistant turn after the last user turn gets a think block (empty when the data
# has no reasoning), the earlier ones none; the generation prompt opens a think block (``enable_thinking``
# false: an empty one). So the template is not incremental over several assistant turns (data/text/template.py).
QWEN3_5 = (
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- macro render_content(content, do_vision_count, is_system_content=false) %}"
    "{%- if content is string %}{{- content }}"
    "{%- elif content is iterable and content is not mapping %}{%- for item in content %}"
    "{%- if 'image' in item or 'image_url' in item or item.type == 'image' %}"
    "{%- if is_system_content %}{{- raise_exception('System message cannot contain images.') }}{%- endif %}"
    "{%- if do_vision_count %}{%- set image_count.value = image_count.value + 1 %}{%- endif %}"
    "{%- if add_vision_id %}{{- 'Picture ' ~ image_count.value ~ ': ' }}{%- endif %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif 'video' in item or item.type == 'video' %}"
    "{%- if is_system_content %}{{- raise_exception('System message cannot contain videos.') }}{%- endif %}"
    "{%- if do_vision_count %}{%- set video_count.value = video_count.value + 1 %}{%- endif %}"
    "{%- if add_vision_id %}{{- 'Video ' ~ video_count.value ~ ': ' }}{%- endif %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in item %}{{- item.text }}"
    "{%- else %}{{- raise_exception('Unexpected item type in content.') }}{%- endif %}{%- endfor %}"
    "{%- elif content is none or content is undefined %}{{- '' }}"
    "{%- else %}{{- raise_exception('Unexpected content type.') }}{%- endif %}"
    "{%- endmacro %}"
    "{%- if not messages %}{{- raise_exception('No messages provided.') }}{%- endif %}"
    "{%- if messages[0].role == 'system' %}"
    "{%- set content = render_content(messages[0].content, false, true)|trim %}"
    "{{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' %}"
    "{%- set content = render_content(message.content, false)|trim %}"
    "{%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endif %}"
    "{%- endfor %}"
    "{%- if ns.multi_step_tool %}{{- raise_exception('No user query found in messages.') }}{%- endif %}"
    "{%- for message in messages %}{%- set content = render_content(message.content, true)|trim %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{- raise_exception('System message must be at the beginning.') }}{%- endif %}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- else %}{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{%- endif %}"
    "{%- set reasoning_content = reasoning_content|trim %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content + '\\n</think>\\n\\n' + content }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
QWEN3_5_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
# 3 decoder layers: Gated DeltaNet, gated full attention, Gated DeltaNet (the published checkpoints: 3 of every 4
# layers linear); head_dim 64 with a quarter rotary (16 dims: M-RoPE sections 3 + 3 + 2, interleaved)
QWEN3_5_LAYERS = ("linear_attention", "full_attention", "linear_attention")


def make_qwen3_5_checkpoint(directory, model_type: str = "qwen3_5", initializer_range: float = 0.2, seed: int = 0,
                            text: dict | None = None, image_processor: dict | None = None) -> Path:
    """A tiny random Qwen3.5 checkpoint (``qwen3_5``, or ``qwen3_5_moe``: 4 experts of 32, top 2, a shared expert)
    as the Qwen/Qwen3.5-* repos hold one, shrunk: config.json (text 64 wide, QWEN3_5_LAYERS, DeltaNet 2 key heads
    and 4 value heads of 16, conv kernel 4; vision tower 2 blocks of 32 with 16-pixel patches and a learned
    8 x 8 position grid), model.safetensors, the tokenizer (the shipped BPE plus <|video_pad|>, <think> and
    </think>; chat template QWEN3_5) and preprocessor_config.json from HF's Qwen2-VL PIL image processor (mean /
    std 0.5 as Qwen3.5's, 4 .. 64 merged tokens per image). ``text`` overrides text config fields (the
    benchmark widens the model). initializer_range 0.2 as the other makers, for visible leaks."""
    from tokenizers import AddedToken
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ray_mmbatch.data.text.tokenizer import load_tokenizer

    if model_type not in QWEN3_5_MODEL_TYPES:
        raise ValueError(f"model_type must be one of {QWEN3_5_MODEL_TYPES}, got {model_type!r}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = copy.deepcopy(load_tokenizer(""))  # a copy: load_tokenizer's instance is shared and cached
    tok.add_tokens([AddedToken("<|video_pad|>", special=True, normalized=False)], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.chat_template = QWEN3_5
    tok.save_pretrained(d)

    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text_config = dict(
        vocab_size=-(-len(tok) // 8) * 8, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=len(
            QWEN3_5_LAYERS), layer_types=list(QWEN3_5_LAYERS), num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=32768,
        initializer_range=initializer_range, rms_norm_eps=1e-6, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True})
    if model_type == "qwen3_5_moe":
        text_config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32)
    text_config.update(text or {})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=text_config["hidden_size"], num_position_embeddings=64,
                  initializer_range=initializer_range)
    save_random_model(d, model_type, text_config, vision, initializer_range, seed, ids)

    factor = 16 * 2
    processor_kw = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5] * 3,
                    "image_std": [0.5] * 3,
                    "size": {"shortest_edge": 4 * factor * factor, "longest_edge": 64 * factor * factor}}
    processor_kw.update(image_processor or {})
    Qwen2VLImageProcessorPil(**processor_kw).save_pretrained(d)
    return d
