"""One invariant checker run over every registered planner in both modes (hypothesis).

For random costs (zero patches / images included) and random budgets (with and
without max_patches / max_images / max_samples / attn_weight): every index
exactly once, every batch within every limit (checked with Budget.violations,
the exact arithmetic), same seed -> same plan, and OversizeError naming the
first sample that cannot fit alone.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_mmbatch.batching import ALGORITHMS, Budget, OversizeError, plan_batches_arrays
from ray_mmbatch.batching.budget import SampleCost


@st.composite
def budgets(draw, mode):
    opt = lambda lo, hi: st.one_of(st.none(), st.integers(lo, hi))  # noqa: E731
    return Budget(
        max_tokens=draw(st.integers(1, 3000)), mode=mode,
        max_patches=draw(opt(1, 5000)), max_images=draw(opt(1, 8)),
        max_samples=draw(opt(1, 12)),
        attn_weight=draw(st.sampled_from([0.0, 0.0, 1e-4, 1e-3, 0.0137])),
    )


@st.composite
def costs(draw):
    n = draw(st.integers(0, 80))
    big = draw(st.sampled_from([10, 300, 3000]))
    tokens = draw(st.lists(st.integers(0, big), min_size=n, max_size=n))
    patches = draw(st.lists(st.sampled_from([0, 0, 16, 64, 400, 1600]), min_size=n, max_size=n))
    images = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    return (np.array(tokens, np.int64), np.array(patches, np.int64), np.array(images, np.int64))


def check_plan(tokens, patches, images, budget, algorithm, seed=0):
    """The invariant checker: returns the plan after asserting every contract."""
    n = len(tokens)
    alone = [i for i in range(n) if budget.violations([tokens[i]], [patches[i]], [images[i]])]
    if alone:
        with pytest.raises(OversizeError) as err:
            plan_batches_arrays(tokens, patches, images, budget, seed, algorithm)
        assert err.value.index == alone[0]
        assert err.value.cost == SampleCost(int(tokens[alone[0]]), int(patches[alone[0]]),
                                            int(images[alone[0]]))
        assert f"sample {alone[0]} " in str(err.value)
        return None
    plan = plan_batches_arrays(tokens, patches, images, budget, seed, algorithm)
    flat = [i for b in plan for i in b]
    assert sorted(flat) == list(range(n)), "every index exactly once"
    for b in plan:
        assert b, "no empty batch"
        assert b == sorted(b), "indices ascending inside a batch"
        assert budget.violations(tokens[b], patches[b], images[b]) == [], (b, budget)
    assert plan == plan_batches_arrays(tokens, patches, images, budget, seed, algorithm)
    other = plan_batches_arrays(tokens, patches, images, budget, seed + 1, algorithm)
    assert sorted(map(tuple, other)) == sorted(map(tuple, plan)), "seed only reorders batches"
    assert budget.n == 0, "planning must not touch the caller's running state"
    return plan


@pytest.mark.parametrize("mode", ["pack", "pad"])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS) + [""])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_planner_keeps_every_invariant(algorithm, mode, data):
    tokens, patches, images = data.draw(costs())
    budget = data.draw(budgets(mode))
    check_plan(tokens, patches, images, budget, algorithm, seed=data.draw(st.integers(0, 9)))


@pytest.mark.parametrize("mode", ["pack", "pad"])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_planners_on_a_large_window_stay_within_budget(algorithm, mode):
    """A realistic-size window (not reachable by hypothesis) with every limit set."""
    rng = np.random.default_rng(3)
    n = 1500
    tokens = np.clip(rng.lognormal(6, 1, n), 1, 4000).astype(np.int64)
    images = rng.integers(0, 4, n)
    patches = images * rng.integers(64, 1024, n)
    budget = Budget(8192, mode, max_patches=12000, max_images=12, max_samples=64,
                    attn_weight=1e-5)
    plan = check_plan(tokens, patches, images, budget, algorithm)
    assert len(plan) >= int(np.ceil(tokens.sum() / 8192))


def test_order_of_batches_is_shuffled_by_seed():
    tokens = np.arange(1, 401, dtype=np.int64)
    budget = Budget(1000, "pad")
    plans = {tuple(map(tuple, plan_batches_arrays(tokens, None, None, budget, s))) for s in range(5)}
    assert len(plans) > 1
    first_longest = [max(tokens[b]) for b in plan_batches_arrays(tokens, None, None, budget, 0)]
    assert first_longest != sorted(first_longest) and first_longest != sorted(first_longest)[::-1]
