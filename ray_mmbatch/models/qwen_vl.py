"""Qwen-VL backend (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE): checkpoint settings, the exact packed forward,
export.

A packed batch drives HF's model exactly as if each sample ran alone when it gets (checked per
token against HF's own single-sample path in tests/test_models_qwen.py)::

    samples            a: text only (3)      b: text, one image of 2x2 merged tokens, text
    input_ids          a0 a1 a2 |  b0 <vs> I  I  I  I <ve> b1
    position_ids [4, 1, T]
      row 0  text       0  1  2 |  0  1   2  3  4  5  6   7     restarts per sample: HF finds the
                                                                packed samples from it (block mask
                                                                for sdpa/eager, varlen for flash-attn)
      row 1  t          0  1  2 |  0  1   2  2  2  2  4   5     rows 1-3: the model's own
      row 2  h          0  1  2 |  0  1   2  2  3  3  4   5     get_rope_index on each sample
      row 3  w          0  1  2 |  0  1   2  3  2  3  4   5     alone, concatenated (M-RoPE)
    no attention_mask; use_cache=False (HFModel): with a cache HF stops looking for packed samples

Padded batches get ``attention_mask`` and ``mm_token_type_ids`` (1 at image tokens) and HF builds
the M-RoPE ids itself, row by row over the unmasked tokens (without ``mm_token_type_ids``
Qwen2.5-VL silently falls back to 1-D positions). Pixels: uint8 patches normalized on the device
(hf_common.normalize_patches) with the processor's mean/std, repeated over ``temporal_patch_size``.
Qwen3-VL needs nothing more: its deepstack features are scattered at the image-token positions in
sequence order and its vision tower, like the others, attends within each image only.

Qwen3-VL-MoE (``qwen3_vl_moe``) is Qwen3-VL in front of a sparse MoE text model: every setting and the packed
forward are Qwen3-VL's. Its loss is the cross-entropy only: HF adds the router's load-balancing loss only with
``output_router_logits``, which stays off; a packed row would balance over all its samples' tokens, a padded batch
over its rows, so neither equals the per-sample sum that exactness is stated on (as models/qwen3_5.py's MoE).

Cost: pack mode runs one ``get_rope_index`` per sample that has images (a Python pass over that
sample's token types, on a CPU copy of the ids) and an arange for text-only samples; HF does
the same pass per row in pad mode. ``configure`` reads two JSON files and the tokenizer.
Importing this module imports no torch (the registry imports every backend to read MODEL_TYPES).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ray_mmbatch.models import hf_export, hf_fsdp_units, hf_state_prefix

NAME = "qwen_vl"
MODEL_TYPES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# Qwen3-VL-MoE (Qwen3-VL-30B-A3B, -235B-A22B) is Qwen3-VL's vision side, processors and token layout in front of
# a sparse MoE text model: every setting and the packed forward are Qwen3-VL's (the MoE note: module docstring).
# Qwen3.5 (models/qwen3_5.py) ships Qwen3-VL's processors (Qwen3VLVideoProcessor): its video settings are Qwen3-VL's.
_SAME_AS = {"qwen3_vl_moe": "qwen3_vl", "qwen3_5": "qwen3_vl", "qwen3_5_moe": "qwen3_vl"}

# HF's Qwen2VLImageProcessor defaults, for keys a preprocessor_config.json leaves out
_PROCESSOR_DEFAULTS = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280,
                       "image_mean": (0.48145466, 0.4578275, 0.40821073),
                       "image_std": (0.26862954, 0.26130258, 0.27577711)}
# HF's vision config class defaults, for keys an old config.json leaves out
_VISION_DEFAULTS = {"qwen2_vl": {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2},
                    "qwen2_5_vl": {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2},
                    "qwen3_vl": {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2}}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _vision_geometry(path: str, model_json: dict, processor: dict) -> dict[str, int]:
    model_type = model_json["model_type"]
    return vision_geometry(path, model_json, processor, _VISION_DEFAULTS[_SAME_AS.get(model_type, model_type)])


def vision_geometry(path: str, model_json: dict, processor: dict, defaults: dict[str, int]) -> dict[str, int]:
    """patch / merge / temporal sizes: config.json's vision_config (what the model is built with; a key
    it leaves out takes HF's class default in ``defaults``), which the image processor must agree with."""
    vision = model_json.get("vision_config") or {}
    geometry = {"patch_size": vision.get("patch_size", vision.get("spatial_patch_size")),
                "merge_size": vision.get("spatial_merge_size"),
                "temporal_patch_size": vision.get("temporal_patch_size")}
    for key, value in geometry.items():
        value = geometry[key] = int(defaults[key] if value is None else value)
        if processor.get(key) is not None and int(processor[key]) != value:
            raise ValueError(f"{path}: the image processor's {key}={processor[key]} disagrees with config.json "
                             f"vision_config ({value}); the checkpoint is inconsistent")
    return geometry


