"""Where the data time goes: each stage's wall seconds ride in the rows it emits.

Ray Data has no end-of-stream hook and the stages run in separate actor processes, so the
train loop can only learn what the data side spent from the data itself::

    read_raw(timed=True)  RAW row     read_s     the read unit's seconds / its rows
    MeasureStage          LIGHT row   measure_s  the tokenizer batch's seconds / its rows (read_s kept)
    plan                  PLAN row    data_time  [read, measure, plan]: the members' sums (+ the window's
                                                 skipped rows' on the batch that carries their records),
                                                 the call's plan seconds spread over the batches it emits
    MaterializeStage      BATCH row   data_time  + [materialize, produced_at]: the block's seconds
                                                 (fetch + decode + collate), produced_at a unix time
    train loop            sums every row it takes, all ranks (run/datatime.py -> summary.json data_time)

Cost: one time.perf_counter() pair per call (a read unit, a tokenizer batch, a window, a
materialize block), never per sample; 16 bytes a sample, 40 a batch. Wall seconds, not CPU
seconds: what a data CPU slot was held for, I/O and payload fetches included. Pure (numpy).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ray_mmbatch import schema as S

#: The data-side stages, in order; a BATCH row's data_time holds them, then produced_at.
STAGES = ("read_s", "measure_s", "plan_s", "materialize_s")


def per_row(seconds: float, n: int) -> np.ndarray:
    """One call's seconds spread evenly over its ``n`` rows."""
    return np.full(n, seconds / n if n else 0.0, dtype=np.float64)


def with_measure_seconds(out: dict[str, Any], raw: dict[str, Any], seconds: float) -> dict[str, Any]:
    """``out`` (measured or LIGHT columns of the RAW ``raw`` rows) + read_s (from ``raw``, 0 where the
    reader was not timed) and measure_s (``seconds`` over the rows)."""
    n = len(out[S.SAMPLE_ID])
    read = raw.get(S.READ_S)
    out[S.READ_S] = np.asarray(read, dtype=np.float64) if read is not None else np.zeros(n)
    out[S.MEASURE_S] = per_row(seconds, n)
    return out


def row_seconds(row: dict[str, Any]) -> tuple[float, float]:
    """(read_s, measure_s) of one measured / LIGHT row (0 where it carries none)."""
    return float(row.get(S.READ_S, 0.0) or 0.0), float(row.get(S.MEASURE_S, 0.0) or 0.0)


def skipped_seconds(batch: dict[str, Any]) -> tuple[float, float]:
    """(read_s, measure_s) summed over the skipped rows of a window (columns of LIGHT rows)."""
    if S.READ_S not in batch or S.SKIP_REASON not in batch:
        return 0.0, 0.0
    skipped = np.array([bool(r) for r in batch[S.SKIP_REASON]], dtype=bool)
    return (float(np.asarray(batch[S.READ_S], np.float64)[skipped].sum()),
            float(np.asarray(batch[S.MEASURE_S], np.float64)[skipped].sum()))


def plan_cells(groups: list[list[dict]], skipped: tuple[float, float], plan_s: float) -> list[list[float]]:
    """The PLAN rows' data_time: per group [read, measure, plan]; the first group (the one carrying the
    window's skip records) also bills the skipped rows' ``skipped`` seconds."""
    cells = []
    for j, members in enumerate(groups):
        read = sum(row_seconds(r)[0] for r in members) + (skipped[0] if j == 0 else 0.0)
        measure = sum(row_seconds(r)[1] for r in members) + (skipped[1] if j == 0 else 0.0)
        cells.append([read, measure, plan_s / len(groups)])
    return cells


def batch_cell(plan_cell, materialize_s: float, produced_at: float) -> list[float]:
    """A BATCH row's data_time: the PLAN row's cell (zeros if it has none) + materialize_s, produced_at."""
    head = [float(x) for x in plan_cell][:3] if plan_cell is not None else []
    return head + [0.0] * (3 - len(head)) + [float(materialize_s), float(produced_at)]


def unpack(cell) -> tuple[dict[str, float], float | None]:
    """A BATCH row's data_time -> ({stage: seconds}, produced_at); ({}, None) for a row without one."""
    if cell is None:
        return {}, None
    values = [float(x) for x in cell]
    if len(values) < len(STAGES) + 1:
        return {}, None
    return dict(zip(STAGES, values)), values[len(STAGES)]
