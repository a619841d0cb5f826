"""pack_best_fit_decreasing: largest first, each into the fullest batch it still fits.

Samples are sorted by token cost (descending, stable on index) and each goes to
the open batch with the *least* remaining token room that can take it (and whose
patch / image / frame / sample-count room also suffices); otherwise it opens a batch.
Long samples set up the batches; the many short ones arrive last and close the
gaps, which is why BFD lands on or next to the lower bound ceil(sum / max_tokens).

Remaining rooms live in one sorted Python list, so "tightest fit" is a bisect
and the per-sample work is a few list operations on ~n/avg-batch entries.
In pad mode the same loop runs with rooms counted in rows (see below).
Cost: O(n log n) sort + O(n * (log b + b_memmove)).

The list is keyed by the budget that binds. In pack mode, when the window's patches
fill more batches than its tokens (sum patches / max_patches > sum tokens / max_tokens)
AND bind for at least 2/3 of its samples (patches / max_patches > tokens / max_tokens;
e.g. Qwen2-VL-like data, patches = 4 x image tokens, max_patches = 2 x max_tokens), the
list holds *patch* rooms: samples come in decreasing order of their larger share of a
batch, max(tokens / max_tokens, patches / max_patches), and each goes to the batch with
the least patch room that also has token / image / frame / count room. Otherwise (tokens bind,
patches bind for fewer samples, or pad mode, where rows must come longest first) the
list holds token (row) rooms: the token-sorted plan above, unchanged. Either way the
other budgets are checked on the tightest fit, then on the next _SCAN batches one by
one, then on the rest of the list by one gather + numpy compare (_first_fit): the first
batch in list order with room on every budget. Keyed by the binding budget, that last
step is rare: on mixture (h) below 111 of 64,334 samples at 4,096 tokens and none at
16,384 reach it; keyed by tokens, 58,085 and 57,173 of ~65k did.

Measured by benchmarks/bench_packing.py (figures in benchmarks/RESULTS.md, "Packing"):
on mixture (h), patch-bound for 92.5% of the samples, plan_batches runs at 0.58x /
0.88x the speed of the token budget alone at 4,096 / 16,384 tokens (0.06x when the list
was keyed by tokens: nearly every sample fell through to the vectorized pass), with
fewer batches: 26,358 / 6,870 per windows of 2048 (was 26,535 / 6,897; patch lower
bound 26,019 / 6,845). The 2/3 threshold is measured too: on random and blended
mixtures, patch-keyed plans from 2/3 on never took more batches than the token-keyed
plan; with 1/2 to 3/5 of the samples patch-bound a few took up to 2% more.
"""
from __future__ import annotations

from bisect import bisect_left
from operator import itemgetter

import numpy as np

from .budget import Budget

_BIG = np.iinfo(np.int64).max // 4  # "no limit" for a side budget
# Patch-keyed when patches also bind for at least this many thirds of the samples
# (module docstring: measured, not guessed).
_PATCH_SHARE = 2


def pack_best_fit_decreasing(tokens: np.ndarray, patches: np.ndarray, images: np.ndarray,
                             budget: Budget, frames: np.ndarray | None = None) -> list[list[int]]:
    sizes = budget.token_sizes(tokens)
    mp, mi, ms = budget.max_patches, budget.max_images, budget.max_samples
    patches = np.asarray(patches, dtype=np.int64)
    images = np.asarray(images, dtype=np.int64)
    # a frame budget over no frames (or no budget) is no side budget at all
    frames = None if budget.max_frames is None or frames is None else np.asarray(frames, dtype=np.int64)
    if budget.mode == "pack":
        cap, caps = budget.token_capacity(), None
        if mp is not None and len(sizes):
            bins = _patch_keyed(sizes, cap, patches, images, budget, frames)
            if bins is not None:
                return bins
        order = np.argsort(-sizes, kind="stable")
        size_l = sizes[order].tolist()
    else:
        # Pad: the first (longest) row of a batch fixes its row cap; later rows are
        # never longer, so the room is counted in rows and every row costs 1.
        order = np.argsort(-sizes, kind="stable")
        cap, caps = None, budget.pad_rows_cap(tokens).tolist()
        size_l = [1] * len(order)
    if mp is None and mi is None and ms is None and frames is None:
        return _token_only(order.tolist(), size_l, cap, caps)
    return _sides(order, size_l, cap, caps, patches[order].tolist(), _BIG if mp is None else int(mp),
                  images, mi, ms, frames, budget.max_frames)


