"""Generator: determinism, the documented mixture, and a bad-data corpus that is really broken."""
from __future__ import annotations

import io
import json
import warnings

import pytest
from PIL import Image, UnidentifiedImageError

from ray_mmbatch import schema
from ray_mmbatch.synthetic import bad_samples, generate
from ray_mmbatch.synthetic.generate import generate_dataset, make_good_sample, tree_digest

FORMAT_KEYS = ("parquet", "caption", "webdataset", "llava")


@pytest.mark.parametrize("fmt", ["parquet", "webdataset", "llava"])
def test_same_seed_same_bytes_serial_or_parallel(tmp_path, fmt):
    a = generate_dataset(str(tmp_path / "a"), 40, fmt, seed=3, shard_size=15, workers=2, bad_per_kind=1)
    b = generate_dataset(str(tmp_path / "b"), 40, fmt, seed=3, shard_size=15, workers=1, bad_per_kind=1)
    assert a == b
    digest = tree_digest(str(tmp_path / "a"))
    assert digest == tree_digest(str(tmp_path / "b"))
    assert len(digest) > 3
    generate_dataset(str(tmp_path / "c"), 40, fmt, seed=4, shard_size=15, workers=1, bad_per_kind=1)
    assert tree_digest(str(tmp_path / "c")) != digest


def test_manifest_layout(tmp_path):
    m = generate_dataset(str(tmp_path), 30, "parquet", seed=0, shard_size=10, workers=1, bad_per_kind=2)
    assert m == json.loads((tmp_path / "manifest.json").read_text())
    assert m["paths"] == [f"train-{i:05d}-of-{len(m['paths']):05d}.parquet" for i in range(len(m["paths"]))]
    assert len(set(m["ids"])) == len(m["ids"]) == 30 + 2 * len(bad_samples.kinds_for("parquet"))
    assert set(m["bad"]) | set(m["valid_unusual"]) <= set(m["ids"])
    assert not set(m["bad"]) & set(m["valid_unusual"])
    assert sum(m["mixture"].values()) == 30
    assert set(m["bad"].values()) <= {v for k, v in vars(schema).items() if k.startswith("SKIP_")}
    too_many = [sid for sid, r in m["bad"].items() if r == schema.SKIP_TOO_MANY_IMAGES]
    assert too_many and set(m["bad_conditions"]) == set(too_many)
    # bad samples are spread among good ones, not bunched at the end
    positions = [m["ids"].index(sid) for sid in m["bad"]]
    assert min(positions) < len(m["ids"]) // 3 and max(positions) > 2 * len(m["ids"]) // 3


def test_bad_arguments_raise(tmp_path):
    with pytest.raises(ValueError, match="format"):
        generate_dataset(str(tmp_path), 5, "csv")
    with pytest.raises(ValueError, match="parquet_style"):
        generate_dataset(str(tmp_path), 5, "parquet", parquet_style="wide")
    with pytest.raises(ValueError):
        generate_dataset(str(tmp_path), 5, "parquet", shard_size=0)
    with pytest.raises(ValueError, match="does not apply"):
        bad_samples.make_bad_sample("path_dotdot", 0, 0, "webdataset")


