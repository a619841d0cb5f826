"""Images in archives under the image root (issue 33): M4-Instruct style ``A.zip`` members read in place,
next to loose files in one record; bad archives skip their samples only; gzip'd tars are named, never read."""
from __future__ import annotations

import io
import json
import logging
import zipfile
from pathlib import Path

import pytest
from PIL import Image

from ray_mmbatch import schema as S
from ray_mmbatch.config import Config, DataConfig
from ray_mmbatch.dataflow.local import local_batches
from ray_mmbatch.formats import archives, llava
from ray_mmbatch.formats.units import read_units

IMG = S.IMAGE_PLACEHOLDER


def picture(fmt: str, colour, side: int = 48) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side + 8), colour).save(buf, format=fmt)
    return buf.getvalue()


def conv(images: int) -> list[dict]:
    return [{"from": "human", "value": IMG * images + "\nWhat colours?"}, {"from": "gpt", "value": "Red, then blue."}]


@pytest.fixture()
def m4(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """root/data.json + loose.png + A.zip (members A/x.jpg and y.png) + bad.zip (not a zip) + out.zip (a link
    out of the root) + big.zip; returns (root, {image path: original bytes})."""
    root = tmp_path / "root"
    root.mkdir()
    images = {"loose.png": picture("PNG", (10, 200, 10)), "A/x.jpg": picture("JPEG", (200, 10, 10)),
              "A/y.png": picture("PNG", (10, 10, 200)), "A/sub/z.jpg": picture("JPEG", (90, 90, 9))}
    (root / "loose.png").write_bytes(images["loose.png"])
    with zipfile.ZipFile(root / "A.zip", "w") as zf:
        zf.writestr("A/x.jpg", images["A/x.jpg"])  # member named with the archive's folder
        zf.writestr("y.png", images["A/y.png"], compress_type=zipfile.ZIP_DEFLATED)  # member without it
        zf.writestr("A/sub/z.jpg", images["A/sub/z.jpg"])
    (root / "bad.zip").write_bytes(b"this is not a zip archive at all" * 10)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    with zipfile.ZipFile(outside / "out.zip", "w") as zf:
        zf.writestr("out/secret.jpg", images["A/x.jpg"])
    (root / "out.zip").symlink_to(outside / "out.zip")
    with zipfile.ZipFile(root / "big.zip", "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("big/huge.png", b"\0" * 200_000)
    records = [
        {"id": "mixed", "image": ["loose.png", "A/x.jpg", "A/y.png"], "conversations": conv(3)},
        {"id": "nested", "image": "A/sub/z.jpg", "conversations": conv(1)},
        {"id": "gone", "image": ["A/x.jpg", "A/nope.jpg"], "conversations": conv(2)},
        {"id": "corrupt", "image": "bad/p.jpg", "conversations": conv(1)},
        {"id": "outside", "image": "out/secret.jpg", "conversations": conv(1)},
        {"id": "big", "image": "big/huge.png", "conversations": conv(1)},
        {"id": "after", "image": ["A/y.png", "loose.png"], "conversations": conv(2)},
    ]
    (root / "data.json").write_text(json.dumps(records))
    archives.close_all()
    yield root, images
    archives.close_all()


def rows_by_id(root: Path, **data) -> dict[str, dict]:
    units, read_fn, kwargs = read_units(str(root), DataConfig(**data))
    rows = []
    for unit in units:
        rows += llava.read_unit(unit, kwargs["data_cfg"])
    return {r[S.SAMPLE_ID].split("#", 1)[1]: r for r in rows}


def test_zip_members_next_to_loose_files_and_bad_archives(m4):
    root, images = m4
    rows = rows_by_id(root, max_file_bytes=100_000)
    assert rows["mixed"][S.READ_ERROR] == ""
    assert rows["mixed"][S.IMAGES] == [images["loose.png"], images["A/x.jpg"], images["A/y.png"]]
    assert rows["nested"][S.IMAGES] == [images["A/sub/z.jpg"]]
    assert rows["after"][S.IMAGES] == [images["A/y.png"], images["loose.png"]] and rows["after"][S.READ_ERROR] == ""
    gone = rows["gone"][S.READ_ERROR]
    assert gone.startswith(S.SKIP_MISSING_FILE) and "A.zip" in gone and "A/nope.jpg" in gone and "nope.jpg" in gone
    corrupt = rows["corrupt"][S.READ_ERROR]
    assert corrupt.startswith(S.SKIP_MISSING_FILE) and "bad.zip is not a zip file" in corrupt
    assert rows["outside"][S.READ_ERROR].startswith(S.SKIP_PATH_OUTSIDE_ROOT)
    big = rows["big"][S.READ_ERROR]
    assert big.startswith(S.SKIP_FILE_TOO_LARGE) and "big.zip member big/huge.png" in big and "200,000" in big
    assert rows["big"][S.IMAGES] == [] and rows["outside"][S.IMAGES] == []
    # each archive opened once for the whole file (kept open), the one outside the root never
    assert sorted(Path(p).name for p in archives.cached_archives()) == ["A.zip", "bad.zip", "big.zip"]


def test_open_archives_stay_bounded(tmp_path):
    archives.close_all()
    data = picture("PNG", (1, 2, 3))
    for k in range(archives.ZIP_CACHE + 3):
        with zipfile.ZipFile(tmp_path / f"S{k}.zip", "w") as zf:
            zf.writestr(f"S{k}/a.png", data)
    records = [{"id": k, "image": f"S{k}/a.png", "conversations": conv(1)} for k in range(archives.ZIP_CACHE + 3)]
    rows = llava.llava_rows(records + records[-2:], str(tmp_path))
    assert all(r[S.IMAGES] == [data] and r[S.READ_ERROR] == "" for r in rows)
    held = [Path(p).name for p in archives.cached_archives()]
    assert len(held) == archives.ZIP_CACHE and held[-1] == f"S{archives.ZIP_CACHE + 2}.zip"
    archives.close_all()


def test_gzipped_tars_are_named_with_their_command_never_read(tmp_path, caplog):
    (tmp_path / "coco").mkdir()
    (tmp_path / "coco" / "a.png").write_bytes(picture("PNG", (5, 5, 5)))
    (tmp_path / "ocr.tar.gz").write_bytes(b"never opened")  # not even a gzip: proof it is not read
    (tmp_path / "chart.tar.gz.part-aa").write_bytes(b"part one")
    (tmp_path / "chart.tar.gz.part-ab").write_bytes(b"part two")
    (tmp_path / "coco.tar.gz").write_bytes(b"already extracted")
    records = [{"id": "ok", "image": "coco/a.png", "conversations": conv(1)},
               {"id": "ocr", "image": "ocr/p/1.jpg", "conversations": conv(1)},
               {"id": "chart", "image": ["coco/a.png", "chart/2.png"], "conversations": conv(2)},
               {"id": "plain", "image": "nothing/3.png", "conversations": conv(1)}]
    (tmp_path / "data.json").write_text(json.dumps(records))
    with caplog.at_level(logging.WARNING, logger="ray_mmbatch.formats"):
        rows = rows_by_id(tmp_path)
    warned = [r.getMessage() for r in caplog.records if "tar archive" in r.getMessage()]
    assert len(warned) == 1 and "chart.tar.gz.part-aa, ocr.tar.gz" in warned[0] and "coco.tar.gz" not in warned[0]
    assert rows["ok"][S.READ_ERROR] == ""
    ocr = rows["ocr"][S.READ_ERROR]
    assert ocr.startswith(S.SKIP_MISSING_FILE) and "ocr.tar.gz" in ocr and "random access" in ocr
    assert f"tar -xzf {tmp_path}/ocr.tar.gz -C {tmp_path}" in ocr
    chart = rows["chart"][S.READ_ERROR]
    assert chart.startswith(S.SKIP_MISSING_FILE)
    assert f"cat {tmp_path}/chart.tar.gz.* | tar -xzf - -C {tmp_path}" in chart
    assert rows["plain"][S.READ_ERROR] == f"{S.SKIP_MISSING_FILE}: nothing/3.png"


def test_zip_held_images_train_in_process(m4):
    root, _ = m4
    cfg = Config()
    cfg.data = DataConfig(path=str(root), max_file_bytes=100_000)
    cfg.budget.max_tokens = 4096
    trained, skipped = [], {}
    batches = 0
    for item in local_batches(cfg, with_skips=True):
        if "skipped" in item:
            skipped.update({s.sample_id.split("#")[1]: s.text for s in item["skipped"]})
        else:
            batches += 1
            trained += [s.split("#")[1] for s in item["sample_ids"]]
    assert sorted(trained) == ["after", "mixed", "nested"] and batches >= 1
    assert {k: v.split(":")[0] for k, v in skipped.items()} == {
        "gone": S.SKIP_MISSING_FILE, "corrupt": S.SKIP_MISSING_FILE, "outside": S.SKIP_PATH_OUTSIDE_ROOT,
        "big": S.SKIP_FILE_TOO_LARGE}
