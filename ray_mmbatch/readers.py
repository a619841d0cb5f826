"""Ray Data readers: a dataset path -> a Dataset of RAW rows (schema.RAW_COLUMNS).

Thin shell over data/sources.py, one Ray read per format:

    parquet     one row group per call, read with pyarrow (only the id/image/text columns) +
                parquet_rows; without an id column each row gets its exact "<file>:<row>" id
    webdataset  one *.tar per call, read with open() + map_batches(webdataset_samples) (a
                shard is held in memory once while it is split into rows)
    llava       the JSON is read on the driver (it is one list), sent as chunks of
                LLAVA_CHUNK records with ray.data.from_items; workers read the image files

Every format is read as a list of read units (row groups, tar files, JSON
chunks) handed to ray.data.from_items, so the unit order is ours: files are
sorted, ``shuffle_seed`` permutes the units (epochs after the first), and
``end_marker`` appends one unit that yields the schema.END_OF_STREAM_ID row
after everything else (the carry planner's end-of-stream signal; with
DataContext.execution_options.preserve_order it is the last row out).
With preserve_order the row order is the same every run. Adapters return Arrow
tables with a fixed schema, so a block of text-only rows still has list<binary>
images.
"""
from __future__ import annotations

import glob
import json
import os
import random
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from ray_mmbatch import schema
from ray_mmbatch.config import DataConfig
from ray_mmbatch.data.sources import llava_rows, parquet_rows, rows_to_table, split_member, webdataset_samples

FORMATS = ("parquet", "webdataset", "llava")
LLAVA_INDEX_NAMES = ("data.json", "data.jsonl")
LLAVA_CHUNK = 64
_EXTS = {"parquet": (".parquet",), "webdataset": (".tar", ".tar.gz", ".tgz"), "llava": (".json", ".jsonl")}


def _files_under(folder: str, exts: tuple[str, ...]) -> list[str]:
    found = []
    for dirpath, dirnames, files in os.walk(folder):
        dirnames.sort()
        found += [os.path.join(dirpath, f) for f in sorted(files) if f.endswith(exts)]
    return found


def resolve_files(path: str, fmt: str = "auto") -> tuple[str, list[str]]:
    """(format, sorted files) for a file, folder or glob; ``fmt`` 'auto' guesses from what is there."""
    if fmt not in FORMATS + ("auto",):
        raise ValueError(f"data.format must be one of {FORMATS + ('auto',)}, got {fmt!r}")
    if any(c in path for c in "*?["):
        files = sorted(glob.glob(path, recursive=True))
        if not files:
            raise FileNotFoundError(f"no files match {path!r}")
    elif os.path.isdir(path):
        index = [os.path.join(path, n) for n in LLAVA_INDEX_NAMES if os.path.isfile(os.path.join(path, n))]
        if fmt in ("auto", "llava") and index:
            return "llava", index[:1]
        for candidate in (FORMATS[:2] if fmt == "auto" else (fmt,)):
            files = _files_under(path, _EXTS[candidate])
            if files:
                return candidate, files
        raise ValueError(f"{path!r} holds no {fmt if fmt != 'auto' else 'data.json, *.parquet or *.tar'} files")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"dataset path {path!r} does not exist")
    if fmt == "auto":
        kinds = {k for f in files for k, exts in _EXTS.items() if f.endswith(exts)}
        if len(kinds) != 1:
            raise ValueError(f"cannot tell the format of {path!r} (found {sorted(kinds) or 'no known'} files); "
                             "set data.format")
        fmt = kinds.pop()
    return fmt, files


# -------------------------------------------------------------- adapters
def end_marker_row() -> dict:
    """The RAW end-of-stream row (see schema.END_OF_STREAM)."""
    return {schema.SAMPLE_ID: schema.END_OF_STREAM_ID, schema.CONVERSATIONS: "[]", schema.IMAGES: [],
            schema.IMAGE_REFS: [], schema.READ_ERROR: schema.END_OF_STREAM}


def is_end_marker(sample_id, reason) -> bool:
    return str(sample_id) == schema.END_OF_STREAM_ID and str(reason) == schema.END_OF_STREAM


def _parquet_row_group(units: pa.Table, data_cfg: DataConfig, columns: list[str]) -> pa.Table:
    tables = []
    for unit in units.to_pylist():
        if unit["end"]:
            tables.append(rows_to_table([end_marker_row()]))
            continue
        part = pq.ParquetFile(unit["path"]).read_row_group(unit["row_group"], columns=columns)
        tables.append(parquet_rows(part, data_cfg, file_name=os.path.basename(unit["path"]),
                                   row_offset=unit["row_offset"]))
    return pa.concat_tables(tables)


