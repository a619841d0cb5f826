"""Split names as HF ``datasets`` reads them (formats/data_patterns.py, formats/splits.py): every constant, the
glob translation and the resolution of the naming styles Hub repos and hand-made sets use, each checked against
the installed ``datasets`` (``get_data_patterns`` on a real folder of empty files, then ``DataFilesDict``). Then
what a run does with them: only the split asked for is read, the files left out are named, ``--split
train_sft`` reads the custom split, a folder of JSON Lines files is one dataset, ``--eval-data`` on a folder of
train files warns. No Ray."""
from __future__ import annotations

import json
import logging
import re

import pyarrow.parquet as pq
import pytest
from test_bad_data import conversations_table, raw_rows

from ray_mmbatch import formats
from ray_mmbatch import schema as S
from ray_mmbatch.config import Config, DataConfig
from ray_mmbatch.data.split import eval_source
from ray_mmbatch.formats import data_patterns as P
from ray_mmbatch.formats import splits
from ray_mmbatch.formats.units import listing_summary, read_units

hf = pytest.importorskip("datasets.data_files")

H = "-5f2a9c1e"  # the content hash the Hub's parquet writer adds to a shard name
# (style, files): how Hub repos, the Hub's parquet conversion, push_to_hub, img2dataset, save_to_disk and
# hand-made sets name split files (notes/dataset-layouts.md, issue 44)
LAYOUTS = [
    ("hub parquet shards", ["README.md", f"data/train-00000-of-00002{H}.parquet",
                            f"data/train-00001-of-00002{H}.parquet", f"data/validation-00000-of-00001{H}.parquet",
                            f"data/test-00000-of-00001{H}.parquet"]),
    ("push_to_hub shards", ["data/train-00000-of-00001.parquet", "data/test-00000-of-00001.parquet"]),
    ("custom splits train_sft / train_gen", [f"data/train_sft-0000{i}-of-00003{H}.parquet" for i in range(3)]
     + [f"data/test_sft-00000-of-00001{H}.parquet", f"data/train_gen-00000-of-00001{H}.parquet",
        f"data/test_gen-00000-of-00001{H}.parquet"]),
    ("custom-split shards outside data/", [f"train_sft-00000-of-00001{H}.parquet",
                                           f"train_gen-00000-of-00001{H}.parquet"]),
    ("shards of a dev split", ["data/train-00000-of-00001.parquet", "data/dev-00000-of-00001.parquet"]),
    ("shards of many custom splits", ["data/zeta-00000-of-00001.parquet", "data/test-00000-of-00001.parquet",
                                      "data/alpha-00000-of-00001.parquet"]),
    ("shards beside files naming no split", ["data/train-00000-of-00001.parquet", "data/extra.parquet",
                                             "other/train.parquet"]),
    ("shards at the root", ["train-00000-of-00001.parquet", "test-00000-of-00001.parquet"]),
    ("one validation shard", ["validation-00000-of-00001.parquet"]),
    ("{split}/ folders", ["train/0000.parquet", "validation/0000.parquet", "test/0000.parquet"]),
    ("parquet conversion branch", ["default/train/0000.parquet", "default/train/0001.parquet",
                                   "default/test/0000.parquet"]),
    ("data/{split}/ folders", ["data/train/shard_0.parquet", "data/test/shard_0.parquet"]),
    ("{split}/ folders of JSON Lines", ["train/shard_0.jsonl", "train/shard_1.jsonl", "test/shard_0.jsonl"]),
    ("COCO year folders", ["train2017/part-0.parquet", "val2017/part-0.parquet"]),
    ("COCO 2014 tar folders", ["train2014/00000.tar", "val2014/00000.tar"]),
    ("keyword after a separator in a folder", ["images_train/0.tar", "images_val/0.tar"]),
    ("eval/ folder", ["eval/0.parquet", "train/0.parquet"]),
    ("nested training/ testing/ folders", ["data/2023/training/part-0.parquet", "data/2023/testing/part-0.parquet"]),
    ("folders without dataset_dict.json", ["train/data-00000-of-00001.arrow", "test/data-00000-of-00001.arrow"]),
    ("a folder outranks file names", ["train/a.parquet", "test.parquet"]),
    ("a folder inside another split's folder", ["train/valid/x.jsonl", "train/y.jsonl"]),
    ("my-dataset.{split}.jsonl", ["my-dataset.train.jsonl", "my-dataset.dev.jsonl", "my-dataset.test.jsonl"]),
    ("cc3m-{split}-NNNN.tar", ["cc3m-train-0000.tar", "cc3m-train-0001.tar", "cc3m-validation-0000.tar"]),
    ("llava_{split}.parquet", ["llava_train.parquet", "llava_test.parquet"]),
    ("{split}_N.jsonl", ["train_0.jsonl", "train_1.jsonl", "test_0.jsonl"]),
    ("{split}.json with dev", ["train.json", "dev.json", "test.json"]),
    ("{split}.jsonl with valid", ["train.jsonl", "valid.jsonl", "test.jsonl"]),
    ("training / testing", ["training.parquet", "testing.parquet"]),
    ("data/{split}.parquet with eval", ["data/train.parquet", "data/eval.parquet"]),
    ("keyword mid-name", ["sft_train_v2.jsonl", "sft_eval_v2.jsonl"]),
    ("dash names", ["mmc4-train.jsonl", "mmc4-val.jsonl"]),
    ("space-separated names", ["my data train.jsonl", "my data test.jsonl"]),
    ("a keyword twice in a name", ["train_train.jsonl", "test.jsonl"]),
    ("data/ without shard numbers", ["data/train-abc.parquet", "data/test-abc.parquet"]),
    ("one config folder", [f"ai2d/train-00000-of-00001{H}.parquet"]),
    ("config folder with two splits", ["en/train-00000-of-00001.parquet", "en/test-00000-of-00001.parquet"]),
    ("only test_0.jsonl", ["test_0.jsonl"]),
    ("__MACOSX copy beside the data", ["train_0.jsonl", "__MACOSX/test_0.jsonl"]),
    ("capitalised keywords", ["dataset.Train.jsonl", "dataset.Test.jsonl"]),
    ("keywords inside words", ["contest_results.parquet", "trainer_logs/x.parquet", "evaluate.parquet"]),
    ("img2dataset shards", ["00000.tar", "00001.tar"]),
    ("save_to_disk shards", ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow", "state.json",
                             "dataset_info.json"]),
    ("parts naming no split", ["part-0.parquet", "part-1.parquet"]),
    ("one LLaVA JSON", ["llava_v1_5_mix665k.json"]),
    ("one JSON Lines file", ["Cambrian7M_withsystemprompt.jsonl"]),
]


