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
Inside a run's scope (formats/listing.py) ``resolve``, ``list_units`` and ``count`` run once per source.
Pure package: no ray (dataflow/read.py is the Ray shell).
"""
from __future__ import annotations

import fnmatch
import glob
import os

import pyarrow as pa

from ray_mmbatch.formats import arrow, data_patterns, fs, listing, llava, parquet, splits, webdataset
from ray_mmbatch.formats.records import rows_to_table

FORMATS = {"parquet": parquet, "webdataset": webdataset, "llava": llava, "arrow": arrow}
_GLOB = "*?["
# 'auto' on a folder: a LLaVA index first, then the first format (in this order) with files there
# (of the chosen split, img2dataset's bookkeeping left out), then the JSON / JSON Lines files.
_AUTO_ORDER = ("parquet", "arrow", "webdataset")
# JSON beside data that is never records: the datasets library's metadata, ray-mmbatch prepare's manifest
NOT_JSON_DATA = data_patterns.FILES_TO_IGNORE | frozenset(splits.NOT_DATA) | {"state.json"}


def _glob(pattern: str) -> tuple[str, list[str]]:
    """(root = the folder before the first wildcard, sorted matches) of a local or URI glob."""
    head = pattern[:min(pattern.index(c) for c in _GLOB if c in pattern)]
    root = head if head.endswith("/") else (head.rsplit("/", 1)[0] + "/" if "/" in head else "./")
    root = root.rstrip("/") or "/"
    if fs.is_uri(pattern):
        listing.check_root(root)
        files = [f for f in listing.files(root) if fnmatch.fnmatchcase(f, pattern)]
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


def _is_glob(location: str) -> bool:
    """Wildcards in the path, and no file or folder of that very name (config folders hold brackets)."""
    tail = location.split("://", 1)[1] if fs.is_uri(location) else location
    if not any(c in tail for c in _GLOB):
        return False
    try:
        return listing.kind(location) == "missing"
    except OSError:
        return True


def _bookkeeping(files: list[str]) -> set[str]:
    """Files beside the data that are never data: img2dataset's NNNNN.parquet / NNNNN_stats.json beside each
    NNNNN.tar, and the ``datasets`` library's cache files (cache-*.arrow) in a save_to_disk folder."""
    tars = {f[:-4] for f in files if f.lower().endswith(".tar")}
    return {f for f in files if (f.lower().endswith(".parquet") and f[:-8] in tars)
            or (f.lower().endswith("_stats.json") and f[:-11] in tars)
            or (f.lower().endswith(".arrow") and os.path.basename(f).startswith("cache-"))}


def resolve(location: str, fmt: str = "auto", split: str = "train") -> tuple[str, str, list[str]]:
    """(format, dataset root, sorted files) for a file, folder or glob (local path or URI). A folder whose
    files name Hub splits gives the files of ``split`` only (formats/splits.py). Once per run
    (formats/listing.py)."""
    return listing.remembered(("resolve", location, fmt, split), lambda: _resolve(location, fmt, split),
                              lambda found: (found[0], found[1], list(found[2])))


def _resolve(location: str, fmt: str, split: str) -> tuple[str, str, list[str]]:
    if fmt not in tuple(FORMATS) + ("auto",):
        raise ValueError(f"data.format must be one of {tuple(FORMATS) + ('auto',)}, got {fmt!r}")
    if _is_glob(location):
        root, files = _glob(location)
    elif listing.check_root(location) == "dir":
        root = location.rstrip("/")
        every = listing.files(root)
        names = {fs.relative(f, root) for f in every}
        if fmt in ("auto", "llava"):
            index = [fs.join(root, n) for n in llava.INDEX_NAMES if n in names]
            if index:
                return "llava", root, index[:1]
        skip = _bookkeeping(every)
        every = splits.select(root, [f for f in every if f not in skip], split)
        for candidate in (_AUTO_ORDER if fmt == "auto" else (fmt,)):
            if candidate not in FORMATS or candidate == "llava":  # below, its metadata files left out
                continue
            files = [f for f in every if f.lower().endswith(FORMATS[candidate].EXTS)]
            if files:
                return candidate, root, files
        if fmt in ("auto", "llava"):  # the JSON / JSON Lines files of the split ("train.jsonl", "x.dev.jsonl")
            files = [f for f in every if f.lower().endswith(llava.EXTS) and os.path.basename(f) not in NOT_JSON_DATA]
            if files:
                return "llava", root, files
        want = fmt if fmt != "auto" else "data.json, *.parquet, *.arrow, *.tar, *.json or *.jsonl"
        raise ValueError(f"{location!r} holds no {want} files")
    else:
        root, files = fs.dirname(location), [location]
    return (_format_of(files, location) if fmt == "auto" else fmt), root, files


def list_units(location: str, data_cfg) -> tuple[str, list[dict]]:
    """(format, read units) of a dataset location; once per run and settings (formats/listing.py)."""
    def compute():
        fmt, root, files = resolve(location, data_cfg.format, getattr(data_cfg, "split", "train"))
        return fmt, FORMATS[fmt].list_units(files, root, data_cfg)
    return listing.remembered(("units", location, listing.settings_key(data_cfg)), compute, listing.copy_units)


def count(location: str, data_cfg) -> int:
    """Rows the source's units yield (its format's ``count``: headers only); once per run and settings."""
    def compute():
        fmt, units = list_units(location, data_cfg)
        return FORMATS[fmt].count(units, data_cfg)
    return listing.remembered(("count", location, listing.settings_key(data_cfg)), compute)


def read_as(fmt: str, units: list[dict], data_cfg) -> list[str]:
    """How the units are read, one line per layout met (what ``inspect`` and the run's start-up print)."""
    lines = sorted({u.get("read_as", "") for u in units if u.get("read_as")})
    if lines:
        return lines
    if fmt == "llava":
        where = data_cfg.image_root or "the JSON file's folder"
        return [f"LLaVA JSON: conversations [{{from, value}}] + image / video paths under {where}"]
    if fmt == "webdataset":
        return ["WebDataset shards: KEY.json dialogue (or KEY.txt caption) + KEY.<image / video ext>"]
    return [fmt]


def read_units_table(units: pa.Table, fmt: str, data_cfg) -> pa.Table:
    """A table of read units -> a RAW table (what each Ray read task runs)."""
    rows = []
    for unit in units.to_pylist():
        rows += FORMATS[fmt].read_unit(unit, data_cfg)
    return rows_to_table(rows)
