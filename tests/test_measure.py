"""data/measure.py: measured cost == materialized sample, skip reasons, oversize policy, through Ray too."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image
from skimage import data as skdata

from ray_mmbatch import schema as S
from ray_mmbatch.batching.budget import max_tokens_alone
from ray_mmbatch.config import BudgetConfig, ImageConfig, TextConfig
from ray_mmbatch.data.image import ImageSkip
from ray_mmbatch.data.materialize import materialize_sample
from ray_mmbatch.data.measure import fit_batch_to_budget, fit_to_budget, measure_batch
from ray_mmbatch.data.text.tokenizer import load_tokenizer, special_ids

CFG = ImageConfig()
TEXT = TextConfig()


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def varied_images() -> dict[str, bytes]:
    """Many sizes, modes and aspects, plus real photos."""
    photo = Image.fromarray(skdata.astronaut())
    exif = Image.Exif()
    exif[0x0112] = 6
    p = Image.new("P", (90, 70), 1)
    p.putpalette([0, 0, 0, 200, 30, 30] + [0] * 762)
    return {
        "1x1": encode(Image.new("RGB", (1, 1), "red"), "PNG"),
        "thin_4000x20": encode(Image.new("L", (4000, 20), 128), "PNG"),
        "tall_3x597": encode(Image.new("RGB", (3, 597), "blue"), "BMP"),
        "3000x2000": encode(photo.resize((3000, 2000)), "JPEG", quality=80),
        "rgba": encode(photo.resize((200, 120)).convert("RGBA"), "PNG"),
        "la": encode(Image.new("LA", (64, 300), (10, 100)), "PNG"),
        "p_transparent": encode(p, "PNG", transparency=0),
        "l": encode(photo.resize((333, 77)).convert("L"), "PNG"),
        "i16": encode(Image.fromarray(np.full((50, 80), 40000, np.uint16)), "PNG"),
        "cmyk": encode(photo.resize((123, 321)).convert("CMYK"), "JPEG"),
        "exif_rotated": encode(photo.resize((300, 180)), "JPEG", exif=exif),
        "webp": encode(photo.resize((150, 150)), "WEBP"),
        "gif": encode(photo.resize((97, 61)).convert("P"), "GIF"),
        "tiff": encode(photo.resize((64, 64)), "TIFF"),
        "astronaut": encode(photo, "PNG"),
        "chelsea": encode(Image.fromarray(skdata.chelsea()), "JPEG"),
        "coffee": encode(Image.fromarray(skdata.coffee()), "JPEG"),
    }


def raw(sample_id, conv, images=(), read_error="") -> dict:
    conv = conv if isinstance(conv, str) else json.dumps(conv)
    return {S.SAMPLE_ID: sample_id, S.CONVERSATIONS: conv, S.IMAGES: list(images),
            S.IMAGE_REFS: [f"{sample_id}/{j}.img" for j in range(len(images))], S.READ_ERROR: read_error}


def columns(rows: list[dict]) -> dict:
    """Rows -> a Ray-style "numpy" batch (object arrays for list / str columns)."""
    out = {}
    for c in S.RAW_COLUMNS:
        col = np.empty(len(rows), dtype=object)
        col[:] = [r[c] for r in rows]
        out[c] = col
    return out


def rows_of(batch: dict) -> list[dict]:
    return [{c: batch[c][i] for c in batch} for i in range(len(batch[S.SAMPLE_ID]))]


def qa(question="Describe <image>.", answer="A picture of something red."):
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def check_materialized(row: dict, m: dict, tok) -> None:
    L = int(row[S.TOKENS])
    assert m["input_ids"].dtype == np.int32 and m["labels"].dtype == np.int32 and len(m["input_ids"]) == L
    assert m["patches"].dtype == np.uint8 and m["patches"].shape == (int(row[S.PATCHES]), 3 * 14 * 14)
    assert m["grids"].dtype == np.int32 and m["grids"].shape == (int(row[S.N_IMAGES]), 3)
    pad = special_ids(tok)[S.IMAGE_PAD]
    assert (m["input_ids"] == pad).sum() == int(row[S.IMAGE_TOKENS])
    assert m["labels"][-1] == S.IGNORE_INDEX
    has = m["labels"][:-1] != S.IGNORE_INDEX
    np.testing.assert_array_equal(m["labels"][:-1][has], m["input_ids"][1:][has])
    assert not np.isin(m["labels"], [pad, special_ids(tok)[S.VISION_START]]).any()


def test_measure_and_materialize_agree_over_many_images(tok):
    images = varied_images()
    rows = [raw(name, qa(), [data]) for name, data in images.items()]
    rows.append(raw("multi", qa("Compare <image> with <image> and <image>."), list(images.values())[:3]))
    rows.append(raw("text_only", [{"from": "gpt", "value": "just a caption"}]))
    batch = measure_batch(columns(rows), CFG, tok, TEXT)
    assert set(S.MEASURED_COLUMNS) <= set(batch)
    for row in rows_of(batch):
        assert row[S.SKIP_REASON] == "", (row[S.SAMPLE_ID], row[S.SKIP_REASON])
        g = np.asarray(row[S.GRIDS]).reshape(-1, 3)
        assert row[S.PATCHES] == (g[:, 1] * g[:, 2]).sum() and row[S.IMAGE_TOKENS] == (g[:, 1] * g[:, 2] // 4).sum()
        assert row[S.TOKENS] == row[S.TEXT_TOKENS] + row[S.IMAGE_TOKENS]
        assert row[S.TEXT_TOKENS] == len(row[S.TEXT_IDS]) - row[S.N_IMAGES]
        assert ((g[:, 1] * g[:, 2] * 196) <= CFG.max_pixels).all()
        check_materialized(row, materialize_sample(row, CFG), tok)
    by_id = {r[S.SAMPLE_ID]: r for r in rows_of(batch)}
    assert by_id["exif_rotated"][S.GRIDS].tolist() == [[1, 22, 12]]  # 180x300 upright, portrait after EXIF
    assert by_id["multi"][S.N_IMAGES] == 3 and by_id["text_only"][S.PATCHES] == 0


def test_every_row_comes_out_with_a_reason(tok):
    good = encode(Image.new("RGB", (64, 64), "green"), "PNG")
    truncated = encode(Image.fromarray(skdata.chelsea()), "JPEG")[:3000]
    rows = [
        raw("ok", qa(), [good]),
        raw("read", qa(), [good], read_error=f"{S.SKIP_MISSING_FILE}: a.jpg"),
        raw("empty", qa(), [b""]),
        raw("garbage", qa(), [good, b"not an image at all"]),
        raw("json", "{not json"),
        raw("mismatch", qa("<image> <image>"), [good]),
        raw("surrogate", [{"from": "gpt", "value": "\ud83d"}]),
        raw("truncated", qa(), [truncated]),  # header fine: skipped only when decoded
        raw("bomb", qa(), [encode(Image.new("L", (1000, 1000)), "PNG")]),
    ]
    batch = measure_batch(columns(rows), ImageConfig(max_header_pixels=500_000), tok, TEXT)
    assert list(batch[S.SAMPLE_ID]) == [r[S.SAMPLE_ID] for r in rows]
    prefix = [r.split(":")[0] for r in batch[S.SKIP_REASON]]
    assert prefix == ["", S.SKIP_MISSING_FILE, S.SKIP_EMPTY_FILE, S.SKIP_NOT_AN_IMAGE, S.SKIP_MALFORMED_RECORD,
                      S.SKIP_PLACEHOLDER_MISMATCH, S.SKIP_TEXT_ENCODING, "", S.SKIP_DECOMPRESSION_BOMB]
    assert "image 1 (garbage/1.img)" in batch[S.SKIP_REASON][3]
    for row in rows_of(batch):
        if row[S.SKIP_REASON]:
            assert row[S.TOKENS] == row[S.PATCHES] == row[S.N_IMAGES] == 0 and len(row[S.TEXT_IDS]) == 0
    with pytest.raises(ImageSkip) as e:
        materialize_sample(rows_of(batch)[7], CFG)
    assert e.value.reason == S.SKIP_CORRUPT_IMAGE


def measured_row(tok, conv, images=()):
    return rows_of(measure_batch(columns([raw("x", conv, images)]), CFG, tok, TEXT))[0]


def test_oversize_truncates_text_after_the_last_image(tok):
    img = encode(Image.fromarray(skdata.coffee()), "JPEG")
    row = measured_row(tok, qa("<image> Tell me everything.", "word " * 800), [img])
    image_tokens = row[S.IMAGE_TOKENS]
    budget = BudgetConfig(max_tokens=image_tokens + 60)
    fitted = fit_to_budget(row, budget)
    assert fitted[S.SKIP_REASON] == "" and fitted[S.TOKENS] == budget.max_tokens
    assert fitted[S.IMAGE_TOKENS] == image_tokens and fitted[S.PATCHES] == row[S.PATCHES]
    check_materialized(fitted, materialize_sample(fitted, CFG), tok)
    assert fit_to_budget(row, BudgetConfig(max_tokens=row[S.TOKENS])) is row  # fits: unchanged
    # the image alone is over budget: cannot truncate
    assert fit_to_budget(row, BudgetConfig(max_tokens=image_tokens))[S.SKIP_REASON].startswith(S.SKIP_OVERSIZE)
    # the answer would be cut away entirely: nothing trainable left
    r = fit_to_budget(row, BudgetConfig(max_tokens=image_tokens + 20))
    assert r[S.SKIP_REASON].startswith(S.SKIP_OVERSIZE) and "nothing trainable" in r[S.SKIP_REASON]
    skipped = fit_to_budget(row, BudgetConfig(max_tokens=image_tokens + 60, oversize="skip"))
    assert skipped[S.SKIP_REASON].startswith(S.SKIP_OVERSIZE) and skipped[S.TOKENS] == 0


def test_other_budgets_and_attention_term(tok):
    img = encode(Image.new("RGB", (100, 100)), "PNG")
    row = measured_row(tok, qa("<image><image><image>", "three"), [img] * 3)
    r = fit_to_budget(row, BudgetConfig(max_images=2))
    assert r[S.SKIP_REASON].startswith(S.SKIP_TOO_MANY_IMAGES)
    r = fit_to_budget(row, BudgetConfig(max_patches=row[S.PATCHES] - 1, oversize="truncate"))
    assert r[S.SKIP_REASON].startswith(S.SKIP_OVERSIZE)
    b = BudgetConfig(max_tokens=1000, attn_weight=0.01)
    t = max_tokens_alone(b)
    assert t + 0.01 * t * t <= 1000 < (t + 1) + 0.01 * (t + 1) ** 2
    text = measured_row(tok, [{"from": "gpt", "value": "long " * 500}])
    fitted = fit_to_budget(text, b)
    assert fitted[S.TOKENS] == t and len(fitted[S.TEXT_IDS]) == t
    check_materialized(fitted, materialize_sample(fitted, CFG), tok)


def test_fit_batch_only_touches_rows_that_do_not_fit(tok):
    rows = [raw("short", [{"from": "gpt", "value": "hi"}]), raw("long", [{"from": "gpt", "value": "w " * 400}]),
            raw("bad", "[", [])]
    batch = measure_batch(columns(rows), CFG, tok, TEXT)
    out = fit_batch_to_budget(batch, BudgetConfig(max_tokens=100))
    assert list(out[S.TOKENS]) == [batch[S.TOKENS][0], 100, 0]
    assert [r.split(":")[0] for r in out[S.SKIP_REASON]] == ["", "", S.SKIP_MALFORMED_RECORD]
    assert batch[S.TOKENS][1] > 100  # the input batch is not modified
    assert fit_batch_to_budget(batch, BudgetConfig(max_tokens=10_000)) is batch


@pytest.mark.ray
def test_measured_rows_survive_ray_data(ray_cluster, tok):
    """Variable-length ids, empty grids and skipped rows in one stream; materialize from what Ray hands back."""
    ray = ray_cluster
    imgs = [encode(Image.new("RGB", (40 + 30 * i, 60), (i * 20, 0, 0)), "PNG") for i in range(5)]
    rows = [raw(f"s{i}", qa("<image> " * (i % 3), f"answer {i} " * (i + 1)) if i % 3 else
                [{"from": "gpt", "value": f"caption {i}"}], imgs[: i % 3]) for i in range(12)]
    rows[4][S.READ_ERROR] = S.SKIP_MISSING_FILE

    def stage(b):
        return fit_batch_to_budget(measure_batch(b, CFG, load_tokenizer(), TEXT), BudgetConfig(max_tokens=40))

    out = ray.data.from_items(rows).map_batches(stage, batch_size=4, batch_format="numpy").take_all()
    assert sorted(r[S.SAMPLE_ID] for r in out) == sorted(r[S.SAMPLE_ID] for r in rows)
    usable = [r for r in out if not r[S.SKIP_REASON]]
    assert len(usable) == 11
    for r in usable:
        check_materialized(r, materialize_sample(r, CFG), tok)
