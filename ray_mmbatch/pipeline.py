"""The Ray Data graph: read -> measure -> plan -> materialize, as thin stages over the pure core.

::

    read_raw (readers.py)            RAW rows, bytes only, each with its read position (unit, row);
                                     + one end-of-stream row when carrying. Resume: units the epoch
                                     finished are not read, done rows of units in flight are dropped
                                     as they are read (data/position.py), so none is measured or decoded
      .map_batches(MeasureStage)     token ids, grids, costs, skip_reason; oversize policy applied.
                                     The measured row (image bytes included) waits in a payload
                                     holder (payloads.py); a LIGHT row goes on: id, costs, read
                                     position (~100 bytes, all Arrow)
      .map_batches(CarryPlanStage,   one PLAN row per batch (ids, payload keys: Arrow lists); windows
                   batch_size=W)     of `budget.window` samples, under-filled batches held back into
                                     the next window (see below). No pixel passes through it
      .map_batches(MaterializeStage, one BATCH row per batch: fetch the payloads, decode + resize +
                   batch_size=1)     patchify + collate
      .repartition(1 row per block)  so Train's split can hand batches to ranks one by one

End of stream: Ray Data gives a map stage no end-of-stream hook, so a buffer carried
from one window to the next would lose its leftovers when the stream ends. We make
the end visible instead: the readers append one end-of-stream row after the last
read unit (readers.py), and the plan stage is ONE actor (CarryPlanStage) running
batching.CarryPlanner, which holds back at most `budget.carry` x window samples in
under-filled batches and flushes them in the window that holds the end row. With
preserve_order (deterministic mode, the default) that row is the last one, so the
carry works across the whole epoch; if it ever comes early, the planner holds
nothing after it, so no order can lose a sample. `budget.carry = 0` plans every
window on its own with a stateless task (plan_rows) and no end row. Fill per window
size, with and without carry: benchmarks/bench_packing.py (benchmarks/RESULTS.md).

Skipped samples travel with the data: the skip list of a window rides on the first
batch of that window (a window with no usable sample emits one empty batch just to
carry it), and samples that fail to decode ride on their own batch. The train loop
records them, so every sample read is either trained once or reported once.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from typing import Any

import numpy as np
import ray

from ray_mmbatch import schema as S
from ray_mmbatch.config import BudgetConfig, Config, ImageConfig, TextConfig

PAYLOAD_KEYS = "payload_keys"  # PLAN row: list<str>, where each sample's measured row waits (payloads.py)
LIGHT_COLUMNS = (S.SAMPLE_ID, S.SKIP_REASON, S.TOKENS, S.PATCHES, S.N_IMAGES) + S.READ_POSITION_COLUMNS
PLAN_CPUS = 0.25  # planning a window takes milliseconds; don't let it hold a whole CPU slot


def _reason_key(reason: str) -> str:
    return reason.split(":", 1)[0].strip()


def window_seed(seed: int, epoch: int, window_key: str) -> int:
    """Plan seed of one window: a function of (seed, epoch, window), never of scheduling."""
    h = hashlib.blake2b(f"{seed}/{epoch}/{window_key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


class MeasureStage:
    """Callable class: loads the tokenizer once per actor, then measures batches of RAW rows.

    With ``payloads`` (payloads.py) each usable measured row is left there and the stage
    returns LIGHT rows (LIGHT_COLUMNS); without, full MEASURED rows.
    """

    def __init__(self, image_cfg: ImageConfig, text_cfg: TextConfig, budget_cfg: BudgetConfig,
                 payloads=None):
        from ray_mmbatch.data.text import tokenizer_for

        self.image_cfg, self.text_cfg, self.budget_cfg = image_cfg, text_cfg, budget_cfg
        self.payloads = payloads
        self.tok = tokenizer_for(text_cfg)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        from ray_mmbatch.data.measure import fit_batch_to_budget, measure_batch

        measured = measure_batch(batch, self.image_cfg, self.tok, self.text_cfg)
        measured.update({c: batch[c] for c in S.READ_POSITION_COLUMNS if c in batch})
        measured = fit_batch_to_budget(measured, self.budget_cfg)
        return measured if self.payloads is None else light_rows(measured, self.payloads)


def payload_key(row: dict) -> str:
    """A sample's payload key: its read position (the same on a retry), else its id."""
    if S.UNIT in row and int(row[S.UNIT]) >= 0:
        return f"{int(row[S.UNIT])}:{int(row[S.UNIT_ROW])}"
    return f"id:{row[S.SAMPLE_ID]}"


