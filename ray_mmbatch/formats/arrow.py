"""Arrow IPC: ``datasets`` ``save_to_disk`` folders (``data-00000-of-00002.arrow`` + ``dataset_info.json`` +
``state.json``; a DatasetDict adds ``dataset_dict.json`` and one such folder per split).

save_to_disk writes the Arrow IPC **stream** format (schema message, record batch messages, an
end-of-stream marker ``ff ff ff ff 00 00 00 00``); a file that starts with the ``ARROW1`` magic is
read as the IPC **file** format (footer + random access). HF ``Image`` features are
struct<bytes, path> with the local files' bytes embedded: the same layouts as Parquet.

Read unit: consecutive record batches of one shard, up to UNIT_ROWS rows or UNIT_BYTES bytes of
the shard (datasets writes batches of 100-1000 rows). Listing walks each shard's message headers
once (formats/ipc_headers.py) for the row counts and byte ranges, never its batch bodies: on a
local file over a memory map, on an object store with a few small ranged reads per shard, so a
shard's bytes are fetched once, where the pipeline reads them (issue 44; benchmarks/bench_listing.py).
Only --filter reads values at listing: each batch by its byte range. A unit is read with one
ranged read (zero-copy on a memory map), never by streaming the shard's head again (a stream
whose schema has dictionary fields is the exception: its units replay the stream from the
start, since the dictionaries sit before the batches). A run lists each shard once
(formats/listing.py).

Columns, layout, --filter and row conversion are Parquet's (formats/parquet.py:
``table_columns``, ``check_filter_columns``, ``kept_rows``, ``rows_of_table``): each unit's "rows"
is what the filter keeps, "filtered" what it drops. A shard that cannot be used (not Arrow, cut
short: a stream without its end-of-stream marker, a file without its footer, a layout that does
not fit) is one skipped-file unit naming why; the other shards are read.

Id scheme: ``<shard relative to the dataset root>:<row in the shard>``, plus ``#<id>`` when the row
has an id (``data-00000-of-00002.arrow:17#abc``; a DatasetDict's ``train/data-00000-of-00001.arrow:3``).
Pure module: pyarrow, no ray.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from ray_mmbatch.formats import filters, fs, ipc_headers, layouts, parquet
from ray_mmbatch.formats.records import file_skip_row

EXTS = (".arrow",)
UNIT_ROWS = 2048
UNIT_BYTES = 64 << 20
FILE_MAGIC = b"ARROW1"
STREAM_BUFFER = 8 << 20  # replaying a stream for --filter on an object store: one request per 8 MiB


def _open(path: str):
    """A random-access file: a memory map locally (batches are zero-copy views), a ranged reader on URIs."""
    if not fs.is_uri(path):
        if fs.kind(path) != "file":
            raise OSError(f"{path} is not a regular file")
        return pa.memory_map(fs.local_path(path))
    return fs.open_random_access(path)


def _has_dictionaries(arrow_schema: pa.Schema) -> bool:
    def walk(t: pa.DataType) -> bool:
        return pa.types.is_dictionary(t) or any(walk(t.field(i).type) for i in range(t.num_fields))
    return any(walk(f.type) for f in arrow_schema)


def _listed_batches(path: str, clauses, check) -> tuple[str, pa.Schema, list[tuple[int, int, int, int]], bool]:
    """(ipc "stream" / "file", schema, [(start byte, end byte, rows, rows --filter keeps)], dictionaries?).

    The record batch headers only (formats/ipc_headers.py: locally a walk over the memory map; on an object
    store a few small ranged reads a shard, no body fetched); with --filter, the filter's columns too (on an
    object store only their buffers are fetched), once ``check(schema)`` (the layout and the filter's
    columns: raises) passed."""
    ipc = "stream"
    try:
        with _open(path) as f:
            try:
                ipc, arrow_schema, found, dicts, walked = ipc_headers.walk(f, whole=not fs.is_uri(path))
            except ValueError:
                ipc = "file" if f.read_at(len(FILE_MAGIC), 0) == FILE_MAGIC else "stream"  # to name it
                raise
            dicts = dicts or _has_dictionaries(arrow_schema)
            check(arrow_schema)
            kept = _kept(f, path, ipc, arrow_schema, found, dicts, walked, clauses) if clauses \
                else [n for _, _, n in found]
    except (layouts.LayoutError, _NotUsable):
        raise
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise _Unreadable(ipc, exc) from None
    return ipc, arrow_schema, [(a, b, n, k) for (a, b, n), k in zip(found, kept)], dicts


def _kept(f, path: str, ipc: str, arrow_schema: pa.Schema, found: list, dicts: bool, walked, clauses) -> list[int]:
    """Rows --filter keeps in each record batch: on an object store only the filter's columns are fetched
    (ipc_headers.read_columns); else each batch is read by its byte range (a stream with dictionaries:
    replayed from its start; the file format: through its footer)."""
    names = [c for c in filters.columns(clauses) if c in arrow_schema.names]
    if fs.is_uri(path) and ipc == "stream" and not dicts:
        out = []
        for (start, end, _), layout in zip(found, walked.layouts):
            batch = ipc_headers.read_columns(f, arrow_schema, start, layout, names)
            if batch is None:  # compressed or view buffers: the whole batch
                batch = pa.ipc.read_record_batch(pa.ipc.read_message(f.read_at(end - start, start)), arrow_schema)
            out.append(int(filters.mask(batch, clauses).sum()))
        return out
    if ipc == "file":
        reader = pa.ipc.open_file(f)
        batches = (reader.get_batch(i) for i in range(len(found)))
    elif dicts:  # dictionaries sit between the batches: replay the stream, buffered (8 MiB a request)
        f.seek(0)
        reader = pa.ipc.open_stream(pa.BufferedInputStream(f, STREAM_BUFFER))
        batches = (reader.read_next_batch() for _ in found)
    else:
        batches = (pa.ipc.read_record_batch(pa.ipc.read_message(f.read_at(end - start, start)), arrow_schema)
                   for start, end, _ in found)
    return [int(filters.mask(b, clauses).sum()) for b in batches]


class _NotUsable(Exception):
    """A shard whose columns do not fit the layout or the filter (the message says why)."""


class _Unreadable(Exception):
    def __init__(self, ipc: str, exc: Exception):
        super().__init__(f"not a readable Arrow IPC {ipc}: {exc}")


def _file_units(path: str, root: str, data_cfg) -> list[dict]:
    rel = fs.relative(path, root)
    base = {"path": path, "rel": rel, "error": "", "ipc": "stream", "batch": 0, "batches": 0, "offset": -1,
            "length": -1, "row_offset": 0, "rows": 1, "filtered": 0, "columns": "", "read_as": ""}
    if not fs.is_uri(path) and fs.kind(path) != "file":  # an object store lists objects only
        return [dict(base, error="not a regular file (dangling link, FIFO or device): never opened")]
    clauses = filters.parse(getattr(data_cfg, "filter", ""))
    found = {}

    def check(arrow_schema: pa.Schema) -> None:
        found["columns"] = parquet.table_columns(arrow_schema, data_cfg)  # LayoutError: this shard is skipped
        why = parquet.check_filter_columns(arrow_schema, data_cfg)
        if why:
            raise _NotUsable(why)

    try:
        ipc, arrow_schema, batches, dicts = _listed_batches(path, clauses, check)
    except (layouts.LayoutError, _NotUsable) as exc:
        return [dict(base, error=str(exc))]
    except _Unreadable as exc:  # any failure of one shard skips that shard, named
        return [dict(base, error=str(exc))]
    cols = found["columns"]
    base.update(ipc=ipc, columns=cols.to_json(), read_as=cols.describe)
    units, row, i = [], 0, 0
    while i < len(batches):
        first, n_rows, n_bytes, n_kept = i, 0, 0, 0
        while i < len(batches) and (i == first or n_rows < UNIT_ROWS and n_bytes < UNIT_BYTES):
            n_rows += batches[i][2]
            n_bytes += batches[i][1] - batches[i][0]
            n_kept += batches[i][3]
            i += 1
        seekable = ipc == "stream" and not dicts
        units.append(dict(base, batch=first, batches=i - first, row_offset=row, rows=n_kept, filtered=n_rows - n_kept,
                          offset=batches[first][0] if seekable else -1,
                          length=batches[i - 1][1] - batches[first][0] if seekable else -1))
        row += n_rows
    return units


def list_units(files: list[str], root: str, data_cfg) -> list[dict]:
    """Units of every shard (sorted order); a shard that cannot be used is one error unit."""
    threads = 16 if files and fs.is_uri(files[0]) else 4
    with ThreadPoolExecutor(max_workers=min(threads, max(1, len(files)))) as pool:
        units = [u for us in pool.map(lambda f: _file_units(f, root, data_cfg), files) for u in us]
    return parquet.check_units(units, root, data_cfg)


def count(units: list[dict], data_cfg) -> int:
    """Rows the units yield (after --filter: listing read the filter's columns)."""
    return sum(int(u["rows"]) for u in units)


def _unit_batches(unit: dict) -> list[pa.RecordBatch]:
    first, n = int(unit["batch"]), int(unit["batches"])
    with _open(unit["path"]) as f:
        if unit["ipc"] == "file":
            reader = pa.ipc.open_file(f)
            return [reader.get_batch(k) for k in range(first, first + n)]
        if int(unit["offset"]) < 0:  # dictionaries before the batches: replay the stream from its start
            reader = pa.ipc.open_stream(f)
            for _ in range(first):
                reader.read_next_batch()
            return [reader.read_next_batch() for _ in range(n)]
        arrow_schema = pa.ipc.open_stream(f).schema
        body = f.read_at(int(unit["length"]), int(unit["offset"]))
    messages = pa.ipc.MessageReader.open_stream(pa.BufferReader(body))
    return [pa.ipc.read_record_batch(messages.read_next_message(), arrow_schema) for _ in range(n)]


def read_unit(unit: dict, data_cfg) -> list[dict]:
    """RAW rows of one unit's record batches (or the one skipped-file row of a shard that cannot be read)."""
    if unit["error"]:
        return [file_skip_row(unit["rel"], unit["error"])]
    cols = layouts.Columns.from_json(unit["columns"])
    wanted = [c for c in (cols.text, cols.image, cols.id, cols.video) if c]
    wanted += [c for c in filters.columns(filters.parse(getattr(data_cfg, "filter", ""))) if c not in wanted]
    last = int(unit["batch"]) + int(unit["batches"]) - 1
    try:
        batches = _unit_batches(unit)
        if len(batches) != int(unit["batches"]):
            raise ValueError(f"{len(batches)} record batches, the listing saw {unit['batches']}")
        table = pa.Table.from_batches([b.select(wanted) for b in batches]) if batches else None
    except (OSError, ValueError, StopIteration, pa.ArrowException) as exc:  # rewritten or cut since listing
        return [file_skip_row(unit["rel"], f"record batches {unit['batch']}-{last}: {exc}")]
    if table is None:
        return []
    return parquet.rows_of_table(table, unit["rel"], int(unit["row_offset"]), cols, data_cfg,
                                 parquet.kept_rows(table, data_cfg))