def _pixel_bounds(processor: dict) -> tuple[int, int]:
    """(min_pixels, max_pixels) as HF's Qwen2-VL processor reads them: the old top-level keys
    override ``size`` {shortest_edge, longest_edge} (or an old ``size`` {min_pixels, max_pixels})."""
    size = processor.get("size") or {}
    lo = processor.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
    hi = processor.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
    return int(lo or _PROCESSOR_DEFAULTS["min_pixels"]), int(hi or _PROCESSOR_DEFAULTS["max_pixels"])


def _check_processor_steps(path: str, processor: dict) -> None:
    """The data path resizes bicubic, rescales by 1/255 and normalizes: refuse a processor that does not."""
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if processor.get(key) is False:
            raise ValueError(f"{path}: the image processor sets {key}=false; the data path always does it")
    if processor.get("resample", 3) != 3:
        raise ValueError(f"{path}: the image processor resamples with {processor['resample']}; "
                         "the data path resizes bicubic (3)")
    if abs(float(processor.get("rescale_factor", 1 / 255)) - 1 / 255) > 1e-9:
        raise ValueError(f"{path}: rescale_factor {processor['rescale_factor']} is not 1/255")


# HF's video processor class defaults, for keys the checkpoint's video processor settings leave out:
# Qwen2VLVideoProcessor (Qwen2-VL and Qwen2.5-VL take video through it) and Qwen3VLVideoProcessor
_QWEN2_VIDEO = {"do_sample_frames": False, "fps": None, "num_frames": None, "min_frames": 4, "max_frames": 768,
                "shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768, "cap_pixels_per_frame": False,
                "max_video_tokens": 128000, "image_mean": _PROCESSOR_DEFAULTS["image_mean"],
                "image_std": _PROCESSOR_DEFAULTS["image_std"]}
_VIDEO_DEFAULTS = {"qwen2_vl": _QWEN2_VIDEO, "qwen2_5_vl": _QWEN2_VIDEO,
                   "qwen3_vl": dict(_QWEN2_VIDEO, do_sample_frames=True, fps=2, shortest_edge=128 * 32 * 32,
                                    longest_edge=32 * 32 * 768, max_video_tokens=768, image_mean=(0.5, 0.5, 0.5),
                                    image_std=(0.5, 0.5, 0.5))}
# How the Qwen team's own loader samples video (qwen-vl-utils vision_process.py: FPS 2.0, FPS_MIN_FRAMES 4,
# FPS_MAX_FRAMES 768, VIDEO_MIN_PIXELS 128 x 28 x 28, VIDEO_MAX_PIXELS 768 x 28 x 28, and the per-frame share of
# VIDEO_TOTAL_PIXELS = 128000 x 28 x 28 x 0.9, which is HF's cap_pixels_per_frame with max_video_tokens 128000).
# A Qwen2-VL / Qwen2.5-VL checkpoint as published ships no video settings (one preprocessor_config.json): HF's
# class defaults would take every frame at the image bounds (up to 12.8 MP a frame); users sample as this does
# (LLaMA-Factory's video_fps / video_maxlen / video_max_pixels and ms-swift's FPS / FPS_MAX_FRAMES too).
QWEN_VL_UTILS_VIDEO = dict(_QWEN2_VIDEO, do_sample_frames=True, fps=2.0, cap_pixels_per_frame=True)
VIDEO_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
_PROCESSOR_CLASS = {"qwen2_vl": "Qwen2VLVideoProcessor", "qwen3_vl": "Qwen3VLVideoProcessor"}


