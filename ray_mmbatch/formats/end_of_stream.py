"""The end-of-stream marker, in one place: added to the read units, read, recognised, removed.

Ray Data gives a map stage no end-of-stream hook, so a buffer carried from one window
to the next (the carry planner) would lose its leftovers when the stream ends. We make
the end visible instead: ``with_end_unit`` appends one read unit after the last real
one; reading it (``marker_table``) yields one RAW row (schema.END_OF_STREAM_ID, read
error schema.END_OF_STREAM) that rides through measure as a skipped row, and the plan
stage takes it out with ``split_marker`` and flushes. It is never batched or reported.
With preserve_order (deterministic mode) it is the last row; if it comes early the
planner holds nothing after it, so arrival order can change fill, never which samples
arrive. Used by units.py and dataflow/read.py (reading), dataflow/local.py (in-process) and
dataflow/stages.py (the plan stage).
"""
from __future__ import annotations

from typing import Any

import pyarrow as pa

from ray_mmbatch import schema

END_UNIT = "end"  # read-unit flag: True for the marker's unit


def with_end_unit(units: list[dict], end_marker: bool) -> list[dict]:
    """Read units (dicts) flagged ``end=False``, plus the marker's unit if ``end_marker``."""
    units = [dict(u, **{END_UNIT: False}) for u in units]
    if end_marker:
        units.append(dict(units[-1], **{END_UNIT: True}) if units else {END_UNIT: True, schema.UNIT: -1})
    return units


def marker_row() -> dict[str, Any]:
    """The RAW end-of-stream row."""
    return {schema.SAMPLE_ID: schema.END_OF_STREAM_ID, schema.CONVERSATIONS: "[]", schema.IMAGES: [],
            schema.IMAGE_REFS: [], schema.READ_ERROR: schema.END_OF_STREAM}


def marker_table() -> pa.Table:
    from ray_mmbatch.formats.records import rows_to_table

    return rows_to_table([marker_row()])


def is_marker(sample_id, reason) -> bool:
    return str(sample_id) == schema.END_OF_STREAM_ID and str(reason) == schema.END_OF_STREAM


def split_marker(rows: list[dict]) -> tuple[list[dict], bool]:
    """(rows without the marker, whether it was there) for measured rows (SAMPLE_ID, SKIP_REASON)."""
    kept = [r for r in rows if not is_marker(r[schema.SAMPLE_ID], r[schema.SKIP_REASON])]
    return kept, len(kept) != len(rows)
