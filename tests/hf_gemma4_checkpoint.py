"""A tiny random Gemma 4 checkpoint directory for tests (nothing downloaded).

``make_gemma4_checkpoint(dir)`` writes what a google/gemma-4-*-it repo holds, shrunk: config.json
(Gemma4Config: a Gemma 4 vision tower in 4-px patches, its pooler averaging 3 x 3 patches into one
LM token, at most ``max_soft_tokens`` = 70 tokens per image (HF's smallest budget: 630 patches,
``pixel_values`` [n, 630, 48]); a Gemma 4 text model of four layers -- sliding (window 12, shorter
than an image block), full, full, full -- the last reusing the third's keys and values
(``num_kv_shared_layers`` = 1, as the E2B / E4B checkpoints share their last layers'), per-layer inputs
(``hidden_size_per_layer_input``), a proportional RoPE on the full layers, a final logit softcap and
``use_bidirectional_attention='vision'``), model.safetensors, the tokenizer and processor_config.json
(HF's Gemma 4 PIL image processor: aspect kept, bicubic to sides that are multiples of 3 x 4 px within
the patch budget, pixels in [0, 1]). No audio tower (as the 26B / 31B checkpoints): audio is not trained
here.

The tokenizer is the shipped byte-level BPE with Gemma 4's special tokens (``<bos>``, ``<|turn>``,
``<turn|>``, ``<|image>`` / ``<image|>`` / ``<|image|>`` named boi / eoi / image token, the audio
ones named boa / eoa / audio token, ``<|video|>``), a ``<bos>`` post-processor and merges for runs of
newlines. Chat template (``GEMMA4``): modelled on the published one: ``<|turn>role\\n ... <turn|>\\n``,
the assistant's role written ``model``, a system turn of its own, every text part trimmed, one
``<|image|>`` per image part (the processor expands it to ``<|image>`` + N x ``<|image|>`` +
``<image|>``), one ``<|video|>`` per video part (the processor writes each sampled frame as ``mm:ss`` + ``<|image>``
+ N x ``<|video|>`` + ``<image|>``, the frames joined by spaces).

processor_config.json nests the video processor's settings as the published checkpoints do (``VIDEO_PROCESSOR``:
HF's Gemma4VideoProcessor with the published settings but the tower's 4 px patches and ``num_frames`` 4, not 32, so
the test clips of a second or two are long enough and the tests fast).

``initializer_range`` 0.2 (not HF's 0.02) makes activations large enough that a wrong mask changes the
loss visibly; HF initializes the patch position table to ones (every position alike: a patch order
mistake would not show), so it is redrawn with std 0.2 before saving.
"""
from __future__ import annotations

import json
from pathlib import Path

PATCH = 4
POOL = 3
MAX_SOFT_TOKENS = 70
SLIDING_WINDOW = 12
# the last layer reuses the third's keys and values (num_kv_shared_layers=1); a full layer with keys of its own
# after each other layer, so that what any layer's mask does to the image tokens reaches the answers
LAYER_TYPES = ["sliding_attention", "full_attention", "full_attention", "full_attention"]

GEMMA4 = (  # modelled on google/gemma-4-*-it's chat_template (no tools, no thinking)
    "{{- bos_token -}}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {{- '<|turn>system\n' -}}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {{- messages[0]['content'] | trim -}}\n"
    "    {%- else -%}\n"
    "        {%- for item in messages[0]['content'] -%}\n"
    "            {%- if item['type'] == 'text' -%}{{- item['text'] | trim -}}{%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- endif -%}\n"
    "    {{- '<turn|>\n' -}}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}\n"
    "    {{- '<|turn>' + role + '\n' -}}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{- message['content'] | trim -}}\n"
    "    {%- else -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{- '<|image|>' -}}\n"
    "            {%- elif item['type'] == 'video' -%}\n"
    "                {{- '<|video|>' -}}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{- item['text'] | trim -}}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- endif -%}\n"
    "    {{- '<turn|>\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{- '<|turn>model\n' -}}\n"
    "{%- endif -%}\n"
)

_NAMED = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
          "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>"}
_OTHER = ["<|turn>", "<turn|>", "<|video|>"]


