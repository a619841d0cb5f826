"""What every resize family shares: the header probe, decoding to RGB as HF loads and converts an image,
the one-band-first plain resize, the patch order (patchify / unpatchify), ImageSkip and the Resizer shape.

Decoding is Pillow's, EXIF orientation applied (HF ``load_image``), then HF ``convert_to_rgb``;
the families (smart.py, square.py, tiles.py, anyres.py, split.py) resize the decoded image.
Pure module: PIL + numpy, no ray, no torch.
"""
from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from ray_mmbatch import schema as S
from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.errors import SampleSkip

# EXIF orientations that rotate by 90/270 degrees, so stored width is displayed height.
_SWAPS_SIDES = frozenset({5, 6, 7, 8})
# Pillow names multi-picture camera JPEGs "MPO"; they are JPEGs for every purpose here.
_FORMAT_ALIASES = {"MPO": "JPEG"}
# PNG chunks that can carry EXIF / XMP orientation (Pillow reads those after IDAT only on load()).
_PNG_LATE_METADATA = (b"eXIf", b"tEXt", b"zTXt", b"iTXt")

HW = tuple[int, int]


class ImageSkip(SampleSkip):
    """An image that cannot be used; ``reason`` is a schema.SKIP_* constant."""


def merged_tokens(grid, hw: HW | None, cfg: ImageConfig) -> int:
    """LM tokens of one image of this grid in every mode but 'anyres': gh * gw / merge**2."""
    _, gh, gw = (int(v) for v in grid)
    return gh * gw // cfg.merge_size ** 2


@dataclass(frozen=True)
class Resizer:
    """One ``ImageConfig.resize`` mode (registry.RESIZERS): how it measures an image and makes its pixels."""

    grid: Callable[[int, int, ImageConfig, int], tuple[int, int, int]]
    """(height, width, cfg, n_images) -> (t, gh, gw) in patches; image_grid has checked the aspect."""
    target_hw: Callable[[HW, HW, ImageConfig], HW]
    """(full_hw, out_hw, cfg) -> the (h, w) the image is resized to first; fast_decode drafts JPEGs to it."""
    pixels: Callable[[Image.Image, HW, HW, ImageConfig], np.ndarray]
    """(decoded image, not yet RGB; full_hw, out_hw, cfg) -> uint8 [out_h, out_w, 3]."""
    tokens: Callable[[tuple[int, int, int], HW | None, ImageConfig], int] = merged_tokens
    """(grid, displayed (h, w) or None, cfg) -> LM tokens of one image."""
    square: bool = False
    """One image_size x image_size view whatever the image: decode_image refuses another grid before decoding."""
    runs: Callable[[tuple[int, int, int], ImageConfig], int] = lambda grid, cfg: 1
    """(grid, cfg) -> runs of image tokens in one image's text block: measure writes one image token per run and
    materialize repeats each to tokens / runs (resize='split': one per view; 'pixtral': one per row)."""


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


def _view_patches(cfg: ImageConfig) -> int:
    """Patches along a side of one image_size view (every mode but 'smart' sees such views, stacked)."""
    ps = cfg.patch_size
    if cfg.image_size % ps:
        raise ValueError(f"image_size {cfg.image_size} is not a multiple of patch_size {ps}")
    return cfg.image_size // ps


def _gap(cfg: ImageConfig) -> float | None:
    """Pillow's ``reducing_gap``: none for HF's pixels, 3.0 with fast_decode."""
    return 3.0 if cfg.fast_decode else None


def _to_rgb(img: Image.Image) -> Image.Image:
    """HF ``convert_to_rgb``: alpha or a transparency key -> composited on white; else Pillow's convert.

    Like HF this clips 16-bit / 32-bit / float greys at 255 (Pillow's I;16 -> L) rather than scaling them.
    """
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def _rgb_or_skip(img: Image.Image) -> Image.Image:
    try:
        return _to_rgb(img)
    except ValueError as e:  # e.g. a mode Pillow cannot convert to RGB
        raise ImageSkip(S.SKIP_UNSUPPORTED_FORMAT, f"mode {img.mode}: {e}") from None


def _pad_to_square(rgb: Image.Image, mean) -> Image.Image:
    """HF LlavaImageProcessor ``pad_to_square`` (do_pad): centred on a square of int(mean * 255)."""
    w, h = rgb.size
    if w == h:
        return rgb
    side = max(w, h)
    square = Image.new("RGB", (side, side), tuple(int(m * 255) for m in mean))
    square.paste(rgb, (0, (side - h) // 2) if w > h else ((side - w) // 2, 0))
    return square


def _resize_rgb(img: Image.Image, size_hw: HW, resample: Image.Resampling, cfg: ImageConfig) -> np.ndarray:
    """The decoded image -> RGB, resized to ``size_hw`` -> uint8 [h, w, 3] (resize='smart' and the square modes)."""
    wh = (size_hw[1], size_hw[0])
    gap = _gap(cfg)
    if img.mode == "L" and img.info.get("transparency") is None and img.size != wh:
        # Grey pages (documents) are the biggest images: resizing one band, then replicating it,
        # gives the same bytes as convert-then-resize (resampling is per band) at ~1/3 the work.
        img = img.resize(wh, resample, reducing_gap=gap)
    rgb = _rgb_or_skip(img)
    if rgb.size != wh:
        rgb = rgb.resize(wh, resample, reducing_gap=gap)
    return np.asarray(rgb, dtype=np.uint8)


def _stack_views(a: np.ndarray, rows: int, cols: int, side: int) -> np.ndarray:
    """uint8 [rows * side, cols * side, 3] -> its rows x cols views of side x side, row-major, top to bottom."""
    return a.reshape(rows, side, cols, side, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols * side, side, 3)


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


def _check_grid(gh: int, gw: int, merge_size: int) -> None:
    if gh % merge_size or gw % merge_size:
        raise ValueError(f"grid {gh}x{gw} is not a multiple of merge_size={merge_size}")


def patchify(img: np.ndarray, cfg: ImageConfig) -> np.ndarray:
    """uint8 [H, W, 3] -> uint8 [gh*gw, 3*ps*ps] in merge-window order (see the package docstring)."""
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
