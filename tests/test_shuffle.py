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
