"""Hub splits, folders of configs and --filter (formats/splits.py, formats/filters.py): a folder as
snapshot_download leaves it trains its train split only, its configs are sources, filtered rows are
counted apart from skips. Real Parquet written with pyarrow; training through the in-process path."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_bad_data import CONV, conversations_table, raw_rows, trained_and_skipped

from ray_mmbatch import schema as S
from ray_mmbatch.config import Config, DataConfig
from ray_mmbatch.data.split import eval_source
from ray_mmbatch.formats import filters
from ray_mmbatch.formats.data_patterns import DEFAULT_PATTERNS_ALL, data_patterns
from ray_mmbatch.formats.sources import data_sources
from ray_mmbatch.formats.units import listing_summary, read_units


def _split_folder(root, layout=(("train-00000-of-00002", 3), ("train-00001-of-00002", 3),
                                ("test-00000-of-00001", 3), ("validation-00000-of-00001", 2))):
    (root / "data").mkdir(parents=True)
    for name, n in layout:
        split = name.split("-")[0]
        pq.write_table(conversations_table(n, [f"{split}{i}" for i in range(n)]), root / "data" / f"{name}.parquet")
    (root / "README.md").write_text("---\nlicense: mit\n---\n")


@pytest.mark.parametrize("rel, split", [
    ("data/train-00000-of-00002.parquet", ["train"]), ("data/test-00000-of-00001.parquet", ["test"]),
    ("validation-00003-of-00010.parquet", ["validation"]), ("data/train_sft-00000-of-00001.parquet", ["train_sft"]),
    ("train_sft-00000-of-00001.parquet", ["train"]),  # not under data/: the keyword rule, as HF reads it
    ("valid/0000.parquet", ["validation"]), ("dev.jsonl", ["validation"]), ("train.json", ["train"]),
    ("cfg/eval/part-1.parquet", ["test"]), ("data-00000-of-00002.arrow", None), ("data/shard-1.parquet", None),
    ("trainer_logs/x.parquet", None), ("contest.parquet", None), ("train2017/0.parquet", ["train"]),
    ("llava_test.parquet", ["test"]), ("Train.jsonl", None),
])
def test_a_lone_file_names_its_split_as_hf_datasets_does(rel, split):
    patterns = data_patterns([rel])
    assert (None if patterns == DEFAULT_PATTERNS_ALL else list(patterns)) == split


def test_split_trap_trains_the_train_split_only_and_evaluates_another(tmp_path):
    _split_folder(tmp_path)
    read = sorted(r[S.SAMPLE_ID].split("#")[1] for r in raw_rows(tmp_path))
    assert read == sorted([f"train{i}" for i in range(3)] * 2)
    trained, skipped = trained_and_skipped(tmp_path)
    assert not skipped and len(trained) == 6 and all("#train" in t for t in trained)  # test / validation never
    cfg = Config()
    cfg.data = DataConfig(path=str(tmp_path), eval_data=str(tmp_path))
    ev, _ = eval_source(cfg)  # --eval-data FOLDER: its validation split
    assert sorted(r[S.SAMPLE_ID].split("#")[1] for r in raw_rows(ev.data.path, ev.data)) == ["validation0",
                                                                                              "validation1"]
    cfg.data.eval_data = f"{tmp_path}#split=test"
    ev, _ = eval_source(cfg)
    assert len(raw_rows(ev.data.path, ev.data)) == 3
    summary = listing_summary(read_units(str(tmp_path), DataConfig()), DataConfig(path=str(tmp_path)))
    assert summary["splits"] == {str(tmp_path): {
        "found": {"test": 1, "train": 2, "validation": 1}, "read": "train", "left_out": {"validation": 1, "test": 1},
        "left_out_files": ["data/validation-00000-of-00001.parquet", "data/test-00000-of-00001.parquet"]}}
    only = tmp_path / "only"  # a held-out folder whose files all say train: its one split is the held-out set
    _split_folder(only, (("train-00000-of-00001", 4),))
    cfg.data.eval_data = str(only)
    ev, _ = eval_source(cfg)
    assert len(raw_rows(ev.data.path, ev.data)) == 4


def test_a_missing_split_is_refused_naming_the_ones_there(tmp_path):
    _split_folder(tmp_path, (("test-00000-of-00001", 2),))
    with pytest.raises(ValueError, match=r"splits \{'test': 1\}.*no 'train'.*--split"):
        read_units(str(tmp_path), DataConfig())
    assert len(raw_rows(tmp_path, DataConfig(split="test"))) == 2


def test_files_naming_no_split_beside_split_files_are_not_read(tmp_path, caplog):
    _split_folder(tmp_path, (("train-00000-of-00001", 2),))
    pq.write_table(conversations_table(5), tmp_path / "data" / "extra.parquet")
    assert len(raw_rows(tmp_path)) == 2
    assert "extra.parquet" in caplog.text
    plain = tmp_path / "plain"  # no split names at all: the whole folder, as before
    plain.mkdir()
    for k in range(2):
        pq.write_table(conversations_table(2), plain / f"part-{k}.parquet")
    assert len(raw_rows(plain)) == 4


def _configs(root, names=("ai2d(cauldron,llava_format)", "chartqa", "vqav2"), rows=(4, 2, 6)):
    for name, n in zip(names, rows):
        (root / name).mkdir(parents=True)
        pq.write_table(conversations_table(n, [f"{name}-{i}" for i in range(n)]),
                       root / name / "train-00000-of-00001.parquet")
        pq.write_table(conversations_table(1, ["held"]), root / name / "test-00000-of-00001.parquet")


def test_a_folder_of_configs_is_one_source_per_config(tmp_path):
    _configs(tmp_path)
    sources = data_sources(DataConfig(path=str(tmp_path)))
    assert [s.name for s in sources] == ["ai2d(cauldron,llava_format)", "chartqa", "vqav2"]
    ids = [r[S.SAMPLE_ID] for r in raw_rows(tmp_path)]
    assert len(ids) == 12 and len(set(ids)) == 12 and not any("held" in i for i in ids)
    assert ids[0] == "ai2d(cauldron,llava_format):train-00000-of-00001.parquet:0#ai2d(cauldron,llava_format)-0"
    one = raw_rows("", DataConfig(sources=[{"path": str(tmp_path), "config": "chartqa"}]))
    assert [r[S.SAMPLE_ID] for r in one] == [f"chartqa:train-00000-of-00001.parquet:{i}#chartqa-{i}" for i in (0, 1)]
    with pytest.raises(ValueError, match="folder of 3 configs.*#config=NAME#WEIGHT"):
        read_units("", DataConfig(sources=[{"path": str(tmp_path), "weight": 1.0}]))


def test_configs_blend_by_weight(tmp_path):
    _configs(tmp_path)
    cfg = DataConfig(sources=[{"path": str(tmp_path), "config": "chartqa", "weight": 3.0},
                              {"path": str(tmp_path), "config": "vqav2", "weight": 1.0}], epoch_samples=8)
    units, fn, kwargs = read_units("", cfg)
    assert kwargs["blend"].targets == [6, 2]  # chartqa's 2 rows up-sampled to 6, vqav2's 6 down to 2


def test_filter_parse_and_mask():
    clauses = filters.parse("relevance_min >= 4 and source in ['ai2d', 'chartqa'] AND ok == true")
    assert [(c.column, c.op) for c in clauses] == [("relevance_min", ">="), ("source", "in"), ("ok", "==")]
    table = pa.table({"relevance_min": [5, 3, None, 4], "source": ["ai2d", "ai2d", "ai2d", "x"],
                      "ok": [True, True, True, True]})
    assert filters.mask(table, clauses).tolist() == [True, False, False, False]  # a null fails its clause
    for bad in ("relevance_min >> 4", "source in 'ai2d'", "relevance_min >= four"):
        with pytest.raises(ValueError, match="--filter"):
            filters.parse(bad)
    with pytest.raises(ValueError, match="cannot compare"):
        filters.mask(table, filters.parse("source >= 4"))


def test_filter_and_inside_quotes_or_lists_is_a_value_and_a_mixed_list_is_named():
    """'and' cuts clauses only outside quotes and brackets; an 'in' list of mixed types, or of the wrong type for
    its column, is a one-line ValueError naming the filter (was: cut in two, and pyarrow's bare ArrowInvalid)."""
    clauses = filters.parse("source == 'q and a' and tag in ['x and y', \"ands\"] and n >= 2")
    assert [(c.column, c.op, c.value) for c in clauses] == [
        ("source", "==", "q and a"), ("tag", "in", ["x and y", "ands"]), ("n", ">=", 2)]
    table = pa.table({"source": ["q and a", "q", "q and a"], "tag": ["x and y", "x and y", "ands"], "n": [2, 5, 1]})
    assert filters.mask(table, clauses).tolist() == [True, False, False]
    assert [c.value for c in filters.parse("n in [1, 2.5] AND source == \"it's\"")] == [[1, 2.5], "it's"]
    with pytest.raises(ValueError, match=r"--filter .*'in' mixes number and str values"):
        filters.parse("source in ['ai2d', 3]")
    with pytest.raises(ValueError, match=r"--filter: cannot compare column 'n' \(int64\)"):
        filters.mask(table, filters.parse("n in ['a', 'b']"))


def test_filtered_rows_are_counted_not_skipped_and_never_read(tmp_path):
    table = conversations_table(10, [f"r{i}" for i in range(10)]).append_column(
        "relevance_min", pa.array([5, 1, 4, 2, 5, 3, 4, 1, 5, 4])).append_column(
        "source", pa.array(["ai2d"] * 10))
    pq.write_table(table, tmp_path / "train-00000-of-00001.parquet", row_group_size=4)
    cfg = DataConfig(path=str(tmp_path), filter="relevance_min >= 4")
    reader = read_units(str(tmp_path), cfg)
    assert [u["rows"] for u in reader[0]] == [2, 2, 2] and sum(u["filtered"] for u in reader[0]) == 4
    kept = [r[S.SAMPLE_ID] for r in raw_rows(tmp_path, cfg)]
    want = [f"train-00000-of-00001.parquet:{i}#r{i}" for i in np.flatnonzero(
        np.array([5, 1, 4, 2, 5, 3, 4, 1, 5, 4]) >= 4)]
    assert kept == want  # ids keep the row's place in its file
    assert listing_summary(reader, cfg)["filtered"] == {"": 4}
    trained, skipped = trained_and_skipped(tmp_path, filter="relevance_min >= 4")
    assert sorted(trained) == sorted(want) and not skipped
    with pytest.raises(ValueError, match="no column 'quality'"):
        read_units(str(tmp_path), DataConfig(path=str(tmp_path), filter="quality > 1"))


def test_inspect_reports_layout_splits_and_filtered(ray_cluster, tmp_path):
    from ray_mmbatch.dataflow.inspection import inspect_dataset

    _split_folder(tmp_path)
    pq.write_table(conversations_table(4, [f"x{i}" for i in range(4)]).append_column("score", pa.array([1, 2, 3, 4])),
                   tmp_path / "data" / "train-00001-of-00002.parquet")
    cfg = Config()
    cfg.data = DataConfig(path=str(tmp_path), filter="score >= 2")
    out = inspect_dataset(cfg)
    assert out["read_as"] == ["conversations [{from, value}] + images list<Image>"]
    assert out["splits"][str(tmp_path)] == {
        "found": {"test": 1, "train": 2, "validation": 1}, "read": "train", "left_out": {"validation": 1, "test": 1},
        "left_out_files": ["data/validation-00000-of-00001.parquet", "data/test-00000-of-00001.parquet"]}
    # file 0 has no 'score' column: one skipped file, named; file 1 keeps rows 1, 2 and 3 (a filtered count
    # unlike the rows read: the two were once mixed up, samples_read 19 / ok 25 / skipped -6 on a docs example)
    assert out["filtered"] == 1 and out["samples_read"] == 3 and out["skipped_files"] == 1
    assert out["samples_ok"] == 3 and out["samples_skipped"] == 0
    assert json.dumps(out)  # JSON-able


def test_conversations_json_layout_unchanged(tmp_path):
    pq.write_table(pa.table({"conversations": [json.dumps(CONV)]}), tmp_path / "t.parquet")
    assert json.loads(raw_rows(tmp_path)[0][S.CONVERSATIONS]) == CONV


def test_dictionary_text_and_cache_files(tmp_path):
    """A categorical (dictionary<string>) caption column is a caption; the datasets cache's cache-*.arrow files
    beside save_to_disk shards, and img2dataset's bookkeeping beside tars, are never data."""
    from ray_mmbatch import formats

    captions = pa.array(["a cat", "a dog", "a cat"]).dictionary_encode()
    pq.write_table(pa.table({"caption": captions}), tmp_path / "c.parquet")
    rows = raw_rows(tmp_path)
    assert [json.loads(r[S.CONVERSATIONS])[0]["value"] for r in rows] == ["a cat", "a dog", "a cat"]
    saved = tmp_path / "saved"
    saved.mkdir()
    for name in ("data-00000-of-00001.arrow", "cache-1a2b3c.arrow"):
        (saved / name).write_bytes(b"")
    (saved / "state.json").write_text("{}")
    assert [p.rsplit("/", 1)[-1] for p in formats.resolve(str(saved))[2]] == ["data-00000-of-00001.arrow"]
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("00000.tar", "00000.parquet", "00000_stats.json"):
        (shards / name).write_bytes(b"")
    fmt, _, files = formats.resolve(str(shards))
    assert fmt == "webdataset" and [p.rsplit("/", 1)[-1] for p in files] == ["00000.tar"]
