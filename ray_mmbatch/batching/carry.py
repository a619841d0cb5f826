"""CarryPlanner: plan a stream window by window, holding back under-filled batches.

Planning each window on its own wastes fill at every window boundary: the last
batches of a window are planned from whatever is left and are under-filled
(pack), or group rows of unequal length because the window holds too few of
that length (pad). A carry planner plans ``carried + window`` with the same
planner, emits the good batches, and holds back the worst ones (their samples
are planned again with the next window)::

    window k:  [carried from k-1] + [2048 new samples]
                     |  plan (same algorithm, unshuffled)
                     v
               batches, worst first by wasted tokens per sample
                     |-- quality < THRESHOLD, within the carry cap, no sample
                     |   carried max_age times already  -> held back (carry)
                     '-- everything else                -> emitted (seeded order)
    end:       flush() plans and emits the carry; nothing is ever held after it

Quality of a batch: pack = the largest fraction of any limit it uses (tokens
with the attention term, patches, images, frames, samples), pad = padded fill (real /
rows x longest). The cap is a fraction of the window (``carry``): the planner
never holds more than ``carry * window`` samples, and a sample waits at most
``max_age`` windows, so the extra memory and delay are bounded.

Lossless by construction: every sample fed comes out exactly once, in a batch
planned (and checked) by the same registry planner. What the caller must
guarantee is that ``flush()`` is called when the stream ends (the Ray stage
sees an end-of-stream marker row, see formats/end_of_stream.py); a ``feed`` after ``flush``
holds nothing back, so a late window is planned on its own, never lost.

Batch scores are vectorized with reduceat, so carrying costs about one extra planning pass
over the held samples. Fill with and without carry, samples held and planner speed:
benchmarks/bench_packing.py (e); figures in benchmarks/RESULTS.md ("Packing").
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Generic, TypeVar

import numpy as np

from .budget import Budget
from .plan import ALGORITHMS, as_costs, check_fits_alone, resolve_algorithm

T = TypeVar("T")

#: Default carry cap per mode, as a fraction of the window (benchmarks/bench_packing.py).
DEFAULT_CARRY = {"pack": 0.05, "pad": 0.10}
#: A batch at or above this quality is never held back.
THRESHOLD = 0.99
#: A sample is held back at most this many times (its batch is emitted after that).
MAX_AGE = 8


def resolve_carry(mode: str, carry: float | None) -> float:
    """The carry cap for ``mode``: the measured default when ``carry`` is None."""
    value = DEFAULT_CARRY[mode] if carry is None else float(carry)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"carry must be a fraction of the window in [0, 1], got {carry!r}")
    return value


class CarryPlanner(Generic[T]):
    """Stateful window planner; see the module docstring. Items are opaque to it."""

    def __init__(self, budget: Budget, algorithm: str = "", carry: float | None = None,
                 max_age: int = MAX_AGE):
        self.budget = budget.limits()
        self.algorithm = resolve_algorithm(budget.mode, algorithm)
        self.carry = resolve_carry(budget.mode, carry)
        self.max_age = int(max_age)
        self.closed = False
        self._items: list[T] = []
        self._costs = np.zeros((4, 0), np.int64)  # tokens, patches, images, frames of carried items
        self._age = np.zeros(0, np.int64)  # windows each carried item has waited

    @property
    def held(self) -> list[T]:
        """Items held back right now (planned again with the next window or at flush)."""
        return list(self._items)

    def relabel(self, items: Sequence[T]) -> None:
        """Rename the held items, in ``held`` order (a caller that re-indexes the rows it keeps)."""
        if len(items) != len(self._items):
            raise ValueError(f"relabel: {len(items)} names for {len(self._items)} held items")
        self._items = list(items)

    def feed(self, items: Sequence[T], tokens, patches=None, images=None, seed: int = 0,
             frames=None) -> list[list[T]]:
        """Plan ``carried + items``; return the emitted batches (seeded order), keep the rest.
        ``patches`` / ``images`` / ``frames`` None = zeros.

        Raises OversizeError (index into ``items``) before touching any state if a new
        item cannot fit a batch alone.
        """
        tokens, patches, images, frames = as_costs(tokens, patches, images, frames=frames)
        if len(items) != len(tokens):
            raise ValueError(f"{len(items)} items but {len(tokens)} costs")
        check_fits_alone(tokens, patches, images, self.budget, frames)
        if not len(items) and not self.closed:
            return []  # a window with no usable sample: keep what is held for the next one
        cap = 0 if self.closed else int(self.carry * len(items))
        return self._plan(list(items), np.stack([tokens, patches, images, frames]), cap, seed)

    def flush(self, seed: int = 0) -> list[list[T]]:
        """End of stream: plan and emit everything held; later feeds hold nothing back."""
        self.closed = True
        return self._plan([], np.zeros((4, 0), np.int64), 0, seed)

    def _plan(self, new: list[T], new_costs: np.ndarray, cap: int, seed: int) -> list[list[T]]:
        items = self._items + new
        costs = np.concatenate([self._costs, new_costs], axis=1)
        age = np.concatenate([self._age, np.zeros(len(new), np.int64)])
        batches = ALGORITHMS[self.algorithm](costs[0], costs[1], costs[2], self.budget, costs[3]) \
            if len(items) else []
        hold: list[int] = []
        held: set[int] = set()
        if cap > 0 and batches:
            quality, waste, oldest = self._scores(batches, costs, age)
            # worst first by wasted tokens per sample; only batches under THRESHOLD are candidates
            for k in sorted(np.flatnonzero(quality < THRESHOLD).tolist(), key=lambda k: (-waste[k], k)):
                b = batches[k]
                if len(hold) + len(b) > cap or oldest[k] >= self.max_age:
                    continue
                hold.extend(b)
                held.add(k)
        out = [b for k, b in enumerate(batches) if k not in held] if held else batches
        hold.sort()
        self._items = [items[i] for i in hold]
        self._costs = costs[:, hold] if hold else np.zeros((4, 0), np.int64)
        self._age = age[hold] + 1 if hold else np.zeros(0, np.int64)
        perm = np.random.default_rng(seed).permutation(len(out)).tolist()
        return [[items[i] for i in out[k]] for k in perm]

    def _scores(self, batches: list[list[int]], costs: np.ndarray, age: np.ndarray):
        """Per batch, vectorized: quality (see module docstring), wasted tokens per sample, oldest age.

        Quality: pack = the largest fraction of any limit used; pad = real / (rows x longest).
        Waste: (tokens occupied - real tokens) / rows, occupied = max_tokens (pack) or rows x longest.
        """
        b = self.budget
        lens = np.fromiter(map(len, batches), np.int64, len(batches))
        flat = np.fromiter(chain.from_iterable(batches), np.int64, int(lens.sum()))
        starts = np.zeros(len(lens), np.int64)
        np.cumsum(lens[:-1], out=starts[1:])
        t = costs[0, flat]
        tsum = np.add.reduceat(t, starts).astype(np.float64)
        longest = np.maximum.reduceat(t, starts).astype(np.float64)
        oldest = np.maximum.reduceat(age[flat], starts)
        if b.mode == "pad":
            occupied = lens * longest
            quality = np.divide(tsum, occupied, out=np.ones(len(lens)), where=occupied > 0)
        else:
            occupied = np.full(len(lens), float(b.max_tokens))
            tcost = tsum
            if b.attn_weight:
                tf = t.astype(np.float64)
                tcost = tsum + b.attn_weight * np.add.reduceat(tf * tf, starts)
            quality = tcost / b.max_tokens
            for row, limit in ((1, b.max_patches), (2, b.max_images), (3, b.max_frames)):
                if limit is not None:
                    quality = np.maximum(quality, np.add.reduceat(costs[row, flat], starts) / limit)
            if b.max_samples is not None:
                quality = np.maximum(quality, lens / b.max_samples)
        return quality, (occupied - tsum) / lens, oldest
