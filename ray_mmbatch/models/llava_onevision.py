"""LLaVA-OneVision backend (``LlavaOnevisionForConditionalGeneration``): anyres tiles, unpadded features.

Cost model (HF's LlavaOnevisionProcessor, ``_get_number_of_features``): the only image of a sample
becomes a base tile (the whole image resized to S x S) plus the crops of the ``image_grid_pinpoints``
resolution that fits it best (``select_best_resolution``: the image resized into it keeping its aspect,
centred on black padding, cut into S x S crops); its LM tokens are g*g base features (g = S / patch)
plus the crops' (rows*g) x (cols*g) feature grid with the padding cut off again (``unpad_image``),
pooled to about anyres_max tiles' worth when more than 1.1x that, plus one newline token per feature
row. In a sample of several images each image is one tile (padded to a square of the mean colour,
resized to S x S): g*g + 1 tokens (HF decides this by ``batch_num_images``, the images of the
sample). All of it is known from the image header: ``configure`` writes resize='anyres', image_size
S, the pinpoints, anyres_max and g into ImageConfig, data/image/ measures it
(``anyres_tiles``, ``anyres_tokens``) and decodes it (the PIL image processor's pixels). Tiles
travel as uint8 patches of one whole tile each (patch_size = S, merge 1: S = 384 is no multiple of
SigLIP's 14), stacked top to bottom: grid (1, tiles, 1); ``image_sizes`` (h, w as displayed) travels
per image from materialize through collate.

Text: the chat template writes one ``<image>`` per image; materialize expands it to the image's token
count: one contiguous run of ``<image>``, as HF's processor (``replace_image_token``).

Forward inputs (``adapter``), on the batch layout of batching/collate.py::

    pixel_values      [n_tiles, 3, S, S]  every tile of every image, sample order, image order, base
                                          tile first (HF's 4-D form: no per-image padding to slice)
    image_sizes       [n_img, 2]          (h, w) per image: HF finds each image's crop grid and unpadding
    batch_num_images  [n_samples]         images per sample: 1 -> anyres, several -> base tile only;
                                          per packed sample, so a pack of one-image samples keeps
                                          every image's anyres view (HF's own batch of them does too)
    pack              position_ids [1, T] restarting at 0 per sample, NO attention_mask (block-diagonal
                      causal from the position ids; explicit cu_seq_lens on flash attention,
                      hf_common.varlen_kwargs). use_cache=False (HFModel).
    pad               attention_mask [B, L] + position_ids 0..L-1
    text only         no pixel_values (HFModel keeps the vision weights in the graph)

The vision features of each tile depend on that tile alone (SigLIP), and HF scatters the images'
features into the ``<image>`` runs in order, so pack and pad mode are exact.

Refused: a vision tower with a CLS token or vision_feature_select_strategy other than 'full' (the
base features must be a g x g grid), vision_feature_layer other than -1, vision_aspect_ratio not
'anyres_max_N', pinpoints that are not multiples of the tile, an image processor whose size, resize
or rescale the data path does not reproduce, or whose pinpoints differ from the model's.
Importing this module imports no torch (the registry imports every backend to read MODEL_TYPES).
"""
from __future__ import annotations

from pathlib import Path

from ray_mmbatch.models import hf_export, hf_fsdp_units, hf_state_prefix

NAME = "llava_onevision"
MODEL_TYPES: tuple[str, ...] = ("llava_onevision",)
VIDEO_MODEL_TYPES: tuple[str, ...] = MODEL_TYPES
"""The model types whose checkpoints train on video too (models.video_model_types)."""
# the rest of the backend protocol (models/__init__.py) is the same for every HF family; export: save_pretrained
# of model + tokenizer, the checkpoint's processor files copied
fsdp_units, state_prefix, export = hf_fsdp_units, hf_state_prefix, hf_export

_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, what data/image/ resizes with
_PROCESSOR_TYPES = ("LlavaOnevisionImageProcessor", "LlavaOnevisionImageProcessorFast",
                    "LlavaOnevisionImageProcessorPil")


def _anyres_max(value: str, where: str) -> int:
    text = str(value)
    if not text.startswith("anyres_max_") or not text[len("anyres_max_"):].isdigit():
        raise ValueError(f"{where}: vision_aspect_ratio={value!r}; only 'anyres_max_N' is supported")
    return int(text[len("anyres_max_"):])


