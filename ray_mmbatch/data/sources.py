"""Moved: the format adapters live in ray_mmbatch/formats/ (one module per format, a registry).

Kept importable for callers of the old names (benchmarks, notebooks).
"""
from __future__ import annotations

import io

from ray_mmbatch.formats.llava import llava_row, llava_rows, resolve_image_path  # noqa: F401
from ray_mmbatch.formats.parquet import parquet_rows  # noqa: F401
from ray_mmbatch.formats.records import (  # noqa: F401
    RAW_ARROW_SCHEMA,
    conversations_to_json,
    error,
    raw_row,
    rows_to_table,
    text_to_json,
)
from ray_mmbatch.formats.webdataset import split_member  # noqa: F401


def webdataset_samples(tar, shard_name: str) -> list[dict]:
    """RAW rows of one tar shard given as bytes or a file object (ids ``<shard_name>/<key>``)."""
    from ray_mmbatch.config import DataConfig
    from ray_mmbatch.formats import webdataset

    stream = io.BytesIO(tar) if isinstance(tar, (bytes, bytearray, memoryview)) else tar
    return webdataset.rows_of_stream(stream, shard_name, DataConfig())