def light_rows(measured: dict[str, Any], payloads) -> dict[str, np.ndarray]:
    """Leave each usable measured row in ``payloads``; return the LIGHT columns (Arrow-friendly)."""
    reasons = np.array([str(r) for r in measured[S.SKIP_REASON]], dtype=object)
    ok = np.flatnonzero(reasons == "").tolist()
    if ok:
        rows = [_plain({k: v[i] for k, v in measured.items()}) for i in ok]
        payloads.put([payload_key(r) for r in rows], rows)
    out = {S.SAMPLE_ID: np.array([str(x) for x in measured[S.SAMPLE_ID]], dtype=object), S.SKIP_REASON: reasons}
    for c in LIGHT_COLUMNS[2:]:
        if c in measured:
            out[c] = np.asarray(measured[c], dtype=np.int64)
    return out


def _rows(batch: dict[str, Any]) -> list[dict[str, Any]]:
    n = len(batch[S.SAMPLE_ID])
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def _position(row: dict) -> tuple[int, int]:
    """(read position, rows of its unit) of a measured row; (-1, 0) for a row without one."""
    from ray_mmbatch.data.position import encode_positions

    if S.UNIT not in row:
        return -1, 0
    return int(encode_positions([row[S.UNIT]], [row[S.UNIT_ROW]])[0]), int(row[S.UNIT_ROWS])


def _split_window(batch: dict[str, Any]) -> tuple[list[dict], list[list], str, bool]:
    """(usable rows, [id, reason, position, unit rows] of skipped rows, window key, end-of-stream
    seen) of one window."""
    from ray_mmbatch.readers import is_end_marker

    rows = _rows(batch)
    end = any(is_end_marker(r[S.SAMPLE_ID], r[S.SKIP_REASON]) for r in rows)
    if end:
        rows = [r for r in rows if not is_end_marker(r[S.SAMPLE_ID], r[S.SKIP_REASON])]
    window_key = str(rows[0][S.SAMPLE_ID]) if rows else ("end" if end else "empty")
    ok = [_plain(r) for r in rows if not r[S.SKIP_REASON]]
    skipped = [[str(r[S.SAMPLE_ID]), str(r[S.SKIP_REASON]), *_position(r)] for r in rows if r[S.SKIP_REASON]]
    return ok, skipped, window_key, end


def _costs(rows: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.array([int(r[k]) for r in rows], dtype=np.int64) for k in (S.TOKENS, S.PATCHES, S.N_IMAGES))


def _plan_output(groups: list[list[dict]], skipped: list, epoch: int, window_key: str) -> dict[str, list]:
    """PLAN rows: one per group of measured rows; the window's skip list rides on the first one
    (a window that emits no batch but skipped samples emits one empty batch to carry them)."""
    if not groups and skipped:
        groups = [[]]
    out: dict[str, list] = {S.BATCH_ID: [], S.BATCH_SAMPLE_IDS: [], PAYLOAD_KEYS: [], S.BATCH_SKIPPED: []}
    for j, members in enumerate(groups):
        out[S.BATCH_ID].append(f"e{epoch}/{window_key}/{j}")
        out[S.BATCH_SAMPLE_IDS].append([str(r[S.SAMPLE_ID]) for r in members])
        out[PAYLOAD_KEYS].append([payload_key(r) for r in members])
        out[S.BATCH_SKIPPED].append(json.dumps(skipped if j == 0 else []))
    return out


def plan_rows(batch: dict[str, Any], budget_cfg: BudgetConfig, seed: int, epoch: int) -> dict[str, list]:
    """Plan one window of MEASURED rows on its own into PLAN rows (carry = 0; stateless task)."""
    from ray_mmbatch.batching import Budget, plan_batches_arrays

    ok, skipped, window_key, _ = _split_window(batch)
    groups: list[list[dict]] = []
    if ok:
        plan = plan_batches_arrays(*_costs(ok), Budget.from_config(budget_cfg),
                                   seed=window_seed(seed, epoch, window_key), algorithm=budget_cfg.algorithm)
        groups = [[ok[i] for i in g] for g in plan]
    return _plan_output(groups, skipped, epoch, window_key)