def _pinpoints(value, side: int, where: str) -> tuple[int, ...]:
    pairs = [tuple(int(v) for v in p) for p in (value or [])]
    if not pairs or any(len(p) != 2 or p[0] % side or p[1] % side or min(p) <= 0 for p in pairs):
        raise ValueError(f"{where}: image_grid_pinpoints {value!r} must be (h, w) multiples of the {side} px tile")
    return tuple(v for p in pairs for v in p)


def _pixel_settings(pre: dict, where: str) -> dict:
    """ImageConfig values from the image processor; anything data/image/ would not reproduce raises."""
    from ray_mmbatch.models.hf_common import CLIP_MEAN, CLIP_STD, pixel_settings

    # CLIP's mean / std: LlavaOnevisionImageProcessor's defaults
    pixels = pixel_settings(pre, where, "LLaVA-OneVision", resample=_BICUBIC, mean=CLIP_MEAN, std=CLIP_STD,
                            types=_PROCESSOR_TYPES, always=("do_resize", "do_convert_rgb"))
    if pre.get("do_center_crop"):
        raise ValueError(f"{where}: do_center_crop must be off (tiles are resized whole)")
    size = {k: v for k, v in dict(pre.get("size") or {"height": 384, "width": 384}).items() if v is not None}
    if set(size) != {"height", "width"} or size["height"] != size["width"]:
        raise ValueError(f"{where}: size {size!r} is not a square tile ({{'height': S, 'width': S}})")
    return {"image_size": int(size["height"]), **pixels, "pinpoints": pre.get("image_grid_pinpoints")}


def configure(cfg):
    """Fill the data path's settings from the checkpoint (see module docstring); contradicting flags raise."""
    from ray_mmbatch.models.hf_common import adopt_setting, adopt_still_pixels, image_token, open_checkpoint, read_json

    path, hf_cfg, processor, where_model, where_proc = open_checkpoint(cfg, NAME, "LLaVA-OneVision", MODEL_TYPES)
    vision = hf_cfg.vision_config
    if hf_cfg.vision_feature_select_strategy != "full" or vision.model_type != "siglip_vision_model":
        raise ValueError(f"{where_model}: vision_feature_select_strategy={hf_cfg.vision_feature_select_strategy!r} "
                         f"on a {vision.model_type!r} tower; only 'full' on SigLIP (no CLS token: the base "
                         "features are a square grid, as in every LLaVA-OneVision checkpoint) is supported")
    if hf_cfg.vision_feature_layer != -1:
        raise ValueError(f"{where_model}: vision_feature_layer={hf_cfg.vision_feature_layer!r}; only -1 is supported "
                         "(other layers leave vision weights unused)")
    side, patch = int(vision.image_size), int(vision.patch_size)
    pixels = _pixel_settings(processor, where_proc)
    if pixels["image_size"] != side:
        raise ValueError(f"{path}: the processor makes {pixels['image_size']} px tiles but the vision tower takes "
                         f"{side} px (vision_config.image_size)")
    pinpoints = _pinpoints(hf_cfg.image_grid_pinpoints, side, f"{where_model}")
    if pixels["pinpoints"] is not None and _pinpoints(pixels["pinpoints"], side, where_proc) != pinpoints:
        raise ValueError(f"{path}: the processor's image_grid_pinpoints differ from config.json's")
    anyres_max = _anyres_max(hf_cfg.vision_aspect_ratio, where_model)
    g = side // patch
    proc_cfg = read_json(Path(path) / "processor_config.json")
    for key, want in (("num_image_tokens", g * g), ("vision_feature_select_strategy", "full"),
                      ("vision_aspect_ratio", hf_cfg.vision_aspect_ratio)):
        if key in proc_cfg and proc_cfg[key] != want:
            raise ValueError(f"{path}/processor_config.json: {key} {proc_cfg[key]!r}, but the model's is {want!r}")

    adopt_setting(cfg, "image.resize", "anyres", f"{where_proc} (LLaVA-OneVision: anyres tiles)")
    adopt_setting(cfg, "image.image_size", side, f"{where_model} vision_config.image_size")
    adopt_setting(cfg, "image.patch_size", side, f"{path} (LLaVA-OneVision: tiles travel whole, one per patch row)")
    adopt_setting(cfg, "image.merge_size", 1, f"{path} (LLaVA-OneVision: tokens from image_tokens, not the grid)")
    adopt_setting(cfg, "image.grid_pinpoints", pinpoints, f"{where_model} image_grid_pinpoints")
    adopt_setting(cfg, "image.anyres_max", anyres_max, f"{where_model} vision_aspect_ratio")
    adopt_setting(cfg, "image.anyres_features", g, f"{where_model} vision_config image_size / patch_size")
    adopt_still_pixels(cfg, pixels, where_proc, "LLaVA-OneVision")
    token_id = int(hf_cfg.image_token_id)
    adopt_setting(cfg, "text.image_token", image_token(cfg.text.tokenizer, token_id, path, "image_token_index"),
                  f"{path} tokenizer, token id {token_id} (config.json image_token_index)")
    video_id = getattr(hf_cfg, "video_token_id", None)
    if video_id is not None and int(video_id) >= 0:
        adopt_setting(cfg, "text.video_token", image_token(cfg.text.tokenizer, int(video_id), path,
                                                           "video_token_index"),
                      f"{path} tokenizer, token id {video_id} (config.json video_token_index)")
        _configure_video(cfg, path, side)
    return cfg