def _write(root, rels):
    for rel in rels:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"")


def _hf(root) -> tuple[dict, dict]:
    """(patterns, {split: sorted relative files}) as the installed datasets resolves the folder."""
    try:
        patterns = hf.get_data_patterns(str(root))
    except hf.EmptyDatasetError:
        return {}, {}
    files = hf.DataFilesDict.from_local_or_remote(patterns, str(root))
    base = str(root) + "/"
    return ({str(s): list(p) for s, p in patterns.items()},
            {str(s): sorted({f[len(base):] for f in fl}) for s, fl in files.items()})


def test_the_table_holds_the_styles_it_claims():
    assert len(LAYOUTS) >= 30 and len({name for name, _ in LAYOUTS}) == len(LAYOUTS)


def test_constants_are_hf_datasets_own():
    assert P.SPLIT_PATTERN_SHARDED == hf.SPLIT_PATTERN_SHARDED and P.NON_WORDS_CHARS == hf.NON_WORDS_CHARS
    assert {str(k): tuple(v) for k, v in hf.SPLIT_KEYWORDS.items()} == P.SPLIT_KEYWORDS
    assert list(P.KEYWORDS_IN_FILENAME_BASE_PATTERNS) == hf.KEYWORDS_IN_FILENAME_BASE_PATTERNS
    assert list(P.KEYWORDS_IN_DIR_NAME_BASE_PATTERNS) == hf.KEYWORDS_IN_DIR_NAME_BASE_PATTERNS
    for mine, theirs in ((P.DEFAULT_PATTERNS_SPLIT_IN_FILENAME, hf.DEFAULT_PATTERNS_SPLIT_IN_FILENAME),
                         (P.DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME, hf.DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME),
                         (P.DEFAULT_PATTERNS_ALL, hf.DEFAULT_PATTERNS_ALL)):
        assert list(mine.items()) == [(str(k), v) for k, v in theirs.items()]
    # HF's order of groups, less the two that match no data file (*.eval logs, task.toml / instruction.md)
    theirs = [g for g in hf.ALL_DEFAULT_PATTERNS if g not in (hf.DEFAULT_PATTERNS_LOGS, hf.DEFAULT_PATTERNS_HARBOR)]
    assert [id(g) for g in P.ALL_DEFAULT_PATTERNS] == [id(g) for g in (
        P.DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME, P.DEFAULT_PATTERNS_SPLIT_IN_FILENAME, P.DEFAULT_PATTERNS_ALL)]
    assert theirs == [hf.DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME, hf.DEFAULT_PATTERNS_SPLIT_IN_FILENAME,
                      hf.DEFAULT_PATTERNS_ALL]
    assert not any(P.candidate(f) for f in hf.FILES_TO_IGNORE) and P.FILES_TO_IGNORE == set(hf.FILES_TO_IGNORE)
    from datasets.naming import _split_re

    assert P.SPLIT_NAME.pattern == _split_re


