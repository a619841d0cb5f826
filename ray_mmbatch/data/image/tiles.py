"""resize='tiles': InternVL's dynamic tiling, HF ``GotOcr2ImageProcessor`` with ``crop_to_patches``.

The cols x rows grid of image_size tiles whose aspect is closest to the image's (``tile_canvas``),
min_tiles..max_tiles of them, plus a thumbnail tile when more than one; the tiles are stacked top to
bottom, so the grid is (1, n_tiles * S/ps, S/ps).
Pure module: PIL + numpy, no ray, no torch.
"""
from __future__ import annotations

import numpy as np
from PIL import Image

from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.image.core import HW, Resizer, _gap, _rgb_or_skip, _stack_views, _view_patches


def tile_canvas(height: int, width: int, cfg: ImageConfig) -> tuple[int, int]:
    """(cols, rows) of image_size tiles for resize='tiles': HF ``get_optimal_tiled_canvas``, formula for formula.

    The arrangement with min_tiles <= cols * rows <= max_tiles whose cols / rows is closest to
    width / height; on a tie the one with more tiles while the image covers more than half of
    its area. max_tiles 1 gives (1, 1) (HF resizes to one tile without tiling then).
    """
    lo, hi = cfg.min_tiles, cfg.max_tiles
    if hi <= 1:
        return 1, 1
    arrangements = sorted(((c, r) for c in range(1, hi + 1) for r in range(1, hi + 1) if lo <= c * r <= hi),
                          key=lambda g: g[0] * g[1])
    side, aspect, area = cfg.image_size, width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for cols, rows in arrangements:
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * side * side * cols * rows:
            best = (cols, rows)
    return best


def n_tiles(height: int, width: int, cfg: ImageConfig) -> int:
    """Tiles the vision tower sees for resize='tiles': cols * rows, plus the thumbnail when that is above 1."""
    cols, rows = tile_canvas(height, width, cfg)
    return 1 if cols * rows == 1 else cols * rows + 1


def _grid(height: int, width: int, cfg: ImageConfig, n_images: int = 1) -> tuple[int, int, int]:
    g = _view_patches(cfg)
    return 1, n_tiles(height, width, cfg) * g, g


def _canvas_hw(full_hw: HW, out_hw: HW, cfg: ImageConfig) -> HW:
    cols, rows = tile_canvas(*full_hw, cfg)
    return rows * cfg.image_size, cols * cfg.image_size


def _tiles(img: Image.Image, full_hw: HW, out_hw: HW, cfg: ImageConfig) -> np.ndarray:
    """HF GotOcr2 ``crop_image_to_patches``: bicubic to cols x rows tiles, split row-major, then the whole
    image bicubic to one tile (the thumbnail) when there is more than one; stacked top to bottom."""
    rgb, side, gap = _rgb_or_skip(img), cfg.image_size, _gap(cfg)
    cols, rows = tile_canvas(*full_hw, cfg)
    n = 1 if cols * rows == 1 else cols * rows + 1
    if out_hw != (n * side, side):
        raise ValueError(f"grid of {out_hw[0]}x{out_hw[1]} px is not the {n} tiles of {side} px this image makes")
    canvas = rgb.resize((cols * side, rows * side), Image.Resampling.BICUBIC, reducing_gap=gap)
    tiles = [_stack_views(np.asarray(canvas, dtype=np.uint8), rows, cols, side)]
    if n > 1:
        tiles.append(np.asarray(rgb.resize((side, side), Image.Resampling.BICUBIC, reducing_gap=gap), dtype=np.uint8))
    return np.ascontiguousarray(np.concatenate(tiles)) if n > 1 else tiles[0]


TILES = Resizer(grid=_grid, target_hw=_canvas_hw, pixels=_tiles)
