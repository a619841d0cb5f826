"""A tiny random Mistral 3 checkpoint directory for tests (nothing downloaded).

``make_mistral3_checkpoint(dir, text)`` writes what a mistralai/Mistral-Small-3.1-24B-Instruct-2503 repo holds
(``text='mistral'``) or a Ministral 3 / Magistral one (``text='ministral3'``: YaRN RoPE and the position-dependent
query scale ``llama_4_scaling_beta``, its ``original_max_position_embeddings`` shrunk to 16 so the scale steps
inside a sample), shrunk: config.json (Mistral3Config: a Pixtral tower in 4-px patches with 2-D RoPE over at most
16 x 16 patches, ``spatial_merge_size`` 2, a two-layer text model), model.safetensors, the tokenizer,
preprocessor_config.json (PixtralImageProcessor: longest edge 64, bicubic, CLIP mean / std) and
processor_config.json (PixtralProcessor: patch_size 4, spatial_merge_size 2, ``[IMG]`` / ``[IMG_BREAK]`` /
``[IMG_END]``), as the published repo splits them.

The tokenizer is the shipped byte-level BPE with Mistral's control tokens (``<s>``, ``</s>``, ``<pad>``,
``[INST]``, ``[/INST]``, ``[SYSTEM_PROMPT]``, ``[/SYSTEM_PROMPT]``, ``[IMG]``, ``[IMG_BREAK]``, ``[IMG_END]``, the
tool tokens) and a ``<s>`` post-processor. Chat template (``MISTRAL3``): the published 2503 template without its
tool branches: ``<s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]answer</s>``, a default system prompt
holding today's date (``strftime_now``) when the conversation has none, one ``[IMG]`` per image part (the
processor expands it to rows of ``[IMG]`` closed by ``[IMG_BREAK]`` / ``[IMG_END]``).

``initializer_range`` 0.2 (not HF's 0.02) makes activations large enough that a wrong mask or position changes
the loss visibly.
"""
from __future__ import annotations

import json
from pathlib import Path

PATCH = 4
MERGE = 2
LONGEST = 64  # the processor's longest edge: at most (64 / 8)**2 = 64 image tokens and 8 rows an image

MISTRAL3 = (  # modelled on mistralai/Mistral-Small-3.1-24B-Instruct-2503's chat_template (no tools)
    '{%- set today = strftime_now("%Y-%m-%d") %}\n'
    '{%- set default_system_message = "You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI, '
    'a French startup headquartered in Paris.\\nYour knowledge base was last updated on 2023-10-01. The current date '
    'is " + today + ".\\n\\nWhen you\'re not sure about some information, you say that you don\'t have the '
    'information and don\'t make up anything." %}\n'
    "\n{{- bos_token }}\n\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- if messages[0]['content'] is string %}\n"
    "        {%- set system_message = messages[0]['content'] %}\n"
    "    {%- else %}\n"
    "        {%- set system_message = messages[0]['content'][0]['text'] %}\n"
    "    {%- endif %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = default_system_message %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}\n\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if message['content'] is string %}\n"
    "            {{- '[INST]' + message['content'] + '[/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- '[INST]' }}\n"
    "            {%- for block in message['content'] %}\n"
    "                {%- if block['type'] == 'text' %}\n"
    "                    {{- block['text'] }}\n"
    "                {%- elif block['type'] in ['image', 'image_url'] %}\n"
    "                    {{- '[IMG]' }}\n"
    "                {%- else %}\n"
    "                    {{- raise_exception('Only text and image blocks are supported in message content!') }}\n"
    "                {%- endif %}\n"
    "            {%- endfor %}\n"
    "            {{- '[/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'system' %}\n"
    "        {%- if message['content'] is string %}\n"
    "            {{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}\n"
    "        {%- else %}\n"
    "            {{- '[SYSTEM_PROMPT]' + message['content'][0]['text'] + '[/SYSTEM_PROMPT]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {%- if message['content'] is string %}\n"
    "            {{- message['content'] + eos_token }}\n"
    "        {%- else %}\n"
    "            {{- message['content'][0]['text'] + eos_token }}\n"
    "        {%- endif %}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user, system and assistant roles are supported!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)

_SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
_CONTROL = ["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
            "[TOOL_CALLS]", "[IMG]", "[IMG_BREAK]", "[IMG_END]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
PROCESSOR = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]",
             "patch_size": PATCH, "spatial_merge_size": MERGE, "processor_class": "PixtralProcessor"}


