"""The bad-data corpus: broken and hostile samples, each with the skip reason it must get.

Every kind is one small builder ``(rng, sample_id, fmt) -> Sample``; ``KINDS``
maps its name to (expected reason, formats where it makes sense, builder).
``expected == ""`` marks a hostile-but-VALID kind that must be *used*.

Formats: ``parquet`` (conversations style), ``caption`` (parquet with plain
text + single image columns), ``webdataset``, ``llava``. Where a kind cannot be
expressed it is left out, e.g. lone surrogates cannot be stored in Arrow
strings (Parquet validates UTF-8), paths only exist in LLaVA, a bad ``.json``
member only in WebDataset.

``too_many_images`` (50 tiny images) is expected to be skipped only under a
budget with ``max_images`` < 50 (16 in our configs); with no image budget it
is a valid sample. The manifest records this under ``bad_conditions``.

Pure module: Pillow and numpy only.
"""
from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image

from ray_mmbatch import schema
from ray_mmbatch.synthetic.draw import EncodedImage, Sample, draw_scene, encode, random_scene

ALL = ("parquet", "caption", "webdataset", "llava")
CONV = ("parquet", "webdataset", "llava")
TOO_MANY_IMAGES_N = 50


def _small_scene(rng, lo: int = 48, hi: int = 96) -> Image.Image:
    return draw_scene(random_scene(rng, lo, hi))


def _jpeg(rng) -> bytes:
    return encode(_small_scene(rng, 96, 160), "RGB", "JPEG")


def _png(rng) -> bytes:
    return encode(_small_scene(rng, 96, 160), "RGB", "PNG")


def _one_image_conv(question: str = "Describe the image.", answer: str = "A picture.") -> list[dict]:
    return [{"from": "human", "value": f"{schema.IMAGE_PLACEHOLDER}\n{question}"},
            {"from": "gpt", "value": answer}]


def _text_conv(question: str, answer: str) -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


def _image_kind(make_bytes, ext: str):
    """A normal one-image sample whose image file is ``make_bytes(rng)``."""
    def build(rng, sid, fmt):
        return Sample(sid, _one_image_conv(), [EncodedImage(make_bytes(rng), ext)])
    return build


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def bomb_png(side: int = 60000) -> bytes:
    """A ~100-byte PNG whose header claims side x side RGB pixels (a decompression bomb)."""
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat)
            + _png_chunk(b"IEND", b""))


def _ico(rng) -> bytes:
    buf = io.BytesIO()
    _small_scene(rng).resize((32, 32)).save(buf, format="ICO", sizes=[(32, 32)])
    return buf.getvalue()


def _cmyk_jpeg(rng) -> bytes:
    buf = io.BytesIO()
    _small_scene(rng).convert("CMYK").save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def _png16(rng) -> bytes:
    arr = (np.linspace(0, 65535, 64 * 48, dtype=np.uint32).reshape(48, 64)).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")  # mode I;16
    return buf.getvalue()


def _palette_transparent(rng) -> bytes:
    img = _small_scene(rng).quantize(colors=16)
    buf = io.BytesIO()
    img.save(buf, format="PNG", transparency=0)
    return buf.getvalue()


def _exif_rotated(rng) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 CW on display
    buf = io.BytesIO()
    draw_scene(random_scene(rng, 120, 200)).save(buf, format="JPEG", exif=exif.tobytes())
    return buf.getvalue()


