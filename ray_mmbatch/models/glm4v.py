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

Video (HF ``Glm4vVideoProcessor`` / ``Glm4vProcessor``): frames sampled by GLM's own sampler (fps over the clip's
duration, max_duration, an even count: data/video/sampling.py), resized as Qwen3-VL's clips are (bounds on the whole
clip), patchified as Qwen2-VL's; the text for the template's ``<|begin_of_video|><|video|><|end_of_video|>``
writes per temporal patch an image block ``<|begin_of_image|>`` + N x ``<|image|>`` + ``<|end_of_image|>`` and its
whole second (data/measure.glm4v_frame_blocks). HF types a frame's tokens 2 by the ``<|begin_of_video|>`` span; the
data path writes ``<|video|>`` there (so materialize and the collate tell frames from images) and this adapter
gives the model ``<|image|>`` back, mm_token_type_ids 2 on them, so GLM's get_rope_index splits each clip into its
temporal patches (one t / h / w block each) as for the sample alone.

HF's forward refuses an image and a video in one call (both placeholder masks take every ``<|image|>``). So a
batch with clips runs the vision tower through the model's own ``get_image_features`` / ``get_video_features``
and hands the features to HF's forward as ``mm_encoder_outputs`` in sequence order (image features at the
image-typed tokens, frame features at the video-typed ones), which HF scatters into every ``<|image|>`` as it
would each kind alone: a packed or padded batch can hold clips beside other samples' images. A single sample
with both an image and a video has no HF forward to be exact against: it is skipped (unsupported_modality,
data/measure.py).

Cost: Qwen-VL's adapter's (one ``get_rope_index`` per packed sample with images or clips); a batch with clips
also one [tokens, hidden] buffer of its image and frame features; ``configure`` reads three JSON files and the
tokenizer. Importing this module imports no torch.
"""
from __future__ import annotations

from functools import partial

from ray_mmbatch.models import hf_export, hf_fsdp_units, hf_state_prefix
from ray_mmbatch.models.qwen_vl import QwenAdapter, _vision_modules, vision_modules  # noqa: F401 (the protocol's)

NAME = "glm4v"
MODEL_TYPES: tuple[str, ...] = ("glm4v", "glm4v_moe")
VIDEO_MODEL_TYPES: tuple[str, ...] = MODEL_TYPES
"""The model types whose checkpoints train on video too (models.video_model_types)."""

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
    (config.json image_token_id: ``<|image|>``); video from its video processor (_configure_video). Idempotent.
    """
    from ray_mmbatch.models.qwen_vl import configure_qwen, vision_geometry

    configure_qwen(cfg, NAME, "GLM-4.1V", MODEL_TYPES, partial(vision_geometry, defaults=_VISION_DEFAULTS),
                   resize="smart_glm", pixel_bounds=_pixel_bounds)
    _configure_video(cfg, cfg.model.path)
    return cfg


# HF Glm4vVideoProcessor's class defaults, for what a checkpoint's video processor leaves out
_VIDEO_DEFAULTS = {"do_sample_frames": True, "fps": 2.0, "num_frames": None, "max_duration": 300,
                   "size": {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 2 * 30000},
                   "image_mean": (0.48145466, 0.4578275, 0.40821073),
                   "image_std": (0.26862954, 0.26130258, 0.27577711)}
# GLM's sampler reads none of them (HF's num_frames, min / max frames, a token cap)
_NOT_READ = ("video_num_frames", "video_min_frames", "video_max_frames", "video_max_tokens")


