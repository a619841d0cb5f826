"""A tiny random GLM-4.1V / GLM-4.5V checkpoint directory for tests (nothing downloaded).

``make_glm4v_checkpoint(dir, model_type)`` writes what a zai-org/GLM-4.1V / GLM-4.5V repo holds, shrunk:
config.json (``glm4v``: Glm4vConfig; ``glm4v_moe``: Glm4vMoeConfig with a dense first layer and then 4 routed
experts of 32, top 2, one shared expert, sigmoid router), model.safetensors, the tokenizer and
preprocessor_config.json from HF's own Glm4vImageProcessor (PIL backend: 14-pixel patches, 2 x 2 merge, 2
temporal frames, CLIP mean / std, ``size`` 4 .. 64 merged tokens per image over 2 frames) and a
video_preprocessor_config.json (VIDEO_PROCESSOR).
Text model 64 wide, 2 layers, 2 heads of 32 with half of each head rotary and a 3-D RoPE section of 2 + 3 + 3
(GLM-4.1V: 0.5 and 8 + 12 + 12 of 128); vision tower 2 blocks of 32 with a 8 x 8 learned position grid
(``image_size`` 112) that GLM interpolates bicubically to each image's grid.

The tokenizer is the shipped byte-level BPE with GLM's special tokens (``[gMASK]``, ``<sop>``, the role tokens
``<|system|>`` / ``<|user|>`` / ``<|assistant|>`` / ``<|observation|>``, ``<|begin_of_image|>`` / ``<|image|>`` /
``<|end_of_image|>`` and the video ones) and ``<think>`` / ``</think>`` as plain added tokens; no BOS (the
template writes ``[gMASK]<sop>``), ``<|endoftext|>`` the EOS and pad token, as GLM's. Chat template
(``GLM4V``): GLM-4.5V's as published (also GLM-4.6V's), tools left out: ``[gMASK]<sop>``, ``<|system|>\\n`` +
text, ``<|user|>\\n`` + images as ``<|begin_of_image|><|image|><|end_of_image|>`` and texts, ``<|assistant|>`` +
``\\n<think></think>`` (the reasoning only on turns after the last user turn that carry one) + ``\\n`` + the
stripped answer; no end-of-turn token; the generation prompt is ``<|assistant|>``.

``initializer_range`` 0.2 (not HF's 0.02) makes activations large enough that a wrong mask or wrong position ids
changes the loss visibly, so the exactness tests can fail.
"""
from __future__ import annotations

from pathlib import Path

GLM4V_MODEL_TYPES = ("glm4v", "glm4v_moe")
PATCH, MERGE = 14, 2
FACTOR = PATCH * MERGE

GLM4V = (  # zai-org/GLM-4.5V chat_template.jinja, the tools branches left out (no test data calls tools)
    "[gMASK]<sop>\n"
    "{%- macro visible_text(content) -%}\n"
    "    {%- if content is string -%}\n"
    "        {{- content }}\n"
    "    {%- elif content is iterable and content is not mapping -%}\n"
    "        {%- for item in content -%}\n"
    "            {%- if item is mapping and item.type == 'text' -%}\n"
    "                {{- item.text }}\n"
    "            {%- elif item is string -%}\n"
    "                {{- item }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{- content }}\n"
    "    {%- endif -%}\n"
    "{%- endmacro -%}\n"
    "{%- set ns = namespace(last_user_index=-1) %}\n"
    "{%- for m in messages %}\n"
    "    {%- if m.role == 'user' %}\n"
    "        {% set ns.last_user_index = loop.index0 -%}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{% for m in messages %}\n"
    "{%- if m.role == 'user' -%}<|user|>\n"
    "{% if m.content is string %}\n"
    "{{ m.content }}\n"
    "{%- else %}\n"
    "{%- for item in m.content %}\n"
    "{% if item.type == 'video' or 'video' in item %}\n"
    "<|begin_of_video|><|video|><|end_of_video|>{% elif item.type == 'image' or 'image' in item %}\n"
    "<|begin_of_image|><|image|><|end_of_image|>{% elif item.type == 'text' %}\n"
    "{{ item.text }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{{- '/nothink' if (enable_thinking is defined and not enable_thinking and not visible_text(m.content)"
    ".endswith(\"/nothink\")) else '' -}}\n"
    "{%- elif m.role == 'assistant' -%}\n"
    "<|assistant|>\n"
    "{%- set reasoning_content = '' %}\n"
    "{%- set content = visible_text(m.content) %}\n"
    "{%- if m.reasoning_content is string %}\n"
    "    {%- set reasoning_content = m.reasoning_content %}\n"
    "{%- else %}\n"
    "    {%- if '</think>' in content %}\n"
    "        {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') %}\n"
    "        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- if loop.index0 > ns.last_user_index and reasoning_content -%}\n"
    "{{ '\\n<think>' + reasoning_content.strip() +  '</think>'}}\n"
    "{%- else -%}\n"
    "{{ '\\n<think></think>' }}\n"
    "{%- endif -%}\n"
    "{%- if content.strip() -%}\n"
    "{{ '\\n' + content.strip() }}\n"
    "{%- endif -%}\n"
    "{%- elif m.role == 'system' -%}\n"
    "<|system|>\n"
    "{{ visible_text(m.content) }}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    <|assistant|>{{- '\\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' -}}\n"
    "{%- endif -%}"
)

