"""resize='budget': HF ``Gemma4ImageProcessor`` (PIL backend, ``aspect_ratio_preserving_resize``).

The aspect is kept: the image is scaled so its area is the patch budget (``max_pixels`` = max patches x
patch_size**2, i.e. max_soft_tokens x pooling_kernel_size**2 patches), then each side is floored to a
multiple of patch_size * merge_size (merge_size = the pooling kernel), bicubic; small images are scaled
up. A side that floors to zero becomes one multiple, the other ``floor(long / short)`` multiples capped
at the budget's longest side (HF's edge case). Tokens: gh * gw / merge**2 (at most max_soft_tokens).
Where HF raises (the edge case still over the budget) the image is skipped (extreme_aspect), as is any
aspect above ``max_aspect``. Pure module: PIL + numpy, no ray, no torch.
"""
from __future__ import annotations

import math

import numpy as np
from PIL import Image

from ray_mmbatch import schema as S
from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.image.core import HW, ImageSkip, Resizer, _resize_rgb


def budget_resize(height: int, width: int, cfg: ImageConfig) -> tuple[int, int]:
    """HF Gemma 4 ``get_aspect_ratio_preserving_size`` formula for formula (max_patches = max_pixels / ps**2,
    pooling_kernel_size = merge_size)."""
    ps, k = cfg.patch_size, cfg.merge_size
    max_patches = cfg.max_pixels // (ps * ps)
    target_px = max_patches * ps ** 2
    factor = math.sqrt(target_px / (height * width))
    side = k * ps
    th = int(math.floor(factor * height / side)) * side
    tw = int(math.floor(factor * width / side)) * side
    if th == 0 and tw == 0:
        raise ImageSkip(S.SKIP_EXTREME_ASPECT, f"{width}x{height} resizes to 0 x 0 (Gemma 4's processor refuses it)")
    longest = (max_patches // k ** 2) * side
    if th == 0:
        th, tw = side, min(int(math.floor(width / height)) * side, longest)
    elif tw == 0:
        th, tw = min(int(math.floor(height / width)) * side, longest), side
    if th * tw > target_px:
        raise ImageSkip(S.SKIP_EXTREME_ASPECT, f"{width}x{height} resizes to {tw}x{th}, over the budget of "
                                               f"{max_patches} patches (Gemma 4's processor refuses it)")
    return th, tw


def _grid(height: int, width: int, cfg: ImageConfig, n_images: int = 1) -> tuple[int, int, int]:
    h, w = budget_resize(height, width, cfg)
    return 1, h // cfg.patch_size, w // cfg.patch_size


def _grid_hw(full_hw: HW, out_hw: HW, cfg: ImageConfig) -> HW:
    return out_hw


def _pixels(img: Image.Image, full_hw: HW, out_hw: HW, cfg: ImageConfig) -> np.ndarray:
    """Bicubic to the grid's size (none when the image has it already, as HF)."""
    return _resize_rgb(img, out_hw, Image.Resampling.BICUBIC, cfg)


BUDGET = Resizer(grid=_grid, target_hw=_grid_hw, pixels=_pixels)
