"""data/image.py on real Pillow-encoded files: probe, smart resize, decode, patch order, bad inputs."""
from __future__ import annotations

import io
import struct
import time
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, JpegImagePlugin
from skimage import data as skdata

from ray_mmbatch import schema as S
from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.image import ImageSkip, decode_image, image_grid, patchify, probe_image, smart_resize, unpatchify
from ray_mmbatch.models.builtin.rope import patch_positions

CFG = ImageConfig()


def decode(data: bytes, size_hw: tuple[int, int], cfg: ImageConfig = CFG):
    """decode_image at a pixel size (multiples of patch_size) instead of a grid."""
    return decode_image(data, (1, size_hw[0] // cfg.patch_size, size_hw[1] // cfg.patch_size), cfg)


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def jpeg_with_orientation(img: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(img, "JPEG", quality=95, exif=exif)


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header_only(width: int, height: int) -> bytes:
    """A valid PNG header claiming width x height, with only a few bytes of pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


def skip_reason(fn, *args) -> str:
    with pytest.raises(ImageSkip) as e:
        fn(*args)
    return e.value.reason


# ------------------------------------------------------------------ probe
def test_probe_reads_size_and_exif_orientation_swaps_sides():
    img = Image.new("RGB", (40, 20), "red")  # width 40, height 20
    assert probe_image(encode(img, "PNG"), CFG) == (20, 40)
    for orientation, expected in [(1, (20, 40)), (3, (20, 40)), (6, (40, 20)), (8, (40, 20)), (5, (40, 20))]:
        assert probe_image(jpeg_with_orientation(img, orientation), CFG) == expected, orientation


def test_probe_bad_inputs_have_reasons():
    assert skip_reason(probe_image, b"", CFG) == S.SKIP_EMPTY_FILE
    assert skip_reason(probe_image, b"\x00garbage" * 50, CFG) == S.SKIP_NOT_AN_IMAGE
    assert skip_reason(probe_image, b"%PDF-1.4\n1 0 obj << >> endobj\n" * 4, CFG) == S.SKIP_NOT_AN_IMAGE
    ico = encode(Image.new("RGB", (32, 32), "blue"), "ICO")
    assert skip_reason(probe_image, ico, CFG) == S.SKIP_UNSUPPORTED_FORMAT
    assert probe_image(ico, ImageConfig(allowed_formats=("ICO",))) == (32, 32)


def test_decompression_bomb_refused_from_header_without_decoding():
    bomb = png_header_only(100_000, 100_000)
    t0 = time.perf_counter()
    assert skip_reason(probe_image, bomb, CFG) == S.SKIP_DECOMPRESSION_BOMB
    assert skip_reason(decode, bomb, (28, 28)) == S.SKIP_DECOMPRESSION_BOMB
    assert time.perf_counter() - t0 < 0.5
    # our own limit applies below Pillow's, still from the header
    small_limit = ImageConfig(max_header_pixels=100 * 100 - 1)
    assert skip_reason(probe_image, encode(Image.new("L", (100, 100)), "PNG"), small_limit) == S.SKIP_DECOMPRESSION_BOMB
    assert Image.MAX_IMAGE_PIXELS is not None  # Pillow's guard is left on


def test_truncated_files_probe_fine_but_decode_is_corrupt():
    photo = Image.fromarray(skdata.chelsea())
    for fmt in ("JPEG", "PNG"):
        full = encode(photo, fmt)
        cut = full[: len(full) // 2]
        assert probe_image(cut, CFG) == (300, 451)
        assert skip_reason(decode, cut, (56, 84)) == S.SKIP_CORRUPT_IMAGE, fmt
    assert not __import__("PIL.ImageFile").ImageFile.LOAD_TRUNCATED_IMAGES


# ------------------------------------------------------------------ smart resize
@settings(max_examples=300, deadline=None)
@given(st.integers(1, 20_000), st.integers(1, 20_000))
def test_smart_resize_bounds(h, w):
    if max(h, w) / min(h, w) > CFG.max_aspect:
        assert skip_reason(smart_resize, h, w, CFG) == S.SKIP_EXTREME_ASPECT
        assert skip_reason(image_grid, h, w, CFG) == S.SKIP_EXTREME_ASPECT
        return
    rh, rw = smart_resize(h, w, CFG)
    f = CFG.factor
    assert rh % f == 0 and rw % f == 0 and rh >= f and rw >= f
    # HF's bounds hold for every aspect <= 200 when max_pixels / 200 >= factor**2 (true of the defaults)
    assert CFG.min_pixels <= rh * rw <= CFG.max_pixels
    if min(rh, rw) >= 4 * f:
        assert abs(np.log(rh / rw) - np.log(h / w)) < np.log(1.7)
    assert image_grid(h, w, CFG) == (1, rh // CFG.patch_size, rw // CFG.patch_size)


def test_smart_resize_known_cases():
    assert smart_resize(1, 1, CFG) == (56, 56)  # default min_pixels = 4 factors**2
    assert smart_resize(224, 224, CFG) == (224, 224)
    assert smart_resize(3000, 2000, CFG) == (532, 364)  # Qwen2-VL gives the same
    assert smart_resize(1, 200, CFG) == (28, 812) and smart_resize(200, 1, CFG) == (812, 28)  # HF's values
    assert smart_resize(10, 600, CFG) == (28, 448)
    for h, w in [(1, 201), (201, 1), (1, 4000), (3, 60_000)]:  # HF raises: the sample is skipped
        assert skip_reason(smart_resize, h, w, CFG) == S.SKIP_EXTREME_ASPECT
    with pytest.raises(ValueError):
        smart_resize(10, 10, ImageConfig(min_pixels=0))  # HF refuses a zero shortest_edge too


def test_fixed_grid_and_unknown_resize():
    cfg = ImageConfig(resize="fixed", image_size=336, merge_size=1)
    assert image_grid(480, 640, cfg) == image_grid(1, 1, cfg) == (1, 24, 24)
    assert skip_reason(image_grid, 1, 201, cfg) == S.SKIP_EXTREME_ASPECT
    with pytest.raises(ValueError):
        image_grid(480, 640, ImageConfig(resize="dynamic"))


# ------------------------------------------------------------------ decode
def test_alpha_is_composited_on_white():
    rgba = Image.new("RGBA", (56, 56), (0, 0, 0, 0))  # fully transparent black
    rgba.paste((255, 0, 0, 255), (0, 0, 28, 56))      # opaque red left half
    out = decode(encode(rgba, "PNG"), (56, 56))
    assert out.dtype == np.uint8 and out.shape == (56, 56, 3)
    assert (out[:, 40:] == 255).all() and (out[:, :20] == [255, 0, 0]).all()
    la = Image.new("LA", (56, 56), (0, 0))
    assert (decode(encode(la, "PNG"), (56, 56)) == 255).all()
    p = Image.new("P", (56, 56), 0)
    p.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)
    p.paste(1, (0, 0, 28, 56))
    out = decode(encode(p, "PNG", transparency=0), (56, 56))
    assert (out[:, 40:] == 255).all() and (out[:, :20] == [0, 255, 0]).all()
    gif = decode(encode(p, "GIF", transparency=0), (56, 56))
    assert (gif[:, 40:] == 255).all()


def test_sixteen_bit_is_clipped_like_hf():
    """HF's convert_to_rgb is Pillow's convert: 16-bit grey values above 255 clip (they are not scaled by 1/257)."""
    ramp = np.tile(np.linspace(0, 600, 56).astype(np.uint16), (56, 1))
    img = Image.fromarray(ramp)
    assert img.mode == "I;16"
    out = decode(encode(img, "PNG"), (56, 56))
    np.testing.assert_array_equal(out, np.repeat(np.minimum(ramp, 255)[..., None], 3, -1))


@pytest.mark.parametrize("mode", ["CMYK", "L", "1", "P", "YCbCr"])
def test_every_mode_decodes_to_rgb(mode):
    img = Image.fromarray(skdata.astronaut()).resize((64, 48)).convert(mode)
    fmt = "JPEG" if mode in ("CMYK", "YCbCr") else "PNG"
    out = decode(encode(img, fmt), (28, 56))
    assert out.shape == (28, 56, 3) and out.dtype == np.uint8 and out.std() > 10


def test_exif_rotated_jpeg_decodes_upright():
    upright = Image.fromarray(skdata.astronaut()).resize((160, 112))
    stored = upright.transpose(Image.Transpose.ROTATE_90)  # orientation 6 = rotate 90 CW to display
    data = jpeg_with_orientation(stored, 6)
    h, w = probe_image(data, CFG)
    assert (h, w) == (112, 160)
    size = smart_resize(h, w, CFG)
    a = decode(data, size).astype(float)
    b = decode(encode(upright, "JPEG", quality=95), size).astype(float)
    assert np.abs(a - b).mean() < 6
    wrong = np.asarray(stored.resize(size[::-1] if size[0] != size[1] else size)).astype(float)
    assert wrong.shape != a.shape or np.abs(wrong - a).mean() > 20


@pytest.mark.parametrize("resize", ["smart", "fixed"])
def test_big_jpeg_is_drafted_only_with_fast_decode(monkeypatch, resize):
    big = Image.fromarray(skdata.coffee()).resize((3000, 2000))
    data = encode(big, "JPEG", quality=85)
    drafted = []
    real_draft = JpegImagePlugin.JpegImageFile.draft

    def spy(img, mode, size):
        out = real_draft(img, mode, size)
        drafted.append(img.size)  # the size Pillow will decode at
        return out

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    for fast in (False, True):
        cfg = ImageConfig(resize=resize, image_size=336, merge_size=1 if resize == "fixed" else 2, fast_decode=fast)
        grid = image_grid(*probe_image(data, cfg), cfg)
        out = decode_image(data, grid, cfg)
        assert out.shape == (grid[1] * 14, grid[2] * 14, 3)
    # exact decode never drafts; fast decode reads the DCT at 1/4 scale, still >= the resize target
    # (smart: 532x364; fixed: 504x336 before the crop), not 1/8 (375x250)
    assert drafted == [(750, 500)]


def test_decode_refuses_formats_not_allowed():
    ico = encode(Image.new("RGB", (32, 32), "blue"), "ICO")
    assert skip_reason(decode, ico, (28, 28)) == S.SKIP_NOT_AN_IMAGE


# ------------------------------------------------------------------ patchify
def qwen2vl_patchify(img: np.ndarray, ps: int, m: int) -> np.ndarray:
    """Qwen2-VL's image processor reshape (temporal_patch_size 1), written independently as the reference."""
    c = img.transpose(2, 0, 1)[None, None]  # (t=1, tp=1, C, H, W)
    gh, gw = img.shape[0] // ps, img.shape[1] // ps
    x = c.reshape(1, 1, 3, gh // m, m, ps, gw // m, m, ps).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gh * gw, 3 * ps * ps)


@pytest.mark.parametrize("hw", [(28, 28), (56, 84), (112, 28), (532, 364)])
def test_patchify_matches_qwen_order_and_round_trips(hw):
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (*hw, 3), dtype=np.uint8)
    p = patchify(img, CFG)
    gh, gw = hw[0] // 14, hw[1] // 14
    assert p.shape == (gh * gw, 3 * 14 * 14) and p.dtype == np.uint8
    np.testing.assert_array_equal(p, qwen2vl_patchify(img, 14, 2))
    np.testing.assert_array_equal(unpatchify(p, (1, gh, gw), CFG), img)


def test_merge_window_order_and_positions():
    cfg = ImageConfig(patch_size=2, merge_size=2)
    gh, gw = 4, 6
    rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    # every pixel of patch (r, c) holds r in channel 0 and c in channel 1
    img = np.stack([rows.repeat(2, 0).repeat(2, 1), cols.repeat(2, 0).repeat(2, 1), np.zeros((8, 12), int)], -1)
    p = patchify(img.astype(np.uint8), cfg)
    got = np.stack([p[:, 0], p[:, 4]], -1)  # channel-major: channel 1 starts at ps*ps = 4
    assert got[:8].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]
    # the vision tower's own positions (models/builtin/rope.py) name each patch's (row, col)
    pos = patch_positions(torch.tensor([[1, gh, gw]]), 2).numpy()
    np.testing.assert_array_equal(pos, got)
    assert p.reshape(-1, 4 * p.shape[1]).shape[0] == gh * gw // 4  # one row per merge window
    with pytest.raises(ValueError):
        patchify(np.zeros((14, 28, 3), np.uint8), CFG)  # 1x2 patches: not a whole merge window


def _png_chunks(data: bytes) -> list[bytes]:
    out, pos = [], 8
    while pos < len(data):
        n = int.from_bytes(data[pos:pos + 4], "big")
        out.append(data[pos:pos + 12 + n])
        pos += 12 + n
    return out


@pytest.mark.parametrize("exif_after_pixels", [False, True])
def test_png_exif_orientation_before_or_after_pixel_data(exif_after_pixels):
    """The fast PNG path must still see an eXIf chunk, wherever in the file it sits."""
    import io

    from PIL import Image

    from ray_mmbatch.config import ImageConfig
    from ray_mmbatch.data.image import decode_image, probe_image

    upright = np.zeros((40, 100, 3), np.uint8)
    upright[:, :50] = (255, 0, 0)
    stored = Image.fromarray(upright).transpose(Image.Transpose.ROTATE_90)  # what a camera would store: 100x40
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display": the stored 40-wide image shows 100 wide
    buf = io.BytesIO()
    stored.save(buf, "PNG", exif=exif.tobytes())
    data = buf.getvalue()
    chunks = _png_chunks(data)
    assert any(c[4:8] == b"eXIf" for c in chunks)
    if exif_after_pixels:
        ex = [c for c in chunks if c[4:8] == b"eXIf"]
        rest = [c for c in chunks if c[4:8] not in (b"eXIf", b"IEND")]
        data = data[:8] + b"".join(rest + ex + [chunks[-1]])
        tail = data[data.find(b"IDAT"):]
        assert b"eXIf" in tail
    cfg = ImageConfig()
    h, w = probe_image(data, cfg)
    assert (h, w) == (40, 100)
    img = decode_image(data, (1, 2, 4), cfg)
    assert img.shape == (28, 56, 3)
    assert img[:, :20, 0].mean() > 200 and img[:, -20:, 0].mean() < 50  # red half on the left, as upright
