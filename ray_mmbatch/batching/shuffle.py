"""The sample order of an epoch: a seeded unit permutation, then a seeded shuffle buffer.

Datasets come as sorted subsets (one file or folder per source), so reading them in
listing order trains subset after subset. Every epoch, the first included, is mixed in
two steps, both functions of ``(seed, epoch)`` and of the stream, never of a worker RNG::

    read units (row groups / shards / LLaVA chunks)
        |  unit_order: a permutation of the units, seeded by (seed, epoch)       [--shuffle units]
        v
    light rows in that order (id, costs, read position: ~250 bytes; the payloads wait in the holders)
        |  ShuffleBuffer(capacity B): the first B rows fill it; then each new row
        |  swaps with the row at slot hash(seed, epoch, row's read position) % B,
        |  which goes on; at the end of the stream the rest leaves in a seeded order  [--shuffle samples]
        v
    the planner's windows (batching/carry.py), batch order shuffled per window (plan.py)

What it guarantees: every row pushed leaves exactly once (a swap or the flush); the output
is a function of the input sequence and (seed, epoch, B) only, so how the stream is cut
into windows changes nothing, and the same seed, data and settings give the same order
(deterministic mode keeps the stream order). Another epoch or seed gives another order.
A row stays a geometric number of swaps (mean B), so a window of the output draws from
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
from collections.abc import Sequence
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


class ShuffleBuffer(Generic[T]):
    """A seeded swap buffer of ``capacity`` items (see the module header).

    ``push(items, positions)`` returns the items that leave (none while it fills, then one per
    item pushed); ``flush()`` returns what is left in a seeded order and empties it. Items are
    opaque; ``positions`` are their read positions (distinct within an epoch), which seed the
    slot each one swaps into. ``capacity`` 0 passes items straight through.
    """

    def __init__(self, capacity: int, seed: int, epoch: int):
        if capacity < 0:
            raise ValueError(f"shuffle buffer capacity must be >= 0, got {capacity}")
        self.capacity, self.seed, self.epoch = int(capacity), int(seed), int(epoch)
        self.items: list[T] = []
        self.pushed = self.flushes = 0

    def __len__(self) -> int:
        return len(self.items)

    def push(self, items: Sequence[T], positions: Sequence[int] | np.ndarray) -> list[T]:
        if len(items) != len(positions):
            raise ValueError(f"{len(items)} items but {len(positions)} positions")
        self.pushed += len(items)
        if self.capacity == 0:
            return list(items)
        slots = (position_hash(positions, self.seed, self.epoch) % np.uint64(self.capacity)).tolist()
        out: list[T] = []
        buf, cap = self.items, self.capacity
        for item, slot in zip(items, slots):
            if len(buf) < cap:
                buf.append(item)
            else:
                out.append(buf[slot])
                buf[slot] = item
        return out

    def flush(self) -> list[T]:
        """Everything held, in an order seeded by (seed, epoch, rows pushed so far)."""
        out, self.items = self.items, []
        random.Random(stream_seed(self.seed, self.epoch, salt=2 + self.pushed)).shuffle(out)
        self.flushes += 1
        return out
