"""data/image.py against the checkpoint's own HF image processor (PIL backend), built from kwargs.

For each file: our header-only grid equals HF's ``image_grid_thw``, and our uint8 pixels,
normalized on the worker by ``models.hf_common.normalize_patches``, equal HF's
``pixel_values``. HF is given the file as its ``load_image`` would hold it: opened by Pillow,
EXIF orientation applied (``ImageOps.exif_transpose``); for the EXIF case we also go through
``load_image`` itself.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps
from skimage import data as skdata

from ray_mmbatch import schema as S
from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.image import ImageSkip, decode_image, image_grid, patchify, probe_image, smart_resize, unpatchify
from ray_mmbatch.models.hf_common import normalize_patches

pytest.importorskip("transformers")
from transformers.image_utils import load_image  # noqa: E402
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: E402
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize  # noqa: E402

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Qwen2-VL / Qwen2.5-VL settings (token budgets kept small so the tests are fast) and Qwen3-VL's
# (patch 16, mean/std 0.5)
QWEN2 = ImageConfig(patch_size=14, merge_size=2, min_pixels=4 * 28 * 28, max_pixels=256 * 28 * 28,
                    image_mean=CLIP_MEAN, image_std=CLIP_STD, temporal_patch_size=2)
QWEN3 = ImageConfig(patch_size=16, merge_size=2, min_pixels=4 * 32 * 32, max_pixels=256 * 32 * 32,
                    image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), temporal_patch_size=2)
FIXED_SIZE = 112


def qwen_processor(cfg: ImageConfig) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, patch_size=cfg.patch_size,
                                    merge_size=cfg.merge_size, temporal_patch_size=cfg.temporal_patch_size,
                                    image_mean=list(cfg.image_mean), image_std=list(cfg.image_std))


def fixed_cfg(resize: str = "fixed") -> ImageConfig:
    return ImageConfig(resize=resize, image_size=FIXED_SIZE, patch_size=14, merge_size=1, temporal_patch_size=1,
                       image_mean=CLIP_MEAN, image_std=CLIP_STD)


def clip_kwargs() -> dict:
    """llava-1.5-hf's preprocessor_config, at a small size."""
    return dict(size={"shortest_edge": FIXED_SIZE}, crop_size={"height": FIXED_SIZE, "width": FIXED_SIZE},
                do_center_crop=True, image_mean=list(CLIP_MEAN), image_std=list(CLIP_STD))


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def opened(data: bytes) -> Image.Image:
    """The image as HF's load_image holds it before its processor: opened, EXIF-transposed."""
    return ImageOps.exif_transpose(Image.open(io.BytesIO(data)))


