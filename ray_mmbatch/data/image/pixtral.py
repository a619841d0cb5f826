"""resize='pixtral': HF ``PixtralImageProcessor`` (PIL backend) as ``PixtralProcessor`` calls it (Mistral 3).

The aspect is kept: an image larger than ``image_size`` (the processor's ``size['longest_edge']``, 1540 in the
published Mistral 3 checkpoints) on either side is scaled by ``max(h, w) / image_size`` with both sides floored;
then each side is rounded UP to a multiple of patch_size * merge_size (the processor passes that product as the
image processor's patch size: 28 for 14-px patches merged 2 x 2) and the image is resized bicubic to it, small
images stretched up (a 1 x 1 image becomes 28 x 28); an image so thin that a side scales to 0 pixels is skipped
(extreme_aspect: HF's resize fails on it). Grid (1, H / ps, W / ps); the tower's patch merger makes
(H / 28) x (W / 28) LM image tokens, one run per row of merged patches (``_runs``): the processor writes each
row's ``[IMG]`` tokens followed by ``[IMG_BREAK]``, the last row's by ``[IMG_END]``; measure splices those
(data/row_breaks.py). Aspects above ``max_aspect`` are skipped, as in every mode. Pure module: PIL + numpy, no
ray, no torch.
"""
from __future__ import annotations

import math

from ray_mmbatch import schema as S
from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.image.budget import BUDGET
from ray_mmbatch.data.image.core import ImageSkip, Resizer


def pixtral_resize(height: int, width: int, cfg: ImageConfig) -> tuple[int, int]:
    """HF Pixtral ``get_resize_output_image_size`` formula for formula, size (image_size, image_size) and patch
    size patch_size * merge_size: the target (height, width) in pixels."""
    longest, side = cfg.image_size, cfg.patch_size * cfg.merge_size
    ratio = max(height / longest, width / longest)
    if ratio > 1:
        scaled = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        if 0 in scaled:  # HF's resize to a side of 0 pixels fails
            raise ImageSkip(S.SKIP_EXTREME_ASPECT, f"{width}x{height} scales to {scaled[1]}x{scaled[0]} within the "
                                                   f"longest edge {longest} (Mistral 3's processor cannot resize it)")
        height, width = scaled
    return ((height - 1) // side + 1) * side, ((width - 1) // side + 1) * side


def _grid(height: int, width: int, cfg: ImageConfig, n_images: int = 1) -> tuple[int, int, int]:
    h, w = pixtral_resize(height, width, cfg)
    return 1, h // cfg.patch_size, w // cfg.patch_size


def _runs(grid, cfg: ImageConfig) -> int:
    """One image-token run per row of merged patches (each followed by [IMG_BREAK] or, the last, [IMG_END])."""
    return int(grid[1]) // cfg.merge_size


# the pixels as Gemma 4's: bicubic to the grid's size, none when the image has it already (as HF)
PIXTRAL = Resizer(grid=_grid, target_hw=BUDGET.target_hw, pixels=BUDGET.pixels, runs=_runs)
