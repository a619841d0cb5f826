"""Ray Data readers: a dataset location -> a Dataset of RAW rows (schema.RAW_COLUMNS).

The Ray shell over formats/ (one module per format behind a registry; paths or URIs of
any pyarrow filesystem): ``read_units`` lists the read units (row groups, tar shards,
LLaVA JSON chunks) in sorted order, ``read_raw`` hands them to ray.data.from_items and
reads each with one map_batches call, so the unit order is ours: ``order`` lists the
units in the epoch's order (batching/shuffle.unit_order), and ``end_marker`` appends the end-of-stream unit
(end_of_stream.py; with DataContext.execution_options.preserve_order its row is the last
out). With preserve_order the row order is the same every run. Read functions
return Arrow tables with a fixed schema, so a block of text-only rows still has
list<binary> images. Ray workers build their filesystem clients from the same
environment (AWS_* etc.) the driver's cluster was started with.
"""
from __future__ import annotations

import hashlib
import json
import zlib

import pyarrow as pa
import ray

from ray_mmbatch import formats, schema
from ray_mmbatch.config import DataConfig
from ray_mmbatch.end_of_stream import END_UNIT, marker_table, with_end_unit
from ray_mmbatch.formats import llava
from ray_mmbatch.formats.records import rows_to_table

FORMATS = tuple(formats.FORMATS)
LLAVA_INDEX_NAMES = llava.INDEX_NAMES
LLAVA_CHUNK = llava.CHUNK


def resolve_files(path: str, fmt: str = "auto") -> tuple[str, list[str]]:
    """(format, sorted files) for a file, folder or glob (path or URI); ``fmt`` 'auto' guesses."""
    fmt, _, files = formats.resolve(path, fmt)
    return fmt, files


def read_unit_table(units: pa.Table, fmt: str, data_cfg: DataConfig) -> pa.Table:
    """A table of read units (with the "end" flag) -> RAW table: what each read task runs."""
    tables = []
    for i, end in enumerate(units.column(END_UNIT).to_pylist()):
        tables.append(marker_table() if end else
                      formats.read_units_table(units.slice(i, 1).drop_columns([END_UNIT]), fmt, data_cfg))
    return pa.concat_tables(tables) if tables else rows_to_table([])


def _units_dataset(units: list[dict], blocks: int | None, order: list[int] | None,
                   end_marker: bool) -> ray.data.Dataset:
    """Read units -> a from_items Dataset in ``order`` (listing indices; None = listing order),
    optionally + the end-marker unit."""
    units = with_end_unit([units[i] for i in (range(len(units)) if order is None else order)], end_marker)
    return ray.data.from_items(units, override_num_blocks=min(len(units), blocks or len(units)) or 1)


def read_units(path: str, data_cfg: DataConfig):
    """(read units, read_fn, read_kwargs): ``read_fn(pa.Table of units, **read_kwargs)`` -> RAW table.

    What ``read_raw`` runs as Ray tasks, callable in-process too (ray_mmbatch.local_batches).
    A missing dataset root, or one that cannot be listed, raises here (naming the URI).
    """
    fmt, units = formats.list_units(path, data_cfg)
    return units, read_unit_table, {"fmt": fmt, "data_cfg": data_cfg}


def listing_digest(units: list[dict]) -> str:
    """What the data position's unit indices refer to: each unit's relative path, row group, row
    offset and row count (and a CRC of a LLaVA chunk's records), hashed; the same wherever the
    data is mounted (a local copy and its bucket give the same digest)."""
    h = hashlib.sha256()
    for u in units:
        rec = u.get("records")
        key = [u.get("rel", ""), u.get("row_group", -1), u.get("row_offset", -1), u.get("rows", -1),
               zlib.crc32(rec.encode()) if isinstance(rec, str) else -1]
        h.update(json.dumps(key).encode())
    return f"{len(units)}:{h.hexdigest()[:16]}"


