"""Format adapters: Parquet tables, WebDataset tars and LLaVA records -> RAW rows.

A RAW row (schema.RAW_COLUMNS) carries the conversation as a JSON string and
the images as undecoded bytes. Problems found while reading (a record of the
wrong shape, an image path that is missing or escapes the image folder) do
not raise: the row keeps its id and gets ``read_error`` = "reason: detail"
so later stages count and report it. Image *content* (empty, truncated, not
an image, bombs) is not judged here: the bytes travel on to the measure stage.

Conversations are validated to a list of {"from": str, "value": str} with
roles system/human/gpt ("user"/"assistant" are renamed). They are re-encoded
as UTF-8 JSON, except when a value holds a lone surrogate: then the JSON is
ASCII-escaped ("\\ud800") so Arrow can store it and the measure stage sees the
surrogate and reports text_encoding.

Cost: one pass over the records; JSON and tar parsing only; image files are
read (never decoded) and only after their path was checked.
Pure module: pyarrow, no ray.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
from typing import BinaryIO

import pyarrow as pa

from ray_mmbatch import schema
from ray_mmbatch.config import DataConfig

RAW_ARROW_SCHEMA = pa.schema([
    (schema.SAMPLE_ID, pa.string()), (schema.CONVERSATIONS, pa.string()),
    (schema.IMAGES, pa.list_(pa.binary())), (schema.IMAGE_REFS, pa.list_(pa.string())),
    (schema.READ_ERROR, pa.string()),
])
ROLE_ALIASES = {"system": "system", "human": "human", "gpt": "gpt", "user": "human", "assistant": "gpt"}
# WebDataset member extensions: the record, a plain caption, and metadata we do not use.
WDS_RECORD_EXT, WDS_TEXT_EXT = "json", "txt"
WDS_METADATA_EXTS = frozenset({"cls", "cls2", "id", "index", "key", "__key__", "url"})


def raw_row(sample_id: str, conversations: str = "[]", images: list[bytes] | None = None,
            image_refs: list[str] | None = None, read_error: str = "") -> dict:
    return {schema.SAMPLE_ID: sample_id, schema.CONVERSATIONS: conversations, schema.IMAGES: images or [],
            schema.IMAGE_REFS: image_refs or [], schema.READ_ERROR: read_error}


def rows_to_table(rows: list[dict]) -> pa.Table:
    """RAW rows as an Arrow table with the fixed schema (empty image lists stay list<binary>)."""
    return pa.Table.from_pylist(rows, schema=RAW_ARROW_SCHEMA)


def error(reason: str, detail: str = "") -> str:
    return f"{reason}: {detail}" if detail else reason


def conversations_to_json(value) -> tuple[str, str]:
    """(JSON string, read_error) for a conversation value; "[]" and a malformed_record error if invalid."""
    if value is None:
        return "[]", error(schema.SKIP_MALFORMED_RECORD, "conversations missing")
    if not isinstance(value, list):
        return "[]", error(schema.SKIP_MALFORMED_RECORD, f"conversations is {type(value).__name__}, not a list")
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict):
            return "[]", error(schema.SKIP_MALFORMED_RECORD, f"turn {i} is not an object")
        role, text = turn.get("from"), turn.get("value")
        if role not in ROLE_ALIASES:
            return "[]", error(schema.SKIP_MALFORMED_RECORD, f"turn {i} has role {role!r}")
        if not isinstance(text, str):
            return "[]", error(schema.SKIP_MALFORMED_RECORD, f"turn {i} value is {type(text).__name__}")
        turns.append({"from": ROLE_ALIASES[role], "value": text})
    out = json.dumps(turns, ensure_ascii=False)
    try:
        out.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogate: keep it, escaped, for the measure stage to report
        out = json.dumps(turns, ensure_ascii=True)
    return out, ""


def text_to_json(text) -> tuple[str, str]:
    """A plain text column value becomes one answer turn."""
    if not isinstance(text, str):
        return "[]", error(schema.SKIP_MALFORMED_RECORD, f"text is {type(text).__name__}")
    return conversations_to_json([{"from": "gpt", "value": text}])


# ---------------------------------------------------------------- Parquet
def _image_items(value) -> list:
    """Normalize an image cell: struct, list of structs, raw bytes, list of bytes, or None."""
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def parquet_rows(table: pa.Table, data_cfg: DataConfig, *, file_name: str | None = None,
                 row_offset: int | None = None) -> pa.Table:
    """RAW rows from a Parquet batch.

    Columns used: data_cfg.id_column (optional), image_column (optional; struct
    {bytes, path}, a list of them, binary or list<binary>), text_column
    (list<struct<from, value>> or plain string). Ids missing from the data are
    "<file>:<row>", which needs ``row_offset`` (row of the batch's first row in
    its file) and the file name (``file_name`` or a "path" column added by the
    reader); else a "row_hash" column from Ray's reader gives "<file>:#<hash>".
    """
    names = table.column_names
    if data_cfg.text_column not in names:
        raise ValueError(f"text column {data_cfg.text_column!r} not in Parquet columns {names}")
    n = table.num_rows
    texts = table.column(data_cfg.text_column).to_pylist()
    plain_text = pa.types.is_string(table.schema.field(data_cfg.text_column).type) or \
        pa.types.is_large_string(table.schema.field(data_cfg.text_column).type)
    images = table.column(data_cfg.image_column).to_pylist() if data_cfg.image_column in names else [None] * n
    ids = table.column(data_cfg.id_column).to_pylist() if data_cfg.id_column in names else [None] * n
    paths = table.column("path").to_pylist() if "path" in names else [file_name or ""] * n
    hashes = table.column("row_hash").to_pylist() if "row_hash" in names else None
    rows = []
    for i in range(n):
        fname = os.path.basename(paths[i] or "")
        if ids[i] is not None and str(ids[i]) != "":
            sid = str(ids[i])
        elif row_offset is not None:
            sid = f"{fname}:{row_offset + i}"
        elif hashes is not None:
            sid = f"{fname}:#{hashes[i]:016x}"
        else:
            raise ValueError("Parquet rows without ids need row_offset or a row_hash column")
        conv, err = (text_to_json if plain_text else conversations_to_json)(texts[i])
        blobs, refs = [], []
        for k, item in enumerate(_image_items(images[i])):
            if isinstance(item, dict):
                data, ref = item.get("bytes"), item.get("path") or f"{sid}#{k}"
            else:
                data, ref = item, f"{sid}#{k}"
            refs.append(ref)
            if data is None and not err:
                err = error(schema.SKIP_MISSING_FILE, f"image {k} ({ref}) has no bytes")
            blobs.append(data or b"")
        rows.append(raw_row(sid, conv, [] if err else blobs, refs, err))
    return rows_to_table(rows)


# ------------------------------------------------------------- WebDataset
def split_member(name: str) -> tuple[str, int, str]:
    """'dir/KEY.2.png' -> ('dir/KEY', 2, 'png'); the key ends at the basename's first dot."""
    folder, _, base = name.rpartition("/")
    stem, _, suffix = base.partition(".")
    parts = suffix.split(".") if suffix else [""]
    index = int(parts[0]) if len(parts) == 2 and parts[0].isdigit() else 0
    return (f"{folder}/{stem}" if folder else stem), index, parts[-1].lower()


