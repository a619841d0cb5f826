"""The training data path in one process, without Ray: ``local_batches(cfg)``.

Yields the collated batches a Train worker receives (numpy dicts, batching/collate.py
layout) for ``cfg.data`` under ``cfg.budget``, through the very stage objects the Ray
graph runs (stages.py): read units -> MeasureStage -> plan (CarryPlanStage with the
end-of-stream row, or plan_rows per window with carry 0) -> MaterializeStage -> decode.
With deterministic settings the batches equal the pipeline's, in order. For notebooks,
debugging, verify_packing and tests; it decodes every image on one core, so it is slow
for a whole dataset (pass ``limit``).
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from ray_mmbatch import schema as S
from ray_mmbatch.config import Config
from ray_mmbatch.data.errors import decode_skips


def _raw_rows(cfg: Config, end_marker: bool, shard: tuple[int, int] = (0, 1),
              epoch: int = 0, split=None, reader: tuple | None = None) -> Iterator[dict[str, Any]]:
    from ray_mmbatch.dataflow.stages import epoch_unit_order
    from ray_mmbatch.formats.end_of_stream import with_end_unit
    from ray_mmbatch.formats.units import for_epoch, read_units, read_with_position

    reader = for_epoch(reader or read_units(cfg.data.path, cfg.data), cfg.train.seed, epoch)
    units, read_fn, kwargs = reader
    index, count = shard
    order = epoch_unit_order(reader, cfg.data, cfg.train.seed, epoch)  # the Ray path's unit order
    units = [dict(units[i], **{S.UNIT: i}) for k, i in enumerate(order) if k % count == index]  # global unit ids
    units = with_end_unit(units, end_marker)
    for unit in units:
        yield from read_with_position(pa.Table.from_pylist([unit]), read_fn, kwargs, split=split).to_pylist()


def _chunks(rows: Iterator[dict[str, Any]], size: int) -> Iterator[dict[str, list]]:
    """Rows -> column dicts of ``size`` rows (what map_batches(batch_size=size) hands a stage)."""
    buf: list[dict[str, Any]] = []
    for row in rows:
        buf.append(row)
        if len(buf) == size:
            yield _columns(buf)
            buf = []
    if buf:
        yield _columns(buf)


def _columns(rows: list[dict[str, Any]]) -> dict[str, list]:
    return {k: [r[k] for r in rows] for k in rows[0]}


def _measured_rows(cfg: Config, end_marker: bool, payloads, shard: tuple[int, int] = (0, 1),
                   epoch: int = 0, split=None, reader: tuple | None = None) -> Iterator[dict]:
    from ray_mmbatch.dataflow.stages import MeasureStage

    stage = MeasureStage(cfg.image, cfg.text, cfg.budget, payloads, cfg.data.measure_batch)
    for batch in _chunks(_raw_rows(cfg, end_marker, shard, epoch, split, reader), max(1, cfg.data.measure_batch)):
        out = stage(batch)
        n = len(out[S.SAMPLE_ID])
        yield from ({k: v[i] for k, v in out.items()} for i in range(n))


def local_batches(cfg: Config, limit: int | None = None, epoch: int = 0,
                  with_skips: bool = False, shard: tuple[int, int] = (0, 1),
                  split: str = "train") -> Iterator[dict[str, Any]]:
    """Collated batches (as a Train worker receives them) for ``cfg``; ``limit`` stops after that many.

    The config goes through ``models.configure`` first (a checkpoint's image / text settings).
    ``with_skips`` also yields ``{"skipped": [SkipRecord, ...]}`` as they occur.
    ``shard=(i, n)``: only units i, i+n, i+2n, ... of the epoch's unit order (one DataLoader
    worker's share; each shard shuffles and plans its own stream, so batches differ from a
    single stream's). Unsharded, the order and batches equal the Ray path's (deterministic mode):
    the same unit order, shuffle buffer and windows (batching/shuffle.py).
    ``split="eval"``: the held-out set instead (--eval-data, or the --eval-split side of --data;
    data/split.py), unshuffled; "train" leaves the --eval-split ids out, as training does.
    """
    if not (0 <= shard[0] < shard[1]):
        raise ValueError(f"shard must be (index, count) with 0 <= index < count, got {shard!r}")
    from ray_mmbatch.batching.collate import decode_batch
    from ray_mmbatch.data.split import eval_source, has_eval, train_split
    from ray_mmbatch.dataflow.payload_store import LocalPayloads
    from ray_mmbatch.dataflow.stages import (
        CarryPlanStage,
        MaterializeStage,
        blend_strata,
        plan_rows,
        shuffle_buffer_size,
        uses_plan_actor,
    )
    from ray_mmbatch.formats.units import read_units
    from ray_mmbatch.models import configure, token_ids

    cfg = configure(copy.deepcopy(cfg))
    if split == "eval":
        if not has_eval(cfg.data):
            raise ValueError("split='eval' needs --eval-data or --eval-split")
        cfg, read_split = eval_source(cfg)
    elif split == "train":
        read_split = train_split(cfg.data)
    else:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not (cfg.data.path or cfg.data.sources):
        raise ValueError("local_batches needs cfg.data.path (a Parquet / WebDataset / LLaVA dataset)")
    stateful = uses_plan_actor(cfg.budget, cfg.data)  # the plan stage shuffles or carries
    seed = cfg.train.seed
    reader = read_units(cfg.data.path, cfg.data)
    planner = CarryPlanStage(cfg.budget, seed, epoch, shuffle_buffer_size(cfg.data),
                             blend_strata(reader), cfg.data.shuffle_ramp) if stateful else None
    payloads = LocalPayloads()
    materialize = MaterializeStage(cfg.image, cfg.budget, token_ids(cfg)["pad_id"], payloads)
    done = 0
    measured = _measured_rows(cfg, end_marker=stateful, payloads=payloads, shard=shard, epoch=epoch,
                              split=read_split, reader=reader)
    # the plan actor cuts its own windows (small ones first): feed it as rows come, like the Ray graph
    chunk = max(1, cfg.data.measure_batch if stateful else cfg.budget.window)
    for window in _chunks(measured, chunk):
        plans = planner(window) if stateful else plan_rows(window, cfg.budget, seed, epoch)
        for i in range(len(plans[S.BATCH_ID])):
            one = {k: [v[i]] for k, v in plans.items()}
            row = {k: v[0] for k, v in materialize(one).items()}
            skipped = decode_skips(row[S.BATCH_SKIPPED])
            if with_skips and skipped:
                yield {"skipped": skipped}
            if int(row[S.BATCH_N_SAMPLES]) == 0:
                continue
            batch = decode_batch(bytes(row[S.BATCH_PAYLOAD]))
            batch["batch_id"] = str(row[S.BATCH_ID])
            yield batch
            done += 1
            if limit is not None and done >= limit:
                return


__all__ = ["local_batches"]
