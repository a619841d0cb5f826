"""GLM-4.1V / GLM-4.5V backend (``glm4v`` dense, ``glm4v_moe``): checkpoint settings, the exact packed forward, export.

GLM-4.1V is built as Qwen2-VL is on the outside: 14-pixel patches, 2 x 2 merge, a still image taken as 2 identical
frames, flat patch lists in ``pixel_values`` with ``image_grid_thw``, and 3-D RoPE whose ids its own
``Glm4vModel.get_rope_index`` builds from ``mm_token_type_ids`` (text positions count on; an image block's t / h / w
ids start at the block's position and the next text starts max(h, w) / merge after it). So Qwen-VL's adapter
(models/qwen_vl.QwenAdapter) drives it exactly, checked per token against HF's path on each sample alone
(tests/test_models_glm4v.py)::

    packed row      a0 a1 | b0 <boi> I I I I <eoi> b1        (a: text; b: one image of 2 x 2 merged tokens)
    position_ids [4, 1, T]
      row 0         0  1  |  0   1   2 3 4 5   6    7        restarting per sample: HF's block-diagonal mask
                                                             (sdpa / eager); flash attention: explicit varlen
      rows 1-3      GLM's own get_rope_index on each sample alone, concatenated
    no attention_mask; use_cache=False

Padded batches get ``attention_mask`` and ``mm_token_type_ids`` and HF builds the 3-D ids row by row.

What differs from Qwen-VL is the checkpoint: the image processor is ``Glm4vImageProcessor``, whose smart resize
first scales an image with a side under 28 px up to 28 and counts the area over the 2 frames of a still image
(resize='smart_glm', data/image/smart.py), with its bounds in ``size`` {shortest_edge, longest_edge} only (HF's GLM
processor reads no top-level min_pixels / max_pixels: neither does this); the image block is
``<|begin_of_image|>`` + n x ``<|image|>`` + ``<|end_of_image|>`` (the template writes one ``<|image|>``, the data
path expands it as HF's processor does). The template (GLM-4.5V's, GLM-4.6V's) starts every render with
``[gMASK]<sop>``, writes no BOS and no end-of-turn token: an assistant turn is ``<|assistant|>`` +
``\\n<think></think>`` + ``\\n`` + the stripped answer, ended by the next ``<|user|>`` (HF's generation_config
stops on ``<|user|>`` / ``<|observation|>`` / ``<|endoftext|>``). The trained tokens are the turn as the template
renders it after the generation prompt ``<|assistant|>``; nothing that stops generation is trained (as for
LLaVA-1.5's template; tests/test_targets.py). GLM-4.1V-9B-Thinking's template writes a system / assistant content
as is (a list of parts as Python text): the data path refuses it (data/text/template.py).

MoE (``glm4v_moe``, GLM-4.5V): the loss is the cross-entropy only. HF's ForConditionalGeneration adds
``router_aux_loss_coef`` x the load-balancing loss when ``output_router_logits`` is set; HFModel runs the base
model and its own loss, so it is never added, packed or padded, whatever the config says: over a packed row it
would count the balance over all its samples' tokens at once and could not equal the per-sample sum; exactness is
stated on the CE. The router (sigmoid scores plus ``e_score_correction_bias``, a buffer HF never updates) trains
through the CE.

Video: not taken yet (``<|begin_of_video|>`` frames with timestamps in the text need GLM's video processor, whose
HF class needs torchvision; and HF's forward refuses images and videos in one call, since a video frame's tokens
are ``<|image|>`` too and both placeholder masks take every one): a sample with a video stops the run naming the
families that take video, as for an image-only family (data/measure.py).

Cost: Qwen-VL's adapter's (one ``get_rope_index`` per packed sample with images); ``configure`` reads two JSON
files and the tokenizer. Importing this module imports no torch.
"""
from __future__ import annotations

from functools import partial

from ray_mmbatch.models import hf_export, hf_fsdp_units, hf_state_prefix
from ray_mmbatch.models.qwen_vl import _vision_modules, vision_modules  # noqa: F401 (the backend protocol's)

NAME = "glm4v"
MODEL_TYPES: tuple[str, ...] = ("glm4v", "glm4v_moe")

# HF's Glm4vVisionConfig (and Glm4vMoeVisionConfig) defaults, for keys a config.json leaves out
_VISION_DEFAULTS = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
# HF's Glm4vImageProcessor class default ``size``, for a preprocessor_config.json without one
_SIZE_DEFAULTS = {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 15000}


def _pixel_bounds(processor: dict) -> tuple[int, int]:
    """(min_pixels, max_pixels) as HF's Glm4vImageProcessor reads them: ``size`` {shortest_edge, longest_edge}, the
    area of a still image counted over its temporal_patch_size frames (data/image/smart.glm_smart_resize)."""
    size = processor.get("size") or _SIZE_DEFAULTS
    if not size.get("shortest_edge") or not size.get("longest_edge"):
        raise ValueError(f"the image processor's size {size} has no shortest_edge and longest_edge: HF's "
                         "Glm4vImageProcessor refuses it")
    return int(size["shortest_edge"]), int(size["longest_edge"])


def configure(cfg):
    """Fill cfg's image / text settings from the checkpoint at cfg.model.path (see models/__init__.py).

    As Qwen-VL's (models/qwen_vl.configure_qwen): resize='smart_glm', patch / merge / temporal sizes (config.json
    vision_config, which the image processor must agree with), min / max pixels from the processor's ``size`` (the
    user's value wins), its mean / std, the tokenizer (the checkpoint's unless --tokenizer) and the image token
    (config.json image_token_id: ``<|image|>``). No video yet (module docstring). Idempotent.
    """
    from ray_mmbatch.models.qwen_vl import configure_qwen, vision_geometry

    return configure_qwen(cfg, NAME, "GLM-4.1V", MODEL_TYPES, partial(vision_geometry, defaults=_VISION_DEFAULTS),
                          resize="smart_glm", pixel_bounds=_pixel_bounds)


fsdp_units, state_prefix = hf_fsdp_units, hf_state_prefix


def create_model(cfg, ids: dict):
    """The checkpoint's Glm4v(Moe)ForConditionalGeneration in HFModel with Qwen-VL's adapter (module docstring)."""
    from ray_mmbatch.models.hf_common import wrap
    from ray_mmbatch.models.qwen_vl import QwenAdapter, load_qwen

    hf = load_qwen(cfg, ids)
    if cfg.image.resize != "smart_glm":
        raise ValueError(f"image.resize is {cfg.image.resize!r} but GLM-4.1V's processor resizes as 'smart_glm': "
                         "call configure(cfg) before create_model")
    adapter = QwenAdapter(hf.model, hf.config.image_token_id, cfg.image.image_mean, cfg.image.image_std,
                          cfg.image.temporal_patch_size, rescale64=True)
    return wrap(hf, cfg, adapter, _vision_modules, NAME)


export = hf_export  # save_pretrained of model + tokenizer, the processor files copied
