"""``datasets`` save_to_disk folders (formats/arrow.py), written by ``datasets`` itself from real image files:
a LLaVA ``conversations`` + ``image`` set and a Cauldron ``texts`` + ``images`` set in 2 shards, a DatasetDict
with train / test. Read in-process (no Ray) the way a run reads: listing, then the read function."""
from __future__ import annotations

import io
import json
import shutil

import datasets  # a dev dependency (pyproject.toml)
import numpy as np
import pyarrow as pa
import pytest
from PIL import Image as PILImage

from ray_mmbatch import formats, schema
from ray_mmbatch.config import DataConfig
from ray_mmbatch.formats import arrow
from ray_mmbatch.formats.end_of_stream import with_end_unit
from ray_mmbatch.formats.units import count_samples, read_units

ROWS = 14
SHARD0 = "data-00000-of-00002.arrow"
SHARD1 = "data-00001-of-00002.arrow"


def _write_images(folder, n: int) -> list:
    """n real image files, JPEG and PNG, each its own size."""
    folder.mkdir()
    paths = []
    for i in range(n):
        fmt, ext = (("JPEG", "jpg"), ("PNG", "png"))[i % 2]
        rng = np.random.default_rng(i)
        path = folder / f"img{i}.{ext}"
        PILImage.fromarray(rng.integers(0, 255, (18 + 3 * i, 25 + i, 3), dtype=np.uint8)).save(path, format=fmt)
        paths.append(path)
    return paths


def _conv(i: int) -> list[dict]:
    return [{"from": "human", "value": f"<image>\nWhat is in picture {i}?"}, {"from": "gpt", "value": f"Noise {i}."}]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Folders written by save_to_disk: {"llava", "cauldron", "dict"} -> path; plus the image files' bytes."""
    root = tmp_path_factory.mktemp("save_to_disk")
    paths = _write_images(root / "images", ROWS + 2)
    llava = datasets.Dataset.from_dict(
        {"id": [f"s{i}" for i in range(ROWS)], "image": [str(p) for p in paths[:ROWS]],
         "conversations": [_conv(i) for i in range(ROWS)], "score": [i % 4 for i in range(ROWS)]},
        features=datasets.Features({
            "id": datasets.Value("string"), "image": datasets.Image(),
            "conversations": [{"from": datasets.Value("string"), "value": datasets.Value("string")}],
            "score": datasets.Value("int64")}))
    mp = pytest.MonkeyPatch()
    mp.setattr(datasets.config, "DEFAULT_MAX_BATCH_SIZE", 3)  # several record batches per shard, as at scale
    try:
        llava.save_to_disk(str(root / "llava"), num_shards=2)
    finally:
        mp.undo()
    cauldron = datasets.Dataset.from_dict(
        {"images": [[str(paths[i])] + ([str(paths[i + 1])] if i % 3 == 0 else []) for i in range(6)],
         "texts": [[{"user": f"Question {i}?", "assistant": f"Answer {i}.", "source": "synthetic"}]
                   + ([{"user": "And?", "assistant": "More."}] if i == 2 else []) for i in range(6)]},
        features=datasets.Features({
            "images": datasets.Sequence(datasets.Image()),
            "texts": [{"user": datasets.Value("string"), "assistant": datasets.Value("string"),
                       "source": datasets.Value("string")}]}))
    cauldron.save_to_disk(str(root / "cauldron"), num_shards=2)
    datasets.DatasetDict(train=llava.select(range(8)), test=llava.select(range(8, ROWS))).save_to_disk(
        str(root / "dict"))
    return {"llava": root / "llava", "cauldron": root / "cauldron", "dict": root / "dict",
            "bytes": [p.read_bytes() for p in paths]}