# How LLaVA-OneVision's own training samples video when a checkpoint ships no video settings (LLaVA-NeXT
# llava/train/train.py: video_fps 1, and scripts/train/finetune_ov.sh --frames_upbound 32): 1 frame a second,
# at most 32; spread over the clip as HF's processor spreads them (default_sample_indices_fn)
LLAVA_NEXT_VIDEO = {"do_sample_frames": True, "fps": 1.0, "max_frames": 32}


def _configure_video(cfg, path: str, side: int) -> None:
    """image.video* from the checkpoint's video processor (HF LlavaOnevisionVideoProcessor: every frame squashed
    to the tower's square, bicubic; all frames unless it samples; CLIP mean / std by default). A checkpoint that
    ships no video settings samples as LLaVA-NeXT trains (LLAVA_NEXT_VIDEO). HF's sampler has no frame bounds:
    --video-min-frames / --video-max-frames bound its fps count when given, --video-max-tokens caps the frames
    (each frame ceil(g/2)**2 tokens, + 1); --video-max-pixels is refused (every frame is the tower's square)."""
    from ray_mmbatch.models.hf_common import (
        CLIP_MEAN,
        CLIP_STD,
        UNBOUNDED,
        adopt_setting,
        adopt_video_settings,
        has_video_settings,
        user_set,
        video_processor_settings,
    )

    video, where = video_processor_settings(path)
    where = f"{path} {where}"
    size = {k: v for k, v in dict(video.get("size") or {"height": 384, "width": 384}).items() if v is not None}
    if set(size) != {"height", "width"} or not size["height"] == size["width"] == side:
        raise ValueError(f"{where}: the video processor resizes frames to {size!r}; the vision tower takes {side} px "
                         "squares (vision_config.image_size)")
    if video.get("do_center_crop"):
        raise ValueError(f"{where}: do_center_crop must be off (frames are resized whole)")
    if user_set(cfg, "image.video_max_pixels"):
        raise ValueError(f"image.video_max_pixels = {cfg.image.video_max_pixels} (--video-max-pixels) contradicts "
                         f"{where} size {size['height']}x{size['width']}: LLaVA-OneVision resizes every frame to the "
                         "tower's square; cap a clip with --video-max-frames or --video-max-tokens instead")
    defaults = {"do_sample_frames": False, "fps": None, "num_frames": None, "max_frames": UNBOUNDED,
                "image_mean": CLIP_MEAN, "image_std": CLIP_STD}
    if not has_video_settings(video):
        defaults.update(LLAVA_NEXT_VIDEO)
        where = f"LLaVA-NeXT's video defaults ({path} ships no video settings)"
    adopt_setting(cfg, "image.video", "llava_onevision", f"{path} (HF LlavaOnevisionVideoProcessor)")
    adopt_video_settings(cfg, video, where, "llava_onevision", defaults)
    adopt_setting(cfg, "image.video_min_frames", 1, f"{where}: HF's sampler has no min_frames", user_may_override=True)
    adopt_setting(cfg, "image.video_max_frames", int(video.get("max_frames", defaults["max_frames"])),
                  f"{where} max_frames", user_may_override=True)
    adopt_setting(cfg, "image.video_max_tokens", UNBOUNDED, f"{where}: HF's processor has no token cap",
                  user_may_override=True)


# ------------------------------------------------------------------ model
def pixel_values(patches, side: int, mean, std):
    """uint8 tiles [n, 3 * side * side] (one tile per patch row) -> normalized float32 [n, 3, side, side]."""
    from ray_mmbatch.models.hf_common import normalize_patches

    return normalize_patches(patches, mean, std).view(-1, 3, side, side)


def images_per_sample(batch: dict) -> list[int]:
    """HF ``batch_num_images``: the images of every sample of the batch (0 for text-only ones)."""
    import torch

    owner = torch.as_tensor(batch["image_sample_index"]).long().cpu()
    return torch.bincount(owner, minlength=len(batch["seq_lens"])).tolist()