def _tokenizer(directory: Path):
    """The shipped BPE + Mistral's control tokens, saved into ``directory``."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    from ray_mmbatch.data.text.tokenizer import SHIPPED_TOKENIZER

    core = Tokenizer.from_str((SHIPPED_TOKENIZER / "tokenizer.json").read_text())
    tok = PreTrainedTokenizerFast(tokenizer_object=core, **_SPECIAL)
    tok.add_special_tokens({"additional_special_tokens": _CONTROL})
    bos = tok.convert_tokens_to_ids("<s>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                              special_tokens=[("<s>", bos)])
    tok.chat_template = MISTRAL3
    tok.save_pretrained(directory)
    return tok


def text_config(kind: str, tok, initializer_range: float, **override):
    """The language model's config: Mistral (Mistral Small 3.x) or Ministral 3, two layers."""
    from transformers import Ministral3Config, MistralConfig

    kw = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, initializer_range=initializer_range,
              pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
              sliding_window=None, tie_word_embeddings=False)
    if kind == "mistral":
        return MistralConfig(**{**kw, "rope_theta": 10000.0, **override})
    if kind == "ministral3":
        rope = {"type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                "max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0,
                "mscale": 1.0, "llama_4_scaling_beta": 0.1}
        return Ministral3Config(**{**kw, "max_position_embeddings": 64, "rope_parameters": rope, **override})
    raise ValueError(f"text {kind!r}: 'mistral' or 'ministral3'")


def make_mistral3_checkpoint(directory, text: str = "mistral", initializer_range: float = 0.2, seed: int = 0,
                             text_override: dict | None = None, vision: dict | None = None, patch: int = PATCH,
                             longest: int = LONGEST) -> Path:
    """Write the checkpoint into ``directory`` and return it; ``text_override`` / ``vision`` override fields of the
    text and vision configs, ``patch`` / ``longest`` the patch size and the processor's longest edge (benchmarks
    widen it)."""
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralVisionConfig
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(d)
    vision_kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                     patch_size=patch, image_size=longest, initializer_range=initializer_range)
    config = Mistral3Config(vision_config=PixtralVisionConfig(**{**vision_kw, **(vision or {})}),
                            text_config=text_config(text, tok, initializer_range, **(text_override or {})),
                            image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=MERGE,
                            vision_feature_layer=-1, multimodal_projector_bias=False, tie_word_embeddings=False)
    config.initializer_range = initializer_range
    torch.manual_seed(seed)
    Mistral3ForConditionalGeneration(config).save_pretrained(d, safe_serialization=True)
    images = PixtralImageProcessorPil(patch_size={"height": patch, "width": patch}, size={"longest_edge": longest})
    (d / "preprocessor_config.json").write_text(json.dumps(
        {**images.to_dict(), "image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor"},
        indent=2))
    (d / "processor_config.json").write_text(json.dumps({**PROCESSOR, "patch_size": patch}, indent=2))
    return d


def pixtral_processor(path):
    """HF's PixtralProcessor for the checkpoint at ``path``, built without torchvision: 5.25's processing module
    imports one helper from the torchvision image processor's module, so that module is stood in by the PIL one
    (which defines the same ``get_resize_output_image_size``) while the class is imported."""
    import importlib
    import sys

    from transformers import AutoTokenizer
    from transformers.models.pixtral import image_processing_pil_pixtral as pil

    name = "transformers.models.pixtral.image_processing_pixtral"
    saved = sys.modules.get(name)
    sys.modules[name] = pil
    try:
        processing = importlib.import_module("transformers.models.pixtral.processing_pixtral")
    finally:
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved
    path = Path(path)
    settings = json.loads((path / "preprocessor_config.json").read_text())
    images = pil.PixtralImageProcessorPil(**{k: v for k, v in settings.items()
                                             if k not in ("image_processor_type", "processor_class")})
    tok = AutoTokenizer.from_pretrained(str(path))
    extra = {k: v for k, v in json.loads((path / "processor_config.json").read_text()).items()
             if k != "processor_class"}
    cls = processing.PixtralProcessor

    class Processor(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            return None  # the PIL image processor under its torchvision class's name

    return Processor(image_processor=images, tokenizer=tok, chat_template=tok.chat_template, **extra)
