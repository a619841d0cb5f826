"""Images: header probe, resize as the checkpoint's HF processor does, decode to RGB, patchify.

Exactness: with the default ``fast_decode=False`` the uint8 pixels equal what the HF image
processor (PIL backend) sees after its own resize / crop, so ``models.hf_common.normalize_patches``
gives HF's ``pixel_values`` (tests/test_image_hf.py, atol 1e-5): resize='smart' is Qwen2-VL's
``smart_resize`` (Qwen2.5-VL and Qwen3-VL use the same processor; Qwen3-VL with patch 16),
'fixed' is CLIP / LLaVA-1.5 (shortest edge to image_size, centre crop), 'fixed_pad' is LLaVA
with ``do_pad`` (pad to a square of the mean colour first), 'tiles' is InternVL's dynamic tiling
(HF ``GotOcr2ImageProcessor`` with ``crop_to_patches``: the cols x rows grid of image_size tiles
whose aspect is closest to the image's, min_tiles..max_tiles of them, plus a thumbnail tile when
more than one; the tiles are stacked top to bottom, so the grid is (1, n_tiles * S/ps, S/ps)),
'split' / 'global' are Idefics3 / SmolVLM with and without image splitting (Lanczos to the longest
edge, then rows x cols S x S views plus a global view stacked as tiles are, or one S x S view;
``split_grid``, ``_split``, ``_global``), 'anyres' is LLaVA-OneVision (a sample's only image: a base
tile, the whole image to S x S, then the crops of its best ``grid_pinpoints`` resolution, resized
into it keeping the aspect and centred on black; each image of a sample of several: one tile padded
to a square of the mean colour; tiles stacked as above; its LM tokens come from ``image_tokens``,
which needs the displayed size, not from the grid).
Decoding is Pillow's, EXIF orientation applied (as HF's ``load_image`` does), then HF's
``convert_to_rgb`` (alpha and
transparency keys composited on white; 16-bit / float greys clipped at 255 by Pillow, as in
HF), then PIL bicubic (bilinear for 'squash', Gemma 3's plain resize to image_size x image_size:
aspect not kept, nothing cropped) on uint8 with no ``reducing_gap``. Where we differ, deliberately:
aspect ratios above ``max_aspect`` (HF Qwen-VL: 200) are skipped (extreme_aspect) in every
mode, also 'fixed' where HF would crop the middle; an unreadable EXIF block counts as upright.
HF itself is not one thing here: its processors given an already-opened PIL image apply no
EXIF orientation (we do, as its loader does), and its ``load_image`` drops alpha without
compositing (we composite on white, as its processors do).

Cost model: ``probe_image`` parses the header only (no pixel decoding, ~10-50 us; for
PNG the EXIF orientation is read without Pillow's full decode unless a metadata chunk
follows the pixel data), so measuring a sample's image tokens is cheap and exact before
any pixel is touched (2,164 generated images: 0.83 s -> 0.08 s once PNGs stopped decoding).
``decode_image`` is the expensive step (once per trained sample): exact decode reads every
JPEG at full scale, so its cost grows with the file's pixels, not the grid: 2-6x the
``fast_decode`` cost for JPEGs at least twice the target's sides, the same for PNG and for
JPEGs near the target (benchmarks/bench_decode.py; figures in benchmarks/RESULTS.md).
``fast_decode`` decodes big JPEGs at a reduced DCT scale (``draft``) and resizes with
``reducing_gap``: cheaper, pixels no longer HF's. Grey images (documents, the largest here)
are resized as one band before becoming RGB (same bytes as HF, ~1/3 the resize work).

Patch order (what the model relies on), for a grid of gh x gw patches, merge m::

    merge block (0,0)        merge block (0,1)   ...   row-major over (gh/m, gw/m)
    p(0,0) p(0,1)            p(0,2) p(0,3)
    p(1,0) p(1,1)            p(1,2) p(1,3)
    -> patches 0..3          -> patches 4..7

so ``patches.reshape(-1, m*m*D)`` is one row per LM image token (Qwen2-VL's order).
Each patch vector is channel-major ``[3, ps, ps]`` flattened (D = 3*ps*ps).
Pure module: PIL + numpy, no ray, no torch.
"""
from __future__ import annotations

import math

import numpy as np
from PIL import Image

from ray_mmbatch import schema as S
from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.image.core import (
    ImageSkip,
    _check_aspect,
    _load,
    _pad_to_square,
    _rgb_or_skip,
    decoded_bytes_per_pixel,
    patchify,
    probe_image,
    unpatchify,
)

__all__ = [
    "RESIZE_MODES", "ImageSkip", "anyres_tiles", "anyres_tokens", "decode_image", "decoded_bytes_per_pixel",
    "image_grid", "image_tokens", "longest_edge_size", "n_tiles", "patchify", "probe_image", "select_best_resolution",
    "shortest_edge_resize", "smart_resize", "split_grid", "tile_canvas", "unpatchify",
]

