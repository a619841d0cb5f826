"""Stage seconds travel with the data (dataflow/timing.py): every read and measure second of every
row, skipped rows and rows held in the shuffle buffer or the carry included, reaches a BATCH row once;
plan and materialize seconds are there too. Runs the stages in one process (local.py), no Ray."""
from __future__ import annotations

import numpy as np
import pytest

from ray_mmbatch import schema as S
from ray_mmbatch.config import Config
from ray_mmbatch.dataflow import timing
from ray_mmbatch.synthetic.generate import generate_dataset

READ_S = 0.001  # each RAW row's read share, as read_raw(timed=True) sets it


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("dt")
    generate_dataset(str(out / "train"), 80, "parquet", seed=3, shard_size=30, bad_per_kind=1)
    return out / "train"


@pytest.mark.parametrize("shuffle,carry", [("samples", None), ("units", 0.0)])  # CarryPlanStage, plan_rows
def test_every_rows_seconds_reach_a_batch_once(small, monkeypatch, shuffle, carry):
    from ray_mmbatch.dataflow import local, stages

    cfg = Config()
    cfg.data.path, cfg.data.format, cfg.data.shuffle, cfg.data.shuffle_buffer = str(small), "parquet", shuffle, 50
    cfg.budget.max_tokens, cfg.budget.window, cfg.budget.carry = 2048, 16, carry
    raw_rows, measured, cells = local._raw_rows, [], []

    def timed_rows(*a, **k):  # local.py reads untimed: give each row the share read_raw(timed=True) would
        for row in raw_rows(*a, **k):
            yield {**row, S.READ_S: READ_S}

    measure, materialize = stages.MeasureStage.__call__, stages.MaterializeStage.__call__

    def spy_measure(self, batch):
        out = measure(self, batch)
        measured.append(out)
        return out

    def spy_materialize(self, batch):
        out = materialize(self, batch)
        cells.extend(out[S.BATCH_DATA_TIME])
        return out

    monkeypatch.setattr(local, "_raw_rows", timed_rows)
    monkeypatch.setattr(stages.MeasureStage, "__call__", spy_measure)
    monkeypatch.setattr(stages.MaterializeStage, "__call__", spy_materialize)
    list(local.local_batches(cfg))

    rows = sum(len(m[S.SAMPLE_ID]) for m in measured)  # samples, skipped ones and the end row included
    skipped = sum(bool(r) for m in measured for r in m[S.SKIP_REASON])
    assert rows > skipped > 0
    got = np.array(cells)
    assert got.shape == (len(cells), len(timing.STAGES) + 1)
    assert got[:, 0].sum() == pytest.approx(rows * READ_S)  # each row's read share, once
    assert got[:, 1].sum() == pytest.approx(sum(float(np.sum(m[S.MEASURE_S])) for m in measured))
    assert got[:, 1].sum() > 0 and got[:, 2].sum() > 0 and (got[:, 3] > 0).all()
    assert (got[:, 4] > 1e9).all()  # produced_at: a unix time


def test_cells_unpack_and_old_rows_count_nothing():
    stages, produced = timing.unpack(timing.batch_cell([1.0, 2.0, 0.5], 3.0, 1234.5))
    assert stages == {"read_s": 1.0, "measure_s": 2.0, "plan_s": 0.5, "materialize_s": 3.0} and produced == 1234.5
    assert timing.batch_cell(None, 3.0, 1.0) == [0.0, 0.0, 0.0, 3.0, 1.0]  # a plan row without data_time
    assert timing.unpack(None) == ({}, None) and timing.unpack([1.0, 2.0]) == ({}, None)
    groups = [[{S.READ_S: 1.0, S.MEASURE_S: 2.0}, {S.READ_S: 1.0, S.MEASURE_S: 2.0}], [{}]]
    assert timing.plan_cells(groups, (0.5, 0.25), 0.2) == [[2.5, 4.25, 0.1], [0.0, 0.0, 0.1]]