def _plain_png(width: int, height: int, colour=(200, 40, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


# ----------------------------------------------------------- conversation kinds
def _placeholder_mismatch(rng, sid, fmt):
    conv = [{"from": "human", "value": f"{schema.IMAGE_PLACEHOLDER}\n{schema.IMAGE_PLACEHOLDER}\nCompare."},
            {"from": "gpt", "value": "They are the same picture."}]
    return Sample(sid, conv, [EncodedImage(_jpeg(rng), "jpg")])


def _image_lost(rng, sid, fmt):
    """An <image> in the question and no image: a null images cell, a key with only .json, no "image" field."""
    return Sample(sid, _one_image_conv(), [])


def _conversations_not_list(rng, sid, fmt):
    # Arrow's list column cannot hold a string, so in Parquet the record is a null list.
    return Sample(sid, None if fmt == "parquet" else "describe the image please", [])


def _turn_missing_field(rng, sid, fmt):
    turn = {"from": None, "value": "hello"} if fmt == "parquet" else {"value": "hello"}
    return Sample(sid, [turn, {"from": "gpt", "value": "hi"}], [])


def _non_string_value(rng, sid, fmt):
    if fmt == "caption":
        return Sample(sid, [{"from": "gpt", "value": None}], [EncodedImage(_png(rng), "png")])
    value = None if fmt == "parquet" else 12345
    return Sample(sid, [{"from": "human", "value": "Count."}, {"from": "gpt", "value": value}], [])


def _lone_surrogate(rng, sid, fmt):
    return Sample(sid, _text_conv("Say something \ud800 odd.", "Something \udfff odd."), [])


def _empty_answer(rng, sid, fmt):
    if fmt == "caption":
        return Sample(sid, [{"from": "gpt", "value": ""}], [EncodedImage(_jpeg(rng), "jpg")])
    return Sample(sid, [{"from": "human", "value": f"{schema.IMAGE_PLACEHOLDER}\nWhat is this?"}],
                  [EncodedImage(_jpeg(rng), "jpg")])


def _too_many_images(rng, sid, fmt):
    images = [EncodedImage(_plain_png(16, 16, tuple(int(c) for c in rng.integers(0, 256, 3))), "png")
              for _ in range(TOO_MANY_IMAGES_N)]
    conv = _one_image_conv("How many pictures are there?", f"There are {TOO_MANY_IMAGES_N} pictures.")
    conv[0]["value"] = f"{schema.IMAGE_PLACEHOLDER}\n" * TOO_MANY_IMAGES_N + "How many pictures are there?"
    return Sample(sid, conv, images)


def _with_override(key: str, value, *, image: bool = True):
    """A normal sample whose format-specific field ``key`` is replaced by ``value``."""
    def build(rng, sid, fmt):
        images = [EncodedImage(_jpeg(rng), "jpg")] if image else []
        conv = _one_image_conv() if image else _text_conv("Hello?", "Hello.")
        return Sample(sid, conv, images, overrides={key: value})
    return build


# --------------------------------------------------------------- valid kinds
def _special_token_text(rng, sid, fmt):
    text = (f"Literal markers {schema.EOS_TOKEN} and {schema.IMAGE_PAD} and <pad> and "
            f"{schema.IM_START} are just text here.")
    return Sample(sid, _one_image_conv("Repeat the markers: " + text, text),
                  [EncodedImage(_png(rng), "png")])


def _placeholder_in_answer(rng, sid, fmt):
    return Sample(sid, _text_conv("How do LLaVA files mark an image?",
                                  f"They write {schema.IMAGE_PLACEHOLDER} in the user turn."), [])


KINDS: dict[str, tuple[str, tuple[str, ...], object]] = {
    # name: (expected skip reason, formats, builder)
    "empty_file": (schema.SKIP_EMPTY_FILE, ALL, _image_kind(lambda rng: b"", "jpg")),
    "random_bytes": (schema.SKIP_NOT_AN_IMAGE, ALL,
                     _image_kind(lambda rng: rng.integers(0, 256, 2048, dtype=np.uint8).tobytes(), "jpg")),
    "text_named_jpg": (schema.SKIP_NOT_AN_IMAGE, ALL,
                       _image_kind(lambda rng: b"this is not a picture, just text\n" * 20, "jpg")),
    "pdf_bytes": (schema.SKIP_NOT_AN_IMAGE, ALL,
                  _image_kind(lambda rng: b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\n%%EOF\n", "pdf")),
    "unsupported_ico": (schema.SKIP_UNSUPPORTED_FORMAT, ALL, _image_kind(_ico, "ico")),
    "truncated_jpeg": (schema.SKIP_CORRUPT_IMAGE, ALL,
                       _image_kind(lambda rng: (b := _jpeg(rng))[: len(b) * 6 // 10], "jpg")),
    "truncated_png": (schema.SKIP_CORRUPT_IMAGE, ALL,
                      _image_kind(lambda rng: (b := _png(rng))[: len(b) * 6 // 10], "png")),
    "decompression_bomb": (schema.SKIP_DECOMPRESSION_BOMB, ALL, _image_kind(lambda rng: bomb_png(), "png")),
    "null_image_bytes": (schema.SKIP_MISSING_FILE, ("parquet", "caption"),
                         _with_override("parquet_null_bytes", True)),
    "missing_file": (schema.SKIP_MISSING_FILE, ("llava",),
                     _with_override("llava_image", "images/does-not-exist/missing.jpg")),
    "path_dotdot": (schema.SKIP_PATH_OUTSIDE_ROOT, ("llava",),
                    _with_override("llava_image", "../../../../../../etc/passwd")),
    "path_absolute": (schema.SKIP_PATH_OUTSIDE_ROOT, ("llava",), _with_override("llava_image", "/etc/passwd")),
    "path_symlink": (schema.SKIP_PATH_OUTSIDE_ROOT, ("llava",), _with_override("llava_symlink", "/etc/passwd")),
    "image_field_wrong_type": (schema.SKIP_MALFORMED_RECORD, ("llava",), _with_override("llava_image", 12345)),
    "record_not_object": (schema.SKIP_MALFORMED_RECORD, ("llava",),
                          _with_override("llava_record", ["not", "a", "record"], image=False)),
    "broken_json": (schema.SKIP_MALFORMED_RECORD, ("webdataset",),
                 _with_override("wds_json", b'{"id": "x", "conversations": [{"from": "hu')),
    "orphan_image": (schema.SKIP_MALFORMED_RECORD, ("webdataset",), _with_override("wds_no_json", True)),
    "conversations_not_list": (schema.SKIP_MALFORMED_RECORD, CONV, _conversations_not_list),
    "turn_missing_field": (schema.SKIP_MALFORMED_RECORD, CONV, _turn_missing_field),
    "non_string_value": (schema.SKIP_MALFORMED_RECORD, ALL, _non_string_value),
    "lone_surrogate": (schema.SKIP_TEXT_ENCODING, ("webdataset", "llava"), _lone_surrogate),
    "placeholder_mismatch": (schema.SKIP_PLACEHOLDER_MISMATCH, CONV, _placeholder_mismatch),
    "image_lost": (schema.SKIP_PLACEHOLDER_MISMATCH, CONV, _image_lost),
    "empty_answer": (schema.SKIP_EMPTY_TEXT, ALL, _empty_answer),
    "too_many_images": (schema.SKIP_TOO_MANY_IMAGES, CONV, _too_many_images),
    "extreme_aspect": (schema.SKIP_EXTREME_ASPECT, ALL, _image_kind(lambda rng: _plain_png(1, 2000), "png")),
    # ---- hostile but valid: must be used
    "special_token_text": ("", CONV, _special_token_text),
    "placeholder_in_answer": ("", CONV, _placeholder_in_answer),
    "tiny_1x1": ("", ALL, _image_kind(lambda rng: _plain_png(1, 1), "png")),
    "thin_2x300": ("", ALL, _image_kind(lambda rng: _plain_png(2, 300), "png")),
    "png_16bit": ("", ALL, _image_kind(_png16, "png")),
    "cmyk_jpeg": ("", ALL, _image_kind(_cmyk_jpeg, "jpg")),
    "palette_transparency": ("", ALL, _image_kind(_palette_transparent, "png")),
    "exif_rotated": ("", ALL, _image_kind(_exif_rotated, "jpg")),
    "llava_no_id": ("", ("llava",), _with_override("llava_no_id", True)),
}

# Reasons decided while reading (data/sources.py); the rest are for the measure stage.
READ_STAGE_REASONS = (schema.SKIP_MALFORMED_RECORD, schema.SKIP_MISSING_FILE, schema.SKIP_PATH_OUTSIDE_ROOT)


def kinds_for(fmt: str) -> list[str]:
    """Kind names that make sense for ``fmt``, in a fixed order."""
    return [name for name, (_, formats, _) in KINDS.items() if fmt in formats]


def make_bad_sample(kind: str, k: int, seed: int, fmt: str) -> Sample:
    """The ``k``-th sample of ``kind``; a function of (seed, kind, k) only."""
    expected, formats, build = KINDS[kind]
    if fmt not in formats:
        raise ValueError(f"bad kind {kind!r} does not apply to format {fmt!r}")
    kind_index = list(KINDS).index(kind)
    rng = np.random.default_rng([seed, 1_000_003, kind_index, k])
    sample = build(rng, f"bad-{kind.replace('_', '-')}-{k}", fmt)
    sample.category = kind
    sample.expected = expected
    sample.unusual = expected == ""
    return sample
