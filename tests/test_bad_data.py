"""Bad data never loses good data (issue 15): layouts real downloads have, built here, read through the
formats registry and the in-process data path (ray_mmbatch.local_batches)."""
from __future__ import annotations

import io
import json
import logging
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from ray_mmbatch import schema as S
from ray_mmbatch.config import Config, DataConfig
from ray_mmbatch.dataflow.local import local_batches
from ray_mmbatch.formats.units import count_samples, read_units

IMG = S.IMAGE_PLACEHOLDER
CONV = [{"from": "human", "value": f"{IMG}\nWhat colour is it?"}, {"from": "gpt", "value": "It is red."}]
IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def png(side: int = 40, colour=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), colour).save(buf, format="PNG")
    return buf.getvalue()


def raw_rows(path, data_cfg: DataConfig | None = None) -> list[dict]:
    """Every RAW row of a dataset, read in-process by the Ray read's own functions."""
    units, read_fn, kwargs = read_units(str(path), data_cfg or DataConfig())
    rows = []
    for unit in units:
        rows += read_fn(pa.Table.from_pylist([dict(unit, end=False)]), **kwargs).to_pylist()
    return rows


def trained_and_skipped(path, oversize: str = "truncate", **data) -> tuple[list[str], dict[str, str]]:
    """(sample ids trained, {id: reason} skipped) over one epoch of local_batches."""
    cfg = Config()
    cfg.data = DataConfig(path=str(path), **data)
    cfg.budget.max_tokens = 1024
    cfg.budget.oversize = oversize
    trained, skipped = [], {}
    for item in local_batches(cfg, with_skips=True):
        if "skipped" in item:
            skipped.update({s.sample_id: s.text for s in item["skipped"]})
        else:
            trained += list(item["sample_ids"])
    return trained, skipped


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def conversations_table(n: int, ids: list | None = None) -> pa.Table:
    cols = {"images": pa.array([[{"bytes": png(40 + i), "path": f"{i}.png"}] for i in range(n)],
                               pa.list_(IMAGE_STRUCT)),
            "conversations": pa.array([CONV] * n)}
    if ids is not None:
        cols["id"] = pa.array(ids)
    return pa.table(cols)


# ------------------------------------------------------------------ ids unique by construction
def test_hub_layout_same_file_names_in_two_folders_trains_every_sample(tmp_path):
    for sub in ("cc3m", "coco"):
        (tmp_path / sub).mkdir()
        pq.write_table(conversations_table(8, [f"{k}" for k in range(8)]),  # same ids in both, too
                       tmp_path / sub / "train-00000-of-00001.parquet", row_group_size=3)
    ids = [r[S.SAMPLE_ID] for r in raw_rows(tmp_path)]  # a folder of configs: one source per config
    assert len(set(ids)) == len(ids) == 16
    assert ids[0] == "cc3m:train-00000-of-00001.parquet:0#0" and ids[8] == "coco:train-00000-of-00001.parquet:0#0"
    trained, skipped = trained_and_skipped(tmp_path)
    assert sorted(trained) == sorted(ids) and not skipped  # 16 trained, each once


def test_webdataset_keys_restarting_in_every_shard_stay_apart(tmp_path):
    for shard in range(3):
        write_tar(tmp_path / f"shard-{shard}.tar",
                  [m for k in range(4) for m in ((f"{k:06d}.json", json.dumps({"conversations": CONV}).encode()),
                                                 (f"{k:06d}.png", png(40 + k)))])
    ids = [r[S.SAMPLE_ID] for r in raw_rows(tmp_path)]
    assert len(set(ids)) == len(ids) == 12 and ids[4] == "shard-1.tar/000000"
    trained, skipped = trained_and_skipped(tmp_path)
    assert sorted(trained) == sorted(ids) and not skipped


