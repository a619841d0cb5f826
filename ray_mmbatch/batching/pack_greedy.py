"""pack_greedy: arrival order, close the batch when the next sample would not fit.

The baseline every token-budget loader starts with (next-fit). It keeps the
data order, so it needs no sort, and is vectorized: cumulative sums of every
additive cost plus one ``searchsorted`` per constraint find where each batch
ends, so the Python loop runs once per *batch*, not per sample.

Cost: O(n + batches * log n). Works for both modes: in pad mode the running
longest row decides, so the end is found by a short scan instead.
The fastest planner, and the worst filled (in pad mode arrival order pads short
rows to long ones) - the reason the sorted planners exist. Fill and speed:
benchmarks/bench_packing.py, figures in benchmarks/RESULTS.md ("Packing").
"""
from __future__ import annotations

import numpy as np

from .budget import Budget
from .prefix import ends_by_additive_limits


def pack_greedy(tokens: np.ndarray, patches: np.ndarray, images: np.ndarray,
                budget: Budget, frames: np.ndarray | None = None) -> list[list[int]]:
    n = len(tokens)
    if budget.mode == "pad":
        return _pad_greedy(tokens, patches, images, budget, frames)
    limit_end = ends_by_additive_limits(budget.token_sizes(tokens), budget.token_capacity(),
                                        patches, images, budget, frames)
    batches, i = [], 0
    while i < n:
        j = max(int(limit_end(i)), i + 1)  # a sample that fits alone always gets a batch
        batches.append(list(range(i, j)))
        i = j
    return batches


def _pad_greedy(tokens, patches, images, budget: Budget, frames=None) -> list[list[int]]:
    limit_end = ends_by_additive_limits(None, None, patches, images, budget, frames)
    row_cap = budget.pad_rows_cap(tokens).tolist()
    batches, i, n = [], 0, len(tokens)
    while i < n:
        hard_end = max(int(limit_end(i)), i + 1)
        j, cap = i + 1, row_cap[i]
        # the allowed row count shrinks as the longest row grows
        while j < hard_end and j + 1 - i <= min(cap, row_cap[j]):
            cap = min(cap, row_cap[j])
            j += 1
        batches.append(list(range(i, j)))
        i = j
    return batches
