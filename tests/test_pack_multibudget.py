"""pack_best_fit_decreasing when the patch budget binds (issue 22): the patch-keyed plan.

When patches fill more batches than tokens and bind for at least 2/3 of the samples,
the planner keeps its sorted list on patch room (pack_best_fit_decreasing.py). Checked
here: every budget holds in every batch (tokens with the attention term, patches,
images, video frames, sample count; Budget.violations), every sample exactly once,
deterministic; hand-worked windows where skipping the token / image / frame / count
check would break a budget (the token-keyed list too, for frames); and on a Qwen2-VL-like
mixture no more batches than the token-keyed scan-based best fit (the plan before,
written out plainly below) and close to the patch bound.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_batching_invariants import check_plan

from ray_mmbatch.batching import Budget, SampleCost, plan_batches, plan_stats_arrays
from ray_mmbatch.batching.pack_best_fit_decreasing import _patch_keyed

ALGO = "pack_best_fit_decreasing"


def patch_keyed(tokens, patches, images, budget, frames=None) -> bool:
    """Whether the planner takes the patch-keyed path for this window."""
    return _patch_keyed(budget.token_sizes(tokens), budget.token_capacity(),
                        np.asarray(patches, np.int64), np.asarray(images, np.int64), budget, frames) is not None


def plan_set(costs, budget):
    return {tuple(b) for b in plan_batches([SampleCost(*c) for c in costs], budget, 0, ALGO)}


def test_the_token_room_is_checked_on_the_tightest_patch_fit():
    # share order 0 (.95 tokens), 1 (.5 patches), 2 (.2 patches): 2 has the tightest patch
    # fit in 0's batch (room 50 >= 40) but only 5 tokens of room there: it goes to 1's
    budget = Budget(100, "pack", max_patches=200)
    costs = [(95, 150), (10, 100), (10, 40)]
    assert patch_keyed(*np.array(costs).T, np.zeros(3, np.int64), budget)
    assert plan_set(costs, budget) == {(0,), (1, 2)}


def test_the_image_room_is_checked_on_the_tightest_patch_fit():
    budget = Budget(100, "pack", max_patches=200, max_images=1)
    costs = [(10, 150, 1), (10, 100, 1), (10, 40, 1)]
    assert patch_keyed(*np.array(costs).T, budget)
    assert plan_set(costs, budget) == {(0,), (1,), (2,)}


@pytest.mark.parametrize("max_images", [None, 5])  # frames in the image slot, or a third side budget
def test_the_frame_room_is_checked_on_the_tightest_patch_fit(max_images):
    budget = Budget(100, "pack", max_patches=200, max_images=max_images, max_frames=16)
    costs = [(10, 150, 0, 16), (10, 100, 0, 16), (10, 40, 0, 16)]
    assert patch_keyed(*np.array(costs).T[:3], budget, np.array([16, 16, 16]))
    assert plan_set(costs, budget) == {(0,), (1,), (2,)}


@pytest.mark.parametrize("extra", [{}, {"max_images": 5}, {"max_samples": 9}, {"max_patches": 10_000}])
def test_the_frame_room_is_checked_on_the_tightest_token_fit(extra):
    # token order 0 (60), 1 (50), 2 (30): 2's tightest token fit is 0's batch (room 40),
    # whose 32 frames leave no frame room: it goes to 1's
    budget = Budget(100, "pack", max_frames=32, **extra)
    costs = [(60, 0, 0, 32), (50, 0, 0, 0), (30, 0, 0, 16)]
    assert plan_set(costs, budget) == {(0,), (1, 2)}
    assert plan_set(costs, Budget(100, "pack", **extra)) == {(0, 2), (1,)}  # no frame budget: the tightest


def test_a_batch_full_by_count_leaves_the_patch_list():
    budget = Budget(100, "pack", max_patches=200, max_samples=2)
    costs = [(1, 100), (1, 50), (1, 30), (1, 10)]
    assert patch_keyed(*np.array(costs).T, np.zeros(4, np.int64), budget)
    assert plan_set(costs, budget) == {(0, 1), (2, 3)}


def test_tokens_binding_keeps_the_token_keyed_plan():
    # patches bind by sum but for under 2/3 of the samples: the token-sorted plan
    budget = Budget(10, "pack", max_patches=10)
    costs = [(6, 9), (5, 0), (4, 0), (3, 0), (2, 0)]
    assert not patch_keyed(*np.array(costs).T, np.zeros(5, np.int64), budget)
    assert plan_set(costs, budget) == {(0, 2), (1, 3, 4)}


@st.composite
def patch_bound_windows(draw):
    """Windows where every sample is patch-bound (patches / max_patches > tokens / max_tokens)
    under a random budget with or without image / frame / count limits and the attention term."""
    max_tokens = draw(st.integers(8, 3000))
    budget = Budget(max_tokens, "pack", max_patches=draw(st.integers(1, 4)) * max_tokens,
                    max_images=draw(st.one_of(st.none(), st.integers(1, 8))),
                    max_samples=draw(st.one_of(st.none(), st.integers(1, 12))),
                    attn_weight=draw(st.sampled_from([0.0, 0.0, 1e-4, 1e-3])),
                    max_frames=draw(st.one_of(st.none(), st.integers(32, 128))))
    n = draw(st.integers(1, 120))
    tokens, patches = [], []
    for _ in range(n):
        t = draw(st.integers(0, max_tokens))
        share = float(budget.token_sizes(np.array([t]))[0]) / budget.token_capacity()
        lo = math.floor(share * budget.max_patches) + 2  # clearly above the token share
        if lo > budget.max_patches:
            t, lo = 0, 1
        tokens.append(t)
        patches.append(draw(st.integers(lo, budget.max_patches)))
    images = draw(st.lists(st.integers(0, min(4, budget.max_images or 4)), min_size=n, max_size=n))
    frames = draw(st.lists(st.sampled_from([0, 0, 4, 16, 32]), min_size=n, max_size=n))
    return (np.array(tokens, np.int64), np.array(patches, np.int64), np.array(images, np.int64), budget,
            np.array(frames, np.int64))


@settings(max_examples=150, deadline=None)
@given(w=patch_bound_windows(), seed=st.integers(0, 9))
def test_patch_keyed_plans_keep_every_budget(w, seed):
    tokens, patches, images, budget, frames = w
    assert patch_keyed(tokens, patches, images, budget, frames)
    plan = check_plan(tokens, patches, images, budget, ALGO, seed=seed, frames=frames)
    if plan is not None:
        assert len(plan) >= math.ceil(int(patches.sum()) / budget.max_patches)


def qwen_like(n: int, seed: int):
    """benchmarks/bench_packing.py's mixture (h): image tokens mostly above the text."""
    rng = np.random.default_rng(seed)
    ln = lambda med, lo, hi, s: np.clip(np.round(rng.lognormal(np.log(med), s, n)), lo, hi).astype(np.int64)  # noqa: E731
    kind = rng.choice(4, size=n, p=[0.60, 0.20, 0.15, 0.05])
    text = np.select([kind == 0, kind == 1, kind == 2, kind == 3],
                     [ln(80, 5, 1500, .9), ln(200, 20, 2000, .8), ln(60, 5, 600, .8), ln(400, 50, 3000, .9)])
    images = np.select([kind == 1, kind == 3], [rng.integers(2, 5, n), 0], 1).astype(np.int64)
    first = np.where(kind == 2, ln(1200, 400, 1800, .4), ln(600, 64, 1280, .6))
    extra = sum(np.where(images > k, ln(300, 64, 1000, .5), 0) for k in range(1, 4))
    img = np.where(images > 0, first + extra, 0)
    return text + img, 4 * img, images