def test_glob_translation_matches_fsspec():
    from fsspec.utils import glob_translate

    paths = sorted({r for _, rels in LAYOUTS for r in rels} | {
        "train", "a/train", "train/", "x/y/train-2/z.tar", "[x].json", "a-b.json", "ab.json", "a/b/c.parquet"})
    patterns = [p for g in P.ALL_DEFAULT_PATTERNS for ps in g.values() for p in ps] + [
        P.SPLIT_PATTERN_SHARDED, P.SPLIT_PATTERN_SHARDED.replace("{split}", "*"), "*", "*/*.tar", "a/**/c.*",
        "?-b.json", "[!a]b.json", "[]x].json", "[x.json", "**/*[-._]*"]
    for pattern in patterns:
        theirs, mine = re.compile(glob_translate(pattern)), P.glob_regex(pattern)
        assert [p for p in paths if theirs.match(p)] == [p for p in paths if mine.match(p)], pattern


@pytest.mark.parametrize("style, rels", LAYOUTS, ids=[name for name, _ in LAYOUTS])
def test_each_naming_style_splits_as_hf_datasets_splits_it(tmp_path, style, rels):
    _write(tmp_path, rels)
    patterns, files = _hf(tmp_path)
    data = [r for r in sorted(rels) if r.endswith(splits.DATA_EXTS)]
    assert P.data_patterns(data) == patterns  # the same split names, in the same order, with the same patterns
    assert {s: sorted(f) for s, f in P.data_files(data).items()} == files
    listing = formats.fs.list_files(str(tmp_path))
    if patterns == P.DEFAULT_PATTERNS_ALL:  # names no split: read whole, whatever the split
        assert splits.found(str(tmp_path), listing) == {}
        assert splits.select(str(tmp_path), listing, "test") == listing
        return
    assert splits.found(str(tmp_path), listing) == {s: len(f) for s, f in files.items()}
    for split, want in files.items():  # what a run reads for --split NAME: that split's files, no other
        kept = splits.select(str(tmp_path), listing, split)
        assert sorted(formats.fs.relative(f, str(tmp_path)) for f in kept) == want


def test_a_shard_split_name_hf_refuses_is_refused(tmp_path):
    rels = ["data/my-data-00000-of-00001.parquet"]
    _write(tmp_path, rels)
    with pytest.raises(ValueError, match="Split name should match"):
        hf.get_data_patterns(str(tmp_path))
    with pytest.raises(ValueError, match=r"data/my-data-NNNNN-of-NNNNN: split names must match"):
        P.data_patterns(rels)


def test_split_aliases_and_the_held_out_pick():
    found = {"train": ["a"], "validation": ["b"], "test": ["c"]}
    assert [splits._wanted(s, found) for s in ("dev", "val", "eval", "Training", splits.HELD_OUT)] == [
        "validation", "validation", "test", "train", "validation"]
    shards = {"train": ["a"], "dev": ["b"]}  # a shard split named dev keeps its name; --split dev reads it
    assert splits._wanted("dev", shards) == "dev" and splits._wanted(splits.HELD_OUT, shards) == "dev"
    assert splits._wanted(splits.HELD_OUT, {"train_sft": ["a"], "test_sft": ["b"]}) == "test_sft"
    assert splits._wanted(splits.HELD_OUT, {"test_sft": ["a"], "test_gen": ["b"]}) == splits.HELD_OUT  # which one?
    with pytest.raises(ValueError, match=r"none is the one held-out split: name it, --eval-data 'R#split=NAME'"):
        splits.selection("R", ["R/data/test_sft-00000-of-00001.parquet", "R/data/test_gen-00000-of-00001.parquet"],
                         splits.HELD_OUT)


