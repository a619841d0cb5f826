"""Shared vectorized helper: where can a batch starting at ``i`` end at the latest?

Every budget limit except the pad row count is additive (tokens in pack mode,
patches, images, frames, sample count), so with cumulative sums ``C`` the last end ``j``
with ``C[j] - C[i] <= cap`` is one ``searchsorted``. Taking the minimum over the
limits gives the longest feasible run. Cost: O(n) once, O(log n) per query.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .budget import Budget


def _cumsum0(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x) + 1, dtype=x.dtype)
    np.cumsum(x, out=out[1:])
    return out


def ends_by_additive_limits(sizes: np.ndarray | None, capacity, patches: np.ndarray,
                            images: np.ndarray, budget: Budget,
                            frames: np.ndarray | None = None) -> Callable[[int], int]:
    """Return ``end(i)``: largest j such that samples [i, j) respect every additive limit
    (``frames`` None = zeros)."""
    limits = []
    if sizes is not None:
        limits.append((_cumsum0(sizes), capacity))
    if budget.max_patches is not None:
        limits.append((_cumsum0(np.asarray(patches, dtype=np.int64)), budget.max_patches))
    if budget.max_images is not None:
        limits.append((_cumsum0(np.asarray(images, dtype=np.int64)), budget.max_images))
    if budget.max_frames is not None and frames is not None:
        limits.append((_cumsum0(np.asarray(frames, dtype=np.int64)), budget.max_frames))
    n = len(patches)
    max_rows = budget.max_samples if budget.max_samples is not None else n

    def end(i: int) -> int:
        j = min(n, i + max_rows)
        for c, cap in limits:
            j = min(j, int(np.searchsorted(c, c[i] + cap, side="right")) - 1)
        return j

    return end