def test_llava_repeated_ids_are_samples_of_their_own_with_one_warning(tmp_path, caplog):
    (tmp_path / "a.png").write_bytes(png())
    ids = ["x", "x", 1, "1", "y", "x"]
    records = [{"id": i, "image": "a.png", "conversations": CONV} for i in ids]
    (tmp_path / "data.json").write_text(json.dumps(records))
    with caplog.at_level(logging.WARNING, logger="ray_mmbatch.formats"):
        rows = raw_rows(tmp_path)
    got = [r[S.SAMPLE_ID] for r in rows]
    assert got == ["data.json:0#x", "data.json:1#x", "data.json:2#1", "data.json:3#1", "data.json:4#y", "data.json:5#x"]
    warnings = [r.getMessage() for r in caplog.records if "share their id" in r.getMessage()]
    assert len(warnings) == 1 and "5 records" in warnings[0] and "'x' x3" in warnings[0]
    trained, skipped = trained_and_skipped(tmp_path)
    assert sorted(trained) == sorted(got) and not skipped
    assert count_samples(str(tmp_path), DataConfig()) == 6


# ------------------------------------------------------------------ one bad file never stops the run
class _Deadline:
    """Fail (instead of hanging the suite) if the block takes longer than ``s`` seconds (a FIFO opened)."""

    def __init__(self, s: int):
        self.s = s

    def __enter__(self):
        import signal

        def boom(*_):
            raise TimeoutError("reading hung (a FIFO was opened?)")
        self.old = signal.signal(signal.SIGALRM, boom)
        signal.alarm(self.s)

    def __exit__(self, *exc):
        import signal

        signal.alarm(0)
        signal.signal(signal.SIGALRM, self.old)


def _file_skips(rows) -> dict[str, str]:
    return {r[S.SAMPLE_ID]: r[S.READ_ERROR] for r in rows if r[S.READ_ERROR].startswith(S.SKIP_UNREADABLE_FILE)}


def _parquet_with_bad_files(tmp_path: Path) -> list[str]:
    """a-good.parquet (6 rows) + one file of each bad kind (their names returned) + hidden files."""
    import os

    good = conversations_table(6, [f"g{i}" for i in range(6)])
    pq.write_table(good, tmp_path / "a-good.parquet", row_group_size=4)
    (tmp_path / "b-corrupt.parquet").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, np.uint8).tobytes())
    (tmp_path / "c-notparquet.parquet").write_text("id,text\n1,hello\n")
    blob = io.BytesIO()
    pq.write_table(good, blob)
    (tmp_path / "d-truncated.parquet").write_bytes(blob.getvalue()[:-100])
    pq.write_table(pa.table({"id": ["i0"], "images": pa.array([7]), "conversations": pa.array([CONV])}),
                   tmp_path / "e-int-images.parquet")
    pq.write_table(pa.table({"key": ["c0"], "image": pa.array([{"bytes": png(), "path": "c.png"}], IMAGE_STRUCT),
                             "text": ["a caption"]}), tmp_path / "f-caption-style.parquet")
    os.mkfifo(tmp_path / "g-fifo.parquet")
    os.symlink(tmp_path / "gone.parquet", tmp_path / "h-dangling.parquet")
    (tmp_path / "._a-good.parquet").write_bytes(b"\x00\x05\x16\x07AppleDouble")  # macOS: hidden, not data
    (tmp_path / ".cache").mkdir()
    pq.write_table(good, tmp_path / ".cache" / "copy.parquet")
    return ["b-corrupt.parquet", "c-notparquet.parquet", "d-truncated.parquet", "e-int-images.parquet",
            "f-caption-style.parquet", "g-fifo.parquet", "h-dangling.parquet"]


def test_parquet_bad_files_are_reported_and_the_rest_trains(tmp_path):
    bad = _parquet_with_bad_files(tmp_path)
    with _Deadline(60):
        rows = raw_rows(tmp_path)
        trained, skipped = trained_and_skipped(tmp_path)
    files = _file_skips(rows)
    assert sorted(files) == bad  # reported by path, each once; hidden files are not data
    assert "image column 'images' is int64" in files["e-int-images.parquet"]
    assert "no text column 'conversations'" in files["f-caption-style.parquet"]
    assert "not a regular file" in files["g-fifo.parquet"] and "not a regular file" in files["h-dangling.parquet"]
    assert [r[S.SAMPLE_ID] for r in rows if r[S.SAMPLE_ID] not in files] == \
        [f"a-good.parquet:{i}#g{i}" for i in range(6)]
    assert sorted(trained) == [f"a-good.parquet:{i}#g{i}" for i in range(6)]
    assert {k: v.split(":")[0] for k, v in skipped.items()} == {f: S.SKIP_UNREADABLE_FILE for f in bad}
    assert count_samples(str(tmp_path), DataConfig()) == len(rows) == 6 + len(bad)


