"""pack_best_fit_decreasing: largest first, each into the fullest batch it still fits.

Samples are sorted by token cost (descending, stable on index) and each goes to
the open batch with the *least* remaining token room that can take it (and whose
patch / image / sample-count room also suffices); otherwise it opens a batch.
Long samples set up the batches; the many short ones arrive last and close the
gaps, which is why BFD lands on or next to the lower bound ceil(sum / max_tokens).

Remaining rooms live in one sorted Python list, so "tightest fit" is a bisect
and the per-sample work is a few list operations on ~n/avg-batch entries.
In pad mode the same loop runs with rooms counted in rows (see below).
Cost: O(n log n) sort + O(n * (log b + b_memmove)); ~0.5 us per sample.
Measured (benchmarks/bench_packing.py, realistic mixture, 65,536 samples,
16384 tokens): fill 99.43% at window 2048 with 3202 batches where the sum of
per-window lower bounds is 3201 (so at most 99.46% is possible there; carry
across windows, batching/carry.py, reaches 99.84%); 98.0% at
window 512, 99.81% at 8192; ~1.9M samples/s on one core. The pack default.
"""
from __future__ import annotations

from bisect import bisect_left

import numpy as np

from .budget import Budget


def pack_best_fit_decreasing(tokens: np.ndarray, patches: np.ndarray, images: np.ndarray,
                             budget: Budget) -> list[list[int]]:
    sizes = budget.token_sizes(tokens)
    order = np.argsort(-sizes, kind="stable")
    order_l = order.tolist()
    if budget.mode == "pack":
        size_l, caps = sizes[order].tolist(), None
        cap = budget.token_capacity()
    else:
        # Pad: the first (longest) row of a batch fixes its row cap; later rows are
        # never longer, so the room is counted in rows and every row costs 1.
        size_l, caps = [1] * len(order_l), budget.pad_rows_cap(tokens).tolist()
    checks = _side_checks(patches, images, budget)
    rooms: list = []      # remaining token room of the open batches, ascending
    room_bin: list = []   # batch id aligned with rooms
    bins: list[list[int]] = []
    side: list[list[int]] = []  # per batch [patches, images, count]
    for s, idx in zip(size_l, order_l):
        k = bisect_left(rooms, s)
        if checks is not None:
            while k < len(rooms) and not checks(side[room_bin[k]], idx):
                k += 1
        if k == len(rooms):
            b = len(bins)
            bins.append([idx])
            side.append([0, 0, 0])
            room = (cap if caps is None else caps[idx]) - s
        else:
            room = rooms.pop(k) - s
            b = room_bin.pop(k)
            bins[b].append(idx)
        if checks is not None:
            sb = side[b]
            sb[0] += int(patches[idx]); sb[1] += int(images[idx]); sb[2] += 1
            if budget.max_samples is not None and sb[2] >= budget.max_samples:
                continue  # full by count: never offered again
        pos = bisect_left(rooms, room)
        rooms.insert(pos, room)
        room_bin.insert(pos, b)
    for b in bins:
        b.sort()
    return bins


def _side_checks(patches, images, budget: Budget):
    """Closure testing the non-token limits of batch ``state`` plus sample ``idx``."""
    mp, mi, ms = budget.max_patches, budget.max_images, budget.max_samples
    if mp is None and mi is None and ms is None:
        return None
    p = np.asarray(patches, dtype=np.int64).tolist()
    m = np.asarray(images, dtype=np.int64).tolist()
    mp = float("inf") if mp is None else mp
    mi = float("inf") if mi is None else mi
    ms = float("inf") if ms is None else ms

    def fits(state, idx):
        return state[0] + p[idx] <= mp and state[1] + m[idx] <= mi and state[2] + 1 <= ms

    return fits