def test_a_save_to_disk_dataset_dict_has_one_folder_per_split(tmp_path):
    _write(tmp_path, ["train_sft/data-00000-of-00001.arrow", "train_sft/state.json",
                      "test_sft/data-00000-of-00001.arrow", "test_sft/state.json"])
    (tmp_path / "dataset_dict.json").write_text(json.dumps({"splits": ["train_sft", "test_sft"]}))
    listing = formats.fs.list_files(str(tmp_path))
    assert splits.found(str(tmp_path), listing) == {"test_sft": 2, "train_sft": 2}  # as load_from_disk names them
    fmt, _, files = formats.resolve(str(tmp_path), "auto", "train_sft")
    assert fmt == "arrow" and [formats.fs.relative(f, str(tmp_path)) for f in files] == [
        "train_sft/data-00000-of-00001.arrow"]


def _parquet(root, rel, ids):
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(conversations_table(len(ids), ids), root / rel)


def test_custom_splits_read_by_name_and_the_left_out_files_named(tmp_path, caplog):
    for split, n in (("train_sft", 3), ("test_sft", 1), ("train_gen", 2), ("test_gen", 1)):
        _parquet(tmp_path, f"data/{split}-00000-of-00001{H}.parquet", [f"{split}{i}" for i in range(n)])
    refused = r"\{'test_gen': 1, 'test_sft': 1, 'train_gen': 1, 'train_sft': 1\}.*no 'train'"
    with pytest.raises(ValueError, match=refused):
        read_units(str(tmp_path), DataConfig())
    cfg = DataConfig(path=str(tmp_path), split="train_sft")
    assert [r[S.SAMPLE_ID].split("#")[1] for r in raw_rows(tmp_path, cfg)] == ["train_sft0", "train_sft1",
                                                                               "train_sft2"]
    told = listing_summary(read_units(str(tmp_path), cfg), cfg)["splits"][str(tmp_path)]
    assert told["read"] == "train_sft" and told["left_out"] == {"test_gen": 1, "test_sft": 1, "train_gen": 1}
    assert sorted(told["left_out_files"]) == sorted(f"data/{s}-00000-of-00001{H}.parquet"
                                                    for s in ("test_gen", "test_sft", "train_gen"))
    assert "reads split 'train_sft'" in caplog.text and f"data/train_gen-00000-of-00001{H}.parquet" in caplog.text
    assert len(raw_rows(tmp_path, DataConfig(path=str(tmp_path), split="train_gen"))) == 2


def test_suffix_and_year_names_no_longer_train_on_the_held_out_split(tmp_path):
    _parquet(tmp_path / "a", "llava_train.parquet", ["t0", "t1"])
    _parquet(tmp_path / "a", "llava_test.parquet", ["held"])
    _parquet(tmp_path / "b", "train2017/part-0.parquet", ["t0", "t1", "t2"])
    _parquet(tmp_path / "b", "val2017/part-0.parquet", ["held"])
    for root, n in ((tmp_path / "a", 2), (tmp_path / "b", 3)):
        ids = [r[S.SAMPLE_ID] for r in raw_rows(root)]
        assert len(ids) == n and not any("held" in i for i in ids)
    cfg = Config()  # --eval-data FOLDER: its validation split (val2017/), else its test split (llava_test)
    for root in (tmp_path / "a", tmp_path / "b"):
        cfg.data = DataConfig(path=str(root), eval_data=str(root))
        ev, _ = eval_source(cfg)
        assert [r[S.SAMPLE_ID].split("#")[1] for r in raw_rows(ev.data.path, ev.data)] == ["held"]
    assert splits.configs(str(tmp_path / "b")) == []  # train2017/ and val2017/ are splits, not two configs


def _jsonl(path, ids):
    path.parent.mkdir(parents=True, exist_ok=True)
    conv = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    path.write_text("".join(json.dumps({"id": i, "conversations": conv}) + "\n" for i in ids))


