"""pack_best_fit_decreasing: largest first, each into the fullest batch it still fits.

Samples are sorted by token cost (descending, stable on index) and each goes to
the open batch with the *least* remaining token room that can take it (and whose
patch / image / sample-count room also suffices); otherwise it opens a batch.
Long samples set up the batches; the many short ones arrive last and close the
gaps, which is why BFD lands on or next to the lower bound ceil(sum / max_tokens).

Remaining rooms live in one sorted Python list, so "tightest fit" is a bisect
and the per-sample work is a few list operations on ~n/avg-batch entries.
In pad mode the same loop runs with rooms counted in rows (see below).
Cost: O(n log n) sort + O(n * (log b + b_memmove)). With a patch, image or count budget,
a batch that lacks room on those costs one vectorized pass over the open batches
(_SideRooms) rather than a check per batch. The pack default: its fill against the
per-window lower bound and its speed (token budget alone, and with max_patches binding)
are measured by benchmarks/bench_packing.py; figures in benchmarks/RESULTS.md ("Packing").
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
    side = _SideRooms(patches, images, budget, len(order_l))
    rooms: list = []      # remaining token room of the open batches, ascending
    room_bin: list = []   # batch id aligned with rooms
    bins: list[list[int]] = []
    for s, idx in zip(size_l, order_l):
        k = bisect_left(rooms, s)
        if side.on:
            k = side.tightest(rooms, room_bin, k, s, idx)
        if k == len(rooms):
            b = len(bins)
            bins.append([idx])
            room = (cap if caps is None else caps[idx]) - s
        else:
            room = rooms.pop(k) - s
            b = room_bin.pop(k)
            bins[b].append(idx)
        if side.on and not side.add(b, idx, room):
            continue  # full by count: never offered again
        pos = bisect_left(rooms, room)
        rooms.insert(pos, room)
        room_bin.insert(pos, b)
    for b in bins:
        b.sort()
    return bins


_SCAN = 32  # batches tested one by one before the vectorized search


class _SideRooms:
    """Patch / image / sample-count rooms of the open batches, for the multi-budget case.

    The tightest token fit is one bisect; when that batch lacks patch or image room,
    ``tightest`` tests the next _SCAN batches one by one, then makes one numpy pass over
    every open batch (token, patch, image room arrays by batch id): the smallest token
    room that passes every check, then its first batch in list order - exactly the batch
    the one-by-one scan would pick. Batches full by count leave the list (token room -inf).
    """

    def __init__(self, patches, images, budget: Budget, n: int):
        mp, mi, ms = budget.max_patches, budget.max_images, budget.max_samples
        self.on = not (mp is None and mi is None and ms is None)
        if not self.on:
            return
        self.p = np.asarray(patches, dtype=np.int64).tolist()
        self.m = np.asarray(images, dtype=np.int64).tolist()
        big = np.iinfo(np.int64).max // 4
        self.limits = [big if v is None else int(v) for v in (mp, mi, ms)]
        self.token = np.full(n, -np.inf)  # token room by batch id; -inf: closed / not open
        self.patch_room, self.image_room = np.zeros(n, np.int64), np.zeros(n, np.int64)
        self.pl, self.ml, self.cl = [], [], []   # the same as Python lists (fast scalar checks)

    def fits(self, b: int, idx: int) -> bool:
        return self.pl[b] >= self.p[idx] and self.ml[b] >= self.m[idx] and self.cl[b] >= 1

    def add(self, b: int, idx: int, token_room) -> bool:
        """Account sample ``idx`` in batch ``b``; False when the batch is full by count."""
        if b == len(self.pl):
            self.pl.append(self.limits[0])
            self.ml.append(self.limits[1])
            self.cl.append(self.limits[2])
        self.pl[b] -= self.p[idx]
        self.ml[b] -= self.m[idx]
        self.cl[b] -= 1
        self.patch_room[b] = self.pl[b]
        self.image_room[b] = self.ml[b]
        if self.cl[b] < 1:
            self.token[b] = -np.inf
            return False
        self.token[b] = token_room
        return True

    def tightest(self, rooms: list, room_bin: list, k: int, s, idx: int) -> int:
        """Index into ``rooms`` (from ``k``, the tightest token fit) of the first batch in list
        order with room for ``idx`` on every budget; len(rooms) if none."""
        pi, mi, pl, ml = self.p[idx], self.m[idx], self.pl, self.ml
        end = len(rooms)
        stop = min(k + _SCAN, end)
        for j in range(k, stop):  # a few one by one first: usually enough
            b = room_bin[j]
            if pl[b] >= pi and ml[b] >= mi:  # batches in ``rooms`` all have count room
                return j
        if stop == end:
            return end
        nb = len(self.pl)
        t = self.token[:nb]
        ok = (t >= s) & (self.patch_room[:nb] >= self.p[idx]) & (self.image_room[:nb] >= self.m[idx])
        if not ok.any():
            return len(rooms)
        best = t[ok].min()
        k = bisect_left(rooms, best)
        while not self.fits(room_bin[k], idx):  # equal rooms: the first that fits, as a scan would
            k += 1
        return k