def _configure_video(cfg, path: str) -> None:
    """image.video* and text.video_token from the checkpoint's video processor (HF Glm4vVideoProcessor: fps 2 over
    the clip, max_duration 300 s, bounds ``size`` over the whole clip's pixels). --video-fps, --video-sample-frames,
    --video-max-pixels are the user's; GLM's sampler has no frame-count or token bounds and ignores num_frames, so
    --video-min-frames / --video-max-frames / --video-max-tokens / image.video_num_frames are refused rather than
    ignored."""
    from ray_mmbatch.data.text.tokenizer import load_tokenizer
    from ray_mmbatch.models.hf_common import (
        UNBOUNDED,
        adopt_setting,
        adopt_video_settings,
        checked_token,
        checkpoint_files,
        user_set,
        video_processor_settings,
    )

    model_json, _ = checkpoint_files(path)
    video, where = video_processor_settings(path)
    where = f"{path} {where}"
    kind = video.get("video_processor_type", "Glm4vVideoProcessor")
    if kind != "Glm4vVideoProcessor":
        raise ValueError(f"{where}: video_processor_type {kind!r}; the glm4v backend reproduces Glm4vVideoProcessor")
    video = {k: v for k, v in video.items() if k != "num_frames"}  # GLM's sample_frames never reads it
    for key in _NOT_READ:
        if user_set(cfg, f"image.{key}") and getattr(cfg.image, key) not in (1, UNBOUNDED):
            raise ValueError(f"image.{key} = {getattr(cfg.image, key)} is set, but GLM-4.1V's video sampler (HF "
                             "Glm4vVideoProcessor) has no such setting and it would not be honoured; bound a clip's "
                             "cost with --video-fps and --video-max-pixels (the whole clip's pixels)")
    get = {k: video.get(k, d) for k, d in _VIDEO_DEFAULTS.items()}
    size = get["size"] or {}
    if not size.get("shortest_edge") or not size.get("longest_edge"):
        raise ValueError(f"{where}: size {size} has no shortest_edge and longest_edge: HF's Glm4vVideoProcessor "
                         "refuses it")
    for key in ("patch_size", "merge_size", "temporal_patch_size"):
        if video.get(key) is not None and int(video[key]) != getattr(cfg.image, key):
            raise ValueError(f"{where}: the video processor's {key}={video[key]} disagrees with config.json "
                             f"vision_config ({getattr(cfg.image, key)}); the checkpoint is inconsistent")
    adopt_setting(cfg, "image.video", NAME, f"{path} (HF Glm4vVideoProcessor)")
    adopt_video_settings(cfg, video, where, "GLM-4.1V", _VIDEO_DEFAULTS)
    adopt_setting(cfg, "image.video_max_duration", float(get["max_duration"]), f"{where} max_duration")
    adopt_setting(cfg, "image.video_min_pixels", int(size["shortest_edge"]), f"{where} size shortest_edge",
                  user_may_override=True)
    adopt_setting(cfg, "image.video_max_pixels", int(size["longest_edge"]), f"{where} size longest_edge",
                  user_may_override=True)
    adopt_setting(cfg, "image.video_cap_pixels_per_frame", False, f"{where}: GLM has no per-frame cap")
    adopt_setting(cfg, "image.video_min_frames", 1, f"{where}: GLM's sampler has no min_frames")
    for key, what in (("video_max_frames", "max_frames"), ("video_max_tokens", "token cap")):
        adopt_setting(cfg, f"image.{key}", UNBOUNDED, f"{where}: GLM's sampler has no {what}")
    token = checked_token(load_tokenizer(cfg.text.tokenizer), int(model_json["video_token_id"]), path,
                          "video_token_id")
    adopt_setting(cfg, "text.video_token", token, f"{path} tokenizer, config.json video_token_id")


fsdp_units, state_prefix = hf_fsdp_units, hf_state_prefix


class GlmAdapter(QwenAdapter):
    """Qwen-VL's adapter (packed 3-D ids from GLM's get_rope_index per sample), and for a batch with clips the
    features placed in sequence order (module docstring)."""

    def __call__(self, batch: dict) -> dict:
        kwargs = super().__call__(batch)
        if "pixel_values_videos" not in kwargs:
            return kwargs  # images and text only: HF's forward takes them as they are
        import torch
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        ids = batch["input_ids"]
        types = self.token_types(ids)
        kwargs["input_ids"] = torch.where(types == 2, self.image_token_id, ids)  # HF's ids: <|image|> in frames
        base, kinds = self.base, types[types > 0]
        features = None
        for kind, get, pixels, grids in ((1, base.get_image_features, "pixel_values", "image_grid_thw"),
                                         (2, base.get_video_features, "pixel_values_videos", "video_grid_thw")):
            if pixels not in kwargs:
                continue
            got = torch.cat(get(kwargs.pop(pixels), kwargs[grids], return_dict=True).pooler_output)
            if features is None:
                features = got.new_zeros((kinds.shape[0], got.shape[-1]))
            features[kinds == kind] = got
        kwargs["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=(features,))}
        if batch["mode"] == "pack":  # the 3-D ids are given
            kwargs.pop("image_grid_thw", None)
            kwargs.pop("video_grid_thw", None)
        return kwargs


def create_model(cfg, ids: dict):
    """The checkpoint's Glm4v(Moe)ForConditionalGeneration in HFModel with GLM's adapter (module docstring)."""
    from ray_mmbatch.models.hf_common import wrap
    from ray_mmbatch.models.qwen_vl import load_qwen

    hf = load_qwen(cfg, ids)
    if cfg.image.resize != "smart_glm":
        raise ValueError(f"image.resize is {cfg.image.resize!r} but GLM-4.1V's processor resizes as 'smart_glm': "
                         "call configure(cfg) before create_model")
    config = hf.config
    adapter = GlmAdapter(hf.model, config.image_token_id, cfg.image.image_mean, cfg.image.image_std,
                         cfg.image.temporal_patch_size, config.video_token_id, cfg.image.video_mean,
                         cfg.image.video_std, rescale64=True)
    return wrap(hf, cfg, adapter, _vision_modules, NAME)


export = hf_export  # save_pretrained of model + tokenizer, the processor files copied