_IMAGE_BOUNDS = ("min_pixels", "max_pixels", "size")


def _check_qwen2_sampling(im, where: str) -> None:
    """Settings with which HF's Qwen2VLVideoProcessor.sample_frames cannot sample any clip, refused as it refuses
    them (it divides by zero): num_frames rounding to 0 temporal patches, or max_frames below one patch."""
    if not im.video_sample_frames:
        return
    tps = max(1, int(im.temporal_patch_size))
    if im.video_num_frames is not None and round(im.video_num_frames / tps) * tps == 0:
        raise ValueError(f"image.video_num_frames = {im.video_num_frames} (from {where} or --set) rounds to 0 frames "
                         f"at temporal_patch_size {tps}, and HF's Qwen2VLVideoProcessor then divides by zero: sample "
                         f"at least {tps} frames")
    if im.video_num_frames is None and im.video_fps is not None and im.video_max_frames < tps:
        raise ValueError(f"image.video_max_frames = {im.video_max_frames} (--video-max-frames, or {where}) is below "
                         f"one temporal patch ({tps} frames), and HF's Qwen2VLVideoProcessor then divides by zero: "
                         f"allow at least {tps}")


def _configure_video(cfg, path: str, model_type: str) -> None:
    """image.video* from the checkpoint's video processor (Qwen2-VL / Qwen2.5-VL / Qwen3-VL(-MoE) / Qwen3.5)."""
    from ray_mmbatch.models.hf_common import (
        adopt_setting,
        adopt_video_settings,
        has_video_settings,
        user_set,
        video_processor_settings,
    )

    base = _SAME_AS.get(model_type, model_type)
    video, where = video_processor_settings(path)
    where = f"{path} {where}"
    defaults = _VIDEO_DEFAULTS[base]
    if base != "qwen3_vl" and not has_video_settings(video):  # as published: qwen-vl-utils' sampling
        defaults, where = QWEN_VL_UTILS_VIDEO, f"qwen-vl-utils' video defaults ({path} ships no video settings)"
        video = {k: v for k, v in video.items() if k not in _IMAGE_BOUNDS}  # the image bounds are not the video's
    size = video.get("size") or {}
    get = {k: video.get(k, d) for k, d in defaults.items()}
    lo = video.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or get["shortest_edge"]
    hi = video.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or get["longest_edge"]
    sampler = "qwen3_vl" if base == "qwen3_vl" else "qwen2_vl"
    adopt_setting(cfg, "image.video", sampler, f"{path} ({model_type}: HF {_PROCESSOR_CLASS[sampler]})")
    adopt_video_settings(cfg, video, where, model_type, defaults)
    # how a clip is sampled and capped is the user's choice (as qwen-vl-utils' and HF's call arguments are)
    adopt_setting(cfg, "image.video_min_frames", int(get["min_frames"]), f"{where} min_frames", user_may_override=True)
    adopt_setting(cfg, "image.video_max_frames", int(get["max_frames"]), f"{where} max_frames", user_may_override=True)
    adopt_setting(cfg, "image.video_min_pixels", int(lo), f"{where} size shortest_edge", user_may_override=True)
    adopt_setting(cfg, "image.video_max_pixels", int(hi), f"{where} size longest_edge", user_may_override=True)
    # --video-max-tokens turns the per-frame share of it on (HF's cap_pixels_per_frame), as --video-fps turns
    # sampling on: a cap the user sets is never accepted and ignored
    # (a value equal to the checkpoint's is not the user's: configure runs again on a configured Config, and must
    # not read the max_video_tokens it adopted the first time as the user's cap)
    cap = bool(get["cap_pixels_per_frame"]) or (user_set(cfg, "image.video_max_tokens")
                                                and cfg.image.video_max_tokens != int(get["max_video_tokens"]))
    adopt_setting(cfg, "image.video_cap_pixels_per_frame", cap, f"{where} cap_pixels_per_frame", user_may_override=True)
    adopt_setting(cfg, "image.video_max_tokens", int(get["max_video_tokens"]), f"{where} max_video_tokens",
                  user_may_override=True)
    if sampler == "qwen2_vl":
        _check_qwen2_sampling(cfg.image, where)
    for key in ("patch_size", "merge_size", "temporal_patch_size"):
        if video.get(key) is not None and int(video[key]) != getattr(cfg.image, key):
            raise ValueError(f"{where}: the video processor's {key}={video[key]} disagrees with config.json "
                             f"vision_config ({getattr(cfg.image, key)}); the checkpoint is inconsistent")


