"""CarryPlanner: windows of a stream planned with under-filled batches held back.

The same invariant checker idea as test_batching_invariants.py, over a whole stream:
every item fed comes out exactly once (after flush), every batch within every limit,
the carry never above its cap, a sample never held more than max_age times, same
stream -> same batches, and a window fed after flush is planned on its own.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_batching_invariants import budgets, costs

from ray_mmbatch.batching import ALGORITHMS, Budget, OversizeError, plan_stats_arrays
from ray_mmbatch.batching.carry import DEFAULT_CARRY, CarryPlanner, resolve_carry


def run_stream(tokens, patches, images, budget, windows, carry, algorithm="", max_age=8, end=True, frames=None):
    """Feed ``windows`` (sizes) through a fresh planner; return (batches, held sizes, planner).
    ``frames`` None: fed without a frames array (the call of before the frames budget)."""
    planner = CarryPlanner(budget, algorithm, carry, max_age=max_age)
    out, held, times_held, s = [], [], {}, 0
    for w in windows:
        sl = slice(s, s + w)
        extra = {} if frames is None else {"frames": frames[sl]}
        out += planner.feed(list(range(s, s + w)), tokens[sl], patches[sl], images[sl], seed=s, **extra)
        held.append(len(planner.held))
        assert len(planner.held) <= int(planner.carry * w), "carry above its cap"
        for i in planner.held:
            times_held[i] = times_held.get(i, 0) + 1
            assert times_held[i] <= max_age, f"item {i} held more than max_age={max_age} times"
        s += w
    if end:
        out += planner.flush(seed=s)
        assert planner.held == []
    return out, held, planner


@st.composite
def streams(draw):
    tokens, patches, images, frames = draw(costs())
    cuts, left = [], len(tokens)
    while left:
        w = draw(st.integers(1, max(1, left)))
        cuts.append(w)
        left -= w
    return tokens, patches, images, frames, cuts


@pytest.mark.parametrize("mode", ["pack", "pad"])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_carry_stream_keeps_every_invariant(algorithm, mode, data):
    tokens, patches, images, frames, windows = data.draw(streams())
    budget = data.draw(budgets(mode))
    carry = data.draw(st.sampled_from([None, 0.0, 0.3, 1.0]))
    max_age = data.draw(st.integers(1, 3))
    if not data.draw(st.booleans()):
        frames = None  # fed the old way: no frames at all
    f = np.zeros(len(tokens), np.int64) if frames is None else frames
    args = (tokens, patches, images, budget, windows, carry, algorithm, max_age)
    if any(budget.violations([tokens[i]], [patches[i]], [images[i]], [f[i]]) for i in range(len(tokens))):
        with pytest.raises(OversizeError):
            run_stream(*args, frames=frames)
        return
    out, _, _ = run_stream(*args, frames=frames)
    flat = [i for b in out for i in b]
    assert sorted(flat) == list(range(len(tokens))), "every item exactly once"
    for b in out:
        assert b, "no empty batch"
        assert budget.violations(tokens[b], patches[b], images[b], f[b]) == [], (b, budget)
        if budget.max_frames is not None:
            assert int(f[b].sum()) <= budget.max_frames, (b, budget)
    again, _, _ = run_stream(*args, frames=frames)
    assert again == out, "same stream -> same batches"


def test_carry_fills_the_window_boundary_by_hand():
    # budget 10. Windows [6, 3] and [4, 7]. On their own: {6,3} then {7}, {4} -> 3 batches.
    # With carry, {6,3} (9/10) is held and planned with the next window: {7,3}, {6,4}.
    tokens = np.array([6, 3, 4, 7])
    on_own, _, _ = run_stream(tokens, tokens * 0, tokens * 0, Budget(10, "pack"), [2, 2], carry=0.0)
    carried, held, _ = run_stream(tokens, tokens * 0, tokens * 0, Budget(10, "pack"), [2, 2], carry=1.0)
    assert sorted(map(tuple, on_own)) == [(0, 1), (2,), (3,)]
    assert held == [2, 0]
    assert sorted(map(tuple, carried)) == [(0, 2), (1, 3)]


def test_nothing_is_held_after_flush():
    tokens = np.array([6, 3, 4, 7, 2, 2])
    planner = CarryPlanner(Budget(10, "pack"), carry=1.0)
    first = planner.feed(["a", "b"], tokens[:2])
    assert first == [] and planner.held == ["a", "b"]
    flushed = planner.flush()
    assert flushed == [["a", "b"]]
    late = planner.feed(["c", "d"], tokens[2:4])  # a window after the end marker: planned on its own
    assert sorted(map(sorted, late)) == [["c"], ["d"]] and planner.held == []


def test_an_empty_window_keeps_the_carry():
    planner = CarryPlanner(Budget(10, "pack"), carry=1.0)
    assert planner.feed(["a", "b"], [6, 3]) == [] and planner.held == ["a", "b"]
    assert planner.feed([], []) == [] and planner.held == ["a", "b"]   # e.g. a window of skipped samples
    assert planner.feed(["c"], [4]) == [["a", "c"]] and planner.held == ["b"]


def test_an_oversize_item_leaves_the_carry_untouched():
    planner = CarryPlanner(Budget(10, "pack"), carry=1.0)
    planner.feed(["a"], [4])
    with pytest.raises(OversizeError, match="sample 1 "):
        planner.feed(["b", "c"], [3, 11])
    assert planner.held == ["a"]
    assert sorted(map(sorted, planner.flush())) == [["a"]]


def test_frames_bind_the_carry_plan_and_an_oversize_clip_raises():
    # 8 clips of 16 frames and 10 tokens: one batch by tokens, 4 by max_frames=32 (two clips each)
    tokens, frames = np.full(8, 10, np.int64), np.full(8, 16, np.int64)
    budget = Budget(1000, "pack", max_frames=32)
    out, _, planner = run_stream(tokens, tokens * 0, tokens * 0, budget, [3, 5], carry=1.0, frames=frames)
    assert sorted(i for b in out for i in b) == list(range(8))
    assert len(out) == 4 and all(int(frames[b].sum()) <= 32 for b in out)
    # a batch of two clips uses its whole frame budget: quality 1.0, never held back
    planner = CarryPlanner(budget, carry=1.0)
    assert len(planner.feed(["a", "b"], [10, 10], frames=[16, 16])) == 1 and planner.held == []
    with pytest.raises(OversizeError, match="frames 33 > 32"):
        planner.feed(["c", "d"], [10, 10], frames=[4, 33])
    assert planner.held == []


def test_carry_setting_is_validated_and_defaults_by_mode():
    assert resolve_carry("pack", None) == DEFAULT_CARRY["pack"]
    assert resolve_carry("pad", None) == DEFAULT_CARRY["pad"]
    assert resolve_carry("pad", "0.2") == 0.2
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="carry"):
            CarryPlanner(Budget(10, "pack"), carry=bad)
    with pytest.raises(ValueError, match="3 items but 2 costs"):
        CarryPlanner(Budget(10, "pack")).feed(["a", "b", "c"], [1, 2])


@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_carry_beats_independent_windows_on_a_realistic_stream(mode):
    """The reason carry exists, on the benchmark's mixture (small: 8 windows of 512)."""
    from benchmarks.bench_packing import realistic_costs

    tokens, patches, images = realistic_costs(4096, seed=1)
    budget = Budget(16384, mode)
    fills = {}
    for carry in (0.0, None):
        out, held, _ = run_stream(tokens, patches, images, budget, [512] * 8, carry)
        fills[carry] = plan_stats_arrays(tokens, patches, images, out, budget)["fill"]
    assert fills[None] > fills[0.0] + 0.002, fills
