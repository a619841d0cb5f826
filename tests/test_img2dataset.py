"""img2dataset WebDataset output, written with webdataset's own TarWriter as img2dataset writes it: per shard
``NNNNN.tar`` (KEY.jpg / .png / .webp, KEY.txt the caption, KEY.json the download metadata), failed
downloads absent, ``NNNNN.parquet`` and ``NNNNN_stats.json`` beside it. Read in-process (no Ray)."""
from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset  # a dev dependency (pyproject.toml)
from PIL import Image

from ray_mmbatch import formats, schema
from ray_mmbatch.config import DataConfig
from ray_mmbatch.formats.end_of_stream import with_end_unit
from ray_mmbatch.formats.units import count_samples, read_units

FAILED = {3, 6, 9}  # rows whose download failed: img2dataset leaves them out of the tar
SHARDS, PER_SHARD = 2, 8


def _image(fmt: str, width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(out, format=fmt)
    return out.getvalue()


def _meta(key: str, url: str, caption: str, status: str, width: int = 0, height: int = 0,
          data: bytes = b"", error: str | None = None) -> dict:
    """img2dataset downloader.py's meta: the input columns (url, caption), then the download's bookkeeping."""
    import hashlib

    ok = status == "success"
    return {"url": url, "caption": caption, "key": key, "status": status, "error_message": error,
            "width": width if ok else None, "height": height if ok else None,
            "original_width": width + 7 if ok else None, "original_height": height + 5 if ok else None,
            "exif": "{}" if ok else None, "sha256": hashlib.sha256(data).hexdigest() if ok else None}


@pytest.fixture(scope="module")
def img2dataset_folder(tmp_path_factory):
    """Two img2dataset shards; returns (folder, {key: (image bytes, ext, caption)} of the downloaded rows)."""
    root = tmp_path_factory.mktemp("img2dataset")
    kept = {}
    for shard in range(SHARDS):
        metas = []
        with webdataset.TarWriter(str(root / f"{shard:05d}.tar")) as sink:
            for i in range(PER_SHARD):
                n = shard * PER_SHARD + i
                key = f"{shard:05d}{i:04d}"  # img2dataset: shard id, then the row in the shard
                caption = f"a photo number {n}, taken [outdoors]"
                if n in FAILED:
                    metas.append(_meta(key, f"http://example.com/{n}.jpg", caption, "failed_to_download",
                                       error="HTTP Error 404: Not Found"))
                    continue
                ext = ("jpg", "png", "webp")[n % 3]
                w, h = 24 + n, 16 + 2 * n
                data = _image({"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[ext], w, h, n)
                meta = _meta(key, f"http://example.com/{n}.{ext}", caption, "success", w, h, data)
                metas.append(meta)
                sink.write({"__key__": key, ext: data, "txt": caption, "json": json.dumps(meta, indent=4)})
                kept[key] = (data, ext, caption)
        pq.write_table(pa.Table.from_pylist(metas), root / f"{shard:05d}.parquet")  # lists the failures too
        (root / f"{shard:05d}_stats.json").write_text(json.dumps(
            {"count": PER_SHARD, "successes": sum(m["status"] == "success" for m in metas),
             "failed_to_download": sum(m["status"] != "success" for m in metas)}))
    return root, kept


def _read(path, cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """(RAW rows, read units) the way a run reads them: listing, then the read function over the units."""
    units, read_fn, kwargs = read_units(str(path), cfg)
    return read_fn(pa.Table.from_pylist(with_end_unit(units, False)), **kwargs).to_pylist(), units


def _tar_files(root) -> list[str]:
    return sorted(str(p) for p in root.glob("*.tar"))


def _cfg(root, **kw) -> DataConfig:
    return DataConfig(path=str(root), format="webdataset", **kw)


def test_every_downloaded_sample_once_caption_is_the_answer(img2dataset_folder):
    root, kept = img2dataset_folder
    rows, units = _read(root, _cfg(root))
    assert [u["rel"] for u in units] == ["00000.tar", "00001.tar"]  # the .parquet / _stats.json are not data
    assert len(rows) == SHARDS * PER_SHARD - len(FAILED) == len(kept)
    by_key = {r[schema.SAMPLE_ID]: r for r in rows}
    assert sorted(by_key) == sorted(f"{k[:5]}.tar/{k}" for k in kept)  # the json's key is no extra "#id"
    for key, (data, ext, caption) in kept.items():
        row = by_key[f"{key[:5]}.tar/{key}"]
        assert row[schema.READ_ERROR] == ""
        assert row[schema.IMAGES] == [data]
        assert row[schema.IMAGE_REFS] == [f"{key[:5]}.tar/{key}.{ext}"]
        turns = json.loads(row[schema.CONVERSATIONS])
        assert turns == [{"from": "gpt", "value": caption}]  # the caption, not the download metadata
    assert count_samples(str(root), _cfg(root)) == len(kept)


def test_caption_prompt_goes_in_the_user_turn(img2dataset_folder):
    root, kept = img2dataset_folder
    rows, _ = _read(root, _cfg(root, caption_prompt="Describe the image."))
    assert len(rows) == len(kept)
    for row in rows:
        key = row[schema.SAMPLE_ID].rpartition("/")[2]
        assert json.loads(row[schema.CONVERSATIONS]) == [
            {"from": "human", "value": schema.IMAGE_PLACEHOLDER + "Describe the image."},
            {"from": "gpt", "value": kept[key][2]}]


def test_metadata_json_is_never_the_dialogue(tmp_path):
    """Without KEY.txt the caption is the json's caption field; without either, a named skip, never the url."""
    data = _image("JPEG", 20, 30, 1)
    with webdataset.TarWriter(str(tmp_path / "00000.tar")) as sink:
        sink.write({"__key__": "000000000", "jpg": data,
                    "json": json.dumps(_meta("000000000", "http://x/0.jpg", "a red square", "success", 20, 30, data))})
        meta = _meta("000000001", "http://x/1.jpg", None, "success", 20, 30, data)
        del meta["caption"]  # img2dataset run without --caption_col
        sink.write({"__key__": "000000001", "jpg": data, "json": json.dumps(meta)})
        # a plain caption record (not download metadata) keeps its old reading, prompt included
        sink.write({"__key__": "000000002", "jpg": data, "json": json.dumps({"caption": "plain"})})
    rows, _ = _read(tmp_path, _cfg(tmp_path, caption_prompt="What is it?"))
    by_key = {r[schema.SAMPLE_ID].rpartition("/")[2]: r for r in rows}
    assert json.loads(by_key["000000000"][schema.CONVERSATIONS]) == [
        {"from": "human", "value": schema.IMAGE_PLACEHOLDER + "What is it?"}, {"from": "gpt", "value": "a red square"}]
    assert by_key["000000000"][schema.IMAGES] == [data]
    bad = by_key["000000001"][schema.READ_ERROR]
    assert bad.startswith(schema.SKIP_MALFORMED_RECORD) and "download metadata" in bad and "000000001.txt" in bad
    assert json.loads(by_key["000000002"][schema.CONVERSATIONS])[1] == {"from": "gpt", "value": "plain"}


def test_txt_caption_of_a_plain_shard_gets_the_prompt(tmp_path):
    data = _image("PNG", 12, 9, 2)
    with webdataset.TarWriter(str(tmp_path / "s.tar")) as sink:
        sink.write({"__key__": "k", "png": data, "txt": "two dots"})
    rows, _ = _read(tmp_path, _cfg(tmp_path, caption_prompt="Caption:"))
    assert json.loads(rows[0][schema.CONVERSATIONS]) == [
        {"from": "human", "value": schema.IMAGE_PLACEHOLDER + "Caption:"}, {"from": "gpt", "value": "two dots"}]
    rows, _ = _read(tmp_path, _cfg(tmp_path))
    assert json.loads(rows[0][schema.CONVERSATIONS]) == [{"from": "gpt", "value": "two dots"}]


def test_auto_detection_reads_only_the_tars(img2dataset_folder):
    root, kept = img2dataset_folder
    fmt, _, files = formats.resolve(str(root))
    assert fmt == "webdataset" and [f.rpartition("/")[2] for f in files] == ["00000.tar", "00001.tar"]
    assert count_samples(str(root), DataConfig(path=str(root))) == len(kept)