# zai-org/GLM-4.1V-9B-Thinking's chat_template.jinja: a system or assistant message's content is written as is (a string
# only; HF renders a list of parts as Python text): the data path refuses it (tests/test_models_glm4v.py)
GLM4_1V_THINKING = (
    "[gMASK]<sop>\n{%- for msg in messages %}\n    {%- if msg.role == 'system' %}\n<|system|>\n{{ msg.content }}\n"
    "    {%- elif msg.role == 'user' %}\n<|user|>{{ '\\n' }}\n\n        {%- if msg.content is string %}\n"
    "{{ msg.content }}\n        {%- else %}\n            {%- for item in msg.content %}\n"
    "                {%- if item.type == 'video' or 'video' in item %}\n<|begin_of_video|><|video|><|end_of_video|>\n"
    "                {%- elif item.type == 'image' or 'image' in item %}\n<|begin_of_image|><|image|><|end_of_image|>\n"
    "                {%- elif item.type == 'text' %}\n{{ item.text }}\n                {%- endif %}\n"
    "            {%- endfor %}\n        {%- endif %}\n    {%- elif msg.role == 'assistant' %}\n"
    "        {%- if msg.metadata %}\n<|assistant|>{{ msg.metadata }}\n{{ msg.content }}\n        {%- else %}\n"
    "<|assistant|>\n{{ msg.content }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_SPECIAL = ["[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
            "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
            "<|image|>", "<|video|>"]


def _tokenizer(directory: Path):
    """The shipped BPE + GLM's special tokens (<|endoftext|> pad and EOS), <think> / </think> as plain added tokens,
    chat template GLM4V, saved into ``directory``."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from ray_mmbatch.data.text.tokenizer import SHIPPED_TOKENIZER

    tok = PreTrainedTokenizerFast.from_pretrained(str(SHIPPED_TOKENIZER), pad_token="<|endoftext|>",
                                                  eos_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": _SPECIAL})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.chat_template = GLM4V
    tok.save_pretrained(directory)
    return tok


# video_preprocessor_config.json as GLM-4.1V / 4.5V repos ship one (Glm4vVideoProcessor), shrunk: 3 frames a second,
# clips over 3 s spread over max_duration x fps frames, 4 .. 96 merged tokens' pixels over the whole clip
VIDEO_PROCESSOR = {"video_processor_type": "Glm4vVideoProcessor", "do_sample_frames": True, "fps": 3.0,
                   "max_duration": 3, "patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": 2,
                   "size": {"shortest_edge": 2 * 4 * FACTOR * FACTOR, "longest_edge": 96 * FACTOR * FACTOR},
                   "image_mean": [0.48145466, 0.4578275, 0.40821073],
                   "image_std": [0.26862954, 0.26130258, 0.27577711]}


def make_glm4v_checkpoint(directory, model_type: str = "glm4v", initializer_range: float = 0.2, seed: int = 0,
                          text: dict | None = None, image_processor: dict | None = None,
                          video_processor: dict | None = VIDEO_PROCESSOR) -> Path:
    """Write the checkpoint into ``directory`` and return it; ``text`` / ``image_processor`` override fields of the
    text config and the image processor (benchmarks widen the model); ``video_processor``: the
    video_preprocessor_config.json written (None: none)."""
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    from tests.hf_checkpoints import save_random_model

    if model_type not in GLM4V_MODEL_TYPES:
        raise ValueError(f"model_type must be one of {GLM4V_MODEL_TYPES}, got {model_type!r}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(d)
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image_token_id", "<|image|>"), ("video_token_id", "<|video|>"),
        ("image_start_token_id", "<|begin_of_image|>"), ("image_end_token_id", "<|end_of_image|>"),
        ("video_start_token_id", "<|begin_of_video|>"), ("video_end_token_id", "<|end_of_video|>"))}
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    text_config = dict(vocab_size=-(-len(tok) // 8) * 8, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                       initializer_range=initializer_range, rms_norm_eps=1e-5, pad_token_id=tok.pad_token_id,
                       eos_token_id=eos, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.5, "mrope_section": [2, 3, 3]})
    if model_type == "glm4v_moe":  # GLM-4.5V: the first layer dense, the rest routed (sigmoid router, top k)
        text_config.update(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                           first_k_dense_replace=1, n_group=1, topk_group=1, attention_bias=True)
    text_config.update(text or {})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH, image_size=8 * PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=2, out_hidden_size=text_config["hidden_size"],
                  initializer_range=initializer_range)
    save_random_model(d, model_type, text_config, vision, initializer_range, seed, ids)

    processor_kw = {"patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": 2,
                    "size": {"shortest_edge": 2 * 4 * FACTOR * FACTOR, "longest_edge": 2 * 64 * FACTOR * FACTOR}}
    processor_kw.update(image_processor or {})
    Glm4vImageProcessorPil(**processor_kw).save_pretrained(d)
    if video_processor is not None:
        import json

        (d / "video_preprocessor_config.json").write_text(json.dumps(video_processor))
    return d