def test_no_file_with_the_text_column_fails_at_start(tmp_path):
    pq.write_table(pa.table({"key": ["c0"], "text": ["a caption"]}), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match="text column 'conversations' not found in any file"):
        read_units(str(tmp_path), DataConfig())


def test_webdataset_bad_shards_and_names(tmp_path):
    import os

    record = json.dumps({"conversations": CONV}).encode()
    write_tar(tmp_path / "a.tar", [("k0.json", record), ("k0.png", png())])
    with tarfile.open(tmp_path / "b-names.tar", "w", format=tarfile.GNU_FORMAT, encoding="utf-8",
                      errors="surrogateescape") as tar:
        for name, data in ((b"caf\xe9.json", record), (b"caf\xe9.png", png())):
            info = tarfile.TarInfo(name.decode("utf-8", "surrogateescape"))
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    os.mkfifo(tmp_path / "c-fifo.tar")
    os.symlink(tmp_path / "nowhere.tar", tmp_path / "d-dangling.tar")
    (tmp_path / "e-empty.tar").write_bytes(b"")
    with _Deadline(60):
        rows = raw_rows(tmp_path)
        trained, skipped = trained_and_skipped(tmp_path)
    by_id = {r[S.SAMPLE_ID]: r for r in rows}
    assert by_id["b-names.tar/caf\\xe9"][S.READ_ERROR] == ""  # escaped, readable, trained
    assert len(by_id["b-names.tar/caf\\xe9"][S.IMAGES]) == 1
    assert sorted(_file_skips(rows)) == ["c-fifo.tar", "d-dangling.tar"]
    assert sorted(trained) == ["a.tar/k0", "b-names.tar/caf\\xe9"]
    assert set(skipped) == {"c-fifo.tar", "d-dangling.tar", "e-empty.tar:unreadable-tail"}


def test_llava_ids_and_paths_that_are_not_valid_text(tmp_path):
    (tmp_path / "a.png").write_bytes(png())
    text = ('[{"id": "bad\\ud800id", "image": "a.png", "conversations": %s},'
            ' {"id": "nul", "image": "a\\u0000.png", "conversations": %s},'
            ' {"id": "ok", "image": "a.png", "conversations": %s}]') % ((json.dumps(CONV),) * 3)
    (tmp_path / "data.json").write_text(text)
    rows = raw_rows(tmp_path)
    ids = [r[S.SAMPLE_ID] for r in rows]
    assert ids == ["data.json:0#bad\\ud800id", "data.json:1#nul", "data.json:2#ok"]
    assert rows[0][S.READ_ERROR] == "" and rows[2][S.READ_ERROR] == ""
    assert rows[1][S.READ_ERROR].startswith(S.SKIP_MALFORMED_RECORD) and "NUL" in rows[1][S.READ_ERROR]
    pa.Table.from_pylist(rows)  # every id and error is storable text
    trained, skipped = trained_and_skipped(tmp_path)
    assert sorted(trained) == [ids[0], ids[2]] and list(skipped) == [ids[1]]


@pytest.mark.ray
def test_inspect_counts_skipped_files_as_training_does(ray_cluster, tmp_path):
    from ray_mmbatch.dataflow.inspection import inspect_dataset

    bad = _parquet_with_bad_files(tmp_path)
    cfg = Config()
    cfg.data = DataConfig(path=str(tmp_path))
    with _Deadline(120):
        summary = inspect_dataset(cfg)
    trained, skipped = trained_and_skipped(tmp_path)
    assert summary["skipped_files"] == len(bad) == sum(r.startswith(S.SKIP_UNREADABLE_FILE) for r in skipped.values())
    assert sorted(summary["skipped_file_reasons"]) == bad
    assert summary["samples_read"] == summary["samples_ok"] == len(trained) == 6


# ------------------------------------------------------------------ formats people already have
TRL = [{"role": "User", "content": [{"type": "image", "text": None}, {"type": "text", "text": "What colour is it?"}]},
       {"role": "ASSISTANT", "content": [{"type": "text", "text": "It is red."}]}]
SHAREGPT = [{"from": "Human", "value": f"{IMG}What colour is it?"}, {"from": "GPT", "value": "It is red."}]


