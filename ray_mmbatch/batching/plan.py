"""plan_batches: validate costs, pick a planner by name, shuffle the batch order.

The registry maps names to pure planners with one signature
``pack_xxx(tokens, patches, images, budget, frames=None) -> list[list[int]]``
(mosaicml streaming's shuffle registry style; ``frames`` None = zeros, so a caller
written before the frames budget keeps working). Every planner here works in both modes; the
defaults per mode were picked by measurement (benchmarks/bench_packing.py; the fills
and speeds are in benchmarks/RESULTS.md, "Packing"):

    pack: pack_best_fit_decreasing  fullest batches at or next to the lower bound
    pad:  pad_sorted_buckets        the minimum batch count at near the DP's padded fill

Contract: every index exactly once; every batch within every limit; a sample
that cannot fit alone raises OversizeError (never dropped); same inputs + seed
-> same output. Indices inside a batch are ascending; the ORDER of batches is a
seeded permutation so the step number does not correlate with length.
Cost: validation O(n) vectorized + the planner + O(batches) shuffle.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .budget import Budget, OversizeError, SampleCost
from .pack_best_fit_decreasing import pack_best_fit_decreasing
from .pack_first_fit_decreasing import pack_first_fit_decreasing
from .pack_greedy import pack_greedy
from .pad_optimal_split import pad_optimal_split
from .pad_sorted_buckets import pad_sorted_buckets

Planner = Callable[..., list]  # (tokens, patches, images, budget, frames=None) -> batches

ALGORITHMS: dict[str, Planner] = {
    "pack_greedy": pack_greedy,
    "pack_first_fit_decreasing": pack_first_fit_decreasing,
    "pack_best_fit_decreasing": pack_best_fit_decreasing,
    "pad_sorted_buckets": pad_sorted_buckets,
    "pad_optimal_split": pad_optimal_split,
}
DEFAULT_ALGORITHM = {"pack": "pack_best_fit_decreasing", "pad": "pad_sorted_buckets"}


def resolve_algorithm(mode: str, algorithm: str = "") -> str:
    name = algorithm or DEFAULT_ALGORITHM[mode]
    if name not in ALGORITHMS:
        raise ValueError(f"unknown planner {name!r}; known: {sorted(ALGORITHMS)}")
    return name


def plan_batches(costs: Sequence[SampleCost], budget: Budget, seed: int = 0,
                 algorithm: str = "") -> list[list[int]]:
    """Plan ``costs`` into batches of indices (see module docstring)."""
    tokens = np.fromiter((c.tokens for c in costs), dtype=np.int64, count=len(costs))
    patches = np.fromiter((c.patches for c in costs), dtype=np.int64, count=len(costs))
    images = np.fromiter((c.images for c in costs), dtype=np.int64, count=len(costs))
    frames = np.fromiter((c.frames for c in costs), dtype=np.int64, count=len(costs))
    return plan_batches_arrays(tokens, patches, images, budget, seed, algorithm, frames)


def plan_batches_arrays(tokens, patches=None, images=None, budget: Budget | None = None,
                        seed: int = 0, algorithm: str = "", frames=None) -> list[list[int]]:
    """Array form of plan_batches; ``patches`` / ``images`` / ``frames`` default to zeros."""
    if budget is None:
        raise ValueError("budget is required")
    tokens, patches, images, frames = as_costs(tokens, patches, images, frames=frames)
    check_fits_alone(tokens, patches, images, budget, frames)
    name = resolve_algorithm(budget.mode, algorithm)
    batches = ALGORITHMS[name](tokens, patches, images, budget.limits(), frames)
    perm = np.random.default_rng(seed).permutation(len(batches)).tolist()
    return [batches[k] for k in perm]


def as_costs(tokens, patches, images, names=("tokens", "patches", "images", "frames"), frames=None):
    """The four cost arrays (tokens, patches, images, frames) as int64 (None: zeros), or ValueError
    naming the bad one (``names``; a 3-name tuple calls the frames array "frames")."""
    arrays = []
    n = len(tokens)
    names = tuple(names) + ("frames",) * (4 - len(names))
    for name, a in zip(names, (tokens, patches, images, frames)):
        a = np.zeros(n, np.int64) if a is None else np.asarray(a)
        if a.ndim != 1 or len(a) != n:
            raise ValueError(f"{name} must be a 1-D array of length {n}, got shape {a.shape}")
        if n and not np.issubdtype(a.dtype, np.integer):
            if not np.all(np.isfinite(a)) or not np.all(a == np.floor(a)):
                raise ValueError(f"{name} must hold whole numbers")
        a = a.astype(np.int64)
        if n and a.min() < 0:
            k = int(np.argmin(a))
            raise ValueError(f"{name}[{k}] = {int(a[k])} is negative")
        arrays.append(a)
    return arrays


def oversize_mask(tokens: np.ndarray, patches: np.ndarray, images: np.ndarray, budget: Budget,
                  frames: np.ndarray | None = None) -> np.ndarray:
    """True for each sample that breaks a budget alone (no batch can hold it); ``frames`` None = zeros."""
    tf = tokens.astype(np.float64)
    cost = tf + budget.attn_weight * tf * tf if budget.attn_weight else tokens
    bad = cost > budget.max_tokens
    if budget.max_patches is not None:
        bad |= patches > budget.max_patches
    if budget.max_images is not None:
        bad |= images > budget.max_images
    if budget.max_frames is not None and frames is not None:
        bad |= np.asarray(frames) > budget.max_frames
    return np.asarray(bad, dtype=bool)


def check_fits_alone(tokens: np.ndarray, patches: np.ndarray, images: np.ndarray,
                     budget: Budget, frames: np.ndarray | None = None) -> None:
    """Raise OversizeError for the first sample that no batch can hold (``frames`` None = zeros)."""
    if not len(tokens):
        return
    bad = oversize_mask(tokens, patches, images, budget, frames)
    if bad.any():
        k = int(np.argmax(bad))
        c = SampleCost(int(tokens[k]), int(patches[k]), int(images[k]), int(frames[k]) if frames is not None else 0)
        raise OversizeError(k, c, "; ".join(budget.violations([c.tokens], [c.patches], [c.images], [c.frames])))