class CarryPlanStage:
    """The plan stage with carry: ONE actor holds back under-filled batches into the next window.

    Runs as an actor pool of exactly one actor (one carry, windows in stream order). The
    readers append an end-of-stream row (schema.END_OF_STREAM_ID) after the last sample;
    the window holding it flushes the carry. If that row ever arrives early (no
    preserve_order), CarryPlanner holds nothing after the flush, so later windows are
    planned on their own: order affects fill, never correctness.

    An actor restarted by Ray (node or process failure) has lost what it held: it raises on
    its first call instead of finishing an epoch without those samples. Training then fails
    over and rebuilds the stream without the samples already trained (train/trainer.py),
    so the held-back samples are planned again.
    """

    def __init__(self, budget_cfg: BudgetConfig, seed: int, epoch: int):
        from ray_mmbatch.batching import Budget
        from ray_mmbatch.batching.carry import CarryPlanner

        self.seed, self.epoch = seed, epoch
        self.planner = CarryPlanner(Budget.from_config(budget_cfg), budget_cfg.algorithm, budget_cfg.carry)
        ctx = ray.get_runtime_context() if ray.is_initialized() else None
        self.restarted = bool(ctx is not None and ctx.get_actor_id() and ctx.was_current_actor_reconstructed)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        if self.restarted:
            raise RuntimeError(
                "the carry plan actor was restarted, so the samples it held back for the next window are "
                "gone from this epoch's stream; failing the stream rather than dropping them (a training run "
                "restores from its checkpoint and re-plans every sample not yet trained)")
        ok, skipped, window_key, end = _split_window(batch)
        groups = self.planner.feed(ok, *_costs(ok), seed=window_seed(self.seed, self.epoch, window_key))
        if end:
            groups += self.planner.flush(seed=window_seed(self.seed, self.epoch, window_key + "/end"))
        return _plan_output(groups, skipped, self.epoch, window_key)


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """Numpy scalars/arrays from Ray batches -> plain values materialize can use."""
    out = {}
    for k, v in row.items():
        if isinstance(v, np.ndarray) and v.dtype == object:
            v = list(v)
        out[k] = v
    return out


class MaterializeStage:
    """Callable: PLAN row -> BATCH row (fetch the payloads, decode, resize, patchify, expand,
    collate, encode); the payloads are released once the BATCH rows are built."""

    def __init__(self, image_cfg: ImageConfig, budget_cfg: BudgetConfig, pad_id: int, payloads):
        self.image_cfg, self.budget_cfg, self.pad_id = image_cfg, budget_cfg, pad_id
        self.payloads = payloads

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        out: dict[str, list] = {k: [] for k in (
            S.BATCH_ID, S.BATCH_SAMPLE_IDS, S.BATCH_PAYLOAD, S.BATCH_REAL_TOKENS, S.BATCH_PADDED_TOKENS,
            S.BATCH_TARGET_TOKENS, S.BATCH_N_SAMPLES, S.BATCH_SKIPPED, S.BATCH_POSITIONS,
            S.BATCH_POSITION_UNIT_ROWS)}
        done: list[str] = []
        for i in range(len(batch[S.BATCH_ID])):
            keys = [str(k) for k in batch[PAYLOAD_KEYS][i]]
            row = materialize_plan_row(self.payloads.get(keys), json.loads(str(batch[S.BATCH_SKIPPED][i])),
                                       self.image_cfg, self.budget_cfg, self.pad_id)
            row[S.BATCH_ID] = str(batch[S.BATCH_ID][i])
            for k in out:
                out[k].append(row[k])
            done += keys
        self.payloads.done(done)
        return out


def materialize_plan_row(members: list[dict], skipped: list, image_cfg: ImageConfig,
                         budget_cfg: BudgetConfig, pad_id: int) -> dict[str, Any]:
    """Pure: the measured rows of one planned batch -> the fields of a BATCH row.

    ``skipped``: [sample id, reason(, read position, unit rows)] entries carried from the plan.
    """
    from ray_mmbatch.batching.collate import collate_pack, collate_pad, encode_batch
    from ray_mmbatch.data.image import ImageSkip
    from ray_mmbatch.data.measure import materialize_sample

    samples, positions = [], []
    skipped = [list(s) + [-1, 0][len(s) - 2:] for s in skipped]
    for r in members:
        try:
            samples.append(materialize_sample(r, image_cfg))
            positions.append(_position(r))
        except ImageSkip as e:
            skipped.append([str(r[S.SAMPLE_ID]), f"{e.reason}: {e}", *_position(r)])
    if samples:
        collate = collate_pack if budget_cfg.mode == "pack" else collate_pad
        b = collate(samples, pad_id)
        real = int(b["real_tokens"])
        padded = budget_cfg.max_tokens if budget_cfg.mode == "pack" else int(np.prod(b["input_ids"].shape))
        payload, target = encode_batch(b), int(b["target_tokens"])
    else:
        real = padded = target = 0
        payload = b""
    return {
        S.BATCH_SAMPLE_IDS: [s["sample_id"] for s in samples],
        S.BATCH_PAYLOAD: payload,
        S.BATCH_REAL_TOKENS: real,
        S.BATCH_PADDED_TOKENS: padded,
        S.BATCH_TARGET_TOKENS: target,
        S.BATCH_N_SAMPLES: len(samples),
        S.BATCH_SKIPPED: json.dumps([s[:2] for s in skipped]),
        S.BATCH_POSITIONS: [p for p, _ in positions] + [int(s[2]) for s in skipped],
        S.BATCH_POSITION_UNIT_ROWS: [n for _, n in positions] + [int(s[3]) for s in skipped],
    }


