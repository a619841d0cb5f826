"""Read units: the listing of a dataset location and reading one unit, with read positions.

Pure (no Ray): the functions both the Ray path (dataflow/read.py: one Ray task per unit) and
the in-process path (dataflow/local.py) run. ``read_units`` lists the read units (row groups,
tar shards, LLaVA JSON chunks) in sorted order; ``listing_digest`` names that listing in a
checkpoint and ``check_listing`` refuses a resume over another one; ``read_with_position``
reads units with each row's read position (schema.READ_POSITION_COLUMNS) and leaves out what
an epoch already trained; ``count_samples`` counts rows without reading images. Read
functions return Arrow tables with a fixed schema, so a block of text-only rows still has
list<binary> images.
"""
from __future__ import annotations

import copy
import hashlib
import json
import zlib

import pyarrow as pa

from ray_mmbatch import formats, schema
from ray_mmbatch.config import DataConfig
from ray_mmbatch.formats import listing
from ray_mmbatch.formats.end_of_stream import END_UNIT, marker_table
from ray_mmbatch.formats.records import rows_to_table


def resolve_files(path: str, fmt: str = "auto", split: str = "train") -> tuple[str, list[str]]:
    """(format, sorted files) for a file, folder or glob (path or URI); ``fmt`` 'auto' guesses; a folder with
    Hub split names gives the files of ``split`` (formats/splits.py)."""
    fmt, _, files = formats.resolve(path, fmt, split)
    return fmt, files


def read_unit_table(units: pa.Table, fmt: str, data_cfg: DataConfig) -> pa.Table:
    """A table of read units (with the "end" flag) -> RAW table: what each read task runs."""
    tables = []
    for i, end in enumerate(units.column(END_UNIT).to_pylist()):
        tables.append(marker_table() if end else
                      formats.read_units_table(units.slice(i, 1).drop_columns([END_UNIT]), fmt, data_cfg))
    return pa.concat_tables(tables) if tables else rows_to_table([])


@listing.in_one_listing
def read_units(path: str, data_cfg: DataConfig):
    """(read units, read_fn, read_kwargs): ``read_fn(pa.Table of units, **read_kwargs)`` -> RAW table.

    What ``read_raw`` runs as Ray tasks, callable in-process too (ray_mmbatch.local_batches).
    A missing dataset root, or one that cannot be listed, raises here (naming the URI).
    With ``data_cfg.sources`` (formats/sources.py) ``path`` is not read: the units of every
    source, one after the other, each tagged with its source's index.
    """
    from ray_mmbatch.formats.sources import blended
    from ray_mmbatch.formats.splits import expand

    if not data_cfg.sources and path and path != data_cfg.path:  # the path given apart from the config
        data_cfg = copy.copy(data_cfg)
        data_cfg.path = path
    data_cfg = expand(data_cfg)  # a folder of configs: one source per config
    if int(data_cfg.epoch_samples or 0) < 0 or (data_cfg.epoch_samples and not blended(data_cfg)):
        raise ValueError(f"--epoch-samples {data_cfg.epoch_samples}: the size of a blended epoch, so it needs "
                         "sources with weights (--data PATH#WEIGHT repeated, or weight: in data.sources) and a "
                         "count > 0; without weights every epoch reads each sample once")
    if data_cfg.sources:
        from ray_mmbatch.formats.sources import SOURCE, BlendPlan, data_sources

        sources, blend = data_sources(data_cfg), blended(data_cfg)
        units, specs, rows = [], [], []
        for k, src in enumerate(sources):
            fmt, listed = formats.list_units(src.data.path, src.data)
            firsts = _unit_rows(src.data.path, src.data, fmt, listed) if blend else [0] * (len(listed) + 1)
            for u, row0 in zip(listed, firsts):  # each unit's first row within its source: the blend draws per row
                units.append(dict(u, **{SOURCE: k, SOURCE_ROW0: row0}))
            rows.append(firsts[-1])
            specs.append((src.name, fmt, src.data))
        plan = BlendPlan(rows, [s.weight for s in sources], data_cfg.epoch_samples) if blend else None
        return units, read_source_units, {"sources": specs, "blend": plan, "epoch": 0, "seed": 0}
    fmt, units = formats.list_units(path, data_cfg)
    return units, read_unit_table, {"fmt": fmt, "data_cfg": data_cfg}


SOURCE_ROW0 = "source_row0"  # a multi-source unit's first row within its source (the blend's row index)


def _unit_rows(path: str, data_cfg, fmt: str, units: list[dict]) -> list[int]:
    """Each unit's first row within its source, then the source's rows (a tar shard's rows are read from its
    headers): once per run."""
    def compute():
        out = [0]
        for u in units:
            out.append(out[-1] + formats.FORMATS[fmt].count([u], data_cfg))
        return out
    return listing.remembered(("unit_rows", path, listing.settings_key(data_cfg)), compute, list)


