"""Write generated samples as one shard of Parquet, WebDataset or LLaVA, byte-deterministically.

Layouts (what users already have)::

    parquet     train-00000-of-000NN.parquet   id: string,
                    images: list<struct<bytes: binary, path: string>> ([] = text-only),
                    conversations: list<struct<from: string, value: string>>
    caption     train-00000-of-000NN.parquet   key: string, image: struct<bytes, path> (null = text-only),
                    text: string (the answers joined by newlines; only the first image is kept)
    webdataset  shard-00000.tar   KEY.json {"id", "conversations"}, KEY.jpg|png, KEY.1.jpg, KEY.2.png ...
    llava       data.json  [{"id", "image": "images/00000/KEY.jpg" | [...], "conversations"}], images/...

Hostile kinds replace one piece through ``Sample.overrides``:
``parquet_null_bytes`` (image struct with bytes null), ``wds_json`` (raw bytes
of KEY.json), ``wds_no_json`` (image members without KEY.json), ``llava_image``
(the "image" field, file not written), ``llava_symlink`` (image file is a
symlink to that target), ``llava_record`` (the whole record), ``llava_no_id``.

Determinism: tar members have mtime 0 and uid/gid 0; JSON is ASCII-escaped
(which also lets lone surrogates through, as real JSON files can carry them).
"""
from __future__ import annotations

import io
import json
import os
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq

from ray_mmbatch.synthetic.draw import Sample

IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
TURN_STRUCT = pa.struct([("from", pa.string()), ("value", pa.string())])
PARQUET_SCHEMA = pa.schema([("id", pa.string()), ("images", pa.list_(IMAGE_STRUCT)),
                            ("conversations", pa.list_(TURN_STRUCT))])
CAPTION_SCHEMA = pa.schema([("key", pa.string()), ("image", IMAGE_STRUCT), ("text", pa.string())])
LLAVA_INDEX = "data.json"
ROW_GROUP_SIZE = 128  # several row groups per shard so readers can split a shard


def _image_name(s: Sample, k: int) -> str:
    return f"{s.sample_id}.{s.images[k].ext}" if k == 0 else f"{s.sample_id}_{k}.{s.images[k].ext}"


def _image_structs(s: Sample) -> list[dict]:
    null = s.overrides.get("parquet_null_bytes", False)
    return [{"bytes": None if null else im.data, "path": _image_name(s, k)} for k, im in enumerate(s.images)]


def _parquet_name(shard: int, n_shards: int) -> str:
    return f"train-{shard:05d}-of-{n_shards:05d}.parquet"


def write_parquet_shard(out: str, shard: int, n_shards: int, samples: list[Sample]) -> dict:
    table = pa.Table.from_pylist(
        [{"id": s.sample_id, "images": _image_structs(s), "conversations": s.conversations} for s in samples],
        schema=PARQUET_SCHEMA)
    name = _parquet_name(shard, n_shards)
    pq.write_table(table, os.path.join(out, name), row_group_size=ROW_GROUP_SIZE,
                   use_dictionary=False)
    return {"paths": [name], "ids": [f"{name}:{row}#{s.sample_id}" for row, s in enumerate(samples)]}


def caption_text(conversations) -> str | None:
    """The answers joined by newlines; None when a turn is not a proper {from, value: str} dict."""
    if not isinstance(conversations, list):
        return None
    answers = []
    for turn in conversations:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            return None
        if turn.get("from") == "gpt":
            answers.append(turn["value"])
    return "\n".join(answers)


def write_caption_shard(out: str, shard: int, n_shards: int, samples: list[Sample]) -> dict:
    rows = [{"key": s.sample_id, "image": (_image_structs(s) or [None])[0], "text": caption_text(s.conversations)}
            for s in samples]
    name = _parquet_name(shard, n_shards)
    pq.write_table(pa.Table.from_pylist(rows, schema=CAPTION_SCHEMA), os.path.join(out, name),
                   row_group_size=ROW_GROUP_SIZE,
                   use_dictionary=False)
    return {"paths": [name], "ids": [f"{name}:{row}#{s.sample_id}" for row, s in enumerate(samples)]}


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def write_webdataset_shard(out: str, shard: int, n_shards: int, samples: list[Sample]) -> dict:
    name = f"shard-{shard:05d}.tar"
    with open(os.path.join(out, name), "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for s in samples:
            key = s.sample_id
            if not s.overrides.get("wds_no_json"):
                record = s.overrides.get("wds_json") or json.dumps(
                    {"id": key, "conversations": s.conversations}, ensure_ascii=True).encode()
                _add_member(tar, f"{key}.json", record)
            for k, im in enumerate(s.images):
                _add_member(tar, f"{key}.{im.ext}" if k == 0 else f"{key}.{k}.{im.ext}", im.data)
    return {"paths": [name], "ids": [f"{name}/{s.sample_id}" for s in samples]}


def write_llava_shard(out: str, shard: int, n_shards: int, samples: list[Sample]) -> dict:
    """Write this shard's image files; return its records (data.json is written once, by the driver)."""
    folder = f"images/{shard:05d}"
    os.makedirs(os.path.join(out, folder), exist_ok=True)
    records, ids = [], []
    for s in samples:
        refs = []
        for k, im in enumerate(s.images):
            rel = f"{folder}/{_image_name(s, k)}"
            path = os.path.join(out, rel)
            if "llava_symlink" in s.overrides:
                if os.path.lexists(path):
                    os.remove(path)
                os.symlink(s.overrides["llava_symlink"], path)
            elif "llava_image" not in s.overrides:
                with open(path, "wb") as f:
                    f.write(im.data)
            refs.append(rel)
        record = {"id": s.sample_id}
        if refs:
            record["image"] = refs[0] if len(refs) == 1 else refs
        if "llava_image" in s.overrides:
            record["image"] = s.overrides["llava_image"]
        record["conversations"] = s.conversations
        if s.overrides.get("llava_no_id"):
            del record["id"]
        record = s.overrides.get("llava_record", record)
        records.append(record)
        no_id = not isinstance(record, dict) or "id" not in record
        ids.append(None if no_id else s.sample_id)  # the reader's id: "data.json:<row>[#<id>]"
    return {"paths": [], "ids": ids, "records": records}


def write_llava_index(out: str, infos: list[dict]) -> str:
    records = [r for info in infos for r in info["records"]]
    with open(os.path.join(out, LLAVA_INDEX), "w") as f:
        json.dump(records, f, ensure_ascii=True)
    return LLAVA_INDEX


def manifest_ids(fmt: str, infos: list[dict]) -> list[str]:
    """Every sample id a reader must produce, in written order (formats/: file relative to the dataset
    root + row / member key, then "#<id>"; LLaVA: 'data.json:<row>[#<id>]')."""
    ids = [i for info in infos for i in info["ids"]]
    if fmt != "llava":
        return ids
    return [f"{LLAVA_INDEX}:{row}" + ("" if i is None else f"#{i}") for row, i in enumerate(ids)]


WRITERS = {"parquet": write_parquet_shard, "caption": write_caption_shard,
           "webdataset": write_webdataset_shard, "llava": write_llava_shard, "llava_index": write_llava_index}
