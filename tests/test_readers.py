"""Ray readers: every generated dataset reads back exactly, bad samples carry their read errors."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_mmbatch import schema
from ray_mmbatch.config import DataConfig
from ray_mmbatch.dataflow.read import read_raw
from ray_mmbatch.formats.units import resolve_files
from ray_mmbatch.synthetic import bad_samples
from ray_mmbatch.synthetic.generate import _build, generate_dataset, plan_entries

pytestmark = pytest.mark.ray
SAMPLES, SEED, BAD = 36, 5, 1
CAPTION_CFG = DataConfig(image_column="image", text_column="text", id_column="key")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gen")
    out = {}
    for key, fmt, style in (("parquet", "parquet", "conversations"), ("caption", "parquet", "caption"),
                            ("webdataset", "webdataset", "conversations"), ("llava", "llava", "conversations")):
        out[key] = root / key
        generate_dataset(str(out[key]), SAMPLES, fmt, seed=SEED, shard_size=16, workers=1, bad_per_kind=BAD,
                         parquet_style=style)
    return out


def _read(path, cfg=None, blocks=None) -> list[dict]:
    import ray
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    return read_raw(str(path), cfg or DataConfig(), override_num_blocks=blocks).take_all()


@pytest.mark.parametrize("key", ["parquet", "caption", "webdataset", "llava"])
def test_reads_back_every_sample_with_its_bytes(ray_cluster, datasets, key):
    manifest = json.loads((datasets[key] / "manifest.json").read_text())
    rows = _read(datasets[key], CAPTION_CFG if key == "caption" else None, blocks=3)
    assert list(rows[0]) == list(schema.RAW_COLUMNS + schema.READ_POSITION_COLUMNS)
    assert [r[schema.SAMPLE_ID] for r in rows] == manifest["ids"]  # each once, in written order
    written = [_build(e, SEED, key) for e in plan_entries(SAMPLES, SEED, key, BAD)]
    for row, sample in zip(rows, written):
        reason = manifest["bad"].get(row[schema.SAMPLE_ID], "")
        if reason in bad_samples.READ_STAGE_REASONS:
            assert row[schema.READ_ERROR].startswith(reason), (row[schema.SAMPLE_ID], row[schema.READ_ERROR])
            continue
        # good, hostile-valid and measure-stage-bad samples all arrive intact, bytes untouched
        assert row[schema.READ_ERROR] == "", (row[schema.SAMPLE_ID], row[schema.READ_ERROR])
        images = [im.data for im in sample.images][: 1 if key == "caption" else None]
        assert row[schema.IMAGES] == images, row[schema.SAMPLE_ID]
        turns = json.loads(row[schema.CONVERSATIONS])
        if key == "caption":
            assert [t["from"] for t in turns] == ["gpt"]
        else:
            assert turns == sample.conversations
    kinds_seen = {manifest["bad"][r[schema.SAMPLE_ID]] for r in rows if r[schema.SAMPLE_ID] in manifest["bad"]}
    assert len(kinds_seen) >= 6


def _by_user_id(rows) -> dict[str, dict]:
    """Rows by the data's own id (what follows "#" in the sample id; a WebDataset key)."""
    return {r[schema.SAMPLE_ID].partition("#")[2] or r[schema.SAMPLE_ID].rpartition("/")[2]: r for r in rows}


def test_read_errors_name_the_problem(ray_cluster, datasets):
    llava = _by_user_id(_read(datasets["llava"]))
    assert llava["bad-path-dotdot-0"][schema.READ_ERROR].startswith(schema.SKIP_PATH_OUTSIDE_ROOT)
    assert llava["bad-path-symlink-0"][schema.READ_ERROR].startswith(schema.SKIP_PATH_OUTSIDE_ROOT)
    assert llava["bad-missing-file-0"][schema.READ_ERROR].startswith(schema.SKIP_MISSING_FILE)
    surrogate = json.loads(llava["bad-lone-surrogate-0"][schema.CONVERSATIONS])
    with pytest.raises(UnicodeEncodeError):  # left for the measure stage to report as text_encoding
        surrogate[0]["value"].encode("utf-8")
    wds = _by_user_id(_read(datasets["webdataset"]))
    assert wds["bad-broken-json-0"][schema.READ_ERROR].startswith(schema.SKIP_MALFORMED_RECORD)
    assert len(wds["bad-too-many-images-0"][schema.IMAGES]) == bad_samples.TOO_MANY_IMAGES_N