#: A WebDataset shard's samples where a count must not read the shards (img2dataset writes 10,000)
SHARD_ROWS = 1_000


def listed_rows(reader: tuple, exact: bool = True) -> int | None:
    """Rows an epoch of ``read_units``' listing yields, from the listing alone (formats' ``count``; a blend: its
    epoch's targets). A tar shard's count would read its headers (a stream per shard on an object store): with
    ``exact`` a listing with shards gives None, else each shard counts as SHARD_ROWS."""
    from ray_mmbatch.formats.sources import SOURCE

    units, _, kwargs = reader
    if kwargs.get("blend") is not None:
        return int(sum(kwargs["blend"].targets))
    specs = kwargs.get("sources") or [("", kwargs["fmt"], kwargs["data_cfg"])]
    total = 0
    for k, (_, fmt, cfg) in enumerate(specs):
        mine = [u for u in units if int(u.get(SOURCE, 0)) == k] if kwargs.get("sources") else units
        if fmt == "webdataset":
            if exact:
                return None
            total += len(mine) * SHARD_ROWS
        else:
            total += formats.FORMATS[fmt].count(mine, cfg)
    return total


def for_epoch(reader: tuple, seed: int, epoch: int) -> tuple:
    """``read_units``' result for one epoch of a blend (which copies each row gets depends on it)."""
    units, fn, kwargs = reader
    if kwargs.get("blend") is None:
        return reader
    kwargs = dict(kwargs, epoch=int(epoch), seed=int(seed))
    kwargs["copies"] = kwargs["blend"].for_epoch(int(epoch), int(seed))
    return units, fn, kwargs


def read_source_units(units: pa.Table, sources: list, blend=None, epoch: int = 0, seed: int = 0,
                      copies=None) -> pa.Table:
    """``read_unit_table`` over units of several sources: each with its source's (format, settings),
    its sample ids as ``name:id`` (formats/sources.py); with a blend, each row as many times as the
    epoch's plan says (``copies`` from ``for_epoch``), consecutive, extra copies' ids ``id~k``."""
    import numpy as np
    import pyarrow.compute as pc

    from ray_mmbatch.formats.sources import ID_SEP, SOURCE

    tables = []
    for i, (end, k) in enumerate(zip(units.column(END_UNIT).to_pylist(), units.column(SOURCE).to_pylist())):
        if end:
            tables.append(marker_table())
            continue
        name, fmt, cfg = sources[int(k)]
        row = units.slice(i, 1).to_pylist()[0]
        unit = {key: v for key, v in row.items() if key not in (END_UNIT, SOURCE, SOURCE_ROW0)}
        t = formats.read_units_table(pa.Table.from_pylist([unit]), fmt, cfg)
        ids = pc.binary_join_element_wise(pa.scalar(name + ID_SEP), t.column(schema.SAMPLE_ID).cast(pa.string()), "")
        t = t.set_column(t.schema.get_field_index(schema.SAMPLE_ID), schema.SAMPLE_ID, ids)
        if blend is not None:
            base, threshold = (copies or blend.for_epoch(epoch, seed))[int(k)]
            src_rows = int(row.get(SOURCE_ROW0) or 0) + np.arange(t.num_rows)
            n = base + (blend.scores(int(k), epoch, src_rows, seed) < np.uint64(threshold)).astype(np.int64)
            n[np.asarray([bool(e) for e in t.column(schema.READ_ERROR).to_pylist()], bool)] = 1  # reported once
            take = np.repeat(np.arange(t.num_rows), n)
            t = t.take(pa.array(take))
            if len(take):  # the k-th extra copy of a row: id~k (ids stay unique in the epoch)
                rank = np.arange(len(take)) - np.repeat(np.cumsum(n) - n, n)
                sid = t.column(schema.SAMPLE_ID).to_pylist()
                t = t.set_column(t.schema.get_field_index(schema.SAMPLE_ID), schema.SAMPLE_ID,
                                 pa.array([s if r == 0 else f"{s}~{r}" for s, r in zip(sid, rank)], pa.string()))
        tables.append(t)
    return pa.concat_tables(tables) if tables else rows_to_table([])


def listing_digest(units: list[dict]) -> str:
    """What the data position's unit indices refer to: each unit's relative path, row group, row
    offset and row count (and a byte-range unit's offset and length), hashed; the same wherever the
    data is mounted (a local copy and its bucket give the same digest)."""
    h = hashlib.sha256()
    for u in units:
        rec = u.get("records")
        key = [u.get("rel", ""), u.get("row_group", -1), u.get("row_offset", -1), u.get("rows", -1),
               zlib.crc32(rec.encode()) if isinstance(rec, str) else -1]
        if "offset" in u:  # a byte-range unit (JSON / JSON Lines, Arrow): where its bytes lie, too
            key += [u.get("offset"), u.get("length")]
        if "source" in u:  # several sources (formats/sources.py): which one, too
            key.append(u["source"])
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