def jpeg_with_orientation(img: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(img, "JPEG", quality=90, exif=exif)


def sample_files() -> dict[str, bytes]:
    photo = Image.fromarray(skdata.astronaut())
    rgba = photo.resize((150, 110)).convert("RGBA")
    alpha = np.tile(np.linspace(0, 255, 150).astype(np.uint8), (110, 1))
    rgba.putalpha(Image.fromarray(alpha))
    pal = photo.resize((97, 61)).convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    ramp16 = np.tile(np.linspace(0, 600, 90).astype(np.uint16), (70, 1))  # part of it above 255
    stored = photo.resize((160, 112)).transpose(Image.Transpose.ROTATE_90)
    return {
        "astronaut_png": encode(photo, "PNG"),
        "coffee_jpeg": encode(Image.fromarray(skdata.coffee()), "JPEG", quality=90),
        "chelsea_jpeg": encode(Image.fromarray(skdata.chelsea()), "JPEG", quality=90),
        "camera_grey_png": encode(Image.fromarray(skdata.camera()), "PNG"),
        "large_jpeg_2000x1500": encode(Image.fromarray(skdata.coffee()).resize((2000, 1500)), "JPEG", quality=90),
        "thin_10x600": encode(photo.resize((600, 10)), "PNG"),
        "tall_600x10": encode(photo.resize((10, 600)), "PNG"),
        "tiny_3x3": encode(photo.resize((3, 3)), "PNG"),
        "tiny_1x1": encode(Image.new("RGB", (1, 1), (200, 30, 40)), "PNG"),
        "aspect_199": encode(photo.resize((597, 3)), "PNG"),
        "aspect_199_tall": encode(Image.new("RGB", (1, 199), (10, 200, 90)), "PNG"),
        "png_16bit": encode(Image.fromarray(ramp16), "PNG"),
        "cmyk_jpeg": encode(photo.resize((123, 321)).convert("CMYK"), "JPEG", quality=90),
        "rgba_png": encode(rgba, "PNG"),
        "la_png": encode(photo.resize((64, 300)).convert("LA"), "PNG"),
        "palette_gif": encode(pal, "GIF", transparency=0),
        "palette_png_transparency": encode(pal, "PNG", transparency=3),
        "exif_rotated_jpeg": jpeg_with_orientation(stored, 6),
        "exif_mirrored_jpeg": jpeg_with_orientation(stored, 5),
        "webp": encode(photo.resize((150, 150)), "WEBP"),
        "int32_tiff": encode(Image.fromarray(np.arange(40 * 50, dtype=np.int32).reshape(40, 50) % 400), "TIFF"),
    }


FILES = sample_files()


def test_sample_files_are_what_they_claim():
    mode = {k: Image.open(io.BytesIO(v)).mode for k, v in FILES.items()}
    assert mode["png_16bit"] == "I;16" and mode["cmyk_jpeg"] == "CMYK" and mode["palette_gif"] == "P"
    assert mode["rgba_png"] == "RGBA" and mode["camera_grey_png"] == "L" and mode["int32_tiff"] == "I"
    assert Image.open(io.BytesIO(FILES["exif_rotated_jpeg"])).size == (112, 160)
    assert probe_image(FILES["exif_rotated_jpeg"], QWEN2) == (112, 160)  # displayed upright: landscape
    assert probe_image(FILES["large_jpeg_2000x1500"], QWEN2) == (1500, 2000)


# ------------------------------------------------------------------ smart resize = HF's formula
@pytest.mark.parametrize("cfg", [QWEN2, QWEN3, ImageConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)],
                         ids=["qwen2", "qwen3", "qwen2_defaults"])