# ImageConfig.resize values: Qwen-VL dynamic resolution; CLIP / LLaVA-1.5 square; the same after LLaVA's do_pad;
# InternVL's tiles (see tile_canvas); Gemma 3's plain bilinear resize to the square (aspect not kept, no crop).
RESIZE_MODES = ("smart", "fixed", "fixed_pad", "tiles", "squash", "anyres", "global", "split")
_FIXED_MODES = frozenset({"fixed", "fixed_pad", "squash", "global"})
# resize='global': Idefics3 / SmolVLM with do_image_splitting off (see global_resize); HF's MAX_IMAGE_SIZE
_IDEFICS3_MAX_SIDE = 4096


def smart_resize(height: int, width: int, cfg: ImageConfig) -> tuple[int, int]:
    """HF Qwen2-VL ``smart_resize`` (also Qwen2.5-VL, Qwen3-VL), formula for formula.

    Sides become multiples of ``factor`` (patch_size * merge_size), the area is pulled into
    [min_pixels, max_pixels] keeping the aspect. As in HF the bounds are not hard: a side
    is never below one factor, so a thin image can end above max_pixels (when max_pixels /
    aspect < factor**2; not with the default settings). Aspect > ``cfg.max_aspect`` raises
    ImageSkip(extreme_aspect) where HF raises ValueError.
    """
    _check_aspect(height, width, cfg)
    f, min_pixels, max_pixels = cfg.factor, cfg.min_pixels, cfg.max_pixels
    if min_pixels < 1 or max_pixels < 1:  # HF's processor refuses a falsy shortest_edge / longest_edge too
        raise ValueError(f"min_pixels ({min_pixels}) and max_pixels ({max_pixels}) must be >= 1")
    h_bar = round(height / f) * f
    w_bar = round(width / f) * f
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(f, math.floor(height / beta / f) * f)
        w_bar = max(f, math.floor(width / beta / f) * f)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / f) * f
        w_bar = math.ceil(width * beta / f) * f
    return h_bar, w_bar