def _patch_keyed(sizes, cap, patches, images, budget: Budget, frames=None) -> list[list[int]] | None:
    """Pack mode: best fit on patch room when the patch budget binds the window (module
    docstring); None when it does not (the token-keyed plan is used)."""
    mp, mi, ms = budget.max_patches, budget.max_images, budget.max_samples
    tok = np.asarray(sizes, np.float64) / cap
    pat = patches / mp
    bound = pat > tok
    if not (3 * int(np.count_nonzero(bound)) >= _PATCH_SHARE * len(bound) and pat.sum() > tok.sum()):
        return None
    order = np.argsort(-np.maximum(tok, pat), kind="stable")  # larger share of a batch first
    return _sides(order, patches[order].tolist(), int(mp), None, sizes[order].tolist(), cap,
                  images, mi, ms, frames, budget.max_frames)


def _sides(order, key_l, cap, caps, a_l, a_cap, images, mi, ms, frames=None, mf=None) -> list[list[int]]:
    """Best fit with side budgets: the lean loop when the only one is ``a``. The image and
    frame budgets are the ``c`` side when only one of them is set (the same loop as before
    frames existed), the ``c`` and ``f`` sides when both are (``frames`` or ``mf`` None: no frame budget)."""
    if mf is None:
        frames = None
    if mi is None and ms is None and frames is None:
        return _best_fit_one_side(order.tolist(), key_l, cap, caps, a_l, a_cap)
    if frames is not None and mi is None:  # frames alone: in the image slot
        images, mi, frames = frames, mf, None
    f_l = [0] * len(order) if frames is None else frames[order].tolist()
    return _best_fit(order.tolist(), key_l, cap, caps, a_l, a_cap, images[order].tolist(),
                     _BIG if mi is None else int(mi), _BIG if ms is None else int(ms),
                     f_l, _BIG if frames is None else int(mf))


def _token_only(order_l, size_l, cap, caps) -> list[list[int]]:
    """One budget: the sorted room list is the whole search."""
    rooms: list = []      # remaining room of the open batches, ascending
    room_bin: list = []   # batch id aligned with rooms
    bins: list[list[int]] = []
    for s, idx in zip(size_l, order_l):
        k = bisect_left(rooms, s)
        if k == len(rooms):
            b = len(bins)
            bins.append([idx])
            room = (cap if caps is None else caps[idx]) - s
        else:
            room = rooms.pop(k) - s
            b = room_bin.pop(k)
            bins[b].append(idx)
        pos = bisect_left(rooms, room)
        rooms.insert(pos, room)
        room_bin.insert(pos, b)
    for b in bins:
        b.sort()
    return bins