def _checkpoint_image_token(path: str, image_token_id: int) -> str:
    """The token whose id is config.json's image_token_id, by the checkpoint's own tokenizer."""
    from ray_mmbatch.data.text.tokenizer import load_tokenizer

    if not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        return "<|image_pad|>"  # Qwen's name for it; the run's tokenizer is checked against the id below
    token = load_tokenizer(path).convert_ids_to_tokens(image_token_id)
    if token is None:
        raise ValueError(f"{path}: config.json image_token_id {image_token_id} is not in its tokenizer")
    return str(token)


def configure(cfg):
    """Fill cfg's image / text settings from the checkpoint at cfg.model.path (see models/__init__.py).

    Taken from the checkpoint: smart resize, patch / merge / temporal sizes (config.json
    vision_config), min/max pixels and mean/std (the image processor), the tokenizer (the
    checkpoint dir unless --tokenizer) and the image token. A changed setting that contradicts
    the checkpoint is refused; min/max pixels are a free choice (the user's value wins).
    Idempotent.
    """
    return configure_qwen(cfg, "qwen_vl", "Qwen-VL", MODEL_TYPES, _vision_geometry, VIDEO_MODEL_TYPES)


def configure_qwen(cfg, backend: str, family: str, model_types: tuple, geometry, video_types: tuple = (),
                   resize: str = "smart", pixel_bounds=_pixel_bounds):
    """``configure`` of the Qwen-style backends (this one, models/qwen3_5.py, models/glm4v.py): ``geometry(path,
    config.json, processor)`` gives the vision sizes; video is taken for ``video_types`` (this module's
    _configure_video); ``resize``: the data path's resize mode; ``pixel_bounds(processor)``: (min, max) pixels."""
    from ray_mmbatch.data.text.tokenizer import load_tokenizer
    from ray_mmbatch.models.hf_common import adopt_setting, checkpoint_files

    path = cfg.model.path
    if not path:
        raise ValueError(f"the {backend} backend needs model.path (--model): a local {family} checkpoint directory")
    model_json, processor = checkpoint_files(path)
    model_type = model_json.get("model_type")
    if model_type not in model_types:
        raise ValueError(f"{path}: model_type {model_type!r} is not a {family} model {model_types}")
    if not processor:
        raise ValueError(f"{path}: no preprocessor_config.json (nor processor_config.json): the image "
                         "processor's settings (pixel bounds, mean/std) are unknown; copy it from the base model")
    _check_processor_steps(path, processor)
    where_model, where_proc = f"{path}/config.json vision_config", f"{path} image processor"
    adopt_setting(cfg, "image.resize", resize, f"{path} ({model_type}: {family} dynamic resolution)")
    for key, value in geometry(path, model_json, processor).items():
        adopt_setting(cfg, f"image.{key}", value, f"{where_model} {key}")
    lo, hi = pixel_bounds(processor)
    adopt_setting(cfg, "image.min_pixels", lo, f"{where_proc} min_pixels", user_may_override=True)
    adopt_setting(cfg, "image.max_pixels", hi, f"{where_proc} max_pixels", user_may_override=True)
    for key in ("image_mean", "image_std"):
        adopt_setting(cfg, f"image.{key}", processor.get(key, _PROCESSOR_DEFAULTS[key]), f"{where_proc} {key}")

    image_token_id = int(model_json.get("image_token_id", model_json.get("image_token_index", -1)))
    if image_token_id < 0:
        raise ValueError(f"{path}/config.json has no image_token_id")
    adopt_setting(cfg, "text.image_token", _checkpoint_image_token(path, image_token_id),
                  f"{path} tokenizer, token id {image_token_id} (config.json image_token_id)")
    if not cfg.text.tokenizer:
        cfg.text.tokenizer = path
    tok = load_tokenizer(cfg.text.tokenizer)
    got = tok.convert_tokens_to_ids(cfg.text.image_token)
    if got != image_token_id:
        raise ValueError(f"--tokenizer {cfg.text.tokenizer}: its {cfg.text.image_token} is id {got}, but the model's "
                         f"image_token_id is {image_token_id} ({path}/config.json); use the checkpoint's tokenizer")
    video_token_id = int(model_json.get("video_token_id", -1))
    if model_type in video_types and video_token_id >= 0:
        adopt_setting(cfg, "text.video_token", str(tok.convert_ids_to_tokens(video_token_id)),
                      f"{path} tokenizer, token id {video_token_id} (config.json video_token_id)")
        _configure_video(cfg, path, model_type)
    vocab = int((model_json.get("text_config") or model_json).get("vocab_size", 0))
    if vocab and len(tok) > vocab:
        raise ValueError(f"tokenizer {cfg.text.tokenizer} has {len(tok)} tokens but the model embeds {vocab}")
    return cfg


