"""Data formats behind a registry: a dataset location -> sorted read units -> RAW rows.

Each format is one module with::

    EXTS                                  file name endings it reads
    list_units(files, root, data_cfg)     -> [unit dict]   read units in a fixed order (row groups,
                                             tar shards, JSON chunks); every unit has "rel" (its file
                                             relative to the dataset root) and "error" ("" or why the
                                             file cannot be read: then it yields one skipped-file row)
    read_unit(unit, data_cfg)             -> [RAW row]     (schema.RAW_COLUMNS, records.py)
    count(units, data_cfg)                -> rows read_unit will yield, read from headers only

and its id scheme in its docstring: ids are the file path relative to the dataset root plus
the row / member key / record index, unique by construction; the data's own id follows "#".
Adding a format is one module plus one line in FORMATS.

Locations are plain paths or URIs of any pyarrow filesystem (formats/fs.py): a file, a folder
(listed recursively, sorted, hidden entries left out) or a glob. A missing or unlistable root
fails at start naming the URI; a file that cannot be read inside it is a skipped file.
Pure package: no ray (dataflow/read.py is the Ray shell).
"""
from __future__ import annotations

import fnmatch
import glob
import os

import pyarrow as pa

from ray_mmbatch.formats import fs, llava, parquet, webdataset
from ray_mmbatch.formats.records import rows_to_table

FORMATS = {"parquet": parquet, "webdataset": webdataset, "llava": llava}
_GLOB = "*?["
# 'auto' on a folder: a LLaVA index first, then the first format (in this order) with files there.
_AUTO_ORDER = ("parquet", "webdataset")


def _glob(pattern: str) -> tuple[str, list[str]]:
    """(root = the folder before the first wildcard, sorted matches) of a local or URI glob."""
    head = pattern[:min(pattern.index(c) for c in _GLOB if c in pattern)]
    root = head if head.endswith("/") else (head.rsplit("/", 1)[0] + "/" if "/" in head else "./")
    root = root.rstrip("/") or "/"
    if fs.is_uri(pattern):
        fs.check_root(root)
        files = [f for f in fs.list_files(root) if fnmatch.fnmatchcase(f, pattern)]
    else:
        files = sorted(f for f in glob.glob(fs.local_path(pattern), recursive=True) if not os.path.isdir(f))
    if not files:
        raise FileNotFoundError(f"no files match {pattern!r}")
    return root, files


def _format_of(files: list[str], location: str) -> str:
    kinds = {name for f in files for name, mod in FORMATS.items() if f.lower().endswith(mod.EXTS)}
    if len(kinds) != 1:
        raise ValueError(f"cannot tell the format of {location!r} (found {sorted(kinds) or 'no known'} files); "
                         "set data.format")
    return kinds.pop()


def resolve(location: str, fmt: str = "auto") -> tuple[str, str, list[str]]:
    """(format, dataset root, sorted files) for a file, folder or glob (local path or URI)."""
    if fmt not in tuple(FORMATS) + ("auto",):
        raise ValueError(f"data.format must be one of {tuple(FORMATS) + ('auto',)}, got {fmt!r}")
    if any(c in location for c in _GLOB) and not fs.is_uri(location) or \
            fs.is_uri(location) and any(c in location.split("://", 1)[1] for c in _GLOB):
        root, files = _glob(location)
    elif fs.check_root(location) == "dir":
        root = location.rstrip("/")
        if fmt in ("auto", "llava"):
            index = [fs.join(root, n) for n in llava.INDEX_NAMES if fs.kind(fs.join(root, n)) == "file"]
            if index:
                return "llava", root, index[:1]
        every = fs.list_files(root)
        for candidate in (_AUTO_ORDER if fmt == "auto" else (fmt,)):
            files = [f for f in every if f.lower().endswith(FORMATS[candidate].EXTS)]
            if files:
                return candidate, root, files
        want = fmt if fmt != "auto" else "data.json, *.parquet or *.tar"
        raise ValueError(f"{location!r} holds no {want} files")
    else:
        root, files = fs.dirname(location), [location]
    return (_format_of(files, location) if fmt == "auto" else fmt), root, files


def list_units(location: str, data_cfg) -> tuple[str, list[dict]]:
    """(format, read units) of a dataset location."""
    fmt, root, files = resolve(location, data_cfg.format)
    return fmt, FORMATS[fmt].list_units(files, root, data_cfg)


def read_units_table(units: pa.Table, fmt: str, data_cfg) -> pa.Table:
    """A table of read units -> a RAW table (what each Ray read task runs)."""
    rows = []
    for unit in units.to_pylist():
        rows += FORMATS[fmt].read_unit(unit, data_cfg)
    return rows_to_table(rows)
