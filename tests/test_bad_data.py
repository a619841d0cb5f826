"""Bad data never loses good data (issue 15): layouts real downloads have, built here, read through the
formats registry and the in-process data path (ray_mmbatch.local_batches)."""
from __future__ import annotations

import io
import json
import logging
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from ray_mmbatch import schema as S
from ray_mmbatch.config import Config, DataConfig
from ray_mmbatch.local import local_batches
from ray_mmbatch.readers import count_samples, read_units

IMG = S.IMAGE_PLACEHOLDER
CONV = [{"from": "human", "value": f"{IMG}\nWhat colour is it?"}, {"from": "gpt", "value": "It is red."}]
IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def png(side: int = 40, colour=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), colour).save(buf, format="PNG")
    return buf.getvalue()


def raw_rows(path, data_cfg: DataConfig | None = None) -> list[dict]:
    """Every RAW row of a dataset, read in-process by the Ray read's own functions."""
    units, read_fn, kwargs = read_units(str(path), data_cfg or DataConfig())
    rows = []
    for unit in units:
        rows += read_fn(pa.Table.from_pylist([dict(unit, end=False)]), **kwargs).to_pylist()
    return rows


def trained_and_skipped(path, **data) -> tuple[list[str], dict[str, str]]:
    """(sample ids trained, {id: reason} skipped) over one epoch of local_batches."""
    cfg = Config()
    cfg.data = DataConfig(path=str(path), **data)
    cfg.budget.max_tokens = 1024
    trained, skipped = [], {}
    for item in local_batches(cfg, with_skips=True):
        if "skipped" in item:
            skipped.update({sid: reason for sid, reason in item["skipped"]})
        else:
            trained += list(item["sample_ids"])
    return trained, skipped


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def conversations_table(n: int, ids: list | None = None) -> pa.Table:
    cols = {"images": pa.array([[{"bytes": png(40 + i), "path": f"{i}.png"}] for i in range(n)],
                               pa.list_(IMAGE_STRUCT)),
            "conversations": pa.array([CONV] * n)}
    if ids is not None:
        cols["id"] = pa.array(ids)
    return pa.table(cols)


# ------------------------------------------------------------------ ids unique by construction
def test_hub_layout_same_file_names_in_two_folders_trains_every_sample(tmp_path):
    for sub in ("cc3m", "coco"):
        (tmp_path / sub).mkdir()
        pq.write_table(conversations_table(8, [f"{k}" for k in range(8)]),  # same ids in both, too
                       tmp_path / sub / "train-00000-of-00001.parquet", row_group_size=3)
    ids = [r[S.SAMPLE_ID] for r in raw_rows(tmp_path)]
    assert len(set(ids)) == len(ids) == 16
    assert ids[0] == "cc3m/train-00000-of-00001.parquet:0#0" and ids[8] == "coco/train-00000-of-00001.parquet:0#0"
    trained, skipped = trained_and_skipped(tmp_path)
    assert sorted(trained) == sorted(ids) and not skipped  # 16 trained, each once


def test_webdataset_keys_restarting_in_every_shard_stay_apart(tmp_path):
    for shard in range(3):
        write_tar(tmp_path / f"shard-{shard}.tar",
                  [m for k in range(4) for m in ((f"{k:06d}.json", json.dumps({"conversations": CONV}).encode()),
                                                 (f"{k:06d}.png", png(40 + k)))])
    ids = [r[S.SAMPLE_ID] for r in raw_rows(tmp_path)]
    assert len(set(ids)) == len(ids) == 12 and ids[4] == "shard-1.tar/000000"
    trained, skipped = trained_and_skipped(tmp_path)
    assert sorted(trained) == sorted(ids) and not skipped


def test_llava_repeated_ids_are_samples_of_their_own_with_one_warning(tmp_path, caplog):
    (tmp_path / "a.png").write_bytes(png())
    ids = ["x", "x", 1, "1", "y", "x"]
    records = [{"id": i, "image": "a.png", "conversations": CONV} for i in ids]
    (tmp_path / "data.json").write_text(json.dumps(records))
    with caplog.at_level(logging.WARNING, logger="ray_mmbatch.formats"):
        rows = raw_rows(tmp_path)
    got = [r[S.SAMPLE_ID] for r in rows]
    assert got == ["data.json:0#x", "data.json:1#x", "data.json:2#1", "data.json:3#1", "data.json:4#y", "data.json:5#x"]
    warnings = [r.getMessage() for r in caplog.records if "share their id" in r.getMessage()]
    assert len(warnings) == 1 and "5 records" in warnings[0] and "'x' x3" in warnings[0]
    trained, skipped = trained_and_skipped(tmp_path)
    assert sorted(trained) == sorted(got) and not skipped
    assert count_samples(str(tmp_path), DataConfig()) == 6