def _tokens(path, **data) -> dict[str, tuple[int, int]]:
    """sample id -> (tokens, images) of every trained sample (local_batches)."""
    cfg = Config()
    cfg.data = DataConfig(path=str(path), **data)
    cfg.budget.max_tokens = 1024
    out = {}
    for b in local_batches(cfg):
        lengths = np.diff(b["cu_seqlens"]) if "cu_seqlens" in b else None
        for j, sid in enumerate(b["sample_ids"]):
            out[sid] = int(lengths[j]) if lengths is not None else -1
    return out


def test_hf_trl_messages_layout_in_every_format(tmp_path):
    image = png()
    ref = tmp_path / "ref"
    ref.mkdir()
    pq.write_table(pa.table({"images": pa.array([[{"bytes": image, "path": "a.png"}]], pa.list_(IMAGE_STRUCT)),
                             "conversations": pa.array([SHAREGPT])}), ref / "r.parquet")
    [expected] = _tokens(ref).values()
    assert expected > 20
    # Parquet: a `messages` column (list of {role, content parts}) beside `images`
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"images": pa.array([[{"bytes": image, "path": "a.png"}]], pa.list_(IMAGE_STRUCT)),
                             "messages": pa.array([TRL])}), tmp_path / "pq" / "train.parquet")
    # Parquet: content as plain strings, roles in capitals
    (tmp_path / "pq_str").mkdir()
    pq.write_table(pa.table({"images": pa.array([[{"bytes": image, "path": "a.png"}]], pa.list_(IMAGE_STRUCT)),
                             "messages": pa.array([[{"role": "USER", "content": f"{IMG}What colour is it?"},
                                                    {"role": "Assistant", "content": "It is red."}]])}),
                   tmp_path / "pq_str" / "train.parquet")
    # Parquet: conversations stored as a JSON string
    (tmp_path / "pq_json").mkdir()
    pq.write_table(pa.table({"images": pa.array([[{"bytes": image, "path": "a.png"}]], pa.list_(IMAGE_STRUCT)),
                             "conversations": [json.dumps(SHAREGPT)]}), tmp_path / "pq_json" / "train.parquet")
    # WebDataset: KEY.json with "messages"
    (tmp_path / "wds").mkdir()
    write_tar(tmp_path / "wds" / "s.tar", [("k.json", json.dumps({"messages": TRL}).encode()), ("k.png", image)])
    # LLaVA-style JSON with "messages", and one with conversations as a JSON string
    for name, record in (("llava", {"id": "m", "image": "a.png", "messages": TRL}),
                         ("llava_json", {"id": "s", "image": "a.png", "conversations": json.dumps(SHAREGPT)})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.png").write_bytes(image)
        (tmp_path / name / "data.json").write_text(json.dumps([record]))
    for name in ("pq", "pq_str", "pq_json", "wds", "llava", "llava_json"):
        got = _tokens(tmp_path / name)
        assert list(got.values()) == [expected], (name, got)


def test_jsonl_named_json_gets_the_right_extension_named(tmp_path):
    lines = [json.dumps({"id": str(i), "conversations": CONV}) for i in range(3)]
    (tmp_path / "data.json").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"JSON Lines.*name it data\.jsonl"):
        read_units(str(tmp_path), DataConfig())


# ------------------------------------------------------------------ samples that lost their image
TEXT_ONLY = [{"from": "human", "value": "What is 2 + 2?"}, {"from": "gpt", "value": "4."}]


def _reasons(skipped: dict[str, str]) -> dict[str, str]:
    return {sid: why.split(":")[0] for sid, why in skipped.items()}


def test_parquet_lost_images_are_placeholder_mismatch_and_columns_are_per_file(tmp_path):
    # sorted first: a file without the images column (its text-only row trains, its <image> row is caught)
    pq.write_table(pa.table({"conversations": pa.array([CONV, TEXT_ONLY])}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"images": pa.array([[{"bytes": png(), "path": "x.png"}], None], pa.list_(IMAGE_STRUCT)),
                             "conversations": pa.array([CONV, CONV])}), tmp_path / "b.parquet")
    trained, skipped = trained_and_skipped(tmp_path)
    assert sorted(trained) == ["a.parquet:1", "b.parquet:0"]  # b's images were not dropped for a's schema
    assert _reasons(skipped) == {"a.parquet:0": S.SKIP_PLACEHOLDER_MISMATCH, "b.parquet:1": S.SKIP_PLACEHOLDER_MISMATCH}


