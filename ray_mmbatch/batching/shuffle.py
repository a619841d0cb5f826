"""The sample order of an epoch: a seeded unit permutation, then a seeded shuffle buffer.

Datasets come as sorted subsets (one file or folder per source), so reading them in
listing order trains subset after subset. Every epoch, the first included, is mixed in
two steps, both functions of ``(seed, epoch)`` and of the stream, never of a worker RNG::

    read units (row groups / shards / LLaVA chunks)
        |  unit_order: a permutation of the units, seeded by (seed, epoch)       [--shuffle units]
        v
    light rows in that order (id, costs, read position: ~250 bytes; the payloads wait in the holders)
        |  ShuffleBuffer(capacity B): it grows to B as rows come (ramp r: while it
        |  grows, r of the rows pushed leave, so planning starts after a few hundred
        |  rows, not after B); a row swaps with the row at slot
        |  hash(seed, epoch, row's read position) % size, which goes on; at the end
        |  of the stream the rest leaves in a seeded order                          [--shuffle samples]
        v
    the planner's windows (batching/carry.py), batch order shuffled per window (plan.py)

A blend of sources by weight (formats/sources.py) is stratified at both steps: the units of
each source are spread evenly over the read stream (``stratified_unit_order``) and the buffer
keeps one part per source and lets out the source furthest behind its share (Megatron-LM's
blending rule), so every stretch of the epoch follows the weights, not just its totals.

What it guarantees: every row pushed leaves exactly once (a swap or the flush); the output
is a function of the input sequence and (seed, epoch, B) only, so how the stream is cut
into windows changes nothing, and the same seed, data and settings give the same order
(deterministic mode keeps the stream order). Another epoch or seed gives another order.
While the buffer grows (the first B / (1 - r) rows of an epoch) its output draws from the rows read
so far, a smaller span: the first stretch of an epoch is mixed over fewer units than the rest, the
price of a first batch in seconds (r = 0 fills the whole buffer first, as before; bench_mixing.py
measures both). Once full, a row stays a geometric number of swaps (mean B), so a window of the output draws from
about the last 2-3 B rows of a stream that is itself a random sequence of units: with
B >= a few units' rows, each part of the epoch mixes many random units.

Cost: O(1) per row (a vectorized hash, one list swap), B light rows of memory in the plan
actor (16,384 rows: ~4 MB) and B payloads waiting in the holders (spilled to disk over
data.payload_memory_mb). Resume stays exact (positions are recorded as batches train);
the units in flight grow to about B / rows-per-unit * (1 + ln rows-per-unit).
Mixing (rank correlation, worst-part subset distance), speed and holder memory against no
shuffle, units only, a plain buffer and a random permutation: benchmarks/bench_mixing.py,
figures in benchmarks/RESULTS.md ("Mixing").
"""
from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")

#: --shuffle values: file order (debugging), a unit permutation, unit permutation + sample buffer.
SHUFFLE_MODES = ("none", "units", "samples")
DEFAULT_SHUFFLE = "samples"

_M64 = (1 << 64) - 1


def check_mode(mode: str) -> str:
    if mode not in SHUFFLE_MODES:
        raise ValueError(f"shuffle must be one of {', '.join(SHUFFLE_MODES)}; got {mode!r}")
    return mode


