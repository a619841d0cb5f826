"""resize='split': HF ``Idefics3ImageProcessor`` (Idefics3, SmolVLM) with ``do_image_splitting``.

Lanczos to the longest edge max_tiles * image_size (``longest_edge_size``), Lanczos to sides rounded up
to multiples of image_size (``_split_sizes``), then rows x cols image_size views row-major plus a global
view of the whole, stacked top to bottom as tiles are (``split_grid``; one view and no global copy when
the rounded-up image is one view). Without splitting ('global', square.py) the same first resize feeds a
single view.
Pure module: PIL + numpy, no ray, no torch.
"""
from __future__ import annotations

import math

import numpy as np
from PIL import Image

from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.image.core import HW, Resizer, _gap, _rgb_or_skip, _stack_views, _view_patches

# HF Idefics3's MAX_IMAGE_SIZE: no side above it after the longest-edge resize ('split' and 'global').
_IDEFICS3_MAX_SIDE = 4096


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """HF Idefics3 ``get_resize_output_image_size``, formula for formula: the longest edge to ``longest`` (up or
    down), the other kept to the aspect, truncated and made even, then both under HF's MAX_IMAGE_SIZE (4096)."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > _IDEFICS3_MAX_SIDE:
        width, height = _IDEFICS3_MAX_SIDE, int(_IDEFICS3_MAX_SIDE / aspect)
    elif height > width and height > _IDEFICS3_MAX_SIDE:
        height, width = _IDEFICS3_MAX_SIDE, int(_IDEFICS3_MAX_SIDE * aspect)
    return max(height, 1), max(width, 1)


def _split_sizes(height: int, width: int, cfg: ImageConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """resize='split': (h, w) after HF Idefics3's resize to the longest edge, then after its
    ``resize_for_vision_encoder`` (sides rounded up to multiples of image_size, formula for formula)."""
    side = cfg.image_size
    h1, w1 = longest_edge_size(height, width, cfg.max_tiles * side)
    aspect = w1 / h1
    if w1 >= h1:
        w2 = math.ceil(w1 / side) * side
        h2 = math.ceil(int(w2 / aspect) / side) * side
    else:
        h2 = math.ceil(h1 / side) * side
        w2 = math.ceil(int(h2 * aspect) / side) * side
    return (h1, w1), (h2, w2)


def split_grid(height: int, width: int, cfg: ImageConfig) -> tuple[int, int]:
    """(rows, cols) of image_size sub-images for resize='split' (HF Idefics3 / SmolVLM ``do_image_splitting``):
    (0, 0) when the rounded-up image is one view (no sub-images, no global copy). The views are the
    rows x cols sub-images row-major, then the global view (rows * cols + 1), stacked top to bottom."""
    _, (h2, w2) = _split_sizes(height, width, cfg)
    side = cfg.image_size
    if h2 > side or w2 > side:
        return (h2 - side) // side + 1, (w2 - side) // side + 1
    return 0, 0


def _grid(height: int, width: int, cfg: ImageConfig, n_images: int = 1) -> tuple[int, int, int]:
    g = _view_patches(cfg)
    rows, cols = split_grid(height, width, cfg)
    return 1, (rows * cols + 1 if rows else 1) * g, g


def _longest_edge_hw(full_hw: HW, out_hw: HW, cfg: ImageConfig) -> HW:
    return longest_edge_size(*full_hw, cfg.max_tiles * cfg.image_size)


def _split(img: Image.Image, full_hw: HW, out_hw: HW, cfg: ImageConfig) -> np.ndarray:
    """resize='split', HF Idefics3 / SmolVLM PIL processor with ``do_image_splitting``: Lanczos to the longest
    edge, Lanczos to multiples of image_size, crop rows x cols views, then that image Lanczos to one view."""
    rgb, gap, side = _rgb_or_skip(img), _gap(cfg), cfg.image_size
    (h1, w1), (h2, w2) = _split_sizes(*full_hw, cfg)
    rows, cols = split_grid(*full_hw, cfg)
    n = rows * cols + 1 if rows else 1
    if out_hw != (n * side, side):
        raise ValueError(f"grid of {out_hw[0]}x{out_hw[1]} px is not the {n} views of {side} px this image makes")
    fitted = rgb.resize((w1, h1), Image.Resampling.LANCZOS, reducing_gap=gap)
    fitted = fitted.resize((w2, h2), Image.Resampling.LANCZOS, reducing_gap=gap)
    if not rows:
        return np.asarray(fitted, dtype=np.uint8)
    views = _stack_views(np.asarray(fitted, dtype=np.uint8), rows, cols, side)
    whole = np.asarray(fitted.resize((side, side), Image.Resampling.LANCZOS, reducing_gap=gap), dtype=np.uint8)
    return np.ascontiguousarray(np.concatenate([views, whole]))


SPLIT = Resizer(grid=_grid, target_hw=_longest_edge_hw, pixels=_split, runs=lambda grid, cfg: grid[1] // grid[2])
