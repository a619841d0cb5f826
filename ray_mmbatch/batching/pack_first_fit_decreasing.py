"""pack_first_fit_decreasing: largest first, each into the first open batch it fits.

Classic FFD (11/9 OPT + 6/9 worst case). Multi-constraint aware: the room of
every open batch in tokens, patches, images, frames and sample count is a numpy vector,
so "first batch that fits" is one vectorized comparison per sample.
In pad mode the token room is counted in rows, capped by the batch's first row.
Cost: O(n log n) sort + O(n * b) vectorized (~5 us per sample at b ~ 100).
It fills as well as best-fit decreasing (the same batch count) but plans about
10x slower, so BFD is the default: benchmarks/bench_packing.py, figures in
benchmarks/RESULTS.md ("Packing").
"""
from __future__ import annotations

import numpy as np

from .budget import Budget


def pack_first_fit_decreasing(tokens: np.ndarray, patches: np.ndarray, images: np.ndarray,
                              budget: Budget, frames: np.ndarray | None = None) -> list[list[int]]:
    n = len(tokens)
    frames = np.zeros(n) if frames is None else frames
    sizes = budget.token_sizes(tokens).astype(np.float64)
    order = np.argsort(-sizes, kind="stable")
    inf = np.inf
    # rows: token room, patch room, image room, frame room, count room; columns: open batches
    limits = np.array([float(budget.token_capacity()),
                       inf if budget.max_patches is None else budget.max_patches,
                       inf if budget.max_images is None else budget.max_images,
                       inf if budget.max_frames is None else budget.max_frames,
                       inf if budget.max_samples is None else budget.max_samples])
    room = np.empty((5, max(n, 1)), dtype=np.float64)
    row_cap = budget.pad_rows_cap(tokens) if budget.mode == "pad" else None
    if row_cap is not None:
        sizes = np.ones(n)  # pad: rows sorted longest first, the first row fixes the cap
    need = np.stack([sizes, np.asarray(patches, np.float64), np.asarray(images, np.float64),
                     np.asarray(frames, np.float64), np.ones(n)])
    bins: list[list[int]] = []
    for idx in order.tolist():
        nb = len(bins)
        ok = np.all(room[:, :nb] >= need[:, idx:idx + 1], axis=0) if nb else np.zeros(0, bool)
        b = int(ok.argmax()) if ok.any() else nb
        if b == nb:
            room[:, nb] = limits
            if row_cap is not None:
                room[0, nb] = row_cap[idx]
            bins.append([])
        room[:, b] -= need[:, idx]
        bins[b].append(idx)
    for b in bins:
        b.sort()
    return bins