def scan_best_fit(tokens, patches, images, budget):
    """The token-keyed best fit as a plain scan (the plan before the patch-keyed list):
    largest token cost first, each into the open batch with the least token room that
    has room on every budget (ties: the earliest batch)."""
    sizes = budget.token_sizes(tokens)
    cap = budget.token_capacity()
    big = 1 << 62
    limits = [budget.max_patches or big, budget.max_images or big, budget.max_samples or big]
    rooms, bins = [], []
    for i in np.argsort(-sizes, kind="stable").tolist():
        need = (sizes[i], patches[i], images[i], 1)
        fit = [b for b, r in enumerate(rooms) if all(x >= y for x, y in zip(r, need))]
        if fit:
            b = min(fit, key=lambda b: rooms[b][0])
            rooms[b] = [x - y for x, y in zip(rooms[b], need)]
            bins[b].append(i)
        else:
            rooms.append([x - y for x, y in zip([cap] + limits, need)])
            bins.append([i])
    return bins


@pytest.mark.parametrize("max_tokens", [4096, 16384])
@pytest.mark.parametrize("extra", [{}, {"max_images": 6, "max_samples": 12}, {"attn_weight": 1e-5}])
@pytest.mark.parametrize("seed", [0, 1])
def test_patch_bound_mixture_no_more_batches_than_the_scan(max_tokens, extra, seed):
    tokens, patches, images = qwen_like(1024, seed)
    budget = Budget(max_tokens, "pack", max_patches=2 * max_tokens, **extra)
    keep = [i for i in range(len(tokens)) if not budget.violations([tokens[i]], [patches[i]], [images[i]])]
    tokens, patches, images = tokens[keep], patches[keep], images[keep]
    assert np.mean(patches / budget.max_patches > tokens / max_tokens) > 0.85  # binds on nearly every sample
    assert patch_keyed(tokens, patches, images, budget)
    plan = check_plan(tokens, patches, images, budget, ALGO, seed=seed)
    scan = scan_best_fit(tokens, patches, images, budget)
    for b in scan:
        assert budget.violations(tokens[b], patches[b], images[b]) == []
    lb = plan_stats_arrays(tokens, patches, images, plan, budget)["lower_bound_batches"]
    assert lb >= math.ceil(int(patches.sum()) / budget.max_patches)  # the patch bound or higher
    assert len(plan) <= len(scan)
    assert len(plan) <= math.ceil(1.02 * lb) + 1, (len(plan), len(scan), lb)
