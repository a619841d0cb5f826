"""Parquet: Hugging Face hub layouts (``cc3m/train-00000-of-00001.parquet`` ...) and caption tables.

Read unit: one row group. Listing reads every file's footer (in threads: on an object
store each footer is a round trip); a file whose footer cannot be read (corrupt, not
Parquet, a FIFO, a dangling link) or that lacks the text column becomes one skipped-file
unit. Columns are chosen PER FILE: a file without the image column gives its own rows no
images, not the whole set.

Columns and layout: formats/layouts.py tells from each file's schema which column holds the
dialogue (LLaVA conversations, HF messages, Cauldron texts, PixMo questions, a caption) and which
the images (``images`` list<Image>, one nullable ``image`` struct, binary); ``--text-column`` /
``--image-column`` override. A file that fits no layout is one skipped-file unit naming why; a
schema whose images are only URLs is refused. An Image struct with null bytes and a path
(``Dataset.to_parquet`` of local files) is read from the path under ``--image-root``. A video column
(``videos`` / ``video`` by default: HF ``Video`` structs, binary or paths, layouts.py) adds each row's
videos to its media, all in the order of the row's ``<image>`` / ``<video>`` placeholders.
``--filter`` (formats/filters.py) is evaluated on its scalar columns at listing (each unit's
row count is what it keeps) and again at read; filtered rows are counted, never read further.

Id scheme: ``<file relative to the dataset root>:<row in the file>``, plus ``#<id>`` when
the row has an id: unique by construction, whatever the ids in the data.
Pure module: pyarrow, no ray.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ray_mmbatch import schema
from ray_mmbatch.formats import filters, fs, layouts
from ray_mmbatch.formats.records import (
    IMAGE,
    VIDEO,
    conversations_to_json,
    error,
    file_skip_row,
    media_slots,
    place_media,
    raw_row,
    reorder,
    rows_to_table,
    sample_id,
)

EXTS = (".parquet",)


def table_columns(arrow_schema: pa.Schema, data_cfg) -> layouts.Columns:
    """The layout and columns a table with this schema is read with (layouts.choose; raises LayoutError)."""
    return layouts.choose(arrow_schema, data_cfg)


def check_filter_columns(arrow_schema: pa.Schema, data_cfg) -> str:
    """"" or why this file cannot be filtered (a --filter column it lacks)."""
    missing = filters.missing_columns(filters.parse(getattr(data_cfg, "filter", "")), arrow_schema)
    return f"no column {missing[0]!r} for --filter; columns are {arrow_schema.names}" if missing else ""


def kept_rows(table: pa.Table, data_cfg) -> np.ndarray | None:
    """The rows of a batch that pass --filter (indices), or None without a filter."""
    clauses = filters.parse(getattr(data_cfg, "filter", ""))
    return np.flatnonzero(filters.mask(table, clauses)) if clauses else None


def _file_units(path: str, root: str, data_cfg) -> list[dict]:
    rel = fs.relative(path, root)
    base = {"path": path, "rel": rel, "row_group": 0, "row_offset": 0, "rows": 1, "filtered": 0, "columns": "",
            "read_as": "", "error": ""}
    try:
        if fs.kind(path) != "file":
            return [dict(base, error="not a regular file (dangling link, FIFO or device): never opened")]
        with fs.open_random_access(path) as f:
            meta = pq.ParquetFile(f).metadata
            arrow_schema = meta.schema.to_arrow_schema()
    except Exception as exc:  # noqa: BLE001 - any failure of one file skips that file, named
        return [dict(base, error=f"not a readable Parquet file: {exc}")]
    try:
        cols = table_columns(arrow_schema, data_cfg)
    except layouts.LayoutError as exc:
        return [dict(base, error=str(exc))]
    why = check_filter_columns(arrow_schema, data_cfg)
    if why:
        return [dict(base, error=why)]
    clauses = filters.parse(getattr(data_cfg, "filter", ""))
    units, offset = [], 0
    for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        kept = n
        if clauses:  # the filter's scalar columns only: cheap, and the unit knows its rows before any read
            with fs.open_random_access(path) as f:
                part = pq.ParquetFile(f).read_row_group(g, columns=filters.columns(clauses))
            kept = int(filters.mask(part, clauses).sum())
        units.append(dict(base, row_group=g, row_offset=offset, rows=kept, filtered=n - kept,
                          columns=cols.to_json(), read_as=cols.describe))
        offset += n
    return units


def list_units(files: list[str], root: str, data_cfg) -> list[dict]:
    """One unit per row group of every file (sorted order); a file that cannot be used is one error unit."""
    threads = 16 if files and fs.is_uri(files[0]) else 4
    with ThreadPoolExecutor(max_workers=min(threads, max(1, len(files)))) as pool:
        per_file = list(pool.map(lambda f: _file_units(f, root, data_cfg), files))
    units = [u for us in per_file for u in us]
    return check_units(units, root, data_cfg)


def check_units(units: list[dict], root: str, data_cfg) -> list[dict]:
    """Refuse at start a listing where no file can be read for the same reason (no text column, only image
    URLs, no --filter column): a wrong flag, not a few bad files. Parquet and Arrow listings."""
    if units and all(u["error"].startswith(("no text column", "text column")) for u in units):
        raise ValueError(f"{root}: text column {data_cfg.text_column!r} not found in any file; "
                         f"{units[0]['rel']}: {units[0]['error']} (set --text-column)")
    unfiltered = [u for u in units if "for --filter" in u["error"]]
    if unfiltered and len(unfiltered) == len(units):
        raise ValueError(f"{root}: {unfiltered[0]['rel']}: {unfiltered[0]['error']}")
    urls = [u for u in units if "holds image URLs" in u["error"]]
    if urls and len(urls) == len(units):
        raise ValueError(f"{root}: {urls[0]['rel']}: {urls[0]['error']}")
    return units


def count(units: list[dict], data_cfg) -> int:
    """Rows the units yield (after --filter: listing read the filter's columns)."""
    return sum(int(u["rows"]) for u in units)


def _image_items(value) -> list:
    """Normalize an image cell: struct, list of structs, raw bytes, list of bytes, or None."""
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _image_from_path(ref: str, image_root: str, max_bytes: int, what: str = IMAGE) -> tuple[bytes, str]:
    """An Image struct with null bytes and a path (``Dataset.to_parquet`` of local files), or a video path:
    read from the path when it lies under --image-root (absolute, or relative to it); nothing outside the
    root is opened."""
    from ray_mmbatch.formats.llava import _inside, _local_root, resolve_image_path
    from ray_mmbatch.formats.llava import _read_image as read_image_file

    if not image_root:
        return b"", error(schema.SKIP_MISSING_FILE, f"{what} {ref!r} has no bytes; set --image-root to the folder "
                                                    "that holds its path to read it from there")
    if not fs.is_uri(image_root) and isinstance(ref, str) and os.path.isabs(ref) and "\x00" not in ref:
        # an absolute path (to_parquet's): made relative to the root it must lie under, as llava reads relative ones
        # ('..' and symlinks resolved, llava's _inside); a NUL is resolve_image_path's malformed record
        root = _local_root(image_root)
        real = _inside(root, ref)  # os.path.join(root, absolute) is the absolute path itself
        if real is None:
            return b"", error(schema.SKIP_PATH_OUTSIDE_ROOT, f"{ref} (not under --image-root {image_root})")
        ref = os.path.relpath(real, root)
    location, err = resolve_image_path(ref, image_root)
    return (b"", err) if err else read_image_file(location, ref, max_bytes)


def _row_images(cell, sid: str, order, image_root: str, max_bytes: int,
                what: str = IMAGE) -> tuple[list[bytes], list[str], str]:
    """(bytes, refs, read_error) of one row's image (``what`` = VIDEO: video) cell; ``order``: the items in the
    order the dialogue names them (HF messages parts with an index), None = as stored. A string item (a video
    column of paths) is a path."""
    items = _image_items(cell)
    if order is not None:
        if sorted(order) != list(range(len(items))):
            return [], [], error(schema.SKIP_PLACEHOLDER_MISMATCH, f"{what} parts name indices {order} of "
                                                                   f"{len(items)} {what}s")
        items = [items[k] for k in order]
    blobs, refs, err = [], [], ""
    for k, item in enumerate(items):
        data, path = (item.get("bytes"), item.get("path")) if isinstance(item, dict) else \
            (None, item) if isinstance(item, str) else (item, None)
        ref = path or (f"{sid}#{k}" if what == IMAGE else f"{sid}#{what}{k}")
        refs.append(ref)
        if err:
            continue
        if item is None:
            err = error(schema.SKIP_MISSING_FILE, f"{what} {k} of the row's list is null")
        elif data is None and path:
            data, err = _image_from_path(path, image_root, max_bytes, what)
        elif data is None:
            err = error(schema.SKIP_MISSING_FILE, f"{what} {k} ({ref}) has no bytes and no path")
        blobs.append(data or b"")
    return blobs, refs, err


def rows_of_table(table: pa.Table, rel: str, row_offset: int, cols, data_cfg, keep=None) -> list[dict]:
    """RAW rows of a Parquet / Arrow batch read with ``cols`` (layouts.Columns); ``keep``: the row indices that
    pass --filter (None = all). Ids use the row's place in its file, filtered rows or not."""
    if isinstance(cols, dict):  # {"text", "image"?, "id"?} -> column name (older callers)
        cols = layouts.choose(table.select(list(cols.values())).schema, data_cfg) if cols else cols
    n = table.num_rows
    rows_idx = range(n) if keep is None else [int(i) for i in keep]
    texts = table.column(cols.text).to_pylist()
    images = table.column(cols.image).to_pylist() if cols.image else [None] * n
    videos = table.column(cols.video).to_pylist() if cols.video else [None] * n
    ids = table.column(cols.id).to_pylist() if cols.id else [None] * n
    max_chars = getattr(data_cfg, "max_text_chars", 0)
    prompt = getattr(data_cfg, "caption_prompt", "")
    image_root = getattr(data_cfg, "image_root", "")
    max_bytes = getattr(data_cfg, "max_file_bytes", 0)
    rows = []
    for i in rows_idx:
        sid = sample_id(f"{rel}:{row_offset + i}", ids[i])
        messages = cols.layout == "messages"
        order = layouts.image_order(texts[i]) if messages else None
        blobs, refs, img_err = _row_images(images[i], sid, order, image_root, max_bytes)
        kinds = [IMAGE] * len(refs)
        if videos[i] is not None:
            order = layouts.image_order(texts[i], layouts.VIDEO_PARTS) if messages else None
            v_blobs, v_refs, video_err = _row_images(videos[i], sid, order, image_root, max_bytes, VIDEO)
            blobs, refs, kinds, img_err = blobs + v_blobs, refs + v_refs, kinds + [VIDEO] * len(v_refs), \
                img_err or video_err
        try:
            turns = layouts.row_turns(cols, texts[i], media_slots(kinds) if VIDEO in kinds else len(refs), prompt)
        except layouts.LayoutError as exc:
            conv, err = "[]", error(schema.SKIP_MALFORMED_RECORD, str(exc))
        else:
            conv, err = conversations_to_json(turns, max_chars)
        if not err:
            conv, order = place_media(conv, kinds)
            refs, blobs = reorder(refs, order), (reorder(blobs, order) if len(blobs) == len(order) else blobs)
        err = err or img_err
        rows.append(raw_row(sid, conv, [] if err else blobs, refs, err))
    return rows


def read_unit(unit: dict, data_cfg) -> list[dict]:
    """RAW rows of one row group (or the one skipped-file row of a file that cannot be read)."""
    if unit["error"]:
        return [file_skip_row(unit["rel"], unit["error"])]
    cols = layouts.Columns.from_json(unit["columns"])
    wanted = [c for c in (cols.text, cols.image, cols.id, cols.video) if c]
    clauses = filters.parse(getattr(data_cfg, "filter", ""))
    try:
        with fs.open_random_access(unit["path"]) as f:
            part = pq.ParquetFile(f).read_row_group(int(unit["row_group"]),
                                                    columns=sorted(set(wanted + filters.columns(clauses))))
    except Exception as exc:  # noqa: BLE001 - a corrupt row group skips that row group, named
        return [file_skip_row(unit["rel"], f"row group {unit['row_group']}: {exc}")]
    return rows_of_table(part, unit["rel"], int(unit["row_offset"]), cols, data_cfg, kept_rows(part, data_cfg))


def parquet_rows(table: pa.Table, data_cfg, *, file_name: str | None = None, row_offset: int = 0) -> pa.Table:
    """RAW rows (Arrow) from a Parquet batch read elsewhere (benchmarks, tests): ids ``<file_name>:<row>``,
    ``row_offset`` being the row of the batch's first row in its file."""
    try:
        cols = table_columns(table.schema, data_cfg)
    except layouts.LayoutError as exc:
        raise ValueError(str(exc)) from None
    return rows_to_table(rows_of_table(table, file_name or "", int(row_offset or 0), cols, data_cfg,
                                       kept_rows(table, data_cfg)))
