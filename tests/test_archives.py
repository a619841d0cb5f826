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


def _zips(root: Path, n: int) -> list[str]:
    """n more archives Z0.zip ... each with one member Zk/p.png; their locations."""
    out = []
    for k in range(n):
        with zipfile.ZipFile(root / f"Z{k}.zip", "w") as zf:
            zf.writestr(f"Z{k}/p.png", picture("PNG", (k, k, k)))
        out.append(str(root / f"Z{k}.zip"))
    return out


def test_an_archive_evicted_while_a_thread_reads_it_stays_open_until_that_read_ends(m4):
    """Reader 1 holds A.zip; others open ZIP_CACHE archives, evicting it: reader 1 still reads its member, and
    A.zip is closed once it is done (was: closed under the reader, 'I/O operation on closed file')."""
    root, images = m4
    entry = archives._acquire(str(root / "A.zip"))
    for k, _ in enumerate(_zips(root, archives.ZIP_CACHE)):
        assert archives.read_archived(f"Z{k}/p.png", str(root), 0, llava.resolve_image_path)[1] == ""
    assert str(root / "A.zip") not in archives.cached_archives()
    assert entry.zf.read("A/x.jpg") == images["A/x.jpg"]  # still open for its borrower
    archives._release(entry)
    assert entry.f.closed  # closed by the last borrower, not leaked


def test_two_threads_opening_one_archive_keep_one_copy_and_close_the_other(m4, monkeypatch):
    """Both threads open A.zip before either caches it (a barrier in the real open): one copy is cached and
    shared, the other file is closed (was: the second overwrote the first in the cache, its file never closed)."""
    import threading

    from ray_mmbatch.formats import fs

    root, images = m4
    barrier, opened = threading.Barrier(2), []
    real_open = fs.open_random_access

    def open_both(location):
        f = real_open(location)
        opened.append(f)
        barrier.wait(5)
        return f

    monkeypatch.setattr(fs, "open_random_access", open_both)
    got = [None, None]

    def read(i):
        got[i] = archives.read_archived("A/x.jpg", str(root), 0, llava.resolve_image_path)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got == [(images["A/x.jpg"], "")] * 2
    assert len(opened) == 2 and sum(f.closed for f in opened) == 1  # one closed, one kept in the cache
    assert archives.cached_archives() == [str(root / "A.zip")]


def test_an_error_opening_an_archive_is_retried_but_not_a_zip_is_remembered(m4, monkeypatch):
    """A transient error opening A.zip (a network blip) skips that sample only; the next read opens it. An
    archive that is not a zip is remembered (its samples skip without reopening it)."""
    from ray_mmbatch.formats import fs

    root, images = m4
    real_open, calls = fs.open_random_access, []

    def flaky(location):
        calls.append(location)
        if len(calls) == 1:
            raise OSError("connection reset by peer")
        return real_open(location)

    monkeypatch.setattr(fs, "open_random_access", flaky)
    data, err = archives.read_archived("A/x.jpg", str(root), 0, llava.resolve_image_path)
    assert data is None and "cannot be opened: connection reset by peer" in err
    assert archives.cached_archives() == []
    assert archives.read_archived("A/x.jpg", str(root), 0, llava.resolve_image_path) == (images["A/x.jpg"], "")
    for _ in range(2):
        assert "is not a zip file" in archives.read_archived("bad/p.jpg", str(root), 0, llava.resolve_image_path)[1]
    assert calls.count(str(root / "bad.zip")) == 1
