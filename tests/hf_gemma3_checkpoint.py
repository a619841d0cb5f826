"""A tiny random Gemma 3 checkpoint directory for tests (nothing downloaded).

``make_gemma3_checkpoint(dir)`` writes what a google/gemma-3-*-it repo holds, shrunk:
config.json (Gemma3Config: a SigLIP tower at ``image_size`` px in 7-px patches, an 8 x 8 patch
grid average-pooled 2 x 2 into ``mm_tokens_per_image`` = 16 LM tokens; a Gemma 3 text model of
two layers, one sliding-window (window 12, shorter than an image block) and one global),
model.safetensors, the tokenizer and preprocessor_config.json from HF's own Gemma 3 PIL image
processor (plain resize to S x S, bilinear, mean / std 0.5).

The tokenizer is the shipped byte-level BPE with Gemma's special tokens (``<bos>``,
``<start_of_turn>``, ``<end_of_turn>``, ``<start_of_image>``, ``<end_of_image>``,
``<image_soft_token>``, named boi / eoi / image token as the real tokenizer_config does), a
``<bos>`` post-processor (as Gemma's tokenizer adds one) and two merges ``\\n\\n`` and
``\\n\\n\\n``: like Gemma's vocabulary, runs of newlines are single tokens, so the blank lines the
processor writes around each image merge with the template's newline -- an image expansion done
on token ids instead of text would give other ids, and the tests would see it. Chat template:
Gemma 3's own (``GEMMA3``; it trims every text part).

``initializer_range`` 0.2 (not HF's 0.02) makes activations large enough that a wrong mask
changes the loss visibly; HF initializes the multimodal projection to exactly zero (pixels would
then not reach the loss at all), so it is redrawn with std 0.2 before saving.
"""
from __future__ import annotations

import json
from pathlib import Path

PATCH = 7
TOKENS_PER_IMAGE = 16
SLIDING_WINDOW = 12

GEMMA3 = (  # google/gemma-3-*-it chat_template (tokenizer_config.json / chat_template.json)
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

_SPECIAL = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
_NAMED = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
_TURN = ["<start_of_turn>", "<end_of_turn>"]


def _tokenizer(directory: Path):
    """The shipped BPE + newline-run merges + Gemma 3's special tokens, saved into ``directory``."""
    return gemma_tokenizer(directory, _NAMED, _TURN, GEMMA3)


def gemma_tokenizer(directory: Path, named: dict[str, str], other: list[str], chat_template: str):
    """The shipped BPE + newline-run merges (Gemma's tokenizers have them) + <bos> / <eos> / <pad>, the ``named``
    special tokens (boi_token, ...) and the ``other`` ones, <bos> prepended and ``chat_template``, saved into
    ``directory`` (tests/hf_gemma4_checkpoint.py's too)."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    from ray_mmbatch.data.text.tokenizer import SHIPPED_TOKENIZER

    spec = json.loads((SHIPPED_TOKENIZER / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    for piece in ("ĊĊ", "ĊĊĊ"):  # byte-level "\n\n", "\n\n\n"
        vocab[piece] = len(vocab)
    spec["model"]["merges"] += [["Ċ", "Ċ"], ["ĊĊ", "Ċ"]]
    core = Tokenizer.from_str(json.dumps(spec))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, **_SPECIAL, extra_special_tokens={**named})
    tok.add_special_tokens({"additional_special_tokens": list(other) + list(named.values())},
                           replace_extra_special_tokens=False)
    bos = tok.convert_tokens_to_ids("<bos>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                              special_tokens=[("<bos>", bos)])
    tok.chat_template = chat_template
    tok.save_pretrained(directory)
    return tok


def make_gemma3_checkpoint(directory, initializer_range: float = 0.2, seed: int = 0, image_size: int = 56,
                           patch: int = PATCH, tokens_per_image: int = TOKENS_PER_IMAGE, text: dict | None = None,
                           vision: dict | None = None, image_processor: dict | None = None) -> Path:
    """Write the checkpoint into ``directory`` and return it; ``text`` / ``vision`` / ``image_processor``
    override fields of the text config, the vision config and the image processor (benchmarks widen it)."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(d)
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in _NAMED.items()}

    vision_kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     image_size=image_size, patch_size=patch, vision_use_head=False)
    text_kw = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                   sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"],
                   max_position_embeddings=1024, initializer_range=initializer_range,
                   pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision_cfg = SiglipVisionConfig(**{**vision_kw, **(vision or {})})
    text_cfg = Gemma3TextConfig(**{**text_kw, **(text or {})})
    config = Gemma3Config(text_config=text_cfg, vision_config=vision_cfg, mm_tokens_per_image=tokens_per_image,
                          boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
                          image_token_index=ids["image_token"], initializer_range=initializer_range)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # HF zero-initializes it: the pixels would not reach the loss at all
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, initializer_range)
    model.save_pretrained(d, safe_serialization=True)

    processor_kw = {"size": {"height": image_size, "width": image_size}, "image_mean": [0.5] * 3,
                    "image_std": [0.5] * 3}
    processor_kw.update(image_processor or {})
    Gemma3ImageProcessorPil(**processor_kw).save_pretrained(d)
    (d / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma3Processor",
                                                          "image_seq_length": tokens_per_image}, indent=2))
    return d
