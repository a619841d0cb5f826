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

import io
import math
import warnings

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from ray_mmbatch import schema as S
from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.errors import SampleSkip

# EXIF orientations that rotate by 90/270 degrees, so stored width is displayed height.
_SWAPS_SIDES = frozenset({5, 6, 7, 8})
# Pillow names multi-picture camera JPEGs "MPO"; they are JPEGs for every purpose here.
_FORMAT_ALIASES = {"MPO": "JPEG"}
# ImageConfig.resize values: Qwen-VL dynamic resolution; CLIP / LLaVA-1.5 square; the same after LLaVA's do_pad;
# InternVL's tiles (see tile_canvas); Gemma 3's plain bilinear resize to the square (aspect not kept, no crop).
RESIZE_MODES = ("smart", "fixed", "fixed_pad", "tiles", "squash", "anyres", "global", "split")
_FIXED_MODES = frozenset({"fixed", "fixed_pad", "squash", "global"})
# resize='global': Idefics3 / SmolVLM with do_image_splitting off (see global_resize); HF's MAX_IMAGE_SIZE
_IDEFICS3_MAX_SIDE = 4096
# PNG chunks that can carry EXIF / XMP orientation (Pillow reads those after IDAT only on load()).
_PNG_LATE_METADATA = (b"eXIf", b"tEXt", b"zTXt", b"iTXt")


class ImageSkip(SampleSkip):
    """An image that cannot be used; ``reason`` is a schema.SKIP_* constant."""


def _open(data: bytes, formats: tuple[str, ...] | None = None) -> Image.Image:
    """Image.open with every failure mapped to a skip reason; Pillow's bomb guard stays on."""
    if data is None or len(data) == 0:
        raise ImageSkip(S.SKIP_EMPTY_FILE, "0 bytes")
    plugins = None
    if formats is not None:
        Image.init()  # MPO opens through the JPEG plugin; unknown names would make Pillow raise KeyError
        plugins = [f for f in formats if f in Image.OPEN]
    try:
        with warnings.catch_warnings():
            # Pillow warns (rather than raises) between 1x and 2x MAX_IMAGE_PIXELS; treat both as a bomb.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(bytes(data)), formats=plugins)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageSkip(S.SKIP_DECOMPRESSION_BOMB, str(e)) from None
    except UnidentifiedImageError:
        raise ImageSkip(S.SKIP_NOT_AN_IMAGE, f"Pillow cannot identify {len(data)} bytes") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageSkip(S.SKIP_CORRUPT_IMAGE, f"header: {type(e).__name__}: {e}") from None


def _png_metadata_after_pixels(img: Image.Image, data: bytes) -> bool:
    """True if a PNG may hold EXIF / XMP chunks after its image data (read only by a full decode).

    Pillow's PNG ``getexif()`` decodes every pixel just to see such late chunks; a byte search
    for their chunk types after the first IDAT (C speed, no decoding) rules them out exactly:
    a false hit inside compressed data only sends us down Pillow's own (decoding) path.
    """
    start = data.find(b"IDAT")
    return start < 0 or any(data.find(tag, start) >= 0 for tag in _PNG_LATE_METADATA)


def _orientation(img: Image.Image, data: bytes | None = None) -> int:
    """EXIF orientation (1 = upright); for PNG without late metadata chunks, no pixel decoding."""
    try:
        if img.format == "PNG" and data is not None and not _png_metadata_after_pixels(img, bytes(data)):
            exif = Image.Image.getexif(img)  # the generic reader: what the header chunks already gave
        else:
            exif = img.getexif()
        return int(exif.get(ExifTags.Base.Orientation, 1) or 1)
    except Exception:  # a broken EXIF block must not cost the image; Pillow ignores it too
        return 1


def decoded_bytes_per_pixel(mode: str) -> int:
    """Bytes per pixel of the largest copy decoding makes: the file's mode, with 16-bit and 32-bit
    modes counted at 4 (Pillow widens I;16 to I on the way to RGB), and never less than the RGB copy."""
    if mode.startswith("I;16") or mode in ("I", "F", "RGBA", "RGBX", "RGBa", "CMYK", "La", "LA", "PA"):
        return 4
    return 3


def probe_image(data: bytes, cfg: ImageConfig) -> tuple[int, int]:
    """(height, width) as displayed (after EXIF orientation), from the header only."""
    img = _open(data)
    fmt = _FORMAT_ALIASES.get(img.format or "", img.format or "")
    if fmt not in cfg.allowed_formats:
        raise ImageSkip(S.SKIP_UNSUPPORTED_FORMAT, f"format {img.format} not in {list(cfg.allowed_formats)}")
    width, height = img.size
    if width <= 0 or height <= 0:
        raise ImageSkip(S.SKIP_CORRUPT_IMAGE, f"header size {width}x{height}")
    if width * height > cfg.max_header_pixels:
        raise ImageSkip(S.SKIP_DECOMPRESSION_BOMB,
                        f"header says {width}x{height} > max_header_pixels={cfg.max_header_pixels}")
    need = width * height * decoded_bytes_per_pixel(img.mode)
    if cfg.max_decoded_bytes and need > cfg.max_decoded_bytes:
        raise ImageSkip(S.SKIP_DECOMPRESSION_BOMB, f"{width}x{height} {img.mode} decodes to {need:,} bytes > "
                                                   f"image.max_decoded_bytes={cfg.max_decoded_bytes:,}")
    if _orientation(img, data) in _SWAPS_SIDES:
        width, height = height, width
    return height, width


