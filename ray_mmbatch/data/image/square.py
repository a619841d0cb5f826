"""One image_size x image_size view whatever the image: resize='fixed', 'fixed_pad', 'squash' and 'global'.

* 'fixed': HF ``CLIPImageProcessor`` / ``LlavaImageProcessor`` (CLIP, LLaVA-1.5): bicubic, shortest edge to
  image_size, centre crop.
* 'fixed_pad': ``LlavaImageProcessor`` with ``do_pad``: first padded to a square of the mean colour.
* 'squash': HF ``Gemma3ImageProcessor`` (no pan-and-scan): bilinear to image_size x image_size, aspect not
  kept, nothing cropped.
* 'global': HF ``Idefics3ImageProcessor`` (Idefics3, SmolVLM) with ``do_image_splitting=False``: Lanczos to
  the longest edge (split.longest_edge_size), then to image_size x image_size.

Every one is a (1, S/ps, S/ps) grid of S * S / (ps * merge)**2 LM tokens.
Pure module: PIL + numpy, no ray, no torch.
"""
from __future__ import annotations

import numpy as np
from PIL import Image

from ray_mmbatch import schema as S
from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.image.core import (
    HW,
    ImageSkip,
    Resizer,
    _gap,
    _pad_to_square,
    _resize_rgb,
    _rgb_or_skip,
    _view_patches,
)
from ray_mmbatch.data.image.split import _longest_edge_hw


def shortest_edge_resize(height: int, width: int, size: int) -> tuple[int, int]:
    """HF ``get_resize_output_image_size(size, default_to_square=False)``: short side -> size, long side truncated."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def _grid(height: int, width: int, cfg: ImageConfig, n_images: int = 1) -> tuple[int, int, int]:
    g = _view_patches(cfg)
    return 1, g, g


def _padded_grid(height: int, width: int, cfg: ImageConfig, n_images: int = 1) -> tuple[int, int, int]:
    grid = _grid(height, width, cfg, n_images)
    if max(height, width) ** 2 > cfg.max_header_pixels:
        raise ImageSkip(S.SKIP_DECOMPRESSION_BOMB, f"{width}x{height} padded to a square is over "
                                                   f"max_header_pixels={cfg.max_header_pixels}")
    return grid


def _fixed_hw(full_hw: HW, out_hw: HW, cfg: ImageConfig) -> HW:
    return shortest_edge_resize(*full_hw, cfg.image_size)


def _padded_hw(full_hw: HW, out_hw: HW, cfg: ImageConfig) -> HW:
    side = max(full_hw)
    return shortest_edge_resize(side, side, cfg.image_size)


def _square_hw(full_hw: HW, out_hw: HW, cfg: ImageConfig) -> HW:
    return cfg.image_size, cfg.image_size


def _crop(img: Image.Image, size_hw: HW, out_hw: HW, resample: Image.Resampling, cfg: ImageConfig) -> np.ndarray:
    """Resize to ``size_hw``, then HF ``center_crop`` to ``out_hw``: top-left corner at ((H - S) // 2,
    (W - S) // 2); the resize never undershoots S."""
    out = _resize_rgb(img, size_hw, resample, cfg)
    top, left = (size_hw[0] - out_hw[0]) // 2, (size_hw[1] - out_hw[1]) // 2
    return out[top:top + out_hw[0], left:left + out_hw[1]]


def _fixed(img: Image.Image, full_hw: HW, out_hw: HW, cfg: ImageConfig) -> np.ndarray:
    return _crop(img, _fixed_hw(full_hw, out_hw, cfg), out_hw, Image.Resampling.BICUBIC, cfg)


def _fixed_pad(img: Image.Image, full_hw: HW, out_hw: HW, cfg: ImageConfig) -> np.ndarray:
    square = _pad_to_square(_rgb_or_skip(img), cfg.image_mean)
    return _crop(square, _padded_hw(full_hw, out_hw, cfg), out_hw, Image.Resampling.BICUBIC, cfg)


def _squash(img: Image.Image, full_hw: HW, out_hw: HW, cfg: ImageConfig) -> np.ndarray:
    return _crop(img, _square_hw(full_hw, out_hw, cfg), out_hw, Image.Resampling.BILINEAR, cfg)


def _global(img: Image.Image, full_hw: HW, out_hw: HW, cfg: ImageConfig) -> np.ndarray:
    """resize='global', HF Idefics3 / SmolVLM PIL processor with ``do_image_splitting=False``: Lanczos to the
    longest edge max_tiles * image_size (``size['longest_edge']``, aspect kept, see longest_edge_size), then
    Lanczos again to image_size x image_size (``max_image_size``): two resizes, as HF, on uint8."""
    rgb, gap = _rgb_or_skip(img), _gap(cfg)
    h, w = _longest_edge_hw(full_hw, out_hw, cfg)
    first = rgb.resize((w, h), Image.Resampling.LANCZOS, reducing_gap=gap)
    side = cfg.image_size
    return np.asarray(first.resize((side, side), Image.Resampling.LANCZOS, reducing_gap=gap), dtype=np.uint8)


FIXED = Resizer(grid=_grid, target_hw=_fixed_hw, pixels=_fixed, square=True)
FIXED_PAD = Resizer(grid=_padded_grid, target_hw=_padded_hw, pixels=_fixed_pad, square=True)
SQUASH = Resizer(grid=_grid, target_hw=_square_hw, pixels=_squash, square=True)
GLOBAL = Resizer(grid=_grid, target_hw=_longest_edge_hw, pixels=_global, square=True)