def read_with_position(units: pa.Table, read_fn, read_kwargs: dict, done=None, split=None) -> pa.Table:
    """Read a table of units with ``read_fn``, appending each row's read position
    (schema.READ_POSITION_COLUMNS: the unit's index in the sorted listing, the row in it, the
    unit's row count; the end-of-stream row is unit -1). ``done`` (data.position.EpochPosition,
    resume): finished units are not read, rows already trained are dropped here. ``split``
    (name, fraction): only the rows of that side of the held-out split (data/split.py)."""
    import numpy as np

    from ray_mmbatch.data.split import keep_mask

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
        side = keep_mask(split, t.column(schema.SAMPLE_ID).to_pylist(), t.column(schema.READ_ERROR).to_pylist()) \
            if uid >= 0 else None
        if side is not None:
            keep = side if keep is None else keep & side
        tables.append(t if keep is None else t.filter(pa.array(keep)))
    if not tables:
        empty = rows_to_table([])
        return empty.select(list(schema.RAW_COLUMNS)).append_column(schema.UNIT, pa.array([], pa.int64())) \
            .append_column(schema.UNIT_ROW, pa.array([], pa.int64())) \
            .append_column(schema.UNIT_ROWS, pa.array([], pa.int64()))
    return pa.concat_tables(tables)


@listing.in_one_listing
def count_samples(path: str, data_cfg: DataConfig) -> int:
    if data_cfg.sources:
        from ray_mmbatch.formats.sources import blended, data_sources

        if blended(data_cfg):  # an epoch holds the blend's targets
            return sum(read_units(path, data_cfg)[2]["blend"].targets)
        return sum(_count_one(src.data.path, src.data) for src in data_sources(data_cfg))
    return _count_one(path, data_cfg)


def _count_one(path: str, data_cfg: DataConfig) -> int:
    """How many RAW rows ``read_raw`` will yield, without reading any image: Parquet footers,
    the LLaVA record list, WebDataset tar headers (a broken tar counts what it lists; a file
    that cannot be read counts its one skipped-file row). For progress and the learning-rate
    schedule of runs that go by epochs."""
    return formats.count(path, data_cfg)


@listing.in_one_listing
def listing_summary(reader: tuple, data_cfg: DataConfig) -> dict:
    """What a listing says before any read: how each source is read (formats.read_as), the splits its folder
    holds, the one read and the files left out (formats/splits.py), and the rows --filter leaves out
    ("filtered", per source)."""
    from ray_mmbatch.formats.sources import SOURCE

    units, _, kwargs = reader
    specs = kwargs.get("sources") or [("", kwargs["fmt"], kwargs["data_cfg"])]
    out: dict = {"read_as": [], "splits": {}, "filtered": {}}
    for k, (name, fmt, cfg) in enumerate(specs):
        mine = [u for u in units if int(u.get(SOURCE, 0)) == k]
        prefix = f"{name}: " if name else ""
        out["read_as"] += [prefix + line for line in formats.read_as(fmt, mine, cfg)]
        filtered = sum(int(u.get("filtered", 0) or 0) for u in mine)
        if filtered or getattr(cfg, "filter", ""):
            out["filtered"][name] = filtered
        try:
            if cfg.path and listing.kind(cfg.path) == "dir":
                out["splits"].update(_split_summary(name or cfg.path, cfg))
        except (OSError, ValueError):
            pass
    return out


def _split_summary(key: str, cfg: DataConfig) -> dict:
    """{key: the splits a folder holds (as HF datasets names them), the one read and the files left out}."""
    from ray_mmbatch.formats import splits

    root = cfg.path.rstrip("/")
    every = listing.files(root)
    skip = formats._bookkeeping(every)
    sel = splits.selection(root, [f for f in every if f not in skip], cfg.split)
    if not sel.found:
        return {}
    gone = sel.left_out()
    told = {"left_out": {s: len(r) for s, r in gone.items()},
            "left_out_files": [r for rs in gone.values() for r in rs][:10]} if gone else {}
    return {key: {"found": splits.counts(sel.found), "read": sel.split, **told}}


@listing.in_one_listing
def filtered_counts(data_cfg: DataConfig) -> dict[str, int]:
    """Rows --filter leaves out, per source name ('' for a single dataset); {} without a filter. Listed
    again (the filter's columns only): what summary.json reports as filtered, apart from skips."""
    entries = data_cfg.sources or []
    if not (data_cfg.filter or any(isinstance(e, dict) and e.get("filter") for e in entries)):
        return {}
    return listing_summary(read_units(data_cfg.path, data_cfg), data_cfg)["filtered"]
