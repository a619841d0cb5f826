"""Hand-worked planner cases, the Budget object, input errors and plan_stats."""
from __future__ import annotations

import numpy as np
import pytest

from ray_mmbatch.batching import (
    Budget,
    OversizeError,
    SampleCost,
    batch_fill,
    plan_batches,
    plan_batches_arrays,
    plan_stats,
)
from ray_mmbatch.config import BudgetConfig


def plan_set(tokens, budget, algorithm, **kw):
    """The plan as a set of index tuples (batch order is a seeded shuffle)."""
    plan = plan_batches([SampleCost(t, **kw) for t in tokens], budget, 0, algorithm)
    return {tuple(b) for b in plan}


@pytest.mark.parametrize("algorithm", ["pack_best_fit_decreasing", "pack_first_fit_decreasing", ""])
def test_decreasing_fit_finds_the_optimum_of_6_5_4_3_2(algorithm):
    # sum 20, max 10 -> lower bound 2 batches: {6,4} and {5,3,2}
    assert plan_set([6, 5, 4, 3, 2], Budget(10, "pack"), algorithm) == {(0, 2), (1, 3, 4)}


def test_greedy_arrival_order_closes_early():
    assert plan_set([6, 5, 4, 3, 2], Budget(10, "pack"), "pack_greedy") == {(0,), (1, 2), (3, 4)}


def test_pad_sorted_buckets_by_hand():
    # sorted 10,9 | 3,3,2,1 : 2 rows x 10 = 20, then 4 rows x 3 = 12 <= 20
    budget = Budget(20, "pad")
    assert plan_set([10, 9, 3, 3, 2, 1], budget, "pad_sorted_buckets") == {(0, 1), (2, 3, 4, 5)}
    assert plan_set([10, 9, 3, 3, 2, 1], budget, "") == {(0, 1), (2, 3, 4, 5)}  # the pad default


def test_pad_optimal_split_beats_the_greedy_cut_on_padding():
    # max 12: greedy takes [6,3] (pad 3) + [3,3,1] (pad 2); the DP finds [6] + [3,3,3,1] (pad 2)
    tokens, budget = [6, 3, 3, 3, 1], Budget(12, "pad")
    assert plan_set(tokens, budget, "pad_sorted_buckets") == {(0, 1), (2, 3, 4)}
    assert plan_set(tokens, budget, "pad_optimal_split") == {(0,), (1, 2, 3, 4)}


def test_attention_weight_counts_the_square():
    # pack: each costs 10 + 0.1*100 = 20 (with w > 0 the pack planners keep a 1e-9
    # relative margin, so a pair landing exactly on the budget may be split: use 41)
    assert plan_set([10, 10], Budget(41, "pack", attn_weight=0.1), "") == {(0, 1)}
    assert plan_set([10, 10], Budget(39, "pack", attn_weight=0.1), "") == {(0,), (1,)}
    assert plan_set([20], Budget(60, "pack", attn_weight=0.1), "") == {(0,)}  # 20+40 = 60 alone
    # pad: rows * (L + w L^2) = 3 * 20 = 60
    assert plan_set([10, 2, 2], Budget(60, "pad", attn_weight=0.1), "") == {(0, 1, 2)}
    assert plan_set([10, 2, 2], Budget(59, "pad", attn_weight=0.1), "") == {(0, 1), (2,)}


def test_side_limits_split_batches():
    b = Budget(1000, "pack", max_images=2)
    assert plan_set([1, 1, 1], b, "", images=1) == {(0, 1), (2,)}
    b = Budget(1000, "pack", max_patches=100)
    assert len(plan_set([1] * 4, b, "", patches=60)) == 4
    b = Budget(1000, "pad", max_samples=3)
    assert len(plan_set([5] * 7, b, "")) == 3
    b = Budget(1000, "pack", max_frames=32)
    assert plan_set([1, 1, 1], b, "", frames=16) == {(0, 1), (2,)}
    assert plan_set([1, 1, 1], Budget(1000, "pack"), "", frames=16) == {(0, 1, 2)}


@pytest.mark.parametrize("cost,budget,why", [
    (SampleCost(11), Budget(10), "tokens cost 11 > 10"),
    (SampleCost(5, patches=300), Budget(10, max_patches=256), "patches 300 > 256"),
    (SampleCost(5, images=3), Budget(10, "pad", max_images=2), "images 3 > 2"),
    (SampleCost(5, frames=65), Budget(10, "pad", max_frames=64), "frames 65 > 64"),
    (SampleCost(5, images=1, frames=65), Budget(10, max_images=1, max_frames=64), "frames 65 > 64"),
    (SampleCost(10), Budget(10, attn_weight=0.01), "tokens cost 11.0 > 10"),
])
def test_oversize_sample_is_named_not_dropped(cost, budget, why):
    costs = [SampleCost(1), SampleCost(2), cost, SampleCost(3)]
    with pytest.raises(OversizeError) as err:
        plan_batches(costs, budget)
    assert err.value.index == 2 and err.value.cost == cost
    assert why in str(err.value) and "sample 2 " in str(err.value)
    assert not budget.fits_alone(cost)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=10, mode="packed"), "mode"),
    (dict(max_tokens=10, max_images=0), "max_images"),
    (dict(max_tokens=10, max_frames=0), "max_frames"), (dict(max_tokens=10, max_frames=2.5), "max_frames"),
    (dict(max_tokens=10, attn_weight=-1.0), "attn_weight"),
    (dict(max_tokens=10, attn_weight=float("nan")), "attn_weight"),
])
def test_bad_budget_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Budget(**kwargs)