@settings(max_examples=400, deadline=None)
@given(h=st.integers(1, 30_000), w=st.integers(1, 30_000))
def test_smart_resize_is_hf_formula(cfg, h, w):
    try:
        expected = hf_smart_resize(h, w, factor=cfg.factor, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    except ValueError:  # HF refuses aspect > 200: we skip the sample
        with pytest.raises(ImageSkip) as e:
            smart_resize(h, w, cfg)
        assert e.value.reason == S.SKIP_EXTREME_ASPECT
        return
    assert smart_resize(h, w, cfg) == expected
    assert image_grid(h, w, cfg) == (1, expected[0] // cfg.patch_size, expected[1] // cfg.patch_size)


@pytest.mark.parametrize("hw", [(1, 1), (3, 3), (10, 600), (600, 10), (1, 14), (14, 1), (13, 2600), (1, 199), (7, 1393),
                                (1, 200), (2, 400), (1, 2), (27, 27), (41, 42)])
def test_smart_resize_thin_and_tiny_match_hf(hw):
    for cfg in (QWEN2, QWEN3):
        assert smart_resize(*hw, cfg) == hf_smart_resize(*hw, factor=cfg.factor, min_pixels=cfg.min_pixels,
                                                         max_pixels=cfg.max_pixels), (hw, cfg.patch_size)


def test_extreme_aspect_is_skipped_from_the_header():
    for hw in [(1, 201), (201, 1), (3, 604), (1, 4000)]:
        with pytest.raises(ValueError):
            hf_smart_resize(*hw)
        for cfg in (QWEN2, fixed_cfg()):
            with pytest.raises(ImageSkip) as e:
                image_grid(*hw, cfg)
            assert e.value.reason == S.SKIP_EXTREME_ASPECT, (hw, cfg.resize)
    data = encode(Image.new("RGB", (201, 1)), "PNG")
    with pytest.raises(ValueError):
        qwen_processor(QWEN2)(images=opened(data))
    with pytest.raises(ImageSkip):
        image_grid(*probe_image(data, QWEN2), QWEN2)
    assert image_grid(1, 201, ImageConfig(max_aspect=250.0)) == (1, 2, 58)  # the limit is a setting


def test_qwen3_vl_uses_the_qwen2_vl_image_processor():
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    for model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        assert IMAGE_PROCESSOR_MAPPING_NAMES[model_type]["pil"] == "Qwen2VLImageProcessorPil", model_type


# ------------------------------------------------------------------ pixels = HF's pixel_values
def ours_qwen(data: bytes, cfg: ImageConfig) -> tuple[tuple[int, int, int], np.ndarray]:
    grid = image_grid(*probe_image(data, cfg), cfg)  # header only, as measure does
    patches = torch.from_numpy(patchify(decode_image(data, grid, cfg), cfg))
    return grid, normalize_patches(patches, cfg.image_mean, cfg.image_std, cfg.temporal_patch_size).numpy()


@pytest.mark.parametrize("name", sorted(FILES))
@pytest.mark.parametrize("cfg", [QWEN2, QWEN3], ids=["qwen2", "qwen3"])
def test_qwen_pixels_equal_hf(name, cfg):
    data = FILES[name]
    ref = qwen_processor(cfg)(images=opened(data), return_tensors="np")
    grid, pixels = ours_qwen(data, cfg)
    assert [list(grid)] == ref["image_grid_thw"].tolist()
    assert pixels.shape == ref["pixel_values"].shape
    np.testing.assert_allclose(pixels, ref["pixel_values"], rtol=0, atol=1e-5)


def test_exif_rotated_equals_hf_load_image(tmp_path):
    """Through HF's own loader (load_image: exif_transpose + convert RGB), for every orientation."""
    stored = Image.fromarray(skdata.chelsea()).resize((170, 90))
    for orientation in range(1, 9):
        path = tmp_path / f"o{orientation}.jpg"
        path.write_bytes(jpeg_with_orientation(stored, orientation))
        ref = qwen_processor(QWEN2)(images=load_image(str(path)), return_tensors="np")
        grid, pixels = ours_qwen(path.read_bytes(), QWEN2)
        assert [list(grid)] == ref["image_grid_thw"].tolist(), orientation
        np.testing.assert_allclose(pixels, ref["pixel_values"], rtol=0, atol=1e-5, err_msg=str(orientation))


def test_fast_decode_keeps_the_grid_but_not_the_pixels():
    data = FILES["large_jpeg_2000x1500"]
    fast = ImageConfig(**{**QWEN2.__dict__, "fast_decode": True})
    grid, exact = ours_qwen(data, QWEN2)
    fast_grid, approx = ours_qwen(data, fast)
    assert fast_grid == grid
    diff = np.abs(approx - exact)
    assert diff.max() > 1e-3 and diff.mean() < 0.1  # close, not equal: the opt-in trade


# ------------------------------------------------------------------ fixed (LLaVA-1.5 / CLIP)
def ours_fixed(data: bytes, cfg: ImageConfig) -> np.ndarray:
    grid = image_grid(*probe_image(data, cfg), cfg)
    assert grid == (1, FIXED_SIZE // 14, FIXED_SIZE // 14)
    patches = torch.from_numpy(patchify(decode_image(data, grid, cfg), cfg))
    normalized = normalize_patches(patches, cfg.image_mean, cfg.image_std, temporal=1).numpy()
    return unpatchify(normalized, grid, cfg).transpose(2, 0, 1)  # [3, S, S] like HF


@pytest.mark.parametrize("name", sorted(FILES))
@pytest.mark.parametrize("processor", ["clip", "llava", "llava_do_pad"])
def test_fixed_pixels_equal_hf(name, processor):
    data = FILES[name]
    if processor == "clip":
        proc, cfg = CLIPImageProcessorPil(**clip_kwargs()), fixed_cfg("fixed")
    else:
        pad = processor == "llava_do_pad"
        proc, cfg = LlavaImageProcessorPil(do_pad=pad, **clip_kwargs()), fixed_cfg("fixed_pad" if pad else "fixed")
    ref = np.asarray(proc(images=opened(data), return_tensors="np")["pixel_values"])
    assert ref.shape == (1, 3, FIXED_SIZE, FIXED_SIZE)
    np.testing.assert_allclose(ours_fixed(data, cfg), ref[0], rtol=0, atol=1e-5)


def test_fixed_grid_is_one_token_per_patch_and_needs_a_whole_number_of_patches():
    cfg = ImageConfig(resize="fixed", image_size=336, patch_size=14, merge_size=1)
    assert image_grid(480, 640, cfg) == image_grid(7, 9, cfg) == (1, 24, 24)  # 576 LM image tokens, any size
    with pytest.raises(ValueError):
        image_grid(480, 640, ImageConfig(resize="fixed", image_size=330, patch_size=14))
    with pytest.raises(ValueError):
        image_grid(480, 640, ImageConfig(resize="square"))