def test_webdataset_lost_images_never_train_as_text(tmp_path):
    record = json.dumps({"conversations": CONV}).encode()
    buf = tmp_path / "s.tar"
    with tarfile.open(buf, "w") as tar:
        for name, data in (("ok.json", record), ("ok.png", png()), ("alone.json", record),
                           ("text.json", json.dumps({"conversations": TEXT_ONLY}).encode()), ("link.json", record)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, kind in (("link.png", tarfile.SYMTYPE), ("dev.png", tarfile.CHRTYPE)):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, "ok.png"
            tar.addfile(info)
        info = tarfile.TarInfo("dev.json")
        info.size = len(record)
        tar.addfile(info, io.BytesIO(record))
    trained, skipped = trained_and_skipped(tmp_path)
    assert sorted(trained) == ["s.tar/ok", "s.tar/text"]
    assert _reasons(skipped) == {"s.tar/alone": S.SKIP_PLACEHOLDER_MISMATCH, "s.tar/link": S.SKIP_MISSING_FILE,
                                 "s.tar/dev": S.SKIP_MISSING_FILE}
    assert "symlink" in skipped["s.tar/link"]


def test_llava_record_without_image_field(tmp_path):
    (tmp_path / "a.png").write_bytes(png())
    records = [{"id": "ok", "image": "a.png", "conversations": CONV}, {"id": "lost", "conversations": CONV},
               {"id": "text", "conversations": TEXT_ONLY},
               {"id": "answer", "conversations": [{"from": "human", "value": "How is an image marked?"},
                                                  {"from": "gpt", "value": f"With {IMG}."}]}]
    (tmp_path / "data.json").write_text(json.dumps(records))
    trained, skipped = trained_and_skipped(tmp_path)
    assert sorted(trained) == ["data.json:0#ok", "data.json:2#text", "data.json:3#answer"]
    assert _reasons(skipped) == {"data.json:1#lost": S.SKIP_PLACEHOLDER_MISMATCH}


def test_webdataset_key_repeated_later_in_one_shard_is_another_sample(tmp_path):
    record = json.dumps({"conversations": CONV}).encode()
    write_tar(tmp_path / "s.tar", [("a.json", record), ("a.png", png(40)), ("b.json", record), ("b.png", png(41)),
                                   ("a.json", record), ("a.png", png(42))])
    rows = raw_rows(tmp_path)
    assert [r[S.SAMPLE_ID] for r in rows] == ["s.tar/a", "s.tar/b", "s.tar/a~2"]
    assert [len(r[S.IMAGES]) for r in rows] == [1, 1, 1] and rows[0][S.IMAGES] != rows[2][S.IMAGES]
    assert count_samples(str(tmp_path), DataConfig()) == 3


def test_local_batches_shards_split_the_units_without_loss_or_overlap(tmp_path):
    """shard=(i, n) (one DataLoader worker's share): the shards' trained and skipped samples are
    disjoint and together exactly the whole stream's, each shard flushing its own carry."""
    from ray_mmbatch.synthetic.generate import generate_dataset

    generate_dataset(str(tmp_path / "d"), 60, "parquet", seed=5, shard_size=12, workers=1, bad_per_kind=1)
    whole_trained, whole_skipped = trained_and_skipped(tmp_path / "d")
    cfg = Config()
    cfg.data = DataConfig(path=str(tmp_path / "d"))
    cfg.budget.max_tokens, cfg.budget.oversize = 1024, "truncate"
    parts = []
    for i in range(3):
        trained, skipped = [], []
        for item in local_batches(cfg, with_skips=True, shard=(i, 3)):
            if "skipped" in item:
                skipped += [s.sample_id for s in item["skipped"]]
            else:
                trained += list(item["sample_ids"])
        assert trained or skipped, f"shard {i} read nothing"
        parts.append(trained + skipped)
    flat = [sid for p in parts for sid in p]
    assert len(flat) == len(set(flat)), "a sample in two shards"
    assert sorted(flat) == sorted(whole_trained + list(whole_skipped))
    with pytest.raises(ValueError, match="shard"):
        next(local_batches(cfg, shard=(3, 3)))