def test_bad_costs_and_names_are_refused():
    b = Budget(10)
    with pytest.raises(ValueError, match=r"tokens\[1\] = -1 is negative"):
        plan_batches_arrays(np.array([1, -1]), None, None, b)
    with pytest.raises(ValueError, match="patches must be a 1-D array of length 2"):
        plan_batches_arrays(np.array([1, 2]), np.array([1]), None, b)
    with pytest.raises(ValueError, match="whole numbers"):
        plan_batches_arrays(np.array([1.5, 2.0]), None, None, b)
    with pytest.raises(ValueError, match="unknown planner 'nope'"):
        plan_batches_arrays(np.array([1]), None, None, b, algorithm="nope")
    with pytest.raises(ValueError, match="budget is required"):
        plan_batches_arrays(np.array([1]))


def test_empty_input_plans_nothing():
    assert plan_batches([], Budget(10)) == []
    assert plan_batches([], Budget(10, "pad"), algorithm="pad_optimal_split") == []


def test_budget_running_state_and_config():
    b = Budget.from_config(BudgetConfig(mode="pad", max_tokens=100, max_images=3, attn_weight=0.0))
    assert (b.mode, b.max_tokens, b.max_images, b.max_patches) == ("pad", 100, 3, None)
    b.add(SampleCost(40, images=1))
    b.add(SampleCost(10, images=1))
    assert not b.exceeded() and b.padded_cost() == 80 and b.current_cost() == 80
    b.add(SampleCost(5, images=1))
    assert b.exceeded()  # 3 rows x 40 = 120 > 100
    state = b.state_dict()
    assert state["n"] == 3 and state["longest"] == 40 and state["max_tokens"] == 100
    c = Budget(1)
    c.load_state_dict(state)
    assert c == b and c.exceeded()
    b.reset()
    assert b.n == 0 and b.padded_cost() == 0 and not b.exceeded()
    p = Budget(100, "pack")
    p.add(SampleCost(30))
    assert p.padded_cost() == 100  # a packed batch occupies the whole slot
    with pytest.raises(KeyError):
        c.load_state_dict({"colour": 1})


def test_budget_running_state_counts_frames():
    b = Budget.from_config(BudgetConfig(max_tokens=1000, max_images=3, max_frames=48))
    assert (b.max_frames, b.max_images, b.limits().max_frames) == (48, 3, 48)
    assert Budget.from_config(BudgetConfig(max_tokens=1000)).max_frames is None
    b.add(SampleCost(10, frames=32))
    b.add(SampleCost(10, images=1, frames=16))
    assert not b.exceeded() and b.sum_frames == 48
    b.add(SampleCost(10, frames=1))
    assert b.exceeded()  # 49 frames > 48, with tokens and images well inside
    state = b.state_dict()
    assert state["max_frames"] == 48 and state["sum_frames"] == 49
    c = Budget(1)
    c.load_state_dict(state)
    assert c == b and c.exceeded()
    assert b.limits().sum_frames == 0 and not b.limits().exceeded()
    b.reset()
    assert b.sum_frames == 0 and not b.exceeded()
    assert b.violations([10, 10], frames=[30, 30]) == ["frames 60 > 48"]
    assert b.violations([10, 10], [0, 0], [0, 0]) == []  # no frames given: none counted
    assert Budget(1000).violations([10], frames=[10**6]) == []  # no frame budget: unlimited
    assert b.fits_alone(SampleCost(10, frames=48)) and not b.fits_alone(SampleCost(10, frames=49))


def test_plan_stats_by_hand():
    costs = [SampleCost(t) for t in [10, 9, 3, 3, 2, 1]]
    pad = Budget(20, "pad")
    st = plan_stats(costs, [[0, 1], [2, 3, 4, 5]], pad)
    assert st["real_tokens"] == 28 and st["occupied_tokens"] == 20 + 12
    assert st["padding_tokens"] == 4 and st["fill"] == pytest.approx(28 / 32)
    assert st["n_batches"] == 2 and st["lower_bound_batches"] == 2  # ceil(28 / 20)
    assert st["max_batch_cost"] == 20 and st["max_batch_cost_ratio"] == 1.0
    assert st["samples_per_batch"] == {"min": 2, "mean": 3.0, "p50": 3.0, "max": 4}
    pack = Budget(20, "pack", max_samples=2)
    st = plan_stats(costs, [[0, 1], [2, 3], [4, 5]], pack)
    assert st["occupied_tokens"] == 60 and st["fill"] == pytest.approx(28 / 60)
    assert st["lower_bound_batches"] == 3  # ceil(6 samples / 2) beats ceil(28 / 20)
    clips = [SampleCost(t, frames=f) for t, f in [(10, 30), (9, 30), (3, 30), (3, 0), (2, 0), (1, 0)]]
    st = plan_stats(clips, [[0], [1, 3], [2, 4, 5]], Budget(20, "pack", max_frames=32))
    assert st["max_batch_frames"] == 30 and st["lower_bound_batches"] == 3  # ceil(90 frames / 32)
    assert batch_fill(5, 0) == 0.0
