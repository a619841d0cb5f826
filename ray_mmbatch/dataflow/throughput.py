"""How fast one data CPU prepares YOUR samples: ``ray-mmbatch inspect --throughput``.

The first ``samples`` rows of the epoch's unit order go through the training path's own stage
objects in this one process, as ``local.local_batches`` runs them: read (a unit's rows) ->
MeasureStage (tokenize, image headers, costs) -> plan_rows (windows of ``budget.window``) ->
MaterializeStage (fetch, decode + resize + patchify, collate, encode). Each stage call is timed
with ``time.process_time`` (CPU seconds of this process, its threads included) and wall time;
the figure is samples per CPU second over the four stages, so it does not depend on how many
cores the machine has or on what else runs on them. Left out: start-up (the tokenizer loads in
MeasureStage's constructor) and the batch's decode on the Train worker (reported apart: it runs
on the accelerator's node, not on a data CPU). Shuffle plays no part in the cost (a seeded
permutation of light rows; benchmarks/bench_plan_stage.py), so planning is per window, without
the shuffle buffer or carry, and a bounded run reads only the units it needs.

Cost: the samples' own work on one core (~150-200 samples/s for the synthetic set at 448 px).
How well it predicts a Ray run with 1 and 2 data CPUs: benchmarks/bench_sizing.py (RESULTS.md).
"""
from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from itertools import islice
from typing import Any

from ray_mmbatch import schema as S
from ray_mmbatch.config import Config

STAGES = ("read", "measure", "plan", "materialize")


class StageClock:
    """CPU and wall seconds per named stage."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str):
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            yield
        finally:
            self.cpu[stage] = self.cpu.get(stage, 0.0) + time.process_time() - c0
            self.wall[stage] = self.wall.get(stage, 0.0) + time.perf_counter() - w0

    def timed(self, stage: str, items):
        """Iterate ``items``, billing the time each ``next`` takes (a generator's own work) to ``stage``."""
        it = iter(items)
        while True:
            with self(stage):
                item = next(it, None)
            if item is None:
                return
            yield item


def measure_throughput(cfg: Config, samples: int = 2000, progress=None) -> dict[str, Any]:
    """Run the first ``samples`` rows through the stages in this process; a JSON-able report.
    ``progress`` (run/progress.Progress): counts each batch's samples and skips as it is materialized."""
    from ray_mmbatch.batching.collate import decode_batch
    from ray_mmbatch.data.errors import decode_skips
    from ray_mmbatch.data.split import train_split
    from ray_mmbatch.dataflow.local import _chunks, _columns, _raw_rows
    from ray_mmbatch.dataflow.payload_store import LocalPayloads
    from ray_mmbatch.dataflow.stages import MaterializeStage, MeasureStage, plan_rows
    from ray_mmbatch.formats.units import read_units
    from ray_mmbatch.models import configure, token_ids

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    t_start = time.perf_counter()
    cfg = configure(copy.deepcopy(cfg))
    payloads = LocalPayloads()
    measure = MeasureStage(cfg.image, cfg.text, cfg.budget, payloads, cfg.data.measure_batch)  # loads the tokenizer
    materialize = MaterializeStage(cfg.image, cfg.budget, token_ids(cfg)["pad_id"], payloads)
    reader = read_units(cfg.data.path, cfg.data)
    startup = time.perf_counter() - t_start
    clock = StageClock()
    n_read = n_ok = tokens = batches = 0
    pending: list[dict] = []

    def plan_and_materialize(window: list[dict]) -> None:
        nonlocal batches
        with clock("plan"):
            plans = plan_rows(_columns(window), cfg.budget, cfg.train.seed, 0)
        for i in range(len(plans[S.BATCH_ID])):
            with clock("materialize"):
                row = {k: v[0] for k, v in materialize({k: [v[i]] for k, v in plans.items()}).items()}
            if int(row[S.BATCH_N_SAMPLES]):
                with clock("decode"):  # the Train worker's side
                    decode_batch(bytes(row[S.BATCH_PAYLOAD]))
                batches += 1
            if progress is not None:
                progress.update(int(row[S.BATCH_N_SAMPLES]) + len(decode_skips(row[S.BATCH_SKIPPED])))

    raw = _raw_rows(cfg, end_marker=False, reader=reader, split=train_split(cfg.data))
    for chunk in clock.timed("read", _chunks(islice(raw, samples), max(1, cfg.data.measure_batch))):
        with clock("measure"):
            out = measure(chunk)
        rows = [{k: v[i] for k, v in out.items()} for i in range(len(out[S.SAMPLE_ID]))]
        n_read += len(chunk[S.SAMPLE_ID])
        for r in rows:
            if not r[S.SKIP_REASON]:
                n_ok, tokens = n_ok + 1, tokens + int(r[S.TOKENS])
        pending += rows
        while len(pending) >= max(1, cfg.budget.window):
            window, pending = pending[:cfg.budget.window], pending[cfg.budget.window:]
            plan_and_materialize(window)
    if pending:
        plan_and_materialize(pending)
    cpu = sum(clock.cpu.get(s, 0.0) for s in STAGES)
    wall = sum(clock.wall.get(s, 0.0) for s in STAGES)
    per_sample = {s: 1000 * clock.cpu.get(s, 0.0) / max(1, n_read) for s in (*STAGES, "decode")}
    return {
        "samples": n_read, "samples_ok": n_ok, "batches": batches,
        "mean_tokens": tokens / n_ok if n_ok else 0.0,
        "cpu_s": cpu, "wall_s": wall, "startup_s": startup,
        "samples_per_cpu_s": n_read / cpu if cpu > 0 else 0.0,
        "samples_per_wall_s": n_read / wall if wall > 0 else 0.0,
        "cpu_ms_per_sample": per_sample,  # decode: on the Train worker, not in the figure
        "path": "read -> measure -> plan -> materialize, one process",
    }
