"""Ray Data readers: a dataset location -> a Dataset of RAW rows (schema.RAW_COLUMNS).

The Ray shell over formats/ (one module per format behind a registry; paths or URIs of
any pyarrow filesystem): ``read_units`` lists the read units (row groups, tar shards,
LLaVA JSON chunks) in sorted order, ``read_raw`` hands them to ray.data.from_items and
reads each with one map_batches call, so the unit order is ours: ``shuffle_seed``
permutes the units (epochs after the first), and ``end_marker`` appends one unit that
yields the schema.END_OF_STREAM_ID row after everything else (the carry planner's
end-of-stream signal; with DataContext.execution_options.preserve_order it is the last
row out). With preserve_order the row order is the same every run. Read functions
return Arrow tables with a fixed schema, so a block of text-only rows still has
list<binary> images. Ray workers build their filesystem clients from the same
environment (AWS_* etc.) the driver's cluster was started with.
"""
from __future__ import annotations

import random

import pyarrow as pa
import ray

from ray_mmbatch import formats, schema
from ray_mmbatch.config import DataConfig
from ray_mmbatch.formats import llava
from ray_mmbatch.formats.records import rows_to_table

FORMATS = tuple(formats.FORMATS)
LLAVA_INDEX_NAMES = llava.INDEX_NAMES
LLAVA_CHUNK = llava.CHUNK


def resolve_files(path: str, fmt: str = "auto") -> tuple[str, list[str]]:
    """(format, sorted files) for a file, folder or glob (path or URI); ``fmt`` 'auto' guesses."""
    fmt, _, files = formats.resolve(path, fmt)
    return fmt, files


def end_marker_row() -> dict:
    """The RAW end-of-stream row (see schema.END_OF_STREAM)."""
    return {schema.SAMPLE_ID: schema.END_OF_STREAM_ID, schema.CONVERSATIONS: "[]", schema.IMAGES: [],
            schema.IMAGE_REFS: [], schema.READ_ERROR: schema.END_OF_STREAM}


def is_end_marker(sample_id, reason) -> bool:
    return str(sample_id) == schema.END_OF_STREAM_ID and str(reason) == schema.END_OF_STREAM


def read_unit_table(units: pa.Table, fmt: str, data_cfg: DataConfig) -> pa.Table:
    """A table of read units (with the "end" flag) -> RAW table: what each read task runs."""
    tables = []
    for i, end in enumerate(units.column("end").to_pylist()):
        tables.append(rows_to_table([end_marker_row()]) if end else
                      formats.read_units_table(units.slice(i, 1).drop_columns(["end"]), fmt, data_cfg))
    return pa.concat_tables(tables) if tables else rows_to_table([])


def _units_dataset(units: list[dict], blocks: int | None, shuffle_seed: int | None,
                   end_marker: bool) -> ray.data.Dataset:
    """Read units -> a from_items Dataset: optionally permuted, optionally + the end-marker unit."""
    if shuffle_seed is not None:
        units = random.Random(shuffle_seed).sample(units, len(units))
    units = [dict(u, end=False) for u in units]
    if end_marker:
        units.append(dict(units[-1], end=True) if units else {"end": True})
    return ray.data.from_items(units, override_num_blocks=min(len(units), blocks or len(units)) or 1)


def read_units(path: str, data_cfg: DataConfig):
    """(read units, read_fn, read_kwargs): ``read_fn(pa.Table of units, **read_kwargs)`` -> RAW table.

    What ``read_raw`` runs as Ray tasks, callable in-process too (ray_mmbatch.local_batches).
    A missing dataset root, or one that cannot be listed, raises here (naming the URI).
    """
    fmt, units = formats.list_units(path, data_cfg)
    return units, read_unit_table, {"fmt": fmt, "data_cfg": data_cfg}


def read_raw(path: str, data_cfg: DataConfig, *, override_num_blocks: int | None = None,
             shuffle_seed: int | None = None, end_marker: bool = False) -> ray.data.Dataset:
    """A Dataset of RAW rows (schema.RAW_COLUMNS) for a Parquet / WebDataset / LLaVA path.

    ``data_cfg.format`` 'auto' guesses: a folder with data.json -> llava, *.parquet -> parquet,
    *.tar -> webdataset; a single file by its extension. ``shuffle_seed`` permutes the read
    units; ``end_marker`` appends the end-of-stream row (see the module docstring).
    """
    units, read_fn, kwargs = read_units(path, data_cfg)
    ds = _units_dataset(units, override_num_blocks, shuffle_seed, end_marker)
    ds = ds.map_batches(read_fn, fn_kwargs=kwargs, batch_format="pyarrow", batch_size=1)
    return ds.select_columns(list(schema.RAW_COLUMNS))


def count_samples(path: str, data_cfg: DataConfig) -> int:
    """How many RAW rows ``read_raw`` will yield, without reading any image: Parquet footers,
    the LLaVA record list, WebDataset tar headers (a broken tar counts what it lists; a file
    that cannot be read counts its one skipped-file row). For progress and the learning-rate
    schedule of runs that go by epochs."""
    fmt, units = formats.list_units(path, data_cfg)
    return formats.FORMATS[fmt].count(units, data_cfg)
