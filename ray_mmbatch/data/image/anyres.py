"""resize='anyres': LLaVA-OneVision, HF ``LlavaOnevisionImageProcessor`` (PIL) and ``LlavaOnevisionProcessor``.

A sample's only image: a base tile (the whole image to S x S), then the crops of its best
``grid_pinpoints`` resolution (``select_best_resolution``), the image resized into it keeping the aspect
and centred on black. Each image of a sample of several: one tile, padded to a square of the mean colour.
Tiles are stacked top to bottom ((1, n * S/ps, S/ps)); the LM tokens are not the grid's: they come from
the displayed size too (``anyres_tokens``: unpadding, pooling and a newline per row).
Pure module: PIL + numpy, no ray, no torch.
"""
from __future__ import annotations

import math

import numpy as np
from PIL import Image

from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.image.core import (
    HW,
    Resizer,
    _gap,
    _pad_to_square,
    _rgb_or_skip,
    _stack_views,
    _view_patches,
)


def _pinpoints(cfg: ImageConfig) -> list[tuple[int, int]]:
    flat = tuple(cfg.grid_pinpoints)
    if not flat or len(flat) % 2:
        raise ValueError(f"resize='anyres' needs image.grid_pinpoints as flat (h, w) pairs, got {flat!r}")
    return [(int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]


def select_best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """HF ``select_best_resolution``, formula for formula: the (h, w) that keeps the most of the image's
    resolution once fitted inside, the least wasted area on a tie (the first such in the list)."""
    best, max_effective, min_wasted = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        down_w, down_h = int(width * scale), int(height * scale)
        effective = min(down_w * down_h, width * height)
        wasted = w * h - effective
        if effective > max_effective or (effective == max_effective and wasted < min_wasted):
            best, max_effective, min_wasted = (h, w), effective, wasted
    return best


def anyres_tiles(height: int, width: int, cfg: ImageConfig, n_images: int = 1) -> int:
    """Tiles the vision tower sees for resize='anyres': the base tile plus the best resolution's crops for
    the only image of a sample, one (padded square) tile for each image of a sample of several (HF
    ``batch_num_images``)."""
    if n_images != 1:
        return 1
    h, w = select_best_resolution(height, width, _pinpoints(cfg))
    side = cfg.image_size
    return 1 + -(-h // side) * -(-w // side)


def anyres_tokens(height: int, width: int, cfg: ImageConfig, n_tiles: int) -> int:
    """LM tokens of one image for resize='anyres' (HF LlavaOnevisionProcessor ``_get_number_of_features`` and
    the model's ``pack_image_features``): g*g base features plus one newline for a lone tile; else the base
    plus the crops' feature grid unpadded to the image's aspect (and pooled to ~anyres_max tiles when
    more than 1.1x that), one newline per row."""
    g = int(cfg.anyres_features)
    if n_tiles == 1:
        return g * g + 1
    best_h, best_w = select_best_resolution(height, width, _pinpoints(cfg))
    cur_h, cur_w = g * (best_h // cfg.image_size), g * (best_w // cfg.image_size)
    if width / height > cur_w / cur_h:
        new_h = int(round(height * (cur_w / width), 7))
        cur_h -= (cur_h - new_h) // 2 * 2
    else:
        new_w = int(round(width * (cur_h / height), 7))
        cur_w -= (cur_w - new_w) // 2 * 2
    unpadded, newlines = cur_h * cur_w, cur_h
    ratio = math.sqrt(cur_h * cur_w / (int(cfg.anyres_max) * g * g))
    if ratio > 1.1:
        unpadded, newlines = int(cur_h // ratio) * int(cur_w // ratio), int(cur_h // ratio)
    return g * g + unpadded + newlines


def _grid(height: int, width: int, cfg: ImageConfig, n_images: int = 1) -> tuple[int, int, int]:
    g = _view_patches(cfg)
    return 1, anyres_tiles(height, width, cfg, n_images) * g, g


def _tokens(grid, hw: HW | None, cfg: ImageConfig) -> int:
    _, gh, _ = (int(v) for v in grid)
    if hw is None:
        raise ValueError("resize='anyres': an image's token count needs its displayed size")
    return anyres_tokens(int(hw[0]), int(hw[1]), cfg, gh // (cfg.image_size // cfg.patch_size))


def _first_hw(full_hw: HW, out_hw: HW, cfg: ImageConfig) -> HW:
    """At least the tile, or the best resolution the crops are cut from."""
    n = out_hw[0] // cfg.image_size
    return (cfg.image_size, cfg.image_size) if n == 1 else select_best_resolution(*full_hw, _pinpoints(cfg))


def _anyres(img: Image.Image, full_hw: HW, out_hw: HW, cfg: ImageConfig) -> np.ndarray:
    """HF LlavaOnevisionImageProcessor (PIL): tiles of image_size stacked top to bottom. One tile (an image of
    a sample of several): padded to a square of the mean colour, bicubic to the tile. Else the base tile
    (the whole image bicubic to the tile, aspect not kept), then the crops: the image bicubic into the best
    pinpoint resolution keeping its aspect (``get_patch_output_size``), centred on black (0) padding, cut
    row-major."""
    rgb, side, gap = _rgb_or_skip(img), cfg.image_size, _gap(cfg)
    n = out_hw[0] // side
    if out_hw != (n * side, side) or n < 1:
        raise ValueError(f"grid of {out_hw[0]}x{out_hw[1]} px is not a stack of {side} px tiles")
    if n == 1:
        square = _pad_to_square(rgb, cfg.image_mean)
        return np.asarray(square.resize((side, side), Image.Resampling.BICUBIC, reducing_gap=gap), dtype=np.uint8)
    h, w = full_hw
    best_h, best_w = select_best_resolution(h, w, _pinpoints(cfg))
    rows, cols = best_h // side, best_w // side
    if 1 + rows * cols != n or best_h % side or best_w % side:
        raise ValueError(f"{w}x{h}: best resolution {best_w}x{best_h} is not the {n - 1} crops of {side} px "
                         "the grid says")
    if best_w / w < best_h / h:
        new_h, new_w = min(math.ceil(h * best_w / w), best_h), best_w
    else:
        new_h, new_w = best_h, min(math.ceil(w * best_h / h), best_w)
    canvas = np.zeros((best_h, best_w, 3), dtype=np.uint8)
    top, left = (best_h - new_h) // 2, (best_w - new_w) // 2
    canvas[top:top + new_h, left:left + new_w] = np.asarray(
        rgb.resize((new_w, new_h), Image.Resampling.BICUBIC, reducing_gap=gap), dtype=np.uint8)
    crops = _stack_views(canvas, rows, cols, side)
    base = np.asarray(rgb.resize((side, side), Image.Resampling.BICUBIC, reducing_gap=gap), dtype=np.uint8)
    return np.ascontiguousarray(np.concatenate([base, crops]))


ANYRES = Resizer(grid=_grid, target_hw=_first_hw, pixels=_anyres, tokens=_tokens)
