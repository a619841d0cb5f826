"""The epoch's sample order (batching/shuffle.py) and the figures that judge it (batching/mixing.py).

Pure: no Ray. The invariants every order must keep (every item once, same seed same order,
another epoch another order, independent of how the stream is cut), and that the default
mixes a stream of sorted subsets about as well as a random permutation when the buffer
spans the stream, and much better than a plain buffer over file order when it does not.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from ray_mmbatch.batching.mixing import order_figures, rank_correlation, worst_part_distance
from ray_mmbatch.batching.shuffle import SHUFFLE_MODES, ShuffleBuffer, unit_order


def _through(buffer: ShuffleBuffer, items: list[int], chunk: int) -> list[int]:
    out: list[int] = []
    for k in range(0, len(items), chunk):
        part = items[k:k + chunk]
        out += buffer.push(part, part)
    return out + buffer.flush()


@pytest.mark.parametrize("capacity", [0, 1, 7, 100, 5000])
def test_every_item_leaves_once_whatever_the_chunks(capacity):
    items = list(range(1000))
    runs = [_through(ShuffleBuffer(capacity, seed=3, epoch=1), items, chunk) for chunk in (1, 13, 64, 1000)]
    assert sorted(runs[0]) == items
    assert all(r == runs[0] for r in runs[1:]), "the order must not depend on the window cuts"
    if capacity == 0:
        assert runs[0] == items
    elif capacity >= 100:
        assert runs[0] != items


def test_same_seed_same_order_other_epoch_or_seed_other_order():
    items = list(range(3000))
    base = _through(ShuffleBuffer(500, seed=0, epoch=0), items, 64)
    assert base == _through(ShuffleBuffer(500, seed=0, epoch=0), items, 64)
    for seed, epoch in ((0, 1), (1, 0)):
        other = _through(ShuffleBuffer(500, seed=seed, epoch=epoch), items, 64)
        assert sorted(other) == items and other != base


def test_buffer_fills_then_emits_one_per_push_and_checks_its_input():
    b = ShuffleBuffer(10, seed=0, epoch=0)
    assert b.push(list(range(10)), list(range(10))) == []
    assert len(b.push([10, 11, 12], [10, 11, 12])) == 3 and len(b) == 10
    with pytest.raises(ValueError, match="positions"):
        b.push([1, 2], [1])
    with pytest.raises(ValueError, match=">= 0"):
        ShuffleBuffer(-1, 0, 0)


def test_unit_order_per_mode():
    assert unit_order(50, 0, 0, "none") == list(range(50))
    units = unit_order(50, 0, 0, "units")
    assert sorted(units) == list(range(50)) and units != list(range(50))
    assert units == unit_order(50, 0, 0, "samples") == unit_order(50, 0, 0, "units")
    assert unit_order(50, 0, 1, "units") != units and unit_order(50, 1, 0, "units") != units
    with pytest.raises(ValueError, match="shuffle must be one of"):
        unit_order(5, 0, 0, "rows")
    assert set(SHUFFLE_MODES) == {"none", "units", "samples"}


def test_figures_tell_file_order_from_a_random_one():
    n, subsets = 4000, 16
    labels = np.arange(n) // (n // subsets)
    assert rank_correlation(np.arange(n)) == pytest.approx(1.0)
    assert rank_correlation(np.arange(n)[::-1]) == pytest.approx(-1.0)
    assert worst_part_distance(labels) == pytest.approx(1 - 1 / subsets)  # a part holds 1 of 16 subsets
    perm = np.random.default_rng(0).permutation(n)
    fig = order_figures(perm, labels[perm])
    assert abs(fig["rank_correlation"]) < 0.05 and fig["worst_part_distance"] < 0.2


def _stream_figures(mode: str, capacity: int, n_subsets=16, per_subset=500, unit_rows=50, epoch=0) -> dict:
    """Figures of the order a stream of sorted subsets (cut into units) takes."""
    n = n_subsets * per_subset
    units = [list(range(u, min(n, u + unit_rows))) for u in range(0, n, unit_rows)]
    stream = [i for u in unit_order(len(units), 0, epoch, mode) for i in units[u]]
    out = _through(ShuffleBuffer(capacity, seed=0, epoch=epoch), stream, 256)
    assert sorted(out) == list(range(n))
    return order_figures(out, [i // per_subset for i in out])


def test_default_mixes_like_a_random_permutation_and_beats_a_plain_buffer():
    n = 16 * 500
    perm = list(range(n))
    random.Random(5).shuffle(perm)
    floor = order_figures(perm, [i // 500 for i in perm])
    spans = _stream_figures("samples", n)  # the buffer spans the epoch (the default's 16,384 does here)
    assert abs(spans["rank_correlation"]) <= 0.05
    assert spans["worst_part_distance"] <= 1.5 * floor["worst_part_distance"] + 0.01
    part = _stream_figures("samples", 1000)  # a buffer of 1/8 of the epoch: still no file order
    plain = _stream_figures("none", 1000)  # the same buffer over file order (a plain shuffle buffer)
    assert abs(part["rank_correlation"]) <= 0.05 < 0.8 < plain["rank_correlation"]
    assert part["worst_part_distance"] < 0.5 * plain["worst_part_distance"]
    assert _stream_figures("none", 0)["rank_correlation"] == pytest.approx(1.0)


def test_an_early_end_row_loses_nothing(tmp_path):
    """Without preserve_order (--deterministic false) the end-of-stream row can reach the plan actor
    before other rows: what comes after it must still be planned, not left in the shuffle buffer."""
    from ray_mmbatch import schema as S
    from ray_mmbatch.config import Config
    from ray_mmbatch.dataflow.local import _chunks, _measured_rows
    from ray_mmbatch.dataflow.payload_store import LocalPayloads
    from ray_mmbatch.dataflow.stages import CarryPlanStage
    from ray_mmbatch.models import configure
    from ray_mmbatch.synthetic.generate import generate_dataset

    manifest = generate_dataset(str(tmp_path / "d"), 40, "parquet", seed=2, workers=1)
    cfg = Config()
    cfg.data.path, cfg.data.format = str(tmp_path / "d"), "parquet"
    cfg.budget.window = 8
    cfg = configure(cfg)
    rows = list(_measured_rows(cfg, end_marker=True, payloads=LocalPayloads()))
    end = [r for r in rows if r[S.SAMPLE_ID] == S.END_OF_STREAM_ID]
    rest = [r for r in rows if r[S.SAMPLE_ID] != S.END_OF_STREAM_ID]
    assert len(end) == 1 and len(rest) == 40
    stage = CarryPlanStage(cfg.budget, seed=0, epoch=0, shuffle_buffer=16)
    planned = []
    for window in _chunks(iter(rest[:5] + end + rest[5:]), 6):  # the end row in the first window
        planned += [s for ids in stage(window)[S.BATCH_SAMPLE_IDS] for s in ids]
    assert sorted(planned) == sorted(manifest["ids"])


# --- a blend's strata (formats/sources.py): the stratified buffer, unit order and batch order ---

_SHARES = {"a": 0.6, "b": 0.3, "c": 0.1}


def _label(item: str) -> str:
    return item[0]


def _worst_share_gap(order: list[str], shares: dict, part: int) -> float:
    """The largest |share of a label in a stretch of ``part`` items - its share|, over every stretch."""
    worst = 0.0
    for start in range(0, len(order) - part + 1, max(1, part // 4)):
        chunk = order[start:start + part]
        for k, w in shares.items():
            worst = max(worst, abs(sum(_label(i) == k for i in chunk) / part - w))
    return worst


@pytest.mark.parametrize("capacity", [50, 100_000])
def test_stratified_buffer_every_item_once_and_every_stretch_by_the_shares(capacity):
    from ray_mmbatch.batching.shuffle import stratified_unit_order

    # units of 10 rows of one source each (600 / 300 / 100 rows), read in the stratified unit order
    units = [[f"{k}{n}" for n in range(u * 10, u * 10 + 10)] for k, count in (("a", 60), ("b", 30), ("c", 10))
             for u in range(count)]
    order = stratified_unit_order([u[0][0] for u in units], [10] * len(units), seed=5, epoch=0)
    items = [i for u in order for i in units[u]]
    runs = []
    for chunk in (1, 17, 1000):
        buf = ShuffleBuffer(capacity, seed=5, epoch=0, shares=_SHARES, label=_label)
        runs.append(_through(buf, items, chunk))
    assert sorted(runs[0]) == sorted(items) and all(r == runs[0] for r in runs[1:])
    assert _worst_share_gap(runs[0], _SHARES, 50) <= 0.04  # within 2 items of 50, in every stretch
    plain = [items[i] for i in _through(ShuffleBuffer(capacity, seed=5, epoch=0), list(range(len(items))), 17)]
    assert _worst_share_gap(plain, _SHARES, 50) > 0.06  # what a plain buffer leaves: the test can fail
    other = _through(ShuffleBuffer(capacity, seed=6, epoch=0, shares=_SHARES, label=_label), items, 17)
    assert other != runs[0] and sorted(other) == sorted(items)


def test_stratified_buffer_passes_over_an_empty_label_and_needs_its_labels():
    items = [f"a{n}" for n in range(30)] + [f"c{n}" for n in range(5)]  # no "b" at all, "c" late
    out = _through(ShuffleBuffer(8, seed=0, epoch=0, shares=_SHARES, label=_label), items, 4)
    assert sorted(out) == sorted(items)
    with pytest.raises(ValueError, match="label"):
        ShuffleBuffer(8, 0, 0, shares=_SHARES)


def test_stratified_unit_order_spreads_every_source_over_the_stream():
    from ray_mmbatch.batching.shuffle import stratified_unit_order

    labels = [0] * 40 + [1] * 10 + [2] * 5  # the listing: source after source
    sizes = [25] * 40 + [50] * 10 + [20] * 5
    order = stratified_unit_order(labels, sizes, seed=1, epoch=0)
    assert sorted(order) == list(range(55))
    assert order == stratified_unit_order(labels, sizes, 1, 0) != stratified_unit_order(labels, sizes, 1, 1)
    for k in range(3):  # each source's rows read by each fifth of the stream: within one unit of even
        rows = np.cumsum([sizes[u] if labels[u] == k else 0 for u in order])
        total, n = rows[-1], len(order)
        for f in (1, 2, 3, 4):
            unit = max(sizes[u] for u in order if labels[u] == k) / total
            assert abs(rows[f * n // 5 - 1] / total - f / 5) <= unit + 0.05
    assert unit_order(55, 1, 0, "units")[:10] != order[:10]


def test_batch_mix_orders_batches_by_the_running_shares():
    from ray_mmbatch.batching.shuffle import BatchMix

    rng = random.Random(0)
    pool = [f"{k}{n}" for k, count in (("a", 600), ("b", 300), ("c", 100)) for n in range(count)]
    rng.shuffle(pool)
    pool.sort(key=lambda i: i[0] != "a")  # batches that are mostly one source, as length grouping can make
    batches = [pool[k:k + 10] for k in range(0, len(pool), 10)]
    rng.shuffle(batches)
    mix = BatchMix(_SHARES, _label)
    ordered = mix.order(list(batches[:50])) + mix.order(list(batches[50:]))  # two windows, one running count
    assert sorted(map(tuple, ordered)) == sorted(map(tuple, batches))
    flat = [i for b in ordered for i in b]
    assert _worst_share_gap(flat, _SHARES, 200) <= 0.05 + 1e-9  # one batch of the stretch's 20
    alone = [i for b in batches for i in b]  # the seeded order alone: two batches off
    assert _worst_share_gap(alone, _SHARES, 200) >= 0.1 - 1e-9


# --- the growing buffer (ramp): planning starts before the buffer is full ---

@pytest.mark.parametrize("ramp", [0.1, 0.25, 0.5])
def test_a_ramped_buffer_grows_to_its_capacity_and_keeps_every_invariant(ramp):
    items = list(range(3000))
    b = ShuffleBuffer(1000, seed=3, epoch=0, ramp=ramp)
    out = b.push(items[:400], items[:400])
    assert len(out) == int(400 * ramp) and len(b) == 400 - int(400 * ramp)  # emits while it grows
    out += b.push(items[400:], items[400:])
    assert len(b) == 1000  # full: from here one out per push, as the plain buffer
    assert sorted(out + b.flush()) == items
    runs = [_through(ShuffleBuffer(1000, seed=3, epoch=0, ramp=ramp), items, chunk) for chunk in (1, 17, 3000)]
    assert runs[0] == runs[1] == runs[2] and sorted(runs[0]) == items  # a function of the stream, not its cuts
    assert runs[0] != _through(ShuffleBuffer(1000, seed=4, epoch=0, ramp=ramp), items, 64)
    # ramp 0 is the buffer that fills first: nothing leaves before `capacity` pushes
    assert ShuffleBuffer(1000, seed=3, epoch=0).push(items[:999], items[:999]) == []
    with pytest.raises(ValueError, match="ramp"):
        ShuffleBuffer(10, 0, 0, ramp=1.0)


def test_a_ramped_stratified_buffer_keeps_every_item_once_and_the_shares():
    rng = random.Random(0)
    items = [f"{k}{i}" for k, n in (("a", 1800), ("b", 900), ("c", 300)) for i in range(n)]
    rng.shuffle(items)
    b = ShuffleBuffer(500, seed=5, epoch=0, shares=_SHARES, label=_label, ramp=0.25)
    out = b.push(items[:200], list(range(200)))
    assert len(out) == 50 and len(b) == 150
    out += b.push(items[200:], list(range(200, len(items)))) + b.flush()
    assert sorted(out) == sorted(items)
    assert _worst_share_gap(out, _SHARES, 200) < 0.1


def test_the_plan_stage_plans_while_the_buffer_grows(tmp_path):
    """With the default 16,384-row buffer and 600 rows, the ramped plan stage emits batches before the
    end of the stream (small first windows, a buffer that lets rows out as it grows); ramp 0 emits
    none before the end row. Both plan every row exactly once."""
    from ray_mmbatch import schema as S
    from ray_mmbatch.config import Config
    from ray_mmbatch.dataflow.local import _chunks, _measured_rows
    from ray_mmbatch.dataflow.payload_store import LocalPayloads
    from ray_mmbatch.dataflow.stages import FIRST_WINDOW, CarryPlanStage
    from ray_mmbatch.models import configure
    from ray_mmbatch.synthetic.generate import generate_dataset

    manifest = generate_dataset(str(tmp_path / "d"), 600, "parquet", seed=2, workers=1)
    cfg = Config()
    cfg.data.path, cfg.data.format = str(tmp_path / "d"), "parquet"
    cfg = configure(cfg)
    rows = list(_measured_rows(cfg, end_marker=True, payloads=LocalPayloads()))
    assert rows[-1][S.SAMPLE_ID] == S.END_OF_STREAM_ID
    for ramp in (0.25, 0.0):
        stage = CarryPlanStage(cfg.budget, 0, 0, shuffle_buffer=16384, shuffle_ramp=ramp)
        before_end, planned = 0, []
        for window in _chunks(iter(rows), 64):
            ids = [s for b in stage(window)[S.BATCH_SAMPLE_IDS] for s in b]
            planned += ids
            if not any(r[S.SAMPLE_ID] == S.END_OF_STREAM_ID for r in _rows_of(window)):
                before_end += len(ids)
        assert sorted(planned) == sorted(manifest["ids"])
        if ramp:
            assert before_end >= FIRST_WINDOW // 2  # planned while the stream still ran
            assert stage.windows >= 2 and stage.window_size() > FIRST_WINDOW
        else:
            assert before_end == 0


def _rows_of(window: dict) -> list[dict]:
    return [{k: v[i] for k, v in window.items()} for i in range(len(next(iter(window.values()))))]


def test_the_ramped_plan_stage_plans_the_same_whatever_the_cuts(tmp_path):
    """Small windows while the buffer grows, whole ones for the end's flush: the batches are the same
    whether the end row comes in a call of its own or with every row (Ray's cuts vs local_batches')."""
    from ray_mmbatch import schema as S
    from ray_mmbatch.config import Config
    from ray_mmbatch.dataflow.local import _chunks, _measured_rows
    from ray_mmbatch.dataflow.payload_store import LocalPayloads
    from ray_mmbatch.dataflow.stages import CarryPlanStage
    from ray_mmbatch.models import configure
    from ray_mmbatch.synthetic.generate import generate_dataset

    generate_dataset(str(tmp_path / "d"), 600, "parquet", seed=2, workers=1)
    cfg = Config()
    cfg.data.path, cfg.data.format = str(tmp_path / "d"), "parquet"
    cfg = configure(cfg)
    rows = list(_measured_rows(cfg, end_marker=True, payloads=LocalPayloads()))
    plans = []
    for chunk in (64, 7, len(rows)):
        stage = CarryPlanStage(cfg.budget, 0, 0, shuffle_buffer=16384, shuffle_ramp=0.25)
        plans.append([list(b) for window in _chunks(iter(rows), chunk) for b in stage(window)[S.BATCH_SAMPLE_IDS]])
    assert plans[0] == plans[1] == plans[2] and sum(map(len, plans[0])) == 600
