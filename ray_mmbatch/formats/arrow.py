"""Arrow IPC: ``datasets`` ``save_to_disk`` folders (``data-00000-of-00002.arrow`` + ``dataset_info.json`` +
``state.json``; a DatasetDict adds ``dataset_dict.json`` and one such folder per split).

save_to_disk writes the Arrow IPC **stream** format (schema message, record batch messages, an
end-of-stream marker ``ff ff ff ff 00 00 00 00``); a file that starts with the ``ARROW1`` magic is
read as the IPC **file** format (footer + random access). HF ``Image`` features are
struct<bytes, path> with the local files' bytes embedded: the same layouts as Parquet.

Read unit: consecutive record batches of one shard, up to UNIT_ROWS rows or UNIT_BYTES bytes
(datasets writes batches of 100-1000 rows). Listing walks each shard once, batch by batch, for
the row counts (and the --filter columns): on a local file through a memory map, so nothing is
copied or decoded; on an object store it is streamed. It records each unit's byte range, so a
unit is read with one ranged read (zero-copy on a memory map), never by streaming the shard's
head again (a stream whose schema has dictionary fields is the exception: its units replay the
stream from the start, since the dictionaries sit before the batches).

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

from ray_mmbatch.formats import filters, fs, layouts, parquet
from ray_mmbatch.formats.records import file_skip_row

EXTS = (".arrow",)
UNIT_ROWS = 2048
UNIT_BYTES = 64 << 20
FILE_MAGIC = b"ARROW1"
STREAM_BUFFER = 8 << 20  # listing a shard on an object store: one request per 8 MiB, not one per message part


def _open(path: str):
    """A random-access file: a memory map locally (batches are zero-copy views), a ranged reader on URIs."""
    if not fs.is_uri(path):
        if fs.kind(path) != "file":
            raise OSError(f"{path} is not a regular file")
        return pa.memory_map(fs.local_path(path))
    return fs.open_random_access(path)


def _is_file_format(path: str) -> bool:
    with fs.open_input(path) as f:
        return f.read(len(FILE_MAGIC)) == FILE_MAGIC


def _has_dictionaries(arrow_schema: pa.Schema) -> bool:
    def walk(t: pa.DataType) -> bool:
        return pa.types.is_dictionary(t) or any(walk(t.field(i).type) for i in range(t.num_fields))
    return any(walk(f.type) for f in arrow_schema)


class _Counted:
    """A stream that knows how many bytes it has given (an object store's input stream cannot ``tell``)."""

    def __init__(self, raw):
        self.raw, self.pos, self.closed = raw, 0, False

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.pos += len(data)
        return data

    def tell(self) -> int:
        return self.pos

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True
        self.raw.close()


def _stream_batches(path: str):
    """(schema, [(start byte, end byte, batch)], dictionaries?) of an IPC stream; raises ValueError when the
    stream ends without its end-of-stream marker (a shard cut at a batch boundary reads as shorter, silently,
    otherwise)."""
    source = _open(path) if not fs.is_uri(path) else \
        pa.PythonFile(_Counted(pa.BufferedInputStream(fs.open_input(path), STREAM_BUFFER)), mode="r")
    with source:
        reader = pa.ipc.open_stream(source)
        dicts = _has_dictionaries(reader.schema)
        out, pos = [], source.tell()
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            out.append((pos, source.tell(), batch))
            pos = source.tell()
        if source.tell() == pos:  # nothing after the last batch: no end-of-stream marker
            raise ValueError(f"cut short: no end-of-stream marker after {len(out)} record batches "
                             f"({sum(b.num_rows for _, _, b in out)} rows); the writer did not finish")
        return reader.schema, out, dicts


def _file_batches(path: str):
    with _open(path) as f:
        reader = pa.ipc.open_file(f)
        return reader.schema, [(-1, -1, reader.get_batch(i)) for i in range(reader.num_record_batches)], False


def _file_units(path: str, root: str, data_cfg) -> list[dict]:
    rel = fs.relative(path, root)
    base = {"path": path, "rel": rel, "error": "", "ipc": "stream", "batch": 0, "batches": 0, "offset": -1,
            "length": -1, "row_offset": 0, "rows": 1, "filtered": 0, "columns": "", "read_as": ""}
    if fs.kind(path) != "file":
        return [dict(base, error="not a regular file (dangling link, FIFO or device): never opened")]
    clauses = filters.parse(getattr(data_cfg, "filter", ""))
    ipc = "stream"
    try:
        ipc = "file" if _is_file_format(path) else "stream"
        arrow_schema, batches, dicts = (_file_batches if ipc == "file" else _stream_batches)(path)
        try:
            cols = parquet.table_columns(arrow_schema, data_cfg)
        except layouts.LayoutError as exc:
            return [dict(base, error=str(exc))]
        why = parquet.check_filter_columns(arrow_schema, data_cfg)
        if why:
            return [dict(base, error=why)]
        kept = [int(filters.mask(b, clauses).sum()) if clauses else b.num_rows for _, _, b in batches]
    except (OSError, ValueError, pa.ArrowException) as exc:  # any failure of one shard skips that shard, named
        return [dict(base, error=f"not a readable Arrow IPC {ipc}: {exc}")]
    base.update(ipc=ipc, columns=cols.to_json(), read_as=cols.describe)
    units, row, i = [], 0, 0
    while i < len(batches):
        first, n_rows, n_bytes, n_kept = i, 0, 0, 0
        while i < len(batches) and (i == first or n_rows < UNIT_ROWS and n_bytes < UNIT_BYTES):
            n_rows += batches[i][2].num_rows
            n_bytes += batches[i][2].nbytes
            n_kept += kept[i]
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