def _read(path, cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """(RAW rows, read units) as a run reads them: the listing, then the read function over every unit."""
    units, read_fn, kwargs = read_units(str(path), cfg)
    return read_fn(pa.Table.from_pylist(with_end_unit(units, False)), **kwargs).to_pylist(), units


def _arrow(path, **kw) -> DataConfig:
    return DataConfig(path=str(path), format="arrow", **kw)


def _shard_rows(n0: int = ROWS // 2) -> list[tuple[str, int]]:
    """(shard, row in it) of every dataset row: save_to_disk splits contiguously."""
    return [(SHARD0, i) if i < n0 else (SHARD1, i - n0) for i in range(ROWS)]


def test_llava_shards_every_row_once_with_the_original_bytes(saved):
    assert sorted(p.name for p in saved["llava"].iterdir()) == [SHARD0, SHARD1, "dataset_info.json", "state.json"]
    rows, units = _read(saved["llava"], _arrow(saved["llava"]))
    assert [r[schema.SAMPLE_ID] for r in rows] == [f"{s}:{k}#s{i}" for i, (s, k) in enumerate(_shard_rows())]
    assert units[0]["read_as"].startswith("conversations") and all(u["error"] == "" for u in units)
    for i, row in enumerate(rows):
        assert row[schema.READ_ERROR] == ""
        assert row[schema.IMAGES] == [saved["bytes"][i]]  # the file's bytes, embedded by save_to_disk, untouched
        assert json.loads(row[schema.CONVERSATIONS]) == _conv(i)
    assert arrow.count(units, DataConfig()) == count_samples(str(saved["llava"]), _arrow(saved["llava"])) == ROWS


def test_units_of_a_few_batches_read_by_byte_range(saved, monkeypatch):
    """Several units per shard (each a byte range of its record batches) read the same rows as one per shard."""
    whole, units = _read(saved["llava"], _arrow(saved["llava"]))
    monkeypatch.setattr(arrow, "UNIT_ROWS", 4)
    rows, small = _read(saved["llava"], _arrow(saved["llava"]))
    assert len(small) > len(units) == 2 and {u["batches"] for u in small} == {2, 1}
    assert [u["offset"] for u in small if u["rel"] == SHARD0] == sorted({u["offset"] for u in small
                                                                         if u["rel"] == SHARD0})
    assert rows == whole


def test_cauldron_texts_and_image_lists(saved):
    rows, units = _read(saved["cauldron"], _arrow(saved["cauldron"]))
    assert units[0]["read_as"].startswith("texts") and "images list<Image>" in units[0]["read_as"]
    assert [r[schema.SAMPLE_ID] for r in rows] == [f"{SHARD0}:{k}" for k in range(3)] + \
        [f"{SHARD1}:{k}" for k in range(3)]
    for i, row in enumerate(rows):
        n = 2 if i % 3 == 0 else 1
        assert row[schema.READ_ERROR] == ""
        assert row[schema.IMAGES] == saved["bytes"][i:i + n]
        turns = json.loads(row[schema.CONVERSATIONS])
        assert turns[:2] == [{"from": "human", "value": "<image>" * n + f"Question {i}?"},
                             {"from": "gpt", "value": f"Answer {i}."}]
        assert len(turns) == (4 if i == 2 else 2)


def test_filter_drops_and_counts(saved):
    cfg = _arrow(saved["llava"], filter="score >= 2")
    rows, units = _read(saved["llava"], cfg)
    want = [f"{s}:{k}#s{i}" for i, (s, k) in enumerate(_shard_rows()) if i % 4 >= 2]
    assert [r[schema.SAMPLE_ID] for r in rows] == want
    assert sum(u["rows"] for u in units) == len(want) == count_samples(str(saved["llava"]), cfg)
    assert sum(u["filtered"] for u in units) == ROWS - len(want)
    with pytest.raises(ValueError, match="no column 'quality' for --filter"):  # no shard has it: refused at start
        _read(saved["llava"], _arrow(saved["llava"], filter="quality >= 2"))


@pytest.mark.parametrize("cut", ["mid-batch", "end-of-stream marker", "not arrow"])
def test_a_bad_shard_is_one_skipped_file_the_other_reads(saved, tmp_path, cut):
    folder = tmp_path / "copy"
    shutil.copytree(saved["llava"], folder)
    shard = folder / SHARD1
    data = shard.read_bytes()
    shard.write_bytes({"mid-batch": data[:len(data) - 100], "end-of-stream marker": data[:-8],
                       "not arrow": b"PAR1 this is no Arrow stream" * 9}[cut])
    rows, units = _read(folder, _arrow(folder))
    good = [r for r in rows if r[schema.SAMPLE_ID].startswith(SHARD0)]
    assert len(good) == ROWS // 2 and all(r[schema.READ_ERROR] == "" for r in good)
    bad = [r for r in rows if not r[schema.SAMPLE_ID].startswith(SHARD0)]
    assert [r[schema.SAMPLE_ID] for r in bad] == [SHARD1]
    assert bad[0][schema.READ_ERROR].startswith(schema.SKIP_UNREADABLE_FILE)
    if cut == "end-of-stream marker":  # cut at a batch boundary: would read as a shorter shard, silently
        assert "no end-of-stream marker" in bad[0][schema.READ_ERROR]
    assert count_samples(str(folder), _arrow(folder)) == len(rows) == ROWS // 2 + 1


def test_ipc_file_format_is_read_too(saved, tmp_path):
    """A shard in the IPC file format (ARROW1 magic, footer) reads the same rows as the stream it was made of."""
    folder = tmp_path / "file_format"
    folder.mkdir()
    with pa.memory_map(str(saved["llava"] / SHARD0)) as src:
        table = pa.ipc.open_stream(src).read_all()
    with pa.ipc.new_file(str(folder / SHARD0), table.schema) as sink:
        for batch in table.to_batches(max_chunksize=2):
            sink.write_batch(batch)
    rows, units = _read(folder, _arrow(folder))
    assert units[0]["ipc"] == "file" and len(units) == 1
    stream_rows, _ = _read(saved["llava"], _arrow(saved["llava"]))
    assert rows == [r for r in stream_rows if r[schema.SAMPLE_ID].startswith(SHARD0)]


def test_dictionary_columns_replay_the_stream(tmp_path, monkeypatch):
    """A stream with a dictionary-encoded column (its dictionaries sit before the batches): units replay it."""
    paths = _write_images(tmp_path / "images", 5)
    table = pa.table({"image": pa.array([{"bytes": p.read_bytes(), "path": p.name} for p in paths]),
                      "caption": pa.array([f"picture {i}" for i in range(5)]),
                      "source": pa.array(["a", "b", "a", "b", "a"]).dictionary_encode()})
    folder = tmp_path / "dict_stream"
    folder.mkdir()
    with pa.ipc.new_stream(str(folder / "data-00000-of-00001.arrow"), table.schema) as sink:
        for batch in table.to_batches(max_chunksize=2):
            sink.write_batch(batch)
    monkeypatch.setattr(arrow, "UNIT_ROWS", 2)
    rows, units = _read(folder, _arrow(folder, text_column="caption", filter="source == 'a'"))
    assert len(units) == 3 and all(u["offset"] == -1 for u in units)
    assert [r[schema.SAMPLE_ID] for r in rows] == [f"data-00000-of-00001.arrow:{i}" for i in (0, 2, 4)]
    assert [r[schema.IMAGES] for r in rows] == [[paths[i].read_bytes()] for i in (0, 2, 4)]
    assert [json.loads(r[schema.CONVERSATIONS]) for r in rows] == [[{"from": "gpt", "value": f"picture {i}"}]
                                                                   for i in (0, 2, 4)]


def test_dataset_dict_split_folder(saved):
    assert (saved["dict"] / "dataset_dict.json").is_file()
    rows, _ = _read(saved["dict"] / "train", _arrow(saved["dict"] / "train"))
    assert [r[schema.SAMPLE_ID] for r in rows] == [f"data-00000-of-00001.arrow:{i}#s{i}" for i in range(8)]
    assert [r[schema.IMAGES] for r in rows] == [[b] for b in saved["bytes"][:8]]


def test_auto_detects_a_save_to_disk_folder(saved):
    fmt, root, files = formats.resolve(str(saved["llava"]))
    assert fmt == "arrow" and [f.rpartition("/")[2] for f in files] == [SHARD0, SHARD1]
    rows, _ = _read(saved["llava"], DataConfig(path=str(saved["llava"])))
    assert len(rows) == ROWS


def test_dataset_dict_folder_reads_the_train_split(saved):
    rows, _ = _read(saved["dict"], DataConfig(path=str(saved["dict"])))  # --split train is the default
    assert len(rows) == 8 and all(r[schema.SAMPLE_ID].startswith("train/data-00000-of-00001.arrow:") for r in rows)
    rows, _ = _read(saved["dict"], DataConfig(path=str(saved["dict"]), split="test"))
    assert len(rows) == ROWS - 8 and all(r[schema.SAMPLE_ID].startswith("test/") for r in rows)


def test_read_from_an_object_store(saved):
    """The same rows from s3:// (moto's S3 server where conftest points AWS_ENDPOINT_URL): the listing streams
    each shard, every unit is one ranged read."""
    import os

    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    port = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        client = boto3.client("s3")
        client.create_bucket(Bucket="arrow-shards")
        for shard in (SHARD0, SHARD1):
            client.upload_file(str(saved["llava"] / shard), "arrow-shards", f"llava/{shard}")
        uri = "s3://arrow-shards/llava"
        rows, units = _read(uri, _arrow(uri))
        local, _ = _read(saved["llava"], _arrow(saved["llava"]))
        assert rows == local
        mp = pytest.MonkeyPatch()
        mp.setattr(arrow, "UNIT_ROWS", 4)  # byte ranges found while streaming hold over S3 too
        try:
            assert _read(uri, _arrow(uri))[0] == local
        finally:
            mp.undo()
    finally:
        server.stop()


def test_image_bytes_are_real_images(saved):
    """The fixture's files are real encoded images of their own sizes (so the bytes checks mean something)."""
    sizes = {PILImage.open(io.BytesIO(b)).size for b in saved["bytes"]}
    assert len(sizes) == len(saved["bytes"])