# ------------------------------------------------------------------ the forward adapter
class QwenAdapter:
    """batch (batching/collate.py layout, tensors) -> kwargs of ``hf_model.model`` (module docstring).

    Videos (data/video.py): ``pixel_values_videos`` (normalized as HF's video processor does),
    ``video_grid_thw``, Qwen2.5-VL's ``second_per_grid_ts``; ``mm_token_type_ids`` is 2 at video tokens, and
    each packed sample's M-RoPE ids come from ``get_rope_index`` on its own images and videos."""

    def __init__(self, base_model, image_token_id: int, mean, std, temporal: int, video_token_id: int = -1,
                 video_mean=(), video_std=(), seconds: bool = False, rescale64: bool = False):
        self.base = base_model  # Qwen*VLModel: its own get_rope_index builds the M-RoPE ids
        self.image_token_id = int(image_token_id)
        self.mean, self.std, self.temporal = tuple(mean), tuple(std), int(temporal)
        self.video_token_id = int(video_token_id)
        self.video_mean, self.video_std = tuple(video_mean or mean), tuple(video_std or std)
        self.seconds = bool(seconds)  # Qwen2.5-VL: the temporal M-RoPE step follows second_per_grid_ts
        self.rescale64 = bool(rescale64)  # pixels rescaled as HF's PIL processor does, bit for bit (normalize_patches)

    def token_types(self, ids):
        """mm_token_type_ids: 1 at image tokens, 2 at video tokens, 0 elsewhere."""
        return (ids == self.image_token_id).int() + 2 * (ids == self.video_token_id).int()

    def __call__(self, batch: dict) -> dict[str, Any]:
        from ray_mmbatch.models.hf_common import normalize_patches, normalize_video_patches, varlen_kwargs

        ids = batch["input_ids"]
        grids = batch.get("image_grid_thw")
        has_images = grids is not None and grids.shape[0] > 0
        vgrids = batch.get("video_grid_thw")
        has_videos = vgrids is not None and vgrids.shape[0] > 0
        kwargs: dict[str, Any] = {"input_ids": ids}
        if has_images:
            grids = grids.long()
            kwargs["pixel_values"] = normalize_patches(batch["patches"], self.mean, self.std, self.temporal,
                                                       self.rescale64)
            kwargs["image_grid_thw"] = grids
        if has_videos:
            kwargs["pixel_values_videos"] = normalize_video_patches(batch["video_patches"], self.video_mean,
                                                                    self.video_std)
            kwargs["video_grid_thw"] = vgrids.long()
            if self.seconds:
                kwargs["second_per_grid_ts"] = batch["second_per_grid_ts"]
        if batch["mode"] == "pack":
            kwargs["position_ids"] = self.packed_position_ids(batch)
            # flash attention: the sample boundaries given, not inferred from position ids (hf_common)
            kwargs.update(varlen_kwargs(batch, self.base.language_model.config))
        else:
            kwargs["attention_mask"] = batch["attention_mask"]
            if has_images or has_videos:
                kwargs["mm_token_type_ids"] = self.token_types(ids)
        return kwargs

    def packed_position_ids(self, batch: dict):
        """[4, 1, T]: the per-sample text positions, then each sample's own (t, h, w) M-RoPE ids."""
        import torch

        ids = batch["input_ids"]
        cpu_ids = ids[0].cpu()
        cu = batch["cu_seqlens"].cpu().tolist()
        none = torch.zeros(0, 3, dtype=torch.long)
        grids = batch.get("image_grid_thw")
        grids = grids.cpu().long() if grids is not None else none
        owner = batch["image_sample_index"].cpu() if grids.shape[0] else torch.zeros(0, dtype=torch.long)
        vgrids = batch.get("video_grid_thw")
        vgrids = vgrids.cpu().long() if vgrids is not None else none
        vowner = batch["video_sample_index"].cpu() if vgrids.shape[0] else torch.zeros(0, dtype=torch.long)
        seconds = batch["second_per_grid_ts"].cpu() if vgrids.shape[0] and self.seconds else None
        rows = []
        for i, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
            mine, mine_v = grids[owner == i], vgrids[vowner == i]
            if mine.shape[0] or mine_v.shape[0]:
                seg = cpu_ids[start:end][None]
                extra = {"second_per_grid_ts": seconds[vowner == i]} if seconds is not None and mine_v.shape[0] else {}
                pos, _ = self.base.get_rope_index(input_ids=seg, mm_token_type_ids=self.token_types(seg),
                                                  image_grid_thw=mine if mine.shape[0] else None,
                                                  video_grid_thw=mine_v if mine_v.shape[0] else None, **extra)
                rows.append(pos[:, 0])
            else:
                rows.append(torch.arange(end - start, dtype=torch.long).expand(3, -1))
        mrope = torch.cat(rows, dim=1)[:, None]  # [3, 1, T]
        text = batch["position_ids"].cpu().long()[None]  # [1, 1, T], restarting per sample
        return torch.cat([text, mrope], dim=0).to(ids.device)