def make_adapter(hf_model, image_cfg):
    """batch (collate layout, tensors) -> kwargs of ``LlavaOnevisionModel.forward`` (see module docstring)."""
    from ray_mmbatch.models.hf_common import image_adapter

    side, ps = int(image_cfg.image_size), int(image_cfg.patch_size)
    mean, std = tuple(image_cfg.image_mean), tuple(image_cfg.image_std)
    if ps != side:
        raise ValueError(f"LLaVA-OneVision tiles travel whole: image.patch_size must be {side}, got {ps}")

    def images(patches, batch: dict) -> dict:
        if "image_sizes" not in batch:
            raise ValueError("LLaVA-OneVision needs image_sizes per image (was the data measured with "
                             "image.resize='anyres'?)")
        return {"pixel_values": pixel_values(patches, side, mean, std).to(hf_model.model.vision_tower.dtype),
                "image_sizes": batch["image_sizes"].long(), "batch_num_images": images_per_sample(batch)}

    still = image_adapter(hf_model.model.language_model.config, images)
    vmean, vstd = tuple(image_cfg.video_mean or mean), tuple(image_cfg.video_std or std)

    def adapter(batch: dict) -> dict:
        kwargs = still(batch)
        vgrids = batch.get("video_grid_thw")
        if vgrids is None or not vgrids.shape[0]:
            return kwargs
        # videos of different lengths do not stack into HF's [videos, frames, 3, S, S]: each clip goes through
        # HF's own get_video_features alone (its features depend on its frames alone) and the model gets the
        # encoder outputs (then the images' must come the same way: HF takes one or the other)
        return _with_video_features(hf_model.model, kwargs, batch, side, vmean, vstd)

    return adapter


def _with_video_features(base, kwargs: dict, batch: dict, side: int, mean, std) -> dict:
    """kwargs with ``mm_encoder_outputs``: HF's get_image_features on the images (as its forward calls it) and
    get_video_features on each clip, concatenated in clip order."""
    import torch
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from ray_mmbatch.models.hf_common import normalize_video_patches

    layer, strategy = base.config.vision_feature_layer, base.config.vision_feature_select_strategy
    out = {}
    if "pixel_values" in kwargs:
        out["image"] = base.get_image_features(kwargs.pop("pixel_values"), kwargs.pop("image_sizes"),
                                               vision_feature_layer=layer, vision_feature_select_strategy=strategy,
                                               batch_num_images=kwargs.pop("batch_num_images"), return_dict=True)
    frames = normalize_video_patches(batch["video_patches"], mean, std).view(-1, 3, side, side)
    frames = frames.to(base.vision_tower.dtype)
    clips, at = [], 0
    for n in batch["video_grid_thw"][:, 0].tolist():
        clips.append(base.get_video_features(frames[at:at + n][None], vision_feature_layer=layer,
                                             vision_feature_select_strategy=strategy,
                                             return_dict=True).pooler_output)
        at += n
    out["video"] = BaseModelOutputWithPooling(pooler_output=torch.cat(clips, dim=1))
    kwargs["mm_encoder_outputs"] = out
    return kwargs


def _vision_modules(hf_model) -> list:
    import torch.nn as nn

    newline = nn.Module()  # image_newline lives on the base model: a holder so text-only batches keep it in graph
    newline.register_parameter("image_newline", hf_model.model.image_newline)
    return [hf_model.model.vision_tower, hf_model.model.multi_modal_projector, newline]


def vision_modules(model) -> list:
    """The vision tower, projector and image_newline of the HFModel: a batch without images does not run them."""
    return _vision_modules(model.hf_model)


def freeze_unused_vision(hf_model) -> int:
    """requires_grad=False on SigLIP's post_layernorm and pooling head: vision_feature_layer -1 takes the last
    encoder layer's hidden states, before them. Returns the number of frozen weights."""
    from ray_mmbatch.models.hf_common import freeze

    tower = hf_model.model.vision_tower
    return freeze(getattr(tower, "post_layernorm", None), getattr(tower, "head", None))


def create_model(cfg, ids: dict):
    """The checkpoint in fp32 wrapped in HFModel with the LLaVA-OneVision adapter; tokenizer ids checked."""
    from ray_mmbatch.models.hf_common import load_checked, wrap

    hf = load_checked(cfg, ids)
    freeze_unused_vision(hf)
    return wrap(hf, cfg, make_adapter(hf, cfg.image), _vision_modules, NAME)