def check_listing(position: dict | None, digest: str, path: str) -> None:
    """A resume over a different listing would leave out the wrong rows: fail, naming both."""
    recorded = str((position or {}).get("listing") or "")
    if recorded and recorded != digest:
        raise ValueError(
            f"{path}: the dataset's read units changed since the checkpoint (listing {recorded} then, {digest} "
            "now: files added, removed or rewritten). The checkpoint's data position counts units in the "
            "old listing, so resuming over this one would skip the wrong samples. Restore the old files, or "
            "start a new run (another --run-name / --output-dir) to train on the new set.")


def read_with_position(units: pa.Table, read_fn, read_kwargs: dict, done=None) -> pa.Table:
    """Read a table of units with ``read_fn``, appending each row's read position
    (schema.READ_POSITION_COLUMNS: the unit's index in the sorted listing, the row in it, the
    unit's row count; the end-of-stream row is unit -1). ``done`` (data.position.EpochPosition,
    resume): finished units are not read, rows already trained are dropped here."""
    import numpy as np

    tables = []
    for i in range(units.num_rows):
        unit = units.slice(i, 1)
        uid = -1 if unit.column(END_UNIT)[0].as_py() else int(unit.column(schema.UNIT)[0].as_py())
        if done is not None and done.unit_finished(uid):
            continue
        t = read_fn(unit, **read_kwargs)
        n = t.num_rows
        t = (t.select(list(schema.RAW_COLUMNS)).append_column(schema.UNIT, pa.array(np.full(n, uid, np.int64)))
             .append_column(schema.UNIT_ROW, pa.array(np.arange(n, dtype=np.int64)))
             .append_column(schema.UNIT_ROWS, pa.array(np.full(n, n, np.int64))))
        keep = done.rows_to_read(uid, n) if done is not None and uid >= 0 else None
        tables.append(t if keep is None else t.filter(pa.array(keep)))
    if not tables:
        empty = rows_to_table([])
        return empty.select(list(schema.RAW_COLUMNS)).append_column(schema.UNIT, pa.array([], pa.int64())) \
            .append_column(schema.UNIT_ROW, pa.array([], pa.int64())) \
            .append_column(schema.UNIT_ROWS, pa.array([], pa.int64()))
    return pa.concat_tables(tables)


def read_raw(path: str, data_cfg: DataConfig, *, override_num_blocks: int | None = None,
             order: list[int] | None = None, end_marker: bool = False, done=None,
             listing: tuple | None = None) -> ray.data.Dataset:
    """A Dataset of RAW rows (schema.RAW_COLUMNS + READ_POSITION_COLUMNS) for a Parquet / WebDataset / LLaVA path.

    ``data_cfg.format`` 'auto' guesses: a folder with data.json -> llava, *.parquet -> parquet,
    *.tar -> webdataset; a single file by its extension. ``order``: the units' read order
    (listing indices, batching/shuffle.unit_order; None = listing order); ``end_marker``
    appends the end-of-stream row (see the module docstring); ``done`` (resume) leaves out what
    an epoch already trained (see read_with_position); ``listing``: what ``read_units`` returned,
    when the caller listed already.
    """
    units, read_fn, kwargs = listing or read_units(path, data_cfg)
    units = [dict(u, **{schema.UNIT: i}) for i, u in enumerate(units)]  # index in the sorted listing
    ds = _units_dataset(units, override_num_blocks, order, end_marker)
    ds = ds.map_batches(read_with_position, fn_kwargs={"read_fn": read_fn, "read_kwargs": kwargs, "done": done},
                        batch_format="pyarrow", batch_size=1)
    return ds.select_columns(list(schema.RAW_COLUMNS + schema.READ_POSITION_COLUMNS))


def count_samples(path: str, data_cfg: DataConfig) -> int:
    """How many RAW rows ``read_raw`` will yield, without reading any image: Parquet footers,
    the LLaVA record list, WebDataset tar headers (a broken tar counts what it lists; a file
    that cannot be read counts its one skipped-file row). For progress and the learning-rate
    schedule of runs that go by epochs."""
    fmt, units = formats.list_units(path, data_cfg)
    return formats.FORMATS[fmt].count(units, data_cfg)