def _stage_args(cfg: Config) -> dict[str, Any]:
    """Resources for CPU preprocessing stages (cluster: a custom resource pins them to CPU nodes)."""
    if cfg.data.data_resource:
        return {"resources": {cfg.data.data_resource: 0.001}}
    return {}


def uses_carry(budget_cfg: BudgetConfig) -> bool:
    from ray_mmbatch.batching.carry import resolve_carry

    return resolve_carry(budget_cfg.mode, budget_cfg.carry) > 0


def measured_dataset(cfg: Config, epoch: int = 0, end_marker: bool = False, done=None, payloads=None):
    """read -> measure (-> oversize policy). One MEASURED row per sample read (+ the end row if asked).

    Epochs after the first read their units (row groups / shards / chunks) in a seeded order.
    ``done`` (data.position.EpochPosition): what this epoch trained already, left out at read.
    ``payloads``: LIGHT rows out, the measured rows left in that store (see MeasureStage).
    """
    from ray_mmbatch.readers import read_raw

    shuffle = cfg.train.seed + epoch if cfg.train.seed is not None and epoch > 0 else None
    ds = read_raw(cfg.data.path, cfg.data, shuffle_seed=shuffle, end_marker=end_marker, done=done)
    return ds.map_batches(
        MeasureStage, batch_size=cfg.data.measure_batch, batch_format="numpy",
        fn_constructor_args=(cfg.image, cfg.text, cfg.budget, payloads),
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=max(1, cfg.data.preprocess_workers)),
        **_stage_args(cfg),
    )


def batch_dataset(cfg: Config, pad_id: int, position: dict | None = None, epoch: int = 0):
    """The whole data path of one epoch for training: one BATCH row per planned batch.

    ``position`` (resume) is a checkpoint's data position (data.position.DataPosition's
    state_dict): what this epoch trained is left out as it is read, so a resumed run
    measures and decodes none of it and re-plans only what is left, whatever window
    boundaries Ray Data draws. Epoch e reads its units in a seeded order and plans with
    seeds of its own; batch ids start with ``e{epoch}/``.
    """
    from ray_mmbatch.data.position import DataPosition

    done = DataPosition.from_state(position).epochs.get(epoch)
    from ray_mmbatch.payloads import RayPayloads

    carry = uses_carry(cfg.budget)
    # measured rows wait in holder actors that live as long as this dataset (payloads.py)
    payloads = RayPayloads(holders=max(1, cfg.data.preprocess_workers), recent=max(1024, cfg.budget.window),
                           **_stage_args(cfg))
    measured = measured_dataset(cfg, epoch, end_marker=carry, done=done, payloads=payloads)
    if carry:  # one actor: one carry, fed the windows in stream order
        with warnings.catch_warnings():
            # Ray Data lets actor tasks run out of order by default; the carry needs windows in
            # the order they were submitted (stream order). Ray 2.60 takes this actor option only
            # through **ray_remote_args, which it flags as deprecated (pyproject pins ray < 2.64).
            warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
            plans = measured.map_batches(
                CarryPlanStage, batch_size=cfg.budget.window, batch_format="numpy",
                fn_constructor_args=(cfg.budget, cfg.train.seed, epoch), num_cpus=PLAN_CPUS,
                compute=ray.data.ActorPoolStrategy(size=1),
                allow_out_of_order_execution=False, **_stage_args(cfg))
    else:
        plans = measured.map_batches(
            plan_rows, batch_size=cfg.budget.window, batch_format="numpy",
            fn_args=(cfg.budget, cfg.train.seed, epoch), num_cpus=PLAN_CPUS, **_stage_args(cfg))
    ds = plans.map_batches(
        MaterializeStage, batch_size=1, batch_format="numpy",
        fn_constructor_args=(cfg.image, cfg.budget, pad_id, payloads),
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=max(1, cfg.data.preprocess_workers)),
        **_stage_args(cfg))
    # One batch per block: Train's split hands out whole blocks, so a block holding a
    # window's worth of batches would starve the other ranks (streaming, no barrier).
    return ds.repartition(target_num_rows_per_block=1)