def _check_aspect(height: int, width: int, cfg: ImageConfig) -> None:
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    aspect = max(height, width) / min(height, width)
    if aspect > cfg.max_aspect:  # HF's Qwen-VL smart_resize raises here (its limit is 200)
        raise ImageSkip(S.SKIP_EXTREME_ASPECT, f"{width}x{height}: aspect {aspect:.1f} > max_aspect={cfg.max_aspect:g}")


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


def _to_rgb(img: Image.Image) -> Image.Image:
    """HF ``convert_to_rgb``: alpha or a transparency key -> composited on white; else Pillow's convert.

    Like HF this clips 16-bit / 32-bit / float greys at 255 (Pillow's I;16 -> L) rather than scaling them.
    """
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def _pad_to_square(rgb: Image.Image, mean) -> Image.Image:
    """HF LlavaImageProcessor ``pad_to_square`` (do_pad): centred on a square of int(mean * 255)."""
    w, h = rgb.size
    if w == h:
        return rgb
    side = max(w, h)
    square = Image.new("RGB", (side, side), tuple(int(m * 255) for m in mean))
    square.paste(rgb, (0, (side - h) // 2) if w > h else ((side - w) // 2, 0))
    return square


def _load(data: bytes, cfg: ImageConfig, draft_hw=None) -> tuple[Image.Image, tuple[int, int]]:
    """Open, decode and EXIF-transpose (as HF's load_image) -> (image, full-size displayed (h, w)).

    With ``draft_hw`` (fast_decode) a JPEG is decoded at the smallest DCT scale that stays at
    least that size, so the image can be smaller than the returned full size.
    """
    img = _open(data, cfg.allowed_formats)
    try:
        orientation = _orientation(img, data)
        w, h = img.size
        full_hw = (w, h) if orientation in _SWAPS_SIDES else (h, w)
        if draft_hw is not None and img.format in ("JPEG", "MPO"):
            # draft() picks the largest DCT scale (1/2, 1/4, 1/8) that stays >= the requested size.
            dh, dw = draft_hw
            img.draft(None, (dh, dw) if orientation in _SWAPS_SIDES else (dw, dh))
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img.load()
        if orientation != 1:  # exif_transpose copies even an upright image
            img = ImageOps.exif_transpose(img)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageSkip(S.SKIP_DECOMPRESSION_BOMB, str(e)) from None
    except Exception as e:  # Pillow's decoders raise OSError, SyntaxError, ValueError, EOFError, zlib/struct errors
        raise ImageSkip(S.SKIP_CORRUPT_IMAGE, f"pixel data: {type(e).__name__}: {e}") from None
    return img, full_hw


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


def _rgb_or_skip(img: Image.Image) -> Image.Image:
    try:
        return _to_rgb(img)
    except ValueError as e:  # e.g. a mode Pillow cannot convert to RGB
        raise ImageSkip(S.SKIP_UNSUPPORTED_FORMAT, f"mode {img.mode}: {e}") from None


def _check_grid(gh: int, gw: int, merge_size: int) -> None:
    if gh % merge_size or gw % merge_size:
        raise ValueError(f"grid {gh}x{gw} is not a multiple of merge_size={merge_size}")


def patchify(img: np.ndarray, cfg: ImageConfig) -> np.ndarray:
    """uint8 [H, W, 3] -> uint8 [gh*gw, 3*ps*ps] in merge-window order (see module docstring)."""
    ps, m = cfg.patch_size, cfg.merge_size
    if img.ndim != 3 or img.shape[2] != 3 or img.shape[0] % ps or img.shape[1] % ps:
        raise ValueError(f"expected [H, W, 3] with H, W multiples of {ps}, got {img.shape}")
    gh, gw = img.shape[0] // ps, img.shape[1] // ps
    _check_grid(gh, gw, m)
    # axes: (block row, row in block, pixel row, block col, col in block, pixel col, channel)
    x = img.reshape(gh // m, m, ps, gw // m, m, ps, 3)
    x = x.transpose(0, 3, 1, 4, 6, 2, 5)  # -> block row, block col, row in block, col in block, c, py, px
    return np.ascontiguousarray(x).reshape(gh * gw, 3 * ps * ps)


def unpatchify(patches: np.ndarray, grid_thw, cfg: ImageConfig) -> np.ndarray:
    """Inverse of patchify for one image: [gh*gw, 3*ps*ps] -> [gh*ps, gw*ps, 3]."""
    ps, m = cfg.patch_size, cfg.merge_size
    _, gh, gw = (int(v) for v in grid_thw)
    _check_grid(gh, gw, m)
    x = np.asarray(patches).reshape(gh // m, gw // m, m, m, 3, ps, ps)
    x = x.transpose(0, 2, 5, 1, 3, 6, 4)
    return np.ascontiguousarray(x).reshape(gh * ps, gw * ps, 3)


