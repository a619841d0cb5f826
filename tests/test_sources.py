"""Pure format adapters (ray_mmbatch/formats): Parquet tables, tar shards and LLaVA records -> RAW rows (no Ray)."""
from __future__ import annotations

import io
import json
import os
import stat
import tarfile
from pathlib import Path

import pyarrow as pa
import pytest

from ray_mmbatch import schema
from ray_mmbatch.config import DataConfig
from ray_mmbatch.formats import fs as formats_fs
from ray_mmbatch.formats import webdataset
from ray_mmbatch.formats.llava import llava_rows, resolve_image_path
from ray_mmbatch.formats.parquet import parquet_rows
from ray_mmbatch.formats.records import RAW_ARROW_SCHEMA, conversations_to_json

CONV = [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A cat."}]


def webdataset_samples(tar: bytes, shard_name: str) -> list[dict]:
    """RAW rows of one tar shard given as bytes (ids ``<shard_name>/<key>``)."""
    return webdataset.rows_of_stream(io.BytesIO(tar), shard_name, DataConfig())


def test_conversations_validated_and_normalized():
    text, err = conversations_to_json([{"from": "user", "value": "hi", "extra": 1},
                                       {"from": "assistant", "value": "yo"}])
    assert err == "" and json.loads(text) == [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    for bad, detail in [(None, "missing"), ("hello", "not a list"), ([{"value": "x"}], "role"),
                        ([{"from": "gpt", "value": 3}], "value is int"), (["x"], "not an object")]:
        text, err = conversations_to_json(bad)
        assert text == "[]" and err.startswith(schema.SKIP_MALFORMED_RECORD) and detail in err
    assert conversations_to_json([]) == ("[]", "")  # empty is well-formed; measure calls it empty_text


def test_lone_surrogate_survives_as_escaped_json():
    text, err = conversations_to_json([{"from": "gpt", "value": "a\ud800b"}])
    assert err == "" and text.isascii()
    text.encode("utf-8")  # Arrow can store it
    assert json.loads(text)[0]["value"] == "a\ud800b"  # the measure stage still sees the surrogate
    assert json.loads(conversations_to_json([{"from": "gpt", "value": "é"}])[0])[0]["value"] == "é"


def _rows(table: pa.Table) -> list[dict]:
    assert table.schema == RAW_ARROW_SCHEMA
    return table.to_pylist()


def test_parquet_rows_hf_style_lists_structs_and_missing():
    images = pa.array([[{"bytes": b"A", "path": "a.jpg"}, {"bytes": b"B", "path": None}], [],
                       [{"bytes": None, "path": "gone.jpg"}]],
                      pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())])))
    convs = pa.array([CONV, [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}], CONV])
    table = pa.table({"id": ["x", None, "z"], "images": images, "conversations": convs})
    rows = _rows(parquet_rows(table, DataConfig(), file_name="f.parquet", row_offset=10))
    assert [r[schema.SAMPLE_ID] for r in rows] == ["f.parquet:10#x", "f.parquet:11", "f.parquet:12#z"]
    assert rows[0][schema.IMAGES] == [b"A", b"B"]
    assert rows[0][schema.IMAGE_REFS] == ["a.jpg", "f.parquet:10#x#1"]
    assert rows[1][schema.IMAGES] == [] and rows[1][schema.READ_ERROR] == ""
    assert rows[2][schema.READ_ERROR].startswith(schema.SKIP_MISSING_FILE) and rows[2][schema.IMAGES] == []
    assert json.loads(rows[0][schema.CONVERSATIONS]) == CONV