def _best_fit(order_l, key_l, cap, caps, a_l, a_cap, c_l, c_cap, count_cap, f_l, f_cap) -> list[list[int]]:
    """Best fit on the key budget (sizes ``key_l`` in visiting order, room ``cap`` or
    ``caps[idx]`` for a batch ``idx`` opens) with three side budgets (sizes ``a_l`` /
    ``c_l`` / ``f_l``, limits ``a_cap`` / ``c_cap`` / ``f_cap``; _BIG and zeros = none)
    and a sample count limit: the first batch in list order (least key room, then
    earliest) with room on every budget. A batch full by count leaves the list."""
    rooms: list = []      # remaining key room of the open batches, ascending
    room_bin: list = []   # batch id aligned with rooms
    bins: list[list[int]] = []
    ar: list = []         # side rooms and samples still allowed, by batch id
    cr: list = []
    fr: list = []
    nr: list = []
    for s, a, c, f, idx in zip(key_l, a_l, c_l, f_l, order_l):
        k = bisect_left(rooms, s)
        end = len(rooms)
        if k < end:
            b = room_bin[k]
            if ar[b] < a or cr[b] < c or fr[b] < f:  # the tightest lacks side room: the next few one by one
                stop = min(k + _SCAN, end)
                k += 1
                while k < stop:
                    b = room_bin[k]
                    if ar[b] >= a and cr[b] >= c and fr[b] >= f:  # batches in ``rooms`` all have count room
                        break
                    k += 1
                else:
                    if stop < end:
                        k = _first_fit(room_bin, stop, ar, a, cr, c, fr, f)
        if k == end:
            b = len(bins)
            bins.append([idx])
            room = (cap if caps is None else caps[idx]) - s
            ar.append(a_cap - a)
            cr.append(c_cap - c)
            fr.append(f_cap - f)
            nr.append(count_cap - 1)
        else:
            room = rooms.pop(k) - s
            b = room_bin.pop(k)
            bins[b].append(idx)
            ar[b] -= a
            cr[b] -= c
            fr[b] -= f
            nr[b] -= 1
        if nr[b] < 1:
            continue  # full by count: never offered again
        pos = bisect_left(rooms, room)
        rooms.insert(pos, room)
        room_bin.insert(pos, b)
    for b in bins:
        b.sort()
    return bins


def _best_fit_one_side(order_l, key_l, cap, caps, a_l, a_cap) -> list[list[int]]:
    """_best_fit with side budget ``a`` only (no image or count limit): the same plan,
    fewer operations per sample."""
    rooms: list = []
    room_bin: list = []
    bins: list[list[int]] = []
    ar: list = []
    for s, a, idx in zip(key_l, a_l, order_l):
        k = bisect_left(rooms, s)
        end = len(rooms)
        if k < end and ar[room_bin[k]] < a:
            stop = min(k + _SCAN, end)
            k += 1
            while k < stop:
                if ar[room_bin[k]] >= a:
                    break
                k += 1
            else:
                if stop < end:
                    k = _first_fit(room_bin, stop, ar, a, ar, 0)
        if k == end:
            b = len(bins)
            bins.append([idx])
            room = (cap if caps is None else caps[idx]) - s
            ar.append(a_cap - a)
        else:
            room = rooms.pop(k) - s
            b = room_bin.pop(k)
            bins[b].append(idx)
            ar[b] -= a
        pos = bisect_left(rooms, room)
        rooms.insert(pos, room)
        room_bin.insert(pos, b)
    for b in bins:
        b.sort()
    return bins


_SCAN = 16  # batches tested one by one before the vectorized search


def _first_fit(room_bin: list, stop: int, ar: list, a, cr: list, c, fr: list | None = None, f=0) -> int:
    """Position in the room list, from ``stop`` on, of the first batch with side room for
    the sample (a, c and f); len(room_bin) if none. One gather + numpy compare over the
    rest of the list instead of a Python test per batch."""
    rest = room_bin[stop:]
    if len(rest) == 1:  # itemgetter of one id returns the value, not a tuple
        b = rest[0]
        return stop if ar[b] >= a and cr[b] >= c and (not f or fr[b] >= f) else len(room_bin)
    get = itemgetter(*rest)
    ok = np.array(get(ar)) >= a
    if c:  # image rooms are never negative: c == 0 always fits
        ok &= np.array(get(cr)) >= c
    if f:  # nor are frame rooms
        ok &= np.array(get(fr)) >= f
    return stop + int(ok.argmax()) if ok.any() else len(room_bin)
