"""How good is a plan: fill, batch count vs the lower bound, worst batch, padding.

Fill is real tokens over the compute a batch occupies: the whole max_tokens
slot for pack (schema.BATCH_PADDED_TOKENS), rows * longest for pad.
``budget_fill`` (real / (batches * max_tokens)) is also reported because it is
comparable across modes and baselines. The lower bound on the batch count is
max over the additive limits of ceil(sum / limit); no plan can beat it.
Cost: O(n) vectorized (one argsort of the batch ids).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .budget import Budget, SampleCost


def batch_fill(real_tokens: int, occupied_tokens: int) -> float:
    """Fraction of the occupied compute holding real tokens (0 for an empty slot)."""
    return float(real_tokens) / occupied_tokens if occupied_tokens > 0 else 0.0


def plan_stats(costs: Sequence[SampleCost], batches: list[list[int]], budget: Budget) -> dict:
    t = np.array([c.tokens for c in costs], dtype=np.int64)
    p = np.array([c.patches for c in costs], dtype=np.int64)
    m = np.array([c.images for c in costs], dtype=np.int64)
    f = np.array([c.frames for c in costs], dtype=np.int64)
    return plan_stats_arrays(t, p, m, batches, budget, f)


def plan_stats_arrays(tokens, patches, images, batches: list[list[int]], budget: Budget,
                      frames=None) -> dict:
    """plan_stats over cost arrays; ``patches`` / ``images`` / ``frames`` None = zeros."""
    tokens = np.asarray(tokens, np.int64)
    patches = np.zeros_like(tokens) if patches is None else np.asarray(patches, np.int64)
    images = np.zeros_like(tokens) if images is None else np.asarray(images, np.int64)
    frames = np.zeros_like(tokens) if frames is None else np.asarray(frames, np.int64)
    nb = len(batches)
    sizes = np.array([len(b) for b in batches], dtype=np.int64)
    flat = np.fromiter((i for b in batches for i in b), dtype=np.int64, count=int(sizes.sum()))
    bid = np.repeat(np.arange(nb), sizes)
    real = np.bincount(bid, weights=tokens[flat], minlength=nb).astype(np.int64)
    sq = np.bincount(bid, weights=tokens[flat].astype(np.float64) ** 2, minlength=nb)
    longest = np.zeros(nb, np.int64)
    np.maximum.at(longest, bid, tokens[flat])
    b_patches = np.bincount(bid, weights=patches[flat], minlength=nb).astype(np.int64)
    b_images = np.bincount(bid, weights=images[flat], minlength=nb).astype(np.int64)
    b_frames = np.bincount(bid, weights=frames[flat], minlength=nb).astype(np.int64)
    w = budget.attn_weight
    if budget.mode == "pack":
        occupied = np.full(nb, budget.max_tokens, np.int64)
        cost = real + w * sq
    else:
        occupied = sizes * longest
        cost = sizes * (longest + w * longest.astype(np.float64) ** 2)
    total = int(tokens.sum())
    lower = max([math.ceil(total / budget.max_tokens)]
                + [math.ceil(int(a.sum()) / lim) for a, lim in
                   ((patches, budget.max_patches), (images, budget.max_images),
                    (frames, budget.max_frames), (np.ones_like(tokens), budget.max_samples))
                   if lim is not None])
    occ = int(occupied.sum())
    return {
        "mode": budget.mode,
        "n_samples": int(len(flat)),
        "n_batches": nb,
        "lower_bound_batches": int(lower),
        "real_tokens": int(real.sum()),
        "occupied_tokens": occ,
        "padding_tokens": occ - int(real.sum()),
        "fill": batch_fill(int(real.sum()), occ),
        "budget_fill": batch_fill(int(real.sum()), nb * budget.max_tokens),
        "max_batch_cost": float(cost.max()) if nb else 0.0,
        "max_batch_cost_ratio": float(cost.max()) / budget.max_tokens if nb else 0.0,
        "max_batch_patches": int(b_patches.max()) if nb else 0,
        "max_batch_images": int(b_images.max()) if nb else 0,
        "max_batch_frames": int(b_frames.max()) if nb else 0,
        "samples_per_batch": {
            "min": int(sizes.min()) if nb else 0,
            "mean": float(sizes.mean()) if nb else 0.0,
            "p50": float(np.median(sizes)) if nb else 0.0,
            "max": int(sizes.max()) if nb else 0,
        },
    }