def test_parquet_rows_custom_columns_single_struct_plain_text_no_id():
    image = pa.array([{"bytes": b"P", "path": "p.png"}, None],
                     pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    table = pa.table({"pic": image, "caption": ["a red circle", None]})
    cfg = DataConfig(image_column="pic", text_column="caption", id_column="uid")
    rows = _rows(parquet_rows(table, cfg, file_name="dir/c.parquet", row_offset=0))
    assert [r[schema.SAMPLE_ID] for r in rows] == ["dir/c.parquet:0", "dir/c.parquet:1"]
    assert json.loads(rows[0][schema.CONVERSATIONS]) == [{"from": "gpt", "value": "a red circle"}]
    assert rows[0][schema.IMAGES] == [b"P"]
    assert rows[1][schema.READ_ERROR].startswith(schema.SKIP_MALFORMED_RECORD)
    # raw binary image column and no image column at all
    raw = _rows(parquet_rows(pa.table({"id": ["q"], "image": [b"RAW"], "text": ["t"]}),
                             DataConfig(image_column="image", text_column="text"), row_offset=0))
    assert raw[0][schema.IMAGES] == [b"RAW"]
    none = _rows(parquet_rows(pa.table({"id": ["q"], "text": ["t"]}), DataConfig(text_column="text"), row_offset=0))
    assert none[0][schema.IMAGES] == [] and none[0][schema.READ_ERROR] == ""
    auto = _rows(parquet_rows(table, DataConfig(), file_name="c.parquet"))  # a caption column, found by name
    assert json.loads(auto[0][schema.CONVERSATIONS]) == [{"from": "gpt", "value": "a red circle"}]
    assert auto[0][schema.IMAGES] == []  # "pic" is no image column name it looks for
    with pytest.raises(ValueError, match="text column"):
        parquet_rows(table.drop_columns(["caption"]).append_column("note", pa.array([1, 2])), DataConfig())
    assert [r[schema.SAMPLE_ID] for r in _rows(parquet_rows(table, cfg, file_name="c.parquet"))] == \
        ["c.parquet:0", "c.parquet:1"]


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _json(sid: str, conv=CONV) -> bytes:
    return json.dumps({"id": sid, "conversations": conv}).encode()


def test_webdataset_groups_by_key_and_orders_extra_images_numerically():
    data = _tar([("d/k1.json", _json("one")), ("d/k1.png", b"I0"), ("d/k1.10.jpg", b"I10"), ("d/k1.2.png", b"I2"),
                 ("d/k1.cls", b"3"), ("k2.txt", b"just a caption"), ("k2.jpg", b"J"),
                 ("k3.json", b'{"id": "three", "conversations": [{"fr'), ("k3.jpg", b"X"),
                 ("k4.png", b"orphan"), ("k5.json", _json("five", "not a list")),
                 ("k6.json", json.dumps({"text": "plain"}).encode())])
    rows = {r[schema.SAMPLE_ID]: r for r in webdataset_samples(data, "s.tar")}
    assert list(rows) == ["s.tar/d/k1#one", "s.tar/k2", "s.tar/k3", "s.tar/k4", "s.tar/k5#five", "s.tar/k6"]
    one = rows["s.tar/d/k1#one"]
    assert one[schema.IMAGES] == [b"I0", b"I2", b"I10"]
    assert one[schema.IMAGE_REFS] == ["s.tar/d/k1.png", "s.tar/d/k1.2.png", "s.tar/d/k1.10.jpg"]
    assert json.loads(rows["s.tar/k2"][schema.CONVERSATIONS]) == [{"from": "gpt", "value": "just a caption"}]
    for sid in ("s.tar/k3", "s.tar/k4", "s.tar/k5#five"):
        assert rows[sid][schema.READ_ERROR].startswith(schema.SKIP_MALFORMED_RECORD), sid
    assert rows["s.tar/k6"][schema.READ_ERROR] == ""


def test_webdataset_truncated_tar_keeps_rows_and_reports_the_tail():
    data = _tar([(f"k{i}.json", _json(f"s{i}")) for i in range(20)] + [("big.png", b"x" * 5000)])
    rows = webdataset_samples(data[: 20 * 1024 + 512 + 1000], "cut.tar")  # cut inside big.png
    assert len(rows) == 22 and [r[schema.SAMPLE_ID] for r in rows[:20]] == [f"cut.tar/k{i}#s{i}" for i in range(20)]
    # the member being read when the shard ended is its sample's problem, not a sample with fewer images
    assert rows[20][schema.SAMPLE_ID] == "cut.tar/big" and "cut off" in rows[20][schema.READ_ERROR]
    rows = rows[:20] + rows[21:]
    assert (rows[-1][schema.READ_ERROR].startswith(schema.SKIP_MALFORMED_RECORD)
            and "cut.tar" in rows[-1][schema.READ_ERROR])


@pytest.fixture
def llava_root(tmp_path: Path) -> Path:
    root = tmp_path / "ds"
    (root / "images").mkdir(parents=True)
    (root / "images" / "a.jpg").write_bytes(b"AAA")
    (root / "images" / "b.png").write_bytes(b"BBB")
    (root / "images" / "sub").mkdir()
    (tmp_path / "secret.jpg").write_bytes(b"SECRET")
    os.symlink(tmp_path / "secret.jpg", root / "images" / "escape.jpg")
    os.symlink(root / "images" / "a.jpg", root / "images" / "inside.jpg")
    return root


def test_llava_rows_resolve_paths_safely(llava_root: Path, monkeypatch):
    opened = []
    real_open = open
    monkeypatch.setattr(formats_fs, "open", lambda p, *a, **k: opened.append(p) or real_open(p, *a, **k), raising=False)
    real_os_open = os.open

    def os_open(p, *a, **k):  # llava's one-open read of plain files (O_NOFOLLOW): the regular files it opens
        fd = real_os_open(p, *a, **k)
        if stat.S_ISREG(os.fstat(fd).st_mode):
            opened.append(p)
        return fd

    monkeypatch.setattr(os, "open", os_open)
    records = [
        {"id": "ok", "image": "images/a.jpg", "conversations": CONV},
        {"id": "many", "image": ["images/b.png", "images/inside.jpg"], "conversations": CONV},
        {"id": "dotdot", "image": "images/../../secret.jpg", "conversations": CONV},
        {"id": "abs", "image": str(llava_root.parent / "secret.jpg"), "conversations": CONV},
        {"id": "link", "image": "images/escape.jpg", "conversations": CONV},
        {"id": "gone", "image": "images/nope.jpg", "conversations": CONV},
        {"id": "dir", "image": "images/sub", "conversations": CONV},
        {"id": "badfield", "image": 7, "conversations": CONV},
        ["not", "a", "record"],
        {"image": "images/a.jpg", "conversations": CONV},
        {"id": 42, "conversations": [{"from": "gpt", "value": "text only"}]},
    ]
    rows = {r[schema.SAMPLE_ID].partition("#")[2] or r[schema.SAMPLE_ID]: r
            for r in llava_rows(records, str(llava_root), file_name="data.json", row_offset=100)}
    assert list(rows) == ["ok", "many", "dotdot", "abs", "link", "gone", "dir", "badfield", "data.json:108",
                          "data.json:109", "42"]
    assert rows["ok"][schema.SAMPLE_ID] == "data.json:100#ok"
    assert rows["ok"][schema.IMAGES] == [b"AAA"] and rows["many"][schema.IMAGES] == [b"BBB", b"AAA"]
    expect = {"dotdot": schema.SKIP_PATH_OUTSIDE_ROOT, "abs": schema.SKIP_PATH_OUTSIDE_ROOT,
              "link": schema.SKIP_PATH_OUTSIDE_ROOT, "gone": schema.SKIP_MISSING_FILE, "dir": schema.SKIP_MISSING_FILE,
              "badfield": schema.SKIP_MALFORMED_RECORD, "data.json:108": schema.SKIP_MALFORMED_RECORD}
    for sid, reason in expect.items():
        assert rows[sid][schema.READ_ERROR].startswith(reason), (sid, rows[sid][schema.READ_ERROR])
        assert rows[sid][schema.IMAGES] == []
    assert rows["data.json:109"][schema.IMAGES] == [b"AAA"] and rows["42"][schema.READ_ERROR] == ""
    assert not any("secret" in str(p) for p in opened)  # refused paths are never opened
    assert len(opened) == 4


def test_resolve_image_path_never_accepts_escapes(llava_root: Path):
    for ref in ("../secret.jpg", "images/../../secret.jpg", "/etc/passwd", "images/escape.jpg", "./../ds2/x"):
        path, err = resolve_image_path(ref, str(llava_root))
        assert path is None and err.startswith(schema.SKIP_PATH_OUTSIDE_ROOT), ref
    path, err = resolve_image_path("images/./a.jpg", str(llava_root))
    assert err == "" and path == os.path.realpath(llava_root / "images" / "a.jpg")
