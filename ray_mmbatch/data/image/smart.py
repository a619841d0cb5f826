"""resize='smart': HF ``Qwen2VLImageProcessor`` (Qwen2-VL, Qwen2.5-VL and Qwen3-VL, the latter with patch 16);
resize='smart_glm': HF ``Glm4vImageProcessor`` (GLM-4.1V, GLM-4.5V).

Dynamic resolution: the image is resized bicubic to sides that are multiples of patch_size * merge_size
with its area within [min_pixels, max_pixels] (``smart_resize``); the grid is that size in patches.
GLM's variant (``glm_smart_resize``) first scales an image with a side under one factor up, and counts
the area over the image's ``temporal_patch_size`` frames (a still image is that many identical frames).
Pure module: PIL + numpy, no ray, no torch.
"""
from __future__ import annotations

import math

import numpy as np
from PIL import Image

from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.image.core import HW, Resizer, _check_aspect, _resize_rgb


def smart_resize(height: int, width: int, cfg: ImageConfig) -> tuple[int, int]:
    """HF Qwen2-VL ``smart_resize`` (also Qwen2.5-VL, Qwen3-VL), formula for formula.

    Sides become multiples of ``factor`` (patch_size * merge_size), the area is pulled into
    [min_pixels, max_pixels] keeping the aspect. As in HF the bounds are not hard: a side
    is never below one factor, so a thin image can end above max_pixels (when max_pixels /
    aspect < factor**2; not with the default settings). Aspect > ``cfg.max_aspect`` raises
    ImageSkip(extreme_aspect) where HF raises ValueError.
    """
    _check_aspect(height, width, cfg)
    return _bounded(height, width, cfg, frames=1)


def glm_smart_resize(height: int, width: int, cfg: ImageConfig) -> tuple[int, int]:
    """HF GLM-4.1V ``smart_resize`` (image_processing_glm4v; GLM-4.5V's too) for a still image, formula for formula:
    a side under one factor scales the image up until it is one factor (HF's ``int`` truncation kept; the aspect is
    checked again after it, as HF checks it there), then Qwen's rounding with the area counted over ``frames`` =
    temporal_patch_size frames (HF passes num_frames = temporal_factor for an image)."""
    _check_aspect(height, width, cfg)
    f = cfg.factor
    if height < f or width < f:
        scale = max(f / height, f / width)
        height, width = int(height * scale), int(width * scale)
        _check_aspect(height, width, cfg)
    return _bounded(height, width, cfg, frames=max(1, int(cfg.temporal_patch_size)))


def _bounded(height: int, width: int, cfg: ImageConfig, frames: int) -> tuple[int, int]:
    """Sides rounded to multiples of the factor, the area of ``frames`` frames pulled into [min_pixels, max_pixels]."""
    f, min_pixels, max_pixels = cfg.factor, cfg.min_pixels, cfg.max_pixels
    if min_pixels < 1 or max_pixels < 1:  # HF's processor refuses a falsy shortest_edge / longest_edge too
        raise ValueError(f"min_pixels ({min_pixels}) and max_pixels ({max_pixels}) must be >= 1")
    h_bar = round(height / f) * f
    w_bar = round(width / f) * f
    if frames * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(f, math.floor(height / beta / f) * f)
        w_bar = max(f, math.floor(width / beta / f) * f)
    elif frames * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / f) * f
        w_bar = math.ceil(width * beta / f) * f
    return h_bar, w_bar


def _grid(height: int, width: int, cfg: ImageConfig, n_images: int = 1) -> tuple[int, int, int]:
    h, w = smart_resize(height, width, cfg)
    return 1, h // cfg.patch_size, w // cfg.patch_size


def _glm_grid(height: int, width: int, cfg: ImageConfig, n_images: int = 1) -> tuple[int, int, int]:
    h, w = glm_smart_resize(height, width, cfg)
    return 1, h // cfg.patch_size, w // cfg.patch_size


def _grid_hw(full_hw: HW, out_hw: HW, cfg: ImageConfig) -> HW:
    return out_hw


def _pixels(img: Image.Image, full_hw: HW, out_hw: HW, cfg: ImageConfig) -> np.ndarray:
    """Bicubic to the grid's size."""
    return _resize_rgb(img, out_hw, Image.Resampling.BICUBIC, cfg)


SMART = Resizer(grid=_grid, target_hw=_grid_hw, pixels=_pixels)
SMART_GLM = Resizer(grid=_glm_grid, target_hw=_grid_hw, pixels=_pixels)
