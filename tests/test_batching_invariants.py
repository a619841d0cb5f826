"""One invariant checker run over every registered planner in both modes (hypothesis).

For random costs (zero patches / images / video frames included) and random budgets
(with and without max_patches / max_images / max_frames / max_samples / attn_weight):
every index exactly once, every batch within every limit (checked with
Budget.violations, the exact arithmetic, and the frame sum by hand), same seed -> same
plan, and OversizeError naming the first sample that cannot fit alone (frames alone
included). Plans without a frames array (the four-argument call of before the frames
budget) are checked too.
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
        # None, at least the longest clip (binds on sums), or under it (a clip alone may not fit)
        max_frames=draw(st.one_of(st.none(), st.integers(64, 256), st.integers(1, 63))),
    )


@st.composite
def costs(draw):
    n = draw(st.integers(0, 80))
    big = draw(st.sampled_from([10, 300, 3000]))
    tokens = draw(st.lists(st.integers(0, big), min_size=n, max_size=n))
    patches = draw(st.lists(st.sampled_from([0, 0, 16, 64, 400, 1600]), min_size=n, max_size=n))
    images = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    # video frames: most samples have none (images / text), a clip has 4..64
    frames = draw(st.lists(st.sampled_from([0, 0, 0, 4, 8, 16, 32, 64]), min_size=n, max_size=n))
    return (np.array(tokens, np.int64), np.array(patches, np.int64), np.array(images, np.int64),
            np.array(frames, np.int64))


def check_plan(tokens, patches, images, budget, algorithm, seed=0, frames=None):
    """The invariant checker: returns the plan after asserting every contract.

    ``frames`` None: the plan is made without a frames array (the call of before the frames
    budget) and checked against zero frames."""
    n = len(tokens)
    f = np.zeros(n, np.int64) if frames is None else np.asarray(frames, np.int64)
    extra = {} if frames is None else {"frames": frames}

    def plan_of(s):
        return plan_batches_arrays(tokens, patches, images, budget, s, algorithm, **extra)

    alone = [i for i in range(n) if budget.violations([tokens[i]], [patches[i]], [images[i]], [f[i]])]
    if alone:
        with pytest.raises(OversizeError) as err:
            plan_of(seed)
        assert err.value.index == alone[0]
        assert err.value.cost == SampleCost(int(tokens[alone[0]]), int(patches[alone[0]]),
                                            int(images[alone[0]]), int(f[alone[0]]))
        assert f"sample {alone[0]} " in str(err.value)
        return None
    plan = plan_of(seed)
    flat = [i for b in plan for i in b]
    assert sorted(flat) == list(range(n)), "every index exactly once"
    for b in plan:
        assert b, "no empty batch"
        assert b == sorted(b), "indices ascending inside a batch"
        assert budget.violations(tokens[b], patches[b], images[b], f[b]) == [], (b, budget)
        if budget.max_frames is not None:
            assert int(f[b].sum()) <= budget.max_frames, (b, budget)
    assert plan == plan_of(seed)
    other = plan_of(seed + 1)
    assert sorted(map(tuple, other)) == sorted(map(tuple, plan)), "seed only reorders batches"
    assert budget.n == 0, "planning must not touch the caller's running state"
    return plan


@pytest.mark.parametrize("mode", ["pack", "pad"])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS) + [""])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_planner_keeps_every_invariant(algorithm, mode, data):
    tokens, patches, images, frames = data.draw(costs())
    budget = data.draw(budgets(mode))
    with_frames = data.draw(st.booleans())
    check_plan(tokens, patches, images, budget, algorithm, seed=data.draw(st.integers(0, 9)),
               frames=frames if with_frames else None)


@pytest.mark.parametrize("mode", ["pack", "pad"])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_planners_on_a_large_window_stay_within_budget(algorithm, mode):
    """A realistic-size window (not reachable by hypothesis) with every limit set."""
    rng = np.random.default_rng(3)
    n = 1500
    tokens = np.clip(rng.lognormal(6, 1, n), 1, 4000).astype(np.int64)
    images = rng.integers(0, 4, n)
    patches = images * rng.integers(64, 1024, n)
    frames = np.where(rng.random(n) < 0.3, rng.integers(4, 65, n), 0)  # ~30 % video clips
    budget = Budget(8192, mode, max_patches=12000, max_images=12, max_samples=64,
                    attn_weight=1e-5, max_frames=128)
    plan = check_plan(tokens, patches, images, budget, algorithm, frames=frames)
    assert len(plan) >= int(np.ceil(tokens.sum() / 8192))
    assert len(plan) >= int(np.ceil(frames.sum() / 128))


@pytest.mark.parametrize("mode", ["pack", "pad"])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_the_frame_budget_splits_batches_tokens_would_not(algorithm, mode):
    """Many frames, few tokens: without max_frames every sample fits one batch; with it
    (32 frames, 16 per clip) at most two clips share a batch. A planner that ignored the
    frames would plan one batch."""
    n = 20
    tokens, zeros, frames = np.full(n, 10, np.int64), np.zeros(n, np.int64), np.full(n, 16, np.int64)
    free = check_plan(tokens, zeros, zeros, Budget(1000, mode), algorithm, frames=frames)
    assert len(free) == 1
    bound = Budget(1000, mode, max_frames=32)
    plan = check_plan(tokens, zeros, zeros, bound, algorithm, frames=frames)
    assert len(plan) == n // 2 and all(len(b) == 2 for b in plan)
    # the planners directly (the registry call), with images set too: the frame room still binds
    both = Budget(1000, mode, max_images=100, max_frames=32)
    for b in ALGORITHMS[algorithm](tokens, zeros, zeros + 1, both, frames):
        assert int(frames[b].sum()) <= 32
    # a planner called the old way (no frames) sees none: the frames budget cannot bind
    assert len(ALGORITHMS[algorithm](tokens, zeros, zeros, bound)) == 1


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS) + [""])
def test_frames_alone_over_the_budget_raise(algorithm):
    tokens, zeros = np.array([5, 5, 5], np.int64), np.zeros(3, np.int64)
    budget = Budget(100, max_frames=32)
    with pytest.raises(OversizeError) as err:
        plan_batches_arrays(tokens, zeros, zeros, budget, 0, algorithm, frames=np.array([8, 40, 8]))
    assert err.value.index == 1 and err.value.cost == SampleCost(5, 0, 0, 40)
    assert "frames 40 > 32" in str(err.value) and "sample 1 " in str(err.value)
    assert not budget.fits_alone(SampleCost(5, frames=40)) and budget.fits_alone(SampleCost(5, frames=32))


def test_order_of_batches_is_shuffled_by_seed():
    tokens = np.arange(1, 401, dtype=np.int64)
    budget = Budget(1000, "pad")
    plans = {tuple(map(tuple, plan_batches_arrays(tokens, None, None, budget, s))) for s in range(5)}
    assert len(plans) > 1
    first_longest = [max(tokens[b]) for b in plan_batches_arrays(tokens, None, None, budget, 0)]
    assert first_longest != sorted(first_longest) and first_longest != sorted(first_longest)[::-1]