def _header(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def _placeholders(conv) -> int:
    return sum(t["value"].count(schema.IMAGE_PLACEHOLDER) for t in conv if t["from"] == "human")


def test_mixture_and_image_variety():
    samples = [make_good_sample(i, seed=0) for i in range(500)]
    share = {c: sum(s.category == c for s in samples) / len(samples) for c, _ in generate.MIXTURE}
    for category, expected in generate.MIXTURE:
        assert abs(share[category] - expected) < 0.06, (category, share)
    modes, formats, sides, ratios, words = set(), set(), [], [], []
    for s in samples:
        assert _placeholders(s.conversations) == len(s.images), s.sample_id
        assert s.conversations[-1]["from"] == "gpt" and s.conversations[-1]["value"]
        words.append(sum(len(t["value"].split()) for t in s.conversations))
        if s.category == "text_only":
            assert not s.images
        if s.category == "multi_image":
            assert 2 <= len(s.images) <= 6
        for im in s.images:
            img = _header(im.data)
            modes.add(img.mode)
            formats.add(img.format)
            sides += [img.width, img.height]
            ratios.append(max(img.size) / min(img.size))
            if s.category == "document":
                assert 1000 <= img.width <= 3000 and 1000 <= img.height <= 3000
    assert {"RGB", "RGBA", "L", "P"} <= modes and {"JPEG", "PNG"} <= formats
    assert min(sides) <= 24 and max(sides) >= 2000
    assert max(ratios) <= 4.5 and max(ratios) > 3
    short = [w for w, s in zip(words, samples) if s.category == "caption"]
    long = [w for w, s in zip(words, samples) if s.category == "conversation"]
    assert max(short) < 60 and max(long) > 1200  # a dozen tokens vs. a few thousand


def test_texts_describe_the_picture():
    s = next(make_good_sample(i, 1) for i in range(50) if make_good_sample(i, 1).category == "caption")
    rng = generate.np.random.default_rng([1, int(s.sample_id[1:])])
    rng.random()
    scene = generate.random_scene(rng)
    assert generate.caption(scene) == s.conversations[-1]["value"]
    for shape in scene.shapes:
        assert shape.colour in s.conversations[-1]["value"] and shape.shape in s.conversations[-1]["value"]


def test_bad_corpus_covers_enough_kinds():
    for fmt in FORMAT_KEYS:
        broken = [k for k in bad_samples.kinds_for(fmt) if bad_samples.KINDS[k][0]]
        assert len(broken) >= (10 if fmt == "caption" else 15), (fmt, broken)
        assert len(bad_samples.kinds_for(fmt)) - len(broken) >= 6


def _bad(kind: str, fmt: str = "llava"):
    return bad_samples.make_bad_sample(kind, 0, 0, fmt)


def test_broken_images_are_broken_the_way_claimed():
    assert _bad("empty_file").images[0].data == b""
    for kind in ("random_bytes", "text_named_jpg", "pdf_bytes"):
        with pytest.raises(UnidentifiedImageError):
            _header(_bad(kind).images[0].data)
    assert _header(_bad("unsupported_ico").images[0].data).format == "ICO"
    for kind, fmt in (("truncated_jpeg", "JPEG"), ("truncated_png", "PNG")):
        img = _header(_bad(kind).images[0].data)
        assert img.format == fmt
        with pytest.raises(OSError):
            img.load()
    bomb = _bad("decompression_bomb").images[0].data
    assert len(bomb) < 200
    with pytest.raises(Image.DecompressionBombError):
        _header(bomb)
    assert len(_bad("too_many_images").images) == bad_samples.TOO_MANY_IMAGES_N
    mismatch = _bad("placeholder_mismatch")
    assert _placeholders(mismatch.conversations) == 2 and len(mismatch.images) == 1
    assert not any(t["from"] == "gpt" for t in _bad("empty_answer").conversations)


def test_hostile_valid_images_decode():
    expect = {"tiny_1x1": lambda im: im.size == (1, 1), "thin_2x300": lambda im: im.size == (2, 300),
              "png_16bit": lambda im: im.mode.startswith("I"), "cmyk_jpeg": lambda im: im.mode == "CMYK",
              "palette_transparency": lambda im: im.mode == "P" and "transparency" in im.info,
              "exif_rotated": lambda im: im.getexif().get(0x0112) == 6}
    for kind, check in expect.items():
        sample = _bad(kind)
        assert sample.unusual and not sample.expected
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. a palette-transparency warning would mean a bad file
            img = _header(sample.images[0].data)
            img.load()
        assert check(img), kind
    text = _bad("special_token_text").conversations[-1]["value"]
    assert schema.EOS_TOKEN in text and schema.IMAGE_PAD in text and "<pad>" in text


def test_cli_writes_dataset(tmp_path):
    from jobs.prepare_data import main
    summary = main(["--out", str(tmp_path), "--samples", "12", "--format", "webdataset", "--seed", "1",
                    "--bad", "1", "--shard-size", "8", "--workers", "1"])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert summary["samples"] == len(manifest["ids"]) and summary["bad"] == len(manifest["bad"]) > 10
    assert sorted(p.name for p in tmp_path.glob("*.tar")) == manifest["paths"]