def test_parquet_custom_columns_without_id_uses_file_and_row(ray_cluster, tmp_path):
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    for f in range(2):
        table = pa.table({"caption": [f"file {f} row {i}" for i in range(5)],
                          "picture": pa.array([{"bytes": bytes([f, i]), "path": None} if i % 2 else None
                                               for i in range(5)], struct)})
        pq.write_table(table, tmp_path / f"part-{f}.parquet", row_group_size=2)
    cfg = DataConfig(image_column="picture", text_column="caption", id_column="uid")
    rows = _read(tmp_path, cfg, blocks=4)
    assert [r[schema.SAMPLE_ID] for r in rows] == [f"part-{f}.parquet:{i}" for f in range(2) for i in range(5)]
    assert len(read_raw(str(tmp_path / "part-1.parquet"), cfg).take_all()) == 5
    assert [r[schema.IMAGES] for r in rows[:3]] == [[], [bytes([0, 1])], []]
    assert json.loads(rows[7][schema.CONVERSATIONS]) == [{"from": "gpt", "value": "file 1 row 2"}]
    auto = read_raw(str(tmp_path), DataConfig()).take_all()  # the caption column found by its name
    assert len(auto) == 10 and all(r[schema.IMAGES] == [] for r in auto)  # "picture" is not an image column name
    with pytest.raises(ValueError, match="text column"):
        read_raw(str(tmp_path), DataConfig(text_column="note"))


@pytest.mark.parametrize("key", ["parquet", "caption", "webdataset", "llava"])
def test_count_samples_matches_what_is_read(datasets, key):
    """count_samples (footers / record list / tar headers, no image read) = the rows read_raw yields."""
    from ray_mmbatch.formats.units import count_samples

    manifest = json.loads((datasets[key] / "manifest.json").read_text())
    assert count_samples(str(datasets[key]), CAPTION_CFG if key == "caption" else DataConfig()) == \
        len(manifest["ids"]) > SAMPLES


def test_llava_jsonl_with_a_broken_line(ray_cluster, tmp_path):
    (tmp_path / "img.png").write_bytes(b"PNGBYTES")
    lines = [json.dumps({"id": "a", "image": "img.png", "conversations": [{"from": "gpt", "value": "x"}]}),
             "{not json", json.dumps({"conversations": [{"from": "gpt", "value": "y"}]})]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    rows = _read(tmp_path / "train.jsonl")
    assert [r[schema.SAMPLE_ID] for r in rows] == ["train.jsonl:0#a", "train.jsonl:1", "train.jsonl:2"]
    assert rows[0][schema.IMAGES] == [b"PNGBYTES"]
    assert rows[1][schema.READ_ERROR].startswith(schema.SKIP_MALFORMED_RECORD)


def test_format_detection(datasets, tmp_path):
    assert resolve_files(str(datasets["llava"]))[0] == "llava"
    fmt, files = resolve_files(str(datasets["parquet"]))
    manifest = json.loads((datasets["parquet"] / "manifest.json").read_text())
    assert fmt == "parquet" and files == [str(datasets["parquet"] / p) for p in manifest["paths"]]
    assert resolve_files(str(datasets["webdataset"] / "shard-00000.tar")) == (
        "webdataset", [str(datasets["webdataset"] / "shard-00000.tar")])
    assert resolve_files(str(datasets["webdataset"]) + "/*.tar")[0] == "webdataset"
    with pytest.raises(FileNotFoundError):
        resolve_files(str(tmp_path / "nothing"))
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="holds no"):
        resolve_files(str(tmp_path))
    with pytest.raises(ValueError, match="data.format"):
        resolve_files(str(tmp_path), "csv")
