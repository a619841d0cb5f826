"""Parquet: Hugging Face hub layouts (``cc3m/train-00000-of-00001.parquet`` ...) and caption tables.

Read unit: one row group. Listing reads every file's footer (in threads: on an object
store each footer is a round trip); a file whose footer cannot be read (corrupt, not
Parquet, a FIFO, a dangling link) or that lacks the text column becomes one skipped-file
unit. Columns are chosen PER FILE: a file without the image column gives its own rows no
images, not the whole set.

Columns: ``data.text_column`` (list<struct<from, value>> / HF ``messages``
list<struct<role, content>>, a JSON string of either, or plain text = one answer;
"messages" is used when the default "conversations" is absent), ``data.image_column``
(struct {bytes, path}, a list of them, binary or list<binary>; any other type skips the
file), ``data.id_column`` (optional, kept readable in the id).

Id scheme: ``<file relative to the dataset root>:<row in the file>``, plus ``#<id>`` when
the row has an id: unique by construction, whatever the ids in the data.
Pure module: pyarrow, no ray.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq

from ray_mmbatch import schema
from ray_mmbatch.formats import fs
from ray_mmbatch.formats.records import (
    conversations_to_json,
    error,
    file_skip_row,
    raw_row,
    rows_to_table,
    sample_id,
    text_to_json,
)

EXTS = (".parquet",)
MESSAGES_COLUMN = "messages"  # HF / TRL chat layout


def _text_column(names: list[str], data_cfg) -> str | None:
    if data_cfg.text_column in names:
        return data_cfg.text_column
    if data_cfg.text_column == "conversations" and MESSAGES_COLUMN in names:
        return MESSAGES_COLUMN
    return None


def _image_type_ok(t: pa.DataType) -> bool:
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        t = t.value_type
    if pa.types.is_struct(t):
        i = t.get_field_index("bytes")
        return i >= 0 and (pa.types.is_binary(t.field(i).type) or pa.types.is_large_binary(t.field(i).type)
                           or pa.types.is_null(t.field(i).type))
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_null(t)


def _file_units(path: str, root: str, data_cfg) -> list[dict]:
    rel = fs.relative(path, root)
    base = {"path": path, "rel": rel, "row_group": 0, "row_offset": 0, "rows": 1, "columns": "", "error": ""}
    try:
        if fs.kind(path) != "file":
            return [dict(base, error="not a regular file (dangling link, FIFO or device): never opened")]
        with fs.open_random_access(path) as f:
            meta = pq.ParquetFile(f).metadata
            arrow_schema = meta.schema.to_arrow_schema()
    except Exception as exc:  # noqa: BLE001 - any failure of one file skips that file, named
        return [dict(base, error=f"not a readable Parquet file: {exc}")]
    names = arrow_schema.names
    text = _text_column(names, data_cfg)
    if text is None:
        return [dict(base, error=f"no text column {data_cfg.text_column!r}; columns are {names}")]
    cols = {"text": text}
    if data_cfg.image_column in names:
        t = arrow_schema.field(data_cfg.image_column).type
        if not _image_type_ok(t):
            return [dict(base, error=f"image column {data_cfg.image_column!r} is {t}, not binary, "
                                     "struct<bytes, path> or a list of them")]
        cols["image"] = data_cfg.image_column
    if data_cfg.id_column in names:
        cols["id"] = data_cfg.id_column
    units, offset = [], 0
    for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        units.append(dict(base, row_group=g, row_offset=offset, rows=n, columns=json.dumps(cols)))
        offset += n
    return units


def list_units(files: list[str], root: str, data_cfg) -> list[dict]:
    """One unit per row group of every file (sorted order); a file that cannot be used is one error unit."""
    threads = 16 if files and fs.is_uri(files[0]) else 4
    with ThreadPoolExecutor(max_workers=min(threads, max(1, len(files)))) as pool:
        per_file = list(pool.map(lambda f: _file_units(f, root, data_cfg), files))
    units = [u for us in per_file for u in us]
    if units and all(u["error"].startswith("no text column") for u in units):
        raise ValueError(f"{root}: text column {data_cfg.text_column!r} not found in any file; "
                         f"{units[0]['rel']} has {units[0]['error'].split('columns are ', 1)[-1]} "
                         "(set data.text_column)")
    return units


def count(units: list[dict], data_cfg) -> int:
    return sum(int(u["rows"]) for u in units)


def _image_items(value) -> list:
    """Normalize an image cell: struct, list of structs, raw bytes, list of bytes, or None."""
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _conversation(value, plain: bool, max_chars: int) -> tuple[str, str]:
    """A string column is a caption unless it holds a JSON list (conversations stored as JSON)."""
    if plain and not (isinstance(value, str) and value.lstrip().startswith("[") and _json_list(value)):
        return text_to_json(value, max_chars)
    return conversations_to_json(value, max_chars)


def _json_list(value) -> bool:
    try:
        return isinstance(json.loads(value), list)
    except (TypeError, ValueError):
        return False


def rows_of_table(table: pa.Table, rel: str, row_offset: int, cols: dict, data_cfg) -> list[dict]:
    """RAW rows of a Parquet batch whose columns are ``cols`` ({"text", "image"?, "id"?} -> column name)."""
    n = table.num_rows
    text_type = table.schema.field(cols["text"]).type
    plain = pa.types.is_string(text_type) or pa.types.is_large_string(text_type)
    texts = table.column(cols["text"]).to_pylist()
    images = table.column(cols["image"]).to_pylist() if "image" in cols else [None] * n
    ids = table.column(cols["id"]).to_pylist() if "id" in cols else [None] * n
    max_chars = getattr(data_cfg, "max_text_chars", 0)
    rows = []
    for i in range(n):
        sid = sample_id(f"{rel}:{row_offset + i}", ids[i])
        conv, err = _conversation(texts[i], plain, max_chars)
        blobs, refs = [], []
        for k, item in enumerate(_image_items(images[i])):
            data, ref = (item.get("bytes"), item.get("path") or f"{sid}#{k}") if isinstance(item, dict) \
                else (item, f"{sid}#{k}")
            refs.append(ref)
            if data is None and not err:
                err = error(schema.SKIP_MISSING_FILE, f"image {k} ({ref}) has no bytes")
            blobs.append(data or b"")
        rows.append(raw_row(sid, conv, [] if err else blobs, refs, err))
    return rows


def read_unit(unit: dict, data_cfg) -> list[dict]:
    """RAW rows of one row group (or the one skipped-file row of a file that cannot be read)."""
    if unit["error"]:
        return [file_skip_row(unit["rel"], unit["error"])]
    cols = json.loads(unit["columns"])
    try:
        with fs.open_random_access(unit["path"]) as f:
            part = pq.ParquetFile(f).read_row_group(int(unit["row_group"]), columns=list(cols.values()))
    except Exception as exc:  # noqa: BLE001 - a corrupt row group skips that row group, named
        return [file_skip_row(unit["rel"], f"row group {unit['row_group']}: {exc}")]
    return rows_of_table(part, unit["rel"], int(unit["row_offset"]), cols, data_cfg)


def parquet_rows(table: pa.Table, data_cfg, *, file_name: str | None = None, row_offset: int = 0) -> pa.Table:
    """RAW rows (Arrow) from a Parquet batch read elsewhere (benchmarks, tests): ids ``<file_name>:<row>``,
    ``row_offset`` being the row of the batch's first row in its file."""
    names = table.column_names
    text = _text_column(names, data_cfg)
    if text is None:
        raise ValueError(f"text column {data_cfg.text_column!r} not in Parquet columns {names}")
    cols = {"text": text}
    cols.update({k: c for k, c in (("image", data_cfg.image_column), ("id", data_cfg.id_column)) if c in names})
    return rows_to_table(rows_of_table(table, file_name or "", int(row_offset or 0), cols, data_cfg))