def shortest_edge_resize(height: int, width: int, size: int) -> tuple[int, int]:
    """HF ``get_resize_output_image_size(size, default_to_square=False)``: short side -> size, long side truncated."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


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


# ------------------------------------------------------------------ resize='anyres' (LLaVA-OneVision)
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


def image_tokens(grid, hw: tuple[int, int] | None, cfg: ImageConfig) -> int:
    """LM tokens of one image of this grid: gh * gw / merge**2, or for resize='anyres' from its displayed
    size ``hw`` too (anyres_tokens; the grid gives its tiles)."""
    _, gh, gw = (int(v) for v in grid)
    if cfg.resize != "anyres":
        return gh * gw // cfg.merge_size ** 2
    if hw is None:
        raise ValueError("resize='anyres': an image's token count needs its displayed size")
    return anyres_tokens(int(hw[0]), int(hw[1]), cfg, gh // (cfg.image_size // cfg.patch_size))


def image_grid(height: int, width: int, cfg: ImageConfig, n_images: int = 1) -> tuple[int, int, int]:
    """(t, gh, gw) in patches for an image of this displayed size (HF's ``image_grid_thw``; t == 1).
    ``n_images``: the images of its sample (resize='anyres' tiles a sample's only image, not several)."""
    _check_aspect(height, width, cfg)
    ps = cfg.patch_size
    if cfg.resize == "anyres":
        if cfg.image_size % ps:
            raise ValueError(f"image_size {cfg.image_size} is not a multiple of patch_size {ps}")
        return 1, anyres_tiles(height, width, cfg, n_images) * (cfg.image_size // ps), cfg.image_size // ps
    if cfg.resize == "smart":
        h, w = smart_resize(height, width, cfg)
        return 1, h // ps, w // ps
    if cfg.resize in _FIXED_MODES:
        if cfg.image_size % ps:
            raise ValueError(f"image_size {cfg.image_size} is not a multiple of patch_size {ps}")
        if cfg.resize == "fixed_pad" and max(height, width) ** 2 > cfg.max_header_pixels:
            raise ImageSkip(S.SKIP_DECOMPRESSION_BOMB, f"{width}x{height} padded to a square is over "
                                                       f"max_header_pixels={cfg.max_header_pixels}")
        return 1, cfg.image_size // ps, cfg.image_size // ps
    if cfg.resize == "tiles":
        if cfg.image_size % ps:
            raise ValueError(f"image_size {cfg.image_size} is not a multiple of patch_size {ps}")
        return 1, n_tiles(height, width, cfg) * (cfg.image_size // ps), cfg.image_size // ps
    if cfg.resize == "split":
        if cfg.image_size % ps:
            raise ValueError(f"image_size {cfg.image_size} is not a multiple of patch_size {ps}")
        rows, cols = split_grid(height, width, cfg)
        return 1, (rows * cols + 1 if rows else 1) * (cfg.image_size // ps), cfg.image_size // ps
    raise ValueError(f"unknown resize {cfg.resize!r}; expected one of {RESIZE_MODES}")


def _target_hw(full_hw: tuple[int, int], out_hw: tuple[int, int], cfg: ImageConfig) -> tuple[int, int]:
    """Size the (padded) image is resized to: the grid's for 'smart', the shortest-edge size for the fixed modes."""
    if cfg.resize == "tiles":
        cols, rows = tile_canvas(*full_hw, cfg)
        return rows * cfg.image_size, cols * cfg.image_size
    if cfg.resize in ("split", "global"):  # the first resize, to the longest edge (both modes resize from it)
        return longest_edge_size(*full_hw, cfg.max_tiles * cfg.image_size)
    if cfg.resize == "anyres":  # at least the tile, or the best resolution the crops are cut from
        n = out_hw[0] // cfg.image_size
        return (cfg.image_size, cfg.image_size) if n == 1 else select_best_resolution(*full_hw, _pinpoints(cfg))
    if cfg.resize not in _FIXED_MODES:
        return out_hw
    if cfg.resize == "squash":
        return cfg.image_size, cfg.image_size
    h, w = full_hw
    if cfg.resize == "fixed_pad":
        h = w = max(h, w)
    return shortest_edge_resize(h, w, cfg.image_size)


def decode_image(data: bytes, grid_thw, cfg: ImageConfig) -> np.ndarray:
    """Decode -> EXIF transpose -> RGB -> resize (-> crop) to ``grid_thw`` -> uint8 [gh*ps, gw*ps, 3].

    resize='smart': bicubic to the grid's size; 'squash': bilinear to image_size x image_size.
    'fixed': shortest edge to image_size, centre crop; 'fixed_pad' first pads to a square of the
    mean colour (LLaVA ``do_pad``). Only
    ``cfg.allowed_formats`` are opened. Broken pixel data raises ImageSkip(corrupt_image);
    truncated files are never accepted. Unless ``cfg.fast_decode``, the pixels are those of
    the HF image processor (PIL backend) given the EXIF-transposed image.
    """
    _, gh, gw = (int(v) for v in grid_thw)
    out_hw = (gh * cfg.patch_size, gw * cfg.patch_size)
    fixed = cfg.resize in _FIXED_MODES
    if fixed and out_hw != (cfg.image_size, cfg.image_size):
        raise ValueError(f"grid {tuple(grid_thw)} is not image_size {cfg.image_size} in patches of {cfg.patch_size}")
    if cfg.fast_decode:
        img, full_hw = _load(data, cfg, draft_hw=_target_hw(probe_image(data, cfg), out_hw, cfg))
    else:
        img, full_hw = _load(data, cfg)
    if cfg.resize == "fixed_pad":
        img = _pad_to_square(_rgb_or_skip(img), cfg.image_mean)
    if cfg.resize == "tiles":
        return _tiles(_rgb_or_skip(img), full_hw, out_hw, cfg)
    if cfg.resize == "anyres":
        return _anyres(_rgb_or_skip(img), full_hw, out_hw, cfg)
    if cfg.resize == "global":
        return _global(_rgb_or_skip(img), full_hw, cfg)
    if cfg.resize == "split":
        return _split(_rgb_or_skip(img), full_hw, out_hw, cfg)
    size_hw = _target_hw(full_hw, out_hw, cfg)
    wh = (size_hw[1], size_hw[0])
    gap = 3.0 if cfg.fast_decode else None
    resample = Image.Resampling.BILINEAR if cfg.resize == "squash" else Image.Resampling.BICUBIC
    if img.mode == "L" and img.info.get("transparency") is None and img.size != wh:
        # Grey pages (documents) are the biggest images: resizing one band, then replicating it,
        # gives the same bytes as convert-then-resize (resampling is per band) at ~1/3 the work.
        img = img.resize(wh, resample, reducing_gap=gap)
    rgb = _rgb_or_skip(img)
    if rgb.size != wh:
        rgb = rgb.resize(wh, resample, reducing_gap=gap)
    out = np.asarray(rgb, dtype=np.uint8)
    if fixed:  # HF center_crop: top-left corner at ((H - S) // 2, (W - S) // 2); the resize never undershoots S
        top, left = (size_hw[0] - out_hw[0]) // 2, (size_hw[1] - out_hw[1]) // 2
        out = out[top:top + out_hw[0], left:left + out_hw[1]]
    return out


def _tiles(rgb: Image.Image, full_hw: tuple[int, int], out_hw: tuple[int, int], cfg: ImageConfig) -> np.ndarray:
    """HF GotOcr2 ``crop_image_to_patches``: bicubic to cols x rows tiles, split row-major, then the whole
    image bicubic to one tile (the thumbnail) when there is more than one; stacked top to bottom."""
    side, gap = cfg.image_size, (3.0 if cfg.fast_decode else None)
    cols, rows = tile_canvas(*full_hw, cfg)
    n = 1 if cols * rows == 1 else cols * rows + 1
    if out_hw != (n * side, side):
        raise ValueError(f"grid of {out_hw[0]}x{out_hw[1]} px is not the {n} tiles of {side} px this image makes")
    canvas = rgb.resize((cols * side, rows * side), Image.Resampling.BICUBIC, reducing_gap=gap)
    a = np.asarray(canvas, dtype=np.uint8).reshape(rows, side, cols, side, 3).transpose(0, 2, 1, 3, 4)
    tiles = [a.reshape(rows * cols * side, side, 3)]
    if n > 1:
        tiles.append(np.asarray(rgb.resize((side, side), Image.Resampling.BICUBIC, reducing_gap=gap), dtype=np.uint8))
    return np.ascontiguousarray(np.concatenate(tiles)) if n > 1 else tiles[0]


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


def _global(rgb: Image.Image, full_hw: tuple[int, int], cfg: ImageConfig) -> np.ndarray:
    """resize='global', HF Idefics3 / SmolVLM PIL processor with ``do_image_splitting=False``: Lanczos to the
    longest edge max_tiles * image_size (``size['longest_edge']``, aspect kept, see longest_edge_size), then
    Lanczos again to image_size x image_size (``max_image_size``): two resizes, as HF, on uint8."""
    gap = 3.0 if cfg.fast_decode else None
    h, w = longest_edge_size(*full_hw, cfg.max_tiles * cfg.image_size)
    first = rgb.resize((w, h), Image.Resampling.LANCZOS, reducing_gap=gap)
    side = cfg.image_size
    return np.asarray(first.resize((side, side), Image.Resampling.LANCZOS, reducing_gap=gap), dtype=np.uint8)


def _anyres(rgb: Image.Image, full_hw: tuple[int, int], out_hw: tuple[int, int], cfg: ImageConfig) -> np.ndarray:
    """HF LlavaOnevisionImageProcessor (PIL): tiles of image_size stacked top to bottom. One tile (an image of
    a sample of several): padded to a square of the mean colour, bicubic to the tile. Else the base tile
    (the whole image bicubic to the tile, aspect not kept), then the crops: the image bicubic into the best
    pinpoint resolution keeping its aspect (``get_patch_output_size``), centred on black (0) padding, cut
    row-major."""
    side, gap = cfg.image_size, (3.0 if cfg.fast_decode else None)
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
    crops = canvas.reshape(rows, side, cols, side, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols * side, side, 3)
    base = np.asarray(rgb.resize((side, side), Image.Resampling.BICUBIC, reducing_gap=gap), dtype=np.uint8)
    return np.ascontiguousarray(np.concatenate([base, crops]))


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


def _split(rgb: Image.Image, full_hw: tuple[int, int], out_hw: tuple[int, int], cfg: ImageConfig) -> np.ndarray:
    """resize='split', HF Idefics3 / SmolVLM PIL processor with ``do_image_splitting``: Lanczos to the longest
    edge, Lanczos to multiples of image_size, crop rows x cols views, then that image Lanczos to one view."""
    gap, side = (3.0 if cfg.fast_decode else None), cfg.image_size
    (h1, w1), (h2, w2) = _split_sizes(*full_hw, cfg)
    rows, cols = split_grid(*full_hw, cfg)
    n = rows * cols + 1 if rows else 1
    if out_hw != (n * side, side):
        raise ValueError(f"grid of {out_hw[0]}x{out_hw[1]} px is not the {n} views of {side} px this image makes")
    fitted = rgb.resize((w1, h1), Image.Resampling.LANCZOS, reducing_gap=gap)
    fitted = fitted.resize((w2, h2), Image.Resampling.LANCZOS, reducing_gap=gap)
    if not rows:
        return np.asarray(fitted, dtype=np.uint8)
    a = np.asarray(fitted, dtype=np.uint8).reshape(rows, side, cols, side, 3).transpose(0, 2, 1, 3, 4)
    views = a.reshape(rows * cols * side, side, 3)
    whole = np.asarray(fitted.resize((side, side), Image.Resampling.LANCZOS, reducing_gap=gap), dtype=np.uint8)
    return np.ascontiguousarray(np.concatenate([views, whole]))