def _wds_row(key: str, members: list[tuple[int, str, str, bytes]], shard_name: str) -> dict:
    record = [m for m in members if m[1] == WDS_RECORD_EXT]
    text = [m for m in members if m[1] == WDS_TEXT_EXT]
    images = sorted((m for m in members if m[1] not in (WDS_RECORD_EXT, WDS_TEXT_EXT)
                     and m[1] not in WDS_METADATA_EXTS), key=lambda m: (m[0], m[1]))
    refs = [f"{shard_name}/{m[2]}" for m in images]
    blobs = [m[3] for m in images]
    if record:
        try:
            rec = json.loads(record[0][3].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return raw_row(key, image_refs=refs, read_error=error(schema.SKIP_MALFORMED_RECORD, f"{key}.json: {exc}"))
        if not isinstance(rec, dict):
            return raw_row(key, image_refs=refs, read_error=error(schema.SKIP_MALFORMED_RECORD, f"{key}.json is not an object"))
        sid = rec.get("id")
        sid = str(sid) if isinstance(sid, (str, int)) and str(sid) else key
        if "conversations" in rec:
            conv, err = conversations_to_json(rec["conversations"])
        else:
            conv, err = text_to_json(rec.get("text", rec.get("caption")))
    elif text:
        sid = key
        try:
            conv, err = text_to_json(text[0][3].decode("utf-8"))
        except UnicodeDecodeError as exc:
            conv, err = "[]", error(schema.SKIP_TEXT_ENCODING, f"{key}.txt: {exc}")
    else:
        return raw_row(key, image_refs=refs, read_error=error(schema.SKIP_MALFORMED_RECORD, f"no {key}.json or {key}.txt"))
    return raw_row(sid, conv, [] if err else blobs, refs, err)


def webdataset_samples(tar: bytes | BinaryIO, shard_name: str) -> list[dict]:
    """RAW rows of one tar shard, in member order; members grouped by key.

    Extra images ``KEY.<n>.<ext>`` follow ``KEY.<ext>`` in numeric order of n.
    A broken tar ends the shard with one malformed_record row naming it.
    """
    fileobj = io.BytesIO(tar) if isinstance(tar, (bytes, bytearray, memoryview)) else tar
    groups: dict[str, list] = {}
    rows_tail = []
    try:
        with tarfile.open(fileobj=fileobj, mode="r|*") as archive:
            for member in archive:
                if not member.isfile():
                    continue
                key, index, ext = split_member(member.name)
                data = archive.extractfile(member).read()
                groups.setdefault(key, []).append((index, ext, member.name, data))
    except (tarfile.TarError, OSError, EOFError) as exc:
        rows_tail.append(raw_row(f"{shard_name}:unreadable-tail",
                                 read_error=error(schema.SKIP_MALFORMED_RECORD, f"tar {shard_name}: {exc}")))
    return [_wds_row(key, members, shard_name) for key, members in groups.items()] + rows_tail


# ------------------------------------------------------------------ LLaVA
def resolve_image_path(ref, image_root: str) -> tuple[str | None, str]:
    """(real path, "") for a file inside image_root, else (None, read_error). Never opens the file."""
    if not isinstance(ref, str) or not ref:
        return None, error(schema.SKIP_MALFORMED_RECORD, f"image path {ref!r} is not a non-empty string")
    if os.path.isabs(ref):
        return None, error(schema.SKIP_PATH_OUTSIDE_ROOT, ref)
    root = os.path.realpath(image_root)
    real = os.path.realpath(os.path.join(root, ref))  # resolves '..' and symlinks without opening
    if os.path.commonpath([root, real]) != root:
        return None, error(schema.SKIP_PATH_OUTSIDE_ROOT, ref)
    if not os.path.exists(real):
        return None, error(schema.SKIP_MISSING_FILE, ref)
    if not os.path.isfile(real):  # a folder or a FIFO would hang or fail the read
        return None, error(schema.SKIP_MISSING_FILE, f"{ref} is not a regular file")
    return real, ""


def _read_file(path: str, ref: str) -> tuple[bytes, str]:
    try:
        with open(path, "rb") as f:
            return f.read(), ""
    except OSError as exc:
        return b"", error(schema.SKIP_MISSING_FILE, f"{ref}: {exc.strerror}")


def llava_row(record, image_root: str, sample_id: str) -> dict:
    if not isinstance(record, dict):
        return raw_row(sample_id, read_error=error(schema.SKIP_MALFORMED_RECORD,
                                                   f"record is {type(record).__name__}, not an object"))
    conv, err = conversations_to_json(record.get("conversations"))
    field = record.get("image", record.get("images"))
    refs = [] if field is None else [field] if isinstance(field, str) else field
    if not isinstance(refs, list):
        return raw_row(sample_id, conv, read_error=error(schema.SKIP_MALFORMED_RECORD,
                                                         f"image field is {type(field).__name__}"))
    ref_strs = [str(r) for r in refs]
    if err:
        return raw_row(sample_id, conv, image_refs=ref_strs, read_error=err)
    blobs = []
    for ref in refs:
        path, err = resolve_image_path(ref, image_root)
        if not err:
            data, err = _read_file(path, ref)
        if err:
            return raw_row(sample_id, conv, image_refs=ref_strs, read_error=err)
        blobs.append(data)
    return raw_row(sample_id, conv, blobs, ref_strs)


def llava_rows(records: list, image_root: str, *, file_name: str = "data.json", row_offset: int = 0) -> list[dict]:
    """RAW rows for LLaVA records; paths resolve inside image_root or are refused unread.

    Ids: the record's "id" (str or int), else "<file_name>:<row>".
    """
    rows = []
    for i, record in enumerate(records):
        rid = record.get("id") if isinstance(record, dict) else None
        sid = str(rid) if isinstance(rid, (str, int)) and str(rid) else f"{file_name}:{row_offset + i}"
        rows.append(llava_row(record, image_root, sid))
    return rows
