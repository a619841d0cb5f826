"""How well mixed a training order is: the two figures bench_mixing.py reports.

``rank_correlation``: Spearman's rho between a sample's place in the listing and its place
in training (1 = file order, 0 = no trace of it). ``worst_part_distance``: cut the epoch, in
training order, into ``parts`` equal parts; the largest total-variation distance between a
part's mix of subsets and the whole epoch's (0 = every part looks like the whole). Both
O(n log n) / O(n); numpy only.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _ranks(x: np.ndarray) -> np.ndarray:
    r = np.empty(len(x), dtype=np.float64)
    r[np.argsort(x, kind="stable")] = np.arange(len(x), dtype=np.float64)
    return r


def rank_correlation(listing_index: Sequence[int] | np.ndarray) -> float:
    """Spearman's rho between listing index and training position (the sequence's own index)."""
    a = _ranks(np.asarray(listing_index))
    if len(a) < 2:
        return 0.0
    b = np.arange(len(a), dtype=np.float64)
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum()))


def worst_part_distance(labels: Sequence | np.ndarray, parts: int = 20) -> float:
    """Largest total-variation distance between a part's label mix and the whole sequence's."""
    _, codes = np.unique(np.asarray(labels), return_inverse=True)
    k = int(codes.max()) + 1 if len(codes) else 0
    whole = np.bincount(codes, minlength=k) / max(1, len(codes))
    worst = 0.0
    for chunk in np.array_split(codes, parts):
        if len(chunk):
            mix = np.bincount(chunk, minlength=k) / len(chunk)
            worst = max(worst, 0.5 * float(np.abs(mix - whole).sum()))
    return worst


def order_figures(listing_index: Sequence[int], labels: Sequence, parts: int = 20) -> dict[str, float]:
    """Both figures of one training order (listing index and subset label per trained sample)."""
    return {"rank_correlation": rank_correlation(listing_index),
            "worst_part_distance": worst_part_distance(labels, parts)}
