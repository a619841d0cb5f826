"""The stages of the data path as plain callables over the pure core (no Ray graph here).

pipeline.py wires them into Ray Data; local.py runs the same objects in one process::

    MeasureStage        RAW rows -> token ids, grids, costs, skip_reason; oversize policy applied.
                        With a payload store (payloads.py) each usable measured row (image bytes
                        included) waits there and a LIGHT row goes on: id, costs, read position
    CarryPlanStage      windows of LIGHT rows -> (seeded shuffle buffer, batching/shuffle.py) ->
                        PLAN rows (ids, payload keys), under-filled batches held back into the
                        next window (batching/carry.py); the window holding the end-of-stream
                        row (formats/end_of_stream.py) flushes what the buffer and the carry hold
    plan_rows           the same for carry 0: each window planned on its own, stateless
    MaterializeStage    PLAN row -> BATCH row: fetch the payloads, decode + resize + patchify,
                        collate, encode; then release the payloads

Skipped samples travel with the data: the skip list of a window rides on the first
batch of that window (a window with no usable sample emits one empty batch just to
carry it), and samples that fail to decode ride on their own batch. The train loop
records them, so every sample read is either trained once or reported once.
"""
from __future__ import annotations

import hashlib
import sys
import time
from typing import Any

import numpy as np

from ray_mmbatch import schema as S
from ray_mmbatch.config import BudgetConfig, DataConfig, ImageConfig, TextConfig
from ray_mmbatch.data.errors import SkipRecord, decode_skips, encode_skips
from ray_mmbatch.dataflow import timing

PAYLOAD_KEYS = "payload_keys"  # PLAN row: list<str>, where each sample's measured row waits (payloads.py)
LIGHT_COLUMNS = (S.SAMPLE_ID, S.SKIP_REASON, S.TOKENS, S.PATCHES, S.N_IMAGES, S.N_FRAMES) + S.READ_POSITION_COLUMNS


def uses_carry(budget_cfg: BudgetConfig) -> bool:
    from ray_mmbatch.batching.carry import resolve_carry

    return resolve_carry(budget_cfg.mode, budget_cfg.carry) > 0


def shuffle_buffer_size(data_cfg: DataConfig) -> int:
    """Samples the plan stage's shuffle buffer holds: data.shuffle_buffer under --shuffle samples, else 0."""
    from ray_mmbatch.batching.shuffle import check_mode

    if data_cfg.shuffle_buffer < 0:
        raise ValueError(f"data.shuffle_buffer must be >= 0, got {data_cfg.shuffle_buffer}")
    return int(data_cfg.shuffle_buffer) if check_mode(data_cfg.shuffle) == "samples" else 0


def uses_plan_actor(budget_cfg: BudgetConfig, data_cfg: DataConfig) -> bool:
    """The plan stage is one stateful actor (with the end-of-stream row) when it carries or shuffles."""
    return uses_carry(budget_cfg) or shuffle_buffer_size(data_cfg) > 0


def epoch_unit_order(reader: tuple, data_cfg: DataConfig, seed: int | None, epoch: int) -> list[int]:
    """The order epoch ``epoch`` reads the units of ``reader`` (formats/units.read_units) in:
    batching/shuffle.unit_order under --shuffle, stratified by source for a blend."""
    from ray_mmbatch.batching.shuffle import check_mode, stratified_unit_order, unit_order

    units, _, kwargs = reader
    blend = kwargs.get("blend")
    if blend is None or check_mode(data_cfg.shuffle) == "none":
        return unit_order(len(units), seed or 0, epoch, data_cfg.shuffle)
    from ray_mmbatch.formats.sources import SOURCE
    from ray_mmbatch.formats.units import SOURCE_ROW0

    labels = [int(u[SOURCE]) for u in units]
    ends = [int(u[SOURCE_ROW0]) for u in units[1:]] + [0]
    sizes = [(ends[i] if i + 1 < len(units) and labels[i + 1] == k else blend.rows[k]) - int(u[SOURCE_ROW0])
             for i, (u, k) in enumerate(zip(units, labels))]
    return stratified_unit_order(labels, sizes, seed or 0, epoch)


def blend_strata(reader: tuple) -> dict[str, float] | None:
    """{source name: share of the epoch} of a blend (what the plan stage's buffer stratifies by), else None."""
    units, _, kwargs = reader
    blend = kwargs.get("blend")
    if blend is None:
        return None
    return {name: float(t) for (name, _, _), t in zip(kwargs["sources"], blend.targets)}