# the published google/gemma-4-* processor_config.json "video_processor", with the tiny tower's patches and 4 frames
VIDEO_PROCESSOR = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                   "do_sample_frames": True, "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0],
                   "max_soft_tokens": MAX_SOFT_TOKENS, "num_frames": 4, "patch_size": PATCH,
                   "pooling_kernel_size": POOL,
                   "resample": 3, "rescale_factor": 1 / 255, "return_metadata": False,
                   "video_processor_type": "Gemma4VideoProcessor"}


def _tokenizer(directory: Path):
    """The shipped BPE + newline-run merges + Gemma 4's special tokens, saved into ``directory``."""
    from tests.hf_gemma3_checkpoint import gemma_tokenizer

    return gemma_tokenizer(directory, _NAMED, _OTHER, GEMMA4)


def gemma4_processor(path, video_processor=None):
    """HF's Gemma4Processor for the checkpoint at ``path``: its tokenizer and chat template, the PIL image processor
    of its processor_config.json, the audio feature extractor; no video processor (HF's needs torchvision) unless
    ``video_processor`` (the reference interpreter's, tests/targets_reference.py)."""
    from transformers import AutoTokenizer, Gemma4Processor
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    class Processor(Gemma4Processor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    path = Path(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    settings = json.loads((path / "processor_config.json").read_text())
    images = Gemma4ImageProcessorPil(**{k: v for k, v in settings["image_processor"].items()
                                        if k != "image_processor_type"})
    return Processor(feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=images, tokenizer=tok,
                     video_processor=video_processor, chat_template=tok.chat_template,
                     image_seq_length=settings["image_seq_length"])


def make_gemma4_checkpoint(directory, initializer_range: float = 0.2, seed: int = 0, text: dict | None = None,
                           vision: dict | None = None, image_processor: dict | None = None,
                           video_processor: dict | None = None) -> Path:
    """Write the checkpoint into ``directory`` and return it; ``text`` / ``vision`` / ``image_processor`` /
    ``video_processor`` override fields of the text config, the vision config and the processors (benchmarks
    widen it)."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig, Gemma4VisionConfig
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(d)
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in _NAMED.items()}

    vision_kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=16, patch_size=PATCH, pooling_kernel_size=POOL,
                     position_embedding_size=256, initializer_range=initializer_range)
    text_kw = dict(vocab_size=len(tok), vocab_size_per_layer_input=len(tok), hidden_size=64, intermediate_size=128,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   global_head_dim=32, hidden_size_per_layer_input=8, num_kv_shared_layers=1,
                   sliding_window=SLIDING_WINDOW, layer_types=LAYER_TYPES,
                   final_logit_softcapping=30.0, use_bidirectional_attention="vision",
                   max_position_embeddings=2048, initializer_range=initializer_range,
                   pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config = Gemma4Config(text_config=Gemma4TextConfig(**{**text_kw, **(text or {})}),
                          vision_config=Gemma4VisionConfig(**{**vision_kw, **(vision or {})}), audio_config=None,
                          boi_token_id=ids["boi_token"], eoi_token_id=ids["eoi_token"],
                          image_token_id=ids["image_token"], video_token_id=tok.convert_tokens_to_ids("<|video|>"),
                          boa_token_id=ids["boa_token"], eoa_token_index=ids["eoa_token"],
                          audio_token_id=ids["audio_token"], initializer_range=initializer_range)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config)
    with torch.no_grad():  # HF initializes it to ones: every patch position would embed alike
        model.model.vision_tower.patch_embedder.position_embedding_table.normal_(0.0, initializer_range)
    model.save_pretrained(d, safe_serialization=True)

    processor_kw = {"patch_size": PATCH, "pooling_kernel_size": POOL, "max_soft_tokens": MAX_SOFT_TOKENS}
    processor_kw.update(image_processor or {})
    images = Gemma4ImageProcessorPil(**processor_kw)
    (d / "processor_config.json").write_text(json.dumps({
        "processor_class": "Gemma4Processor", "image_seq_length": MAX_SOFT_TOKENS,
        "image_processor": {**images.to_dict(), "image_processor_type": "Gemma4ImageProcessor"},
        "video_processor": {**VIDEO_PROCESSOR, **(video_processor or {})}}, indent=2))
    return d