def _vision_modules(hf_model) -> list:
    return [hf_model.model.visual]


def vision_modules(model) -> list:
    """The vision tower of the HFModel: a batch without images does not run it."""
    return _vision_modules(model.hf_model)


# the rest of the backend protocol (models/__init__.py) is the same for every HF family
fsdp_units, state_prefix = hf_fsdp_units, hf_state_prefix


def load_qwen(cfg, ids: dict):
    """The checkpoint's HF model (load_checked), its vision sizes checked against the configured ones, no cache:
    the Qwen-style backends' (this one, models/qwen3_5.py) start of create_model."""
    from ray_mmbatch.models.hf_common import load_checked

    hf = load_checked(cfg, ids, hint="run configure(cfg) with the checkpoint's tokenizer")
    vision = hf.config.vision_config
    for key, want in (("patch_size", vision.patch_size), ("merge_size", vision.spatial_merge_size),
                      ("temporal_patch_size", vision.temporal_patch_size)):
        if getattr(cfg.image, key) != want:
            raise ValueError(f"image.{key} is {getattr(cfg.image, key)} but the model's is {want}: "
                             "call configure(cfg) before create_model")
    hf.config.use_cache = False
    return hf


def qwen_adapter(cfg, hf, cls=QwenAdapter):
    """``cls`` (QwenAdapter or a subclass, models/qwen3_5.py's) over the loaded model, with its image and video
    token ids and the configured image / video mean and std."""
    config = hf.config
    return cls(hf.model, config.image_token_id, cfg.image.image_mean, cfg.image.image_std,
               cfg.image.temporal_patch_size, getattr(config, "video_token_id", -1),
               cfg.image.video_mean, cfg.image.video_std, seconds=config.model_type == "qwen2_5_vl")


def create_model(cfg, ids: dict):
    """The checkpoint's *ForConditionalGeneration wrapped in HFModel with the Qwen adapter."""
    from ray_mmbatch.models.hf_common import wrap

    hf = load_qwen(cfg, ids)
    return wrap(hf, cfg, qwen_adapter(cfg, hf), _vision_modules, NAME)


export = hf_export  # save_pretrained of model + tokenizer, the processor files copied