def set_deterministic(deterministic: bool) -> None:
    """Deterministic mode: preserve order so windows, plans and batch ids repeat run to run."""
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = bool(deterministic)



class InspectStage:
    """The data check in ONE actor stage: measure + materialize each block of RAW rows, keep counts.

    Fused on purpose (bench_ingest): a separate measure stage would ship every image's bytes
    (as pickled objects, Arrow cannot hold ndarrays of bytes) to a second actor pool that loads
    its own processes. Here each actor loads the tokenizer once, takes one read block
    (one Parquet row group / WebDataset shard / LLaVA chunk), measures it in slices of
    ``measure_batch`` rows (one tokenizer call each), materializes every usable sample
    (decode + resize + patchify, expand image tokens: per sample, that is Pillow's work)
    and returns only numbers and reasons.
    """

    def __init__(self, image_cfg: ImageConfig, text_cfg: TextConfig, measure_batch: int):
        from ray_mmbatch.data.text import tokenizer_for

        self.image_cfg, self.text_cfg, self.measure_batch = image_cfg, text_cfg, max(1, int(measure_batch))
        self.tok = tokenizer_for(text_cfg)

    def __call__(self, block) -> dict[str, np.ndarray]:
        from ray_mmbatch.data.measure import measure_batch

        n = block.num_rows
        out: dict[str, list] = {k: [] for k in _INSPECT_COUNTS}
        for start in range(0, n, self.measure_batch):
            part = block.slice(start, self.measure_batch)
            raw = {c: part.column(c).to_pylist() for c in part.column_names}
            measured = measure_batch(raw, self.image_cfg, self.tok, self.text_cfg)
            reasons, mismatch = self._materialize(measured)
            out[S.SKIP_REASON] += reasons
            out["length_mismatch"] += mismatch
            for k in (S.TOKENS, S.TEXT_TOKENS, S.IMAGE_TOKENS, S.PATCHES, S.N_IMAGES):
                out[k].append(np.asarray(measured[k], dtype=np.int64))
        ints = {k: (np.concatenate(v) if v else np.zeros(0, np.int64)) for k, v in out.items()
                if k not in (S.SKIP_REASON, "length_mismatch")}
        return {S.SAMPLE_ID: np.asarray(block.column(S.SAMPLE_ID).to_pylist(), dtype=object),
                S.SKIP_REASON: np.asarray(out[S.SKIP_REASON], dtype=object),
                "length_mismatch": np.asarray(out["length_mismatch"], dtype=bool),
                "image_bytes": image_bytes_per_row(block.column(S.IMAGES)), **ints}

    def _materialize(self, m: dict[str, Any]) -> tuple[list[str], list[bool]]:
        """Materialize every usable row; (skip reason, materialized length != measured) per row."""
        from ray_mmbatch.data.image import ImageSkip
        from ray_mmbatch.data.measure import materialize_sample

        reasons, mismatch = [str(r) for r in m[S.SKIP_REASON]], [False] * len(m[S.SKIP_REASON])
        for i, reason in enumerate(reasons):
            if reason:
                continue
            try:
                s = materialize_sample({k: v[i] for k, v in m.items()}, self.image_cfg)
            except ImageSkip as e:
                reasons[i] = f"{e.reason}: {e}"
                continue
            mismatch[i] = len(s["input_ids"]) != int(m[S.TOKENS][i]) or len(s["patches"]) != int(m[S.PATCHES][i])
        return reasons, mismatch


_INSPECT_COUNTS = (S.SKIP_REASON, "length_mismatch", S.TOKENS, S.TEXT_TOKENS, S.IMAGE_TOKENS, S.PATCHES,
                   S.N_IMAGES)