def _webdataset_batch(units: pa.Table) -> pa.Table:
    rows = []
    for unit in units.to_pylist():
        if unit["end"]:
            rows.append(end_marker_row())
            continue
        with open(unit["path"], "rb") as f:
            data = f.read()
        rows += webdataset_samples(data, os.path.basename(unit["path"]))
    return rows_to_table(rows)


def _llava_batch(chunks: pa.Table, image_root: str, file_name: str) -> pa.Table:
    rows = []
    for unit in chunks.to_pylist():
        if unit["end"]:
            rows.append(end_marker_row())
            continue
        rows += llava_rows(json.loads(unit["records"]), image_root, file_name=file_name,
                           row_offset=unit["row_offset"])
    return rows_to_table(rows)


def _units_dataset(units: list[dict], blocks: int | None, shuffle_seed: int | None,
                   end_marker: bool) -> ray.data.Dataset:
    """Read units -> a from_items Dataset: optionally permuted, optionally + the end-marker unit."""
    if shuffle_seed is not None:
        units = random.Random(shuffle_seed).sample(units, len(units))
    units = [dict(u, end=False) for u in units]
    if end_marker:
        units.append(dict(units[-1], end=True) if units else {"end": True})
    return ray.data.from_items(units, override_num_blocks=min(len(units), blocks or len(units)) or 1)


# ----------------------------------------------------------------- reads
# Each format: files -> (read units, the function that reads a table of units, its kwargs).
def _parquet_units(files: list[str], data_cfg: DataConfig):
    names = pq.read_schema(files[0]).names
    if data_cfg.text_column not in names:
        raise ValueError(f"{files[0]}: text column {data_cfg.text_column!r} not found; columns are {names} "
                         "(set data.text_column)")
    columns = [c for c in (data_cfg.id_column, data_cfg.image_column, data_cfg.text_column) if c in names]
    # One task per row group, read with pyarrow: Ray's own Parquet reader (2.60) starts
    # dozens of processes to read footers and may pack every file into one block, which
    # leaves a 2-core machine's later stages a single task to work on (bench_ingest).
    units = []
    for f in files:
        meta, offset = pq.ParquetFile(f).metadata, 0
        for g in range(meta.num_row_groups):
            units.append({"path": f, "row_group": g, "row_offset": offset})
            offset += meta.row_group(g).num_rows
    return units, _parquet_row_group, {"data_cfg": data_cfg, "columns": columns}


def _webdataset_units(files: list[str], data_cfg: DataConfig):
    return [{"path": f} for f in files], _webdataset_batch, {}


def _llava_records(files: list[str]) -> list:
    """The records of the one LLaVA JSON / JSONL file (a line that is not JSON stays as a string)."""
    if len(files) != 1:
        raise ValueError(f"LLaVA format reads one JSON file, got {len(files)}: {files[:3]}")
    path = files[0]
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            records = []
            for line in f:
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError:
                        records.append(f"not JSON: {line[:80]}")  # kept: a row with malformed_record
        else:
            records = json.load(f)
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a JSON list of records, got {type(records).__name__}")
    return records


def _llava_units(files: list[str], data_cfg: DataConfig):
    records, path = _llava_records(files), files[0]
    chunks = [{"row_offset": i, "records": json.dumps(records[i:i + LLAVA_CHUNK], ensure_ascii=True)}
              for i in range(0, len(records), LLAVA_CHUNK)]
    root = data_cfg.image_root or os.path.dirname(os.path.abspath(path))
    return chunks, _llava_batch, {"image_root": root, "file_name": os.path.basename(path)}


_UNITS = {"parquet": _parquet_units, "webdataset": _webdataset_units, "llava": _llava_units}


def read_units(path: str, data_cfg: DataConfig):
    """(read units, read_fn, read_kwargs): ``read_fn(pa.Table of units, **read_kwargs)`` -> RAW table.

    What ``read_raw`` runs as Ray tasks, callable in-process too (ray_mmbatch.local_batches).
    """
    fmt, files = resolve_files(path, data_cfg.format)
    return _UNITS[fmt](files, data_cfg)


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
    the LLaVA record list, WebDataset tar headers (a broken tar counts what it lists).
    For progress and the learning-rate schedule of runs that go by epochs."""
    fmt, files = resolve_files(path, data_cfg.format)
    if fmt == "parquet":
        return sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    if fmt == "llava":
        return len(_llava_records(files))
    total = 0
    for f in files:
        keys = set()
        try:
            with tarfile.open(f, mode="r:*") as archive:
                for member in archive:
                    if member.isfile():
                        keys.add(split_member(member.name)[0])
        except (tarfile.TarError, OSError, EOFError):
            keys.add(f"{f}:unreadable-tail")
        total += len(keys)
    return total
