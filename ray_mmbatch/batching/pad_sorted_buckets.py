"""pad_sorted_buckets: sort by length, cut the sorted run into padded batches.

Pad mode costs rows * longest, so rows of similar length belong together. The
window is sorted by length (descending, stable) and cut greedily: each batch
takes as many next-longest rows as ``rows * (L + w L^2) <= max_tokens`` and the
patch / image / frame / sample limits allow. Because feasibility is monotone along the
sorted order, this greedy cut gives the *minimum number of batches* of any
split of the sorted order. Cost: O(n log n) sort + O(batches * log n).
The pad default: the DP (pad_optimal_split) gains under a tenth of a point of
padded fill at about 10x the planning time (benchmarks/bench_packing.py, figures
in benchmarks/RESULTS.md, "Packing").
"""
from __future__ import annotations

import numpy as np

from .budget import Budget
from .prefix import ends_by_additive_limits


def pad_sorted_buckets(tokens: np.ndarray, patches: np.ndarray, images: np.ndarray,
                       budget: Budget, frames: np.ndarray | None = None) -> list[list[int]]:
    n = len(tokens)
    frames = np.zeros(n, np.int64) if frames is None else np.asarray(frames, np.int64)
    order = np.argsort(-np.asarray(tokens, dtype=np.int64), kind="stable")
    t_sorted = np.asarray(tokens)[order]
    if budget.mode == "pack":
        # the same sorted cut is valid for pack (sum <= rows*longest); kept for comparison
        limit_end = ends_by_additive_limits(budget.token_sizes(t_sorted), budget.token_capacity(),
                                            patches[order], images[order], budget, frames[order])
        row_cap = None
    else:
        limit_end = ends_by_additive_limits(None, None, patches[order], images[order], budget, frames[order])
        row_cap = budget.pad_rows_cap(t_sorted).tolist()  # sorted descending: first row is longest
    batches, i = [], 0
    order_l = order.tolist()
    while i < n:
        j = int(limit_end(i))
        if row_cap is not None:
            j = min(j, i + row_cap[i])
        j = max(j, i + 1)
        batches.append(sorted(order_l[i:j]))
        i = j
    return batches
