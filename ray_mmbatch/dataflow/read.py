"""Ray Data reading: a dataset location -> a Dataset of RAW rows (schema.RAW_COLUMNS + read positions).

The Ray shell over formats/ (one module per format behind a registry; paths or URIs of any
pyarrow filesystem) and formats/units.py (the listing and the per-unit read): ``read_raw``
hands the read units to ray.data.from_items and reads each with one map_batches call, so
the unit order is ours: ``order`` lists the units in the epoch's order
(batching/shuffle.unit_order), and ``end_marker`` appends the end-of-stream unit
(formats/end_of_stream.py; with DataContext.execution_options.preserve_order its row is the
last out). With preserve_order the row order is the same every run. Ray workers build their
filesystem clients from the same environment (AWS_* etc.) the driver's cluster was started with.
"""
from __future__ import annotations

import time

import pyarrow as pa
import ray

from ray_mmbatch import schema
from ray_mmbatch.config import DataConfig
from ray_mmbatch.dataflow.timing import per_row
from ray_mmbatch.formats.end_of_stream import with_end_unit
from ray_mmbatch.formats.units import read_units, read_with_position


def _units_dataset(units: list[dict], blocks: int | None, order: list[int] | None,
                   end_marker: bool) -> ray.data.Dataset:
    """Read units -> a from_items Dataset in ``order`` (listing indices; None = listing order),
    optionally + the end-marker unit."""
    units = with_end_unit([units[i] for i in (range(len(units)) if order is None else order)], end_marker)
    return ray.data.from_items(units, override_num_blocks=min(len(units), blocks or len(units)) or 1)


def _timed_read(units: pa.Table, **kwargs) -> pa.Table:
    """read_with_position + each row's share of the unit's read seconds (schema.READ_S, timing.py)."""
    t0 = time.perf_counter()
    t = read_with_position(units, **kwargs)
    return t.append_column(schema.READ_S, pa.array(per_row(time.perf_counter() - t0, t.num_rows)))


def read_raw(path: str, data_cfg: DataConfig, *, override_num_blocks: int | None = None,
             order: list[int] | None = None, end_marker: bool = False, done=None,
             reader: tuple | None = None, split=None, timed: bool = False) -> ray.data.Dataset:
    """A Dataset of RAW rows (schema.RAW_COLUMNS + READ_POSITION_COLUMNS) for a Parquet / WebDataset / LLaVA path.

    ``data_cfg.format`` 'auto' guesses: a folder with data.json -> llava, *.parquet -> parquet,
    *.tar -> webdataset; a single file by its extension. ``order``: the units' read order
    (listing indices, batching/shuffle.unit_order; None = listing order); ``end_marker``
    appends the end-of-stream row (see the module docstring); ``done`` (resume) leaves out what
    an epoch already trained (see read_with_position); ``reader``: what ``read_units`` returned,
    when the caller listed already; ``split``: one side of the held-out split (data/split.py);
    ``timed``: + schema.READ_S, each row's share of its unit's read seconds (the training path).
    """
    units, read_fn, kwargs = reader or read_units(path, data_cfg)
    units = [dict(u, **{schema.UNIT: i}) for i, u in enumerate(units)]  # index in the sorted listing
    ds = _units_dataset(units, override_num_blocks, order, end_marker)
    ds = ds.map_batches(_timed_read if timed else read_with_position,
                        fn_kwargs={"read_fn": read_fn, "read_kwargs": kwargs, "done": done, "split": split},
                        batch_format="pyarrow", batch_size=1)
    timing = (schema.READ_S,) if timed else ()
    return ds.select_columns(list(schema.RAW_COLUMNS + schema.READ_POSITION_COLUMNS + timing))