def test_a_folder_of_json_lines_files_is_one_dataset_split_by_name(tmp_path):
    one = tmp_path / "dotted"
    _jsonl(one / "my-dataset.train.jsonl", ["a", "b"])
    _jsonl(one / "my-dataset.dev.jsonl", ["held"])
    (one / "dataset_info.json").write_text("{}")  # HF's metadata: never records
    assert [r[S.SAMPLE_ID] for r in raw_rows(one)] == ["my-dataset.train.jsonl:0#a", "my-dataset.train.jsonl:1#b"]
    assert [r[S.SAMPLE_ID] for r in raw_rows(one, DataConfig(path=str(one), split="validation"))] == [
        "my-dataset.dev.jsonl:0#held"]
    numbered = tmp_path / "numbered"
    _jsonl(numbered / "train_0.jsonl", ["a", "b"])
    _jsonl(numbered / "train_1.jsonl", ["c"])
    _jsonl(numbered / "test_0.jsonl", ["held"])
    fmt, _, files = formats.resolve(str(numbered))
    assert fmt == "llava" and [f.rsplit("/", 1)[1] for f in files] == ["train_0.jsonl", "train_1.jsonl"]
    assert [r[S.SAMPLE_ID] for r in raw_rows(numbered)] == ["train_0.jsonl:0#a", "train_0.jsonl:1#b",
                                                            "train_1.jsonl:0#c"]
    nested = tmp_path / "nested"  # several files: ids carry the path under the folder, so they stay unique
    _jsonl(nested / "train" / "a" / "part.jsonl", ["x"])
    _jsonl(nested / "train" / "b" / "part.jsonl", ["x"])
    assert [r[S.SAMPLE_ID] for r in raw_rows(nested)] == ["train/a/part.jsonl:0#x", "train/b/part.jsonl:0#x"]
    plain = tmp_path / "plain"  # no split names, no data.json: every JSON file, as before only one was
    _jsonl(plain / "part-0.jsonl", ["p"])
    (plain / "part-1.json").write_text(json.dumps([{"id": "q", "conversations": [
        {"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]))
    assert [r[S.SAMPLE_ID] for r in raw_rows(plain)] == ["part-0.jsonl:0#p", "part-1.json:0#q"]


def test_images_never_decide_the_split(tmp_path):
    """On purpose unlike HF (which would read the images of train2017/ as its train split and nothing else):
    only data files decide, so LLaVA's JSON beside COCO's image folders is the dataset, read whole."""
    _jsonl(tmp_path / "llava_v1_5_mix665k.jsonl", ["a"])
    _write(tmp_path, ["coco/train2017/000000000009.jpg", "coco/val2017/000000000139.jpg"])
    assert _hf(tmp_path)[1] == {"train": ["coco/train2017/000000000009.jpg"],
                                "validation": ["coco/val2017/000000000139.jpg"]}
    fmt, _, files = formats.resolve(str(tmp_path))
    assert fmt == "llava" and [f.rsplit("/", 1)[1] for f in files] == ["llava_v1_5_mix665k.jsonl"]


def test_eval_data_on_a_folder_of_train_files_warns(tmp_path, caplog):
    _parquet(tmp_path / "only", "train-00000-of-00001.parquet", ["a", "b"])
    _parquet(tmp_path / "sft", f"data/train_sft-00000-of-00001{H}.parquet", ["a", "b", "c"])
    _parquet(tmp_path / "plain", "part-0.parquet", ["a"])
    cfg = Config()
    for name, rows in (("only", 2), ("sft", 3), ("plain", 1)):
        cfg.data = DataConfig(path=str(tmp_path / name), eval_data=str(tmp_path / name))
        ev, _ = eval_source(cfg)
        with caplog.at_level(logging.WARNING, "ray_mmbatch.formats"):
            assert len(raw_rows(ev.data.path, ev.data)) == rows
    told = [r.getMessage() for r in caplog.records if "evaluation runs on training data" in r.getMessage()]
    assert [t.split(":")[0] for t in told] == [str(tmp_path / "only"), str(tmp_path / "sft")]
    assert "split 'train'" in told[0] and "split 'train_sft'" in told[1]
    assert str(tmp_path / "plain") not in caplog.text  # a folder naming no split is the held-out set it is given
