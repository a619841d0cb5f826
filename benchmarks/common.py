"""What the benchmarks share: the pure data path over a local folder of Parquet files (no Ray)."""
from __future__ import annotations

import glob
import os

import numpy as np
import pyarrow.parquet as pq

from ray_mmbatch.config import BudgetConfig, Config
from ray_mmbatch.data.measure import fit_batch_to_budget, measure_batch
from ray_mmbatch.formats.parquet import parquet_rows


def read_measured(data_dir: str, cfg: Config, tok, fit: BudgetConfig) -> dict:
    """Every parquet file under ``data_dir`` (file order) -> one MEASURED batch, the oversize
    policy of ``fit`` applied to each sample alone."""
    files = sorted(glob.glob(os.path.join(data_dir, "**", "*.parquet"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no .parquet files under {data_dir}")
    cols: dict[str, list] = {}
    for f in files:
        raw = parquet_rows(pq.read_table(f), cfg.data, file_name=f)
        for c in raw.column_names:
            cols.setdefault(c, []).extend(raw[c].to_pylist())
    batch = {c: _object_array(v) for c, v in cols.items()}
    return fit_batch_to_budget(measure_batch(batch, cfg.image, tok, cfg.text), fit)


def _object_array(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def data_or_generated(data: str | None, samples: int, seed: int, prefix: str):
    """(folder, temp dir to clean up or None): ``data`` as given, else ``samples`` generated Parquet
    samples in a temp folder."""
    if data:
        return data, None
    import tempfile

    from ray_mmbatch.synthetic.generate import generate_dataset

    tmp = tempfile.TemporaryDirectory(prefix=prefix)
    generate_dataset(tmp.name, samples, "parquet", seed=seed)
    return tmp.name, tmp