def stream_seed(seed: int, epoch: int, salt: int = 0) -> int:
    """One 64-bit seed for (seed, epoch, salt): splitmix64 of the three, so nearby seeds and
    epochs give unrelated orders."""
    x = _splitmix(np.array([(int(seed) * 0x9E3779B1 + int(epoch) * 0x85EBCA77 + salt) & _M64], dtype=np.uint64))
    return int(x[0])


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer over a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def position_hash(positions: Sequence[int] | np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """A uint64 hash per read position, seeded by (seed, epoch): per-sample randomness."""
    p = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        return _splitmix(p ^ np.uint64(stream_seed(seed, epoch, salt=1)))


def unit_order(n_units: int, seed: int, epoch: int, mode: str) -> list[int]:
    """The order an epoch reads its units in (indices into the sorted listing)."""
    if check_mode(mode) == "none":
        return list(range(n_units))
    return random.Random(stream_seed(seed, epoch)).sample(range(n_units), n_units)


def stratified_unit_order(labels: Sequence[Hashable], sizes: Sequence[int], seed: int, epoch: int) -> list[int]:
    """A unit order that spreads every stratum (a blend's source) evenly over the epoch.

    Each stratum's units are drawn in a seeded order; a unit of r rows that starts at row c of
    its stratum's R rows is due at time (c + r / 2) / R, the middle of the stretch of its
    stratum it covers; all units are merged by that time (ties by a seeded draw). Every part
    of the read stream then holds each stratum in proportion to its rows (a blend's copies
    are the same multiple of every row of a source, so in proportion to its weight too),
    which keeps the stratified buffer below fed from every source.
    """
    rng = random.Random(stream_seed(seed, epoch, salt=4))
    strata: dict[Hashable, list[int]] = {}
    for i, label in enumerate(labels):
        strata.setdefault(label, []).append(i)
    keyed = []
    for label in sorted(strata, key=repr):
        units = strata[label]
        rng.shuffle(units)
        sized = [max(0, int(sizes[i])) for i in units]
        if not sum(sized):
            sized = [1] * len(units)
        total, start = float(sum(sized)), 0
        for i, r in zip(units, sized):
            keyed.append(((start + r / 2) / total, rng.random(), i))
            start += r
    return [i for _, _, i in sorted(keyed)]


class ShuffleBuffer(Generic[T]):
    """A seeded swap buffer of ``capacity`` items (see the module header).

    ``push(items, positions)`` returns the items that leave; ``flush()`` returns what is left in a
    seeded order and empties it. Items are opaque; ``positions`` are their read positions (distinct
    within an epoch), which seed the slot each one swaps into. ``capacity`` 0 passes items
    straight through.

    ``ramp`` (0 <= r < 1): how the buffer grows to ``capacity``. After n pushes it holds
    min(capacity, n - floor(n r)) items: while it grows, the pushes that make floor(n r) step
    up swap an item out (one in 1/r), the others only add; once full, every push swaps. r = 0
    fills it first and emits nothing before ``capacity`` items came (the plain swap buffer).
    The output stays a function of the pushed sequence and (seed, epoch, capacity, ramp).

    Stratified (``shares``: {label: share of the epoch}, ``label``: item -> its label; a blend's
    sources): each label's items wait in a part of their own (the capacity counts them all),
    and each item that leaves comes from the label furthest behind its share of what has left
    so far (Megatron-LM's blending rule: the largest share x (n + 1) - emitted), from a seeded
    random slot of that part. Every stretch of the output then holds each label within about
    one item of its share, however small the set, as long as the input feeds every part
    (``stratified_unit_order``); a label with nothing waiting is passed over, so every item
    still leaves exactly once.
    """

    def __init__(self, capacity: int, seed: int, epoch: int, shares: dict | None = None,
                 label: Callable[[T], Hashable] | None = None, ramp: float = 0.0):
        if capacity < 0:
            raise ValueError(f"shuffle buffer capacity must be >= 0, got {capacity}")
        if not 0.0 <= ramp < 1.0:
            raise ValueError(f"shuffle buffer ramp must be in [0, 1), got {ramp}")
        self.ramp = float(ramp)
        if shares and label is None:
            raise ValueError("a stratified shuffle buffer needs label (item -> its stratum) with its shares")
        self.capacity, self.seed, self.epoch = int(capacity), int(seed), int(epoch)
        self.items: list[T] = []
        self.pushed = self.flushes = 0
        total = float(sum(shares.values())) if shares else 0.0
        self.shares = {k: float(v) / total for k, v in shares.items()} if total > 0 else None
        self.label = label
        self.parts: dict[Hashable, list[T]] = {}
        self.emitted: dict[Hashable, int] = {}
        self.held = self.left = 0
        self.rng = random.Random(stream_seed(seed, epoch, salt=3))

    def __len__(self) -> int:
        return self.held if self.shares else len(self.items)

    def size_after(self, pushed: int) -> int:
        """Items held after ``pushed`` pushes (before any flush): the buffer's growth."""
        return min(self.capacity, pushed - int(pushed * self.ramp))

    def push(self, items: Sequence[T], positions: Sequence[int] | np.ndarray) -> list[T]:
        if len(items) != len(positions):
            raise ValueError(f"{len(items)} items but {len(positions)} positions")
        n0 = self.pushed
        self.pushed += len(items)
        if self.capacity == 0:
            return list(items)
        if self.shares:
            out: list[T] = []
            for n, item in enumerate(items, n0 + 1):
                self.parts.setdefault(self.label(item), []).append(item)
                self.held += 1
                while self.held > self.size_after(n):
                    if self.held < self.capacity and not self.parts.get(self._due()):
                        break  # growing: wait for the label that is due rather than skew the mix
                    out.append(self._pop())
            return out
        hashes = position_hash(positions, self.seed, self.epoch).tolist()
        out: list[T] = []
        buf, size_after = self.items, self.size_after
        for n, (item, h) in enumerate(zip(items, hashes), n0 + 1):
            if len(buf) < size_after(n):
                buf.append(item)
            elif buf:
                slot = h % len(buf)  # len(buf) == cap once full: the plain swap buffer
                out.append(buf[slot])
                buf[slot] = item
            else:
                out.append(item)
        return out

    def _due(self) -> Hashable:
        """The label furthest behind its share of what has left so far (waiting or not)."""
        n = self.left + 1
        return max(self.shares, key=lambda k: (self.shares[k] * n - self.emitted.get(k, 0), repr(k)))

    def _pop(self) -> T:
        """One item out of a stratified buffer: from the label furthest behind its share."""
        n = self.left + 1
        best = max((k for k, part in self.parts.items() if part),
                   key=lambda k: (self.shares.get(k, 0.0) * n - self.emitted.get(k, 0), repr(k)))
        part = self.parts[best]
        slot = self.rng.randrange(len(part))
        part[slot], part[-1] = part[-1], part[slot]
        self.emitted[best] = self.emitted.get(best, 0) + 1
        self.held -= 1
        self.left += 1
        return part.pop()

    def flush(self) -> list[T]:
        """Everything held, in an order seeded by (seed, epoch, rows pushed so far)."""
        if self.shares:
            out = [self._pop() for _ in range(self.held)]
            self.flushes += 1
            return out
        out, self.items = self.items, []
        random.Random(stream_seed(self.seed, self.epoch, salt=2 + self.pushed)).shuffle(out)
        self.flushes += 1
        return out


class BatchMix(Generic[T]):
    """Orders each window's planned batches so the running mix of the epoch follows the shares.

    The planner groups a window's samples by length, so a batch can hold one source more than
    another, and the window's batches leave in a seeded random order; for a blend (``shares``:
    {label: share}, ``label``: item -> its label) ``order`` instead lets out, batch after
    batch, the one that keeps the labels' running counts over the epoch (across windows)
    closest to their shares (least total |count - share x samples|), the seeded order
    breaking ties. A window then spreads each source over its stretch of the epoch, and no
    stretch drifts from the weights by more than about a batch. O(B^2 x labels) numpy per
    window of B batches.
    """

    def __init__(self, shares: dict, label: Callable[[T], Hashable]):
        self.names = sorted(shares, key=repr)
        self.index = {k: i for i, k in enumerate(self.names)}
        total = float(sum(shares.values())) or 1.0
        self.share = np.array([float(shares[k]) / total for k in self.names] + [0.0])  # last: unknown labels
        self.label = label
        self.counts = np.zeros(len(self.share))

    def order(self, batches: list[list[T]]) -> list[list[T]]:
        if not batches:
            return batches
        other = len(self.names)
        c = np.zeros((len(batches), len(self.share)))
        for b, members in enumerate(batches):
            for item in members:
                c[b, self.index.get(self.label(item), other)] += 1
        n = c.sum(axis=1)
        left = np.arange(len(batches))
        out = []
        while len(left):
            after = self.counts + c[left]
            dev = np.abs(after - self.share * (self.counts.sum() + n[left])[:, None]).sum(axis=1)
            k = int(np.argmin(dev))  # the first of equals: the seeded order decides
            j = int(left[k])
            out.append(batches[j])
            self.counts += c[j]
            left = np.delete(left, k)
        return out
