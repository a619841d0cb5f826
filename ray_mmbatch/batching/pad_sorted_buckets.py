"""pad_sorted_buckets: sort by length, cut the sorted run into padded batches.

Pad mode costs rows * longest, so rows of similar length belong together. The
window is sorted by length (descending, stable) and cut greedily: each batch
takes as many next-longest rows as ``rows * (L + w L^2) <= max_tokens`` and the
patch / image / sample limits allow. Because feasibility is monotone along the
sorted order, this greedy cut gives the *minimum number of batches* of any
split of the sorted order. Cost: O(n log n) sort + O(batches * log n).
Measured (benchmarks/bench_packing.py, realistic mixture, 65,536 samples,
16384 tokens): padded fill (real / rows*longest) 98.24% at window 2048, 94.0%
at 512, 99.52% at 8192; ~3M samples/s on one core. The pad default: the DP
(pad_optimal_split) gains only 0.07 points at 10x the planning time.
"""
from __future__ import annotations

import numpy as np

from .budget import Budget
from .prefix import ends_by_additive_limits


def pad_sorted_buckets(tokens: np.ndarray, patches: np.ndarray, images: np.ndarray,
                       budget: Budget) -> list[list[int]]:
    n = len(tokens)
    order = np.argsort(-np.asarray(tokens, dtype=np.int64), kind="stable")
    t_sorted = np.asarray(tokens)[order]
    if budget.mode == "pack":
        # the same sorted cut is valid for pack (sum <= rows*longest); kept for comparison
        limit_end = ends_by_additive_limits(budget.token_sizes(t_sorted), budget.token_capacity(),
                                            patches[order], images[order], budget)
        row_cap = None
    else:
        limit_end = ends_by_additive_limits(None, None, patches[order], images[order], budget)
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