def _source_label(row: dict[str, Any]) -> str:
    from ray_mmbatch.formats.sources import source_of

    return source_of(str(row[S.SAMPLE_ID]))


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
                 payloads=None, measure_batch: int = 64):
        from ray_mmbatch.data.text.encoder import tokenizer_for

        self.image_cfg, self.text_cfg, self.budget_cfg = image_cfg, text_cfg, budget_cfg
        self.payloads, self.measure_batch = payloads, measure_batch
        self.tok = tokenizer_for(text_cfg)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """One read block (batch_size=None: a unit's rows) in tokenizer batches of ``measure_batch``.

        Taking the whole block matters: with batch_size=N, Ray bundles the fused read op's INPUT
        rows (one per read unit) until it has N, so up to N units ran as one task on one actor.
        """
        n = len(next(iter(batch.values()))) if batch else 0
        step = max(1, int(self.measure_batch))
        if n <= step:
            return self._measure(batch)
        parts = [self._measure({k: v[i:i + step] for k, v in batch.items()}) for i in range(0, n, step)]
        return {k: np.concatenate([p[k] for p in parts]) if isinstance(parts[0][k], np.ndarray)
                else [x for p in parts for x in p[k]] for k in parts[0]}

    def _measure(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        from ray_mmbatch.data.measure import fit_batch_to_budget, measure_batch

        t0 = time.perf_counter()
        measured = measure_batch(batch, self.image_cfg, self.tok, self.text_cfg)
        measured.update({c: batch[c] for c in S.READ_POSITION_COLUMNS if c in batch})
        measured = fit_batch_to_budget(measured, self.budget_cfg)
        out = measured if self.payloads is None else light_rows(measured, self.payloads)
        return timing.with_measure_seconds(out, batch, time.perf_counter() - t0)  # read_s, measure_s ride on


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
    return out  # + read_s, measure_s (MeasureStage, timing.py)


def _rows(batch: dict[str, Any]) -> list[dict[str, Any]]:
    n = len(batch[S.SAMPLE_ID])
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def _position(row: dict) -> tuple[int, int]:
    """(read position, rows of its unit) of a measured row; (-1, 0) for a row without one."""
    from ray_mmbatch.data.position import encode_positions

    if S.UNIT not in row:
        return -1, 0
    return int(encode_positions([row[S.UNIT]], [row[S.UNIT_ROW]])[0]), int(row[S.UNIT_ROWS])


def _split_window(batch: dict[str, Any]) -> tuple[list[dict], list[SkipRecord], str, bool]:
    """(usable rows, skip records of the skipped rows, window key, end-of-stream seen) of one window."""
    from ray_mmbatch.formats.end_of_stream import split_marker

    rows, end = split_marker(_rows(batch))
    window_key = str(rows[0][S.SAMPLE_ID]) if rows else ("end" if end else "empty")
    ok = [_plain(r) for r in rows if not r[S.SKIP_REASON]]
    skipped = [SkipRecord.of(r[S.SAMPLE_ID], r[S.SKIP_REASON], *_position(r)) for r in rows if r[S.SKIP_REASON]]
    return ok, skipped, window_key, end


def _costs(rows: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, patches, images, frames) of measured rows; a row without a frames column has none."""
    t, p, m = (np.array([int(r[k]) for r in rows], dtype=np.int64) for k in (S.TOKENS, S.PATCHES, S.N_IMAGES))
    return t, p, m, np.array([int(r.get(S.N_FRAMES, 0)) for r in rows], dtype=np.int64)


def _plan_output(groups: list[list[dict]], skipped: list, epoch: int, window_key: str,
                 seconds: tuple[tuple[float, float], float] = ((0.0, 0.0), 0.0)) -> dict[str, list]:
    """PLAN rows: one per group of measured rows; the window's skip list rides on the first one
    (a window that emits no batch but skipped samples emits one empty batch to carry them).
    ``seconds``: (the skipped rows' (read_s, measure_s), the plan seconds), billed in data_time (timing.py)."""
    if not groups and skipped:
        groups = [[]]
    out: dict[str, list] = {S.BATCH_ID: [], S.BATCH_SAMPLE_IDS: [], PAYLOAD_KEYS: [], S.BATCH_SKIPPED: [],
                            S.BATCH_DATA_TIME: timing.plan_cells(groups, *seconds)}
    for j, members in enumerate(groups):
        out[S.BATCH_ID].append(f"e{epoch}/{window_key}/{j}")
        out[S.BATCH_SAMPLE_IDS].append([str(r[S.SAMPLE_ID]) for r in members])
        out[PAYLOAD_KEYS].append([payload_key(r) for r in members])
        out[S.BATCH_SKIPPED].append(encode_skips(skipped if j == 0 else []))
    return out


def plan_rows(batch: dict[str, Any], budget_cfg: BudgetConfig, seed: int, epoch: int) -> dict[str, list]:
    """Plan one window of MEASURED rows on its own into PLAN rows (carry = 0; stateless task)."""
    from ray_mmbatch.batching import Budget, plan_batches_arrays

    t0 = time.perf_counter()
    ok, skipped, window_key, _ = _split_window(batch)
    groups: list[list[dict]] = []
    if ok:
        t, p, m, f = _costs(ok)
        plan = plan_batches_arrays(t, p, m, Budget.from_config(budget_cfg), seed=window_seed(seed, epoch, window_key),
                                   algorithm=budget_cfg.algorithm, frames=f)
        groups = [[ok[i] for i in g] for g in plan]
    return _plan_output(groups, skipped, epoch, window_key,
                        (timing.skipped_seconds(batch), time.perf_counter() - t0))


#: rows of the stateful plan stage's first window; each next window doubles, up to budget.window
FIRST_WINDOW = 32


class CarryPlanStage:
    """The stateful plan stage: ONE actor shuffles the stream (a seeded buffer of
    ``shuffle_buffer`` light rows, batching/shuffle.py) and holds back under-filled batches
    into the next window (the carry).

    Runs as an actor pool of exactly one actor (one buffer and carry, windows in stream
    order). The readers append an end-of-stream row (schema.END_OF_STREAM_ID) after the
    last sample; the window holding it flushes the buffer, then the carry. If that row ever
    arrives early (no preserve_order: --deterministic false), every later call passes its
    rows straight through the buffer and plans them at once, holding nothing back: order
    affects fill and mixing, never correctness (before, rows after an early end row stayed
    in the refilled buffer and were lost). Skipped rows never wait in the buffer.

    The actor plans windows of the buffer's output of fixed sizes (``window_size``: FIRST_WINDOW
    rows, doubling to ``budget.window``), whatever batches Ray hands it (one measured block per
    call, so planning starts as soon as the first rows leave the growing buffer): with the stream
    order fixed (deterministic mode), the plans are the same run to run and equal
    local_batches' (local.py).

    An actor restarted by Ray (node or process failure) has lost what it held: it raises on
    its first call instead of finishing an epoch without those samples. Training then fails
    over and rebuilds the stream without the samples already trained (train/trainer.py),
    so the held-back samples are planned again.
    """

    def __init__(self, budget_cfg: BudgetConfig, seed: int, epoch: int, shuffle_buffer: int = 0,
                 strata: dict[str, float] | None = None, shuffle_ramp: float = 0.0):
        from ray_mmbatch.batching import Budget
        from ray_mmbatch.batching.carry import CarryPlanner
        from ray_mmbatch.batching.shuffle import BatchMix, ShuffleBuffer

        self.seed, self.epoch, self.window = seed, epoch, max(1, budget_cfg.window)
        self.windows = 0  # windows planned: the first ones are smaller (window_size)
        self.streamed = self.planned = 0  # rows out of the buffer before its end flush; rows planned
        self.planner = CarryPlanner(Budget.from_config(budget_cfg), budget_cfg.algorithm, budget_cfg.carry)
        # strata (a blend: {source: share}): the buffer lets out each source by its share (batching/shuffle.py)
        self.buffer = ShuffleBuffer(shuffle_buffer, seed or 0, epoch, shares=strata,
                                    label=_source_label if strata else None, ramp=shuffle_ramp)
        self.mix = BatchMix(strata, _source_label) if strata else None  # and the batches leave by the shares too
        self.pending: list[dict] = []  # rows out of the buffer, planned once a whole window is here
        self.ended = False  # the end-of-stream row has been seen: hold nothing from now on
        self.unbilled_s = 0.0  # plan seconds of calls that emitted no batch: billed on the next one
        ray = sys.modules.get("ray")  # loaded in a Ray actor; in-process (local.py) there is no actor to restart
        ctx = ray.get_runtime_context() if ray is not None and ray.is_initialized() else None
        self.restarted = bool(ctx is not None and ctx.get_actor_id() and ctx.was_current_actor_reconstructed)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        if self.restarted:
            raise RuntimeError(
                "the carry plan actor was restarted, so the samples it held back for the next window are "
                "gone from this epoch's stream; failing the stream rather than dropping them (a training run "
                "restores from its checkpoint and re-plans every sample not yet trained)")
        t0 = time.perf_counter()
        ok, skipped, window_key, end = _split_window(batch)
        self.ended = self.ended or end
        left = self.buffer.push(ok, [_position(r)[0] for r in ok])
        self.pending += left
        self.streamed += len(left)
        if self.ended:  # at the end, or rows that came after an early end row: nothing may stay behind
            self.pending += self.buffer.flush()
        groups: list[list[dict]] = []
        while self.pending:
            # small windows only over rows that left the buffer while the stream ran (an early
            # start); a window reaching into the end's flush is a whole one (fill). Both counts are
            # functions of the stream, so the windows do not depend on how Ray cuts it into calls.
            small = self.window_size()
            size = small if self.planned + small <= self.streamed else self.window
            if len(self.pending) < size and not self.ended:
                break
            part, self.pending = self.pending[:size], self.pending[size:]
            self.windows, self.planned = self.windows + 1, self.planned + len(part)
            key = str(part[0][S.SAMPLE_ID])  # a function of the stream, not of Ray's batch cuts
            t, p, m, f = _costs(part)
            groups += self._mixed(self.planner.feed(part, t, p, m, seed=window_seed(self.seed, self.epoch, key),
                                                    frames=f))
        if self.ended:
            groups += self._mixed(self.planner.flush(seed=window_seed(self.seed, self.epoch, "end")))
        plan_s = self.unbilled_s + time.perf_counter() - t0
        out = _plan_output(groups, skipped, self.epoch, window_key, (timing.skipped_seconds(batch), plan_s))
        self.unbilled_s = 0.0 if out[S.BATCH_ID] else plan_s
        return out

    def window_size(self) -> int:
        """Rows of the next window: FIRST_WINDOW, doubling each window up to budget.window, so the
        first batch is planned once a few hundred rows are here, not a whole window (the carry
        holds the under-filled batches of the small windows back, so fill is kept)."""
        return min(self.window, FIRST_WINDOW << min(self.windows, 30))

    def _mixed(self, groups: list[list[dict]]) -> list[list[dict]]:
        """One window's batches, in the blend's order (BatchMix) when there is one (per window, so
        the order does not depend on how Ray cuts the stream into calls)."""
        return self.mix.order(groups) if self.mix is not None else groups


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
        t0 = time.perf_counter()
        out: dict[str, list] = {k: [] for k in (
            S.BATCH_ID, S.BATCH_SAMPLE_IDS, S.BATCH_PAYLOAD, S.BATCH_REAL_TOKENS, S.BATCH_PADDED_TOKENS,
            S.BATCH_TARGET_TOKENS, S.BATCH_N_SAMPLES, S.BATCH_SKIPPED, S.BATCH_POSITIONS,
            S.BATCH_POSITION_UNIT_ROWS)}
        n = len(batch[S.BATCH_ID])
        keys = [[str(k) for k in batch[PAYLOAD_KEYS][i]] for i in range(n)]
        fetched = iter(self.payloads.get([k for ks in keys for k in ks]))  # one fetch per holder per block
        done: list[str] = []
        own: list[float] = []  # each batch's own seconds; the block's fetch and release are shared out
        for i in range(n):
            t1 = time.perf_counter()
            members = [next(fetched) for _ in keys[i]]
            row = materialize_plan_row(members, decode_skips(batch[S.BATCH_SKIPPED][i]),
                                       self.image_cfg, self.budget_cfg, self.pad_id)
            row[S.BATCH_ID] = str(batch[S.BATCH_ID][i])
            for k in out:
                out[k].append(row[k])
            done += keys[i]
            own.append(time.perf_counter() - t1)
        self.payloads.done(done)
        shared, plan = (time.perf_counter() - t0 - sum(own)) / max(n, 1), batch.get(S.BATCH_DATA_TIME)
        now = time.time()  # produced_at: the train loop's transfer_s is its time.time() minus this
        out[S.BATCH_DATA_TIME] = [timing.batch_cell(None if plan is None else plan[i], own[i] + shared, now)
                                  for i in range(n)]
        return out


def materialize_plan_row(members: list[dict], skipped: list[SkipRecord], image_cfg: ImageConfig,
                         budget_cfg: BudgetConfig, pad_id: int) -> dict[str, Any]:
    """Pure: the measured rows of one planned batch -> the fields of a BATCH row.

    ``skipped``: the skip records carried from the plan; samples that fail to decode join them.
    """
    from ray_mmbatch.batching.collate import collate_pack, collate_pad, encode_batch
    from ray_mmbatch.data.image import ImageSkip
    from ray_mmbatch.data.materialize import materialize_sample

    samples, positions = [], []
    skipped = list(skipped)
    for r in members:
        try:
            samples.append(materialize_sample(r, image_cfg))
            positions.append(_position(r))
        except ImageSkip as e:
            skipped.append(SkipRecord(str(r[S.SAMPLE_ID]), e.reason, e.detail, *_position(r)))
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
        S.BATCH_SKIPPED: encode_skips(skipped),
        S.BATCH_POSITIONS: [p for p, _ in positions],
        S.BATCH_POSITION_UNIT_ROWS: [n for _, n in positions],
    }