def image_bytes_per_row(images) -> np.ndarray:
    """Encoded image bytes per row of a list<binary> Arrow column (null = 0), without a Python loop."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(images, pa.ChunkedArray):
        images = images.combine_chunks()
    n = len(images)
    flat = pc.list_flatten(images)
    if len(flat) == 0:
        return np.zeros(n, dtype=np.int64)
    lengths = pc.fill_null(pc.binary_length(flat), 0).to_numpy(zero_copy_only=False)
    rows = pc.list_parent_indices(images).to_numpy(zero_copy_only=False)
    return np.bincount(rows, weights=lengths, minlength=n).astype(np.int64)


def inspect_workers(cfg: Config) -> int:
    """Actors for the data check: data.preprocess_workers, at most the cluster's CPUs (one process per core)."""
    workers = max(1, cfg.data.preprocess_workers)
    if ray.is_initialized():  # else Ray Data starts a local cluster of this machine's cores
        return max(1, min(workers, int(ray.cluster_resources().get("CPU", 1))))
    return workers


def _percentiles(x: np.ndarray) -> dict[str, float]:
    if len(x) == 0:
        return {}
    q = np.percentile(x, [0, 10, 50, 90, 99, 100])
    return {"min": float(q[0]), "p10": float(q[1]), "p50": float(q[2]), "p90": float(q[3]),
            "p99": float(q[4]), "max": float(q[5]), "mean": float(x.mean()), "sum": float(x.sum())}


def inspect_dataset(cfg: Config) -> dict[str, Any]:
    """read -> measure -> materialize every sample; a JSON-able summary for choosing budgets."""
    import time

    from ray_mmbatch.readers import read_raw

    t0 = time.perf_counter()
    workers = inspect_workers(cfg)
    # batch_size=None: one call per read block. Ray fuses the read into this actor stage and,
    # given a row count, would bundle read units (row groups) until it has that many ROWS OF
    # UNITS - for Parquet that packed every row group into one task on one actor.
    ds = read_raw(cfg.data.path, cfg.data).map_batches(
        InspectStage, batch_size=None, batch_format="pyarrow",
        fn_constructor_args=(cfg.image, cfg.text, cfg.data.measure_batch),
        compute=ray.data.ActorPoolStrategy(min_size=workers, max_size=workers), **_stage_args(cfg))
    cols: dict[str, list] = {}
    for b in ds.iter_batches(batch_size=4096, batch_format="numpy"):
        for k, v in b.items():
            cols.setdefault(k, []).extend(v.tolist())
    wall = time.perf_counter() - t0
    reasons = np.array(cols.get(S.SKIP_REASON, []), dtype=object)
    ok = np.array([not r for r in reasons], dtype=bool)
    skipped: dict[str, int] = {}
    examples: dict[str, list[str]] = {}
    files: dict[str, str] = {}  # read units that could not be read: one row each, id = the file (formats/)
    for sid, r in zip(cols.get(S.SAMPLE_ID, []), reasons):
        if r:
            key = _reason_key(r)
            skipped[key] = skipped.get(key, 0) + 1
            if key == S.SKIP_UNREADABLE_FILE:
                files[str(sid)] = str(r)
            if len(examples.setdefault(key, [])) < 5:
                examples[key].append(sid)
    arr = {k: np.asarray(cols.get(k, []), dtype=np.int64)[ok] for k in
           (S.TOKENS, S.TEXT_TOKENS, S.IMAGE_TOKENS, S.PATCHES, S.N_IMAGES)}
    nbytes = float(np.sum(cols.get("image_bytes", [0])))
    n = len(reasons) - len(files)
    return {
        "samples_read": n, "samples_ok": int(ok.sum()), "samples_skipped": int(n - ok.sum()),
        "skipped": skipped, "skipped_examples": examples,
        "skipped_files": len(files), "skipped_file_reasons": dict(list(files.items())[:20]),
        "length_mismatch": int(np.sum(cols.get("length_mismatch", [0]))),
        "tokens": _percentiles(arr[S.TOKENS]), "text_tokens": _percentiles(arr[S.TEXT_TOKENS]),
        "image_tokens": _percentiles(arr[S.IMAGE_TOKENS]), "patches": _percentiles(arr[S.PATCHES]),
        "images_per_sample": {str(k): int(v) for k, v in zip(*np.unique(arr[S.N_IMAGES], return_counts=True))},
        "wall_s": wall, "samples_per_s": n / wall if wall else 0.0,
        "image_mb_per_s": nbytes / 2**20 / wall if wall else 0.0,
    }
