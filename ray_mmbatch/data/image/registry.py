"""The resize modes by name (``ImageConfig.resize``) and the three calls that dispatch on it.

``RESIZERS`` maps each mode to its family module's core.Resizer (a new mode: a Resizer in a module of
its own, one line here). ``image_grid``, ``image_tokens`` and ``decode_image`` look the mode up and
refuse an unknown one.
Pure module: PIL + numpy, no ray, no torch.
"""
from __future__ import annotations

import numpy as np

from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.image.anyres import ANYRES
from ray_mmbatch.data.image.budget import BUDGET
from ray_mmbatch.data.image.core import Resizer, _check_aspect, _load, probe_image
from ray_mmbatch.data.image.pixtral import PIXTRAL
from ray_mmbatch.data.image.smart import SMART, SMART_GLM
from ray_mmbatch.data.image.split import SPLIT
from ray_mmbatch.data.image.square import FIXED, FIXED_PAD, GLOBAL, SQUASH
from ray_mmbatch.data.image.tiles import TILES

RESIZERS: dict[str, Resizer] = {
    "smart": SMART,  # Qwen-VL dynamic resolution
    "fixed": FIXED,  # CLIP / LLaVA-1.5: shortest edge, centre crop
    "fixed_pad": FIXED_PAD,  # the same after LLaVA's do_pad
    "tiles": TILES,  # InternVL's dynamic tiles
    "squash": SQUASH,  # Gemma 3: plain bilinear to the square
    "anyres": ANYRES,  # LLaVA-OneVision
    "global": GLOBAL,  # Idefics3 / SmolVLM without image splitting
    "split": SPLIT,  # Idefics3 / SmolVLM with image splitting
    "budget": BUDGET,  # Gemma 4: aspect kept, a patch budget
    "pixtral": PIXTRAL,  # Mistral 3: longest edge, sides rounded up to merged patches
    "smart_glm": SMART_GLM,  # GLM-4.1V / 4.5V: smart with small images scaled up, the area over 2 frames
}
RESIZE_MODES = tuple(RESIZERS)


def resizer_for(cfg: ImageConfig) -> Resizer:
    """``cfg.resize``'s Resizer; ValueError for an unknown mode."""
    resizer = RESIZERS.get(cfg.resize)
    if resizer is None:
        raise ValueError(f"unknown resize {cfg.resize!r}; expected one of {RESIZE_MODES}")
    return resizer


def image_grid(height: int, width: int, cfg: ImageConfig, n_images: int = 1) -> tuple[int, int, int]:
    """(t, gh, gw) in patches for an image of this displayed size (HF's ``image_grid_thw``; t == 1).
    ``n_images``: the images of its sample (resize='anyres' tiles a sample's only image, not several)."""
    _check_aspect(height, width, cfg)
    return resizer_for(cfg).grid(height, width, cfg, n_images)


def image_tokens(grid, hw: tuple[int, int] | None, cfg: ImageConfig) -> int:
    """LM tokens of one image of this grid: gh * gw / merge**2, or for resize='anyres' from its displayed
    size ``hw`` too (anyres_tokens; the grid gives its tiles)."""
    return resizer_for(cfg).tokens(grid, hw, cfg)


def image_runs(grid, cfg: ImageConfig) -> int:
    """Image-token runs in one image's text block (Resizer.runs): one image token each in the measured ids."""
    return resizer_for(cfg).runs(grid, cfg)


def decode_image(data: bytes, grid_thw, cfg: ImageConfig) -> np.ndarray:
    """Decode -> EXIF transpose -> RGB -> resize (-> crop) to ``grid_thw`` -> uint8 [gh*ps, gw*ps, 3].

    How the image is resized is its mode's (the family modules). Only ``cfg.allowed_formats`` are
    opened. Broken pixel data raises ImageSkip(corrupt_image); truncated files are never accepted.
    Unless ``cfg.fast_decode``, the pixels are those of the HF image processor (PIL backend) given
    the EXIF-transposed image.
    """
    resizer = resizer_for(cfg)
    _, gh, gw = (int(v) for v in grid_thw)
    out_hw = (gh * cfg.patch_size, gw * cfg.patch_size)
    if resizer.square and out_hw != (cfg.image_size, cfg.image_size):
        raise ValueError(f"grid {tuple(grid_thw)} is not image_size {cfg.image_size} in patches of {cfg.patch_size}")
    if cfg.fast_decode:
        img, full_hw = _load(data, cfg, draft_hw=resizer.target_hw(probe_image(data, cfg), out_hw, cfg))
    else:
        img, full_hw = _load(data, cfg)
    return resizer.pixels(img, full_hw, out_hw, cfg)
