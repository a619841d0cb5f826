"""The data position of a run: what each epoch has trained, recorded per READ UNIT.

Every RAW row carries where it was read (readers.read_with_position): its read unit
(``schema.UNIT``: the unit's index in the sorted unit list - a Parquet row group, a tar
shard, a LLaVA chunk), its row in that unit (``UNIT_ROW``) and the unit's row count
(``UNIT_ROWS``). A row's position is one int64, ``unit << 32 | row``. Per epoch::

    finished   bitmap over units: every row trained or reported skipped   units / 8 bytes
    in_flight  {unit: bitmap of its rows done}, units partly done          rows / 8 bytes each

so the state grows with the number of units IN FLIGHT (a few windows' worth), never with
the samples trained: 100 M samples in 50,000 units stopped mid-epoch (256 units in flight) is ~100 kB
(benchmarks/bench_resume_state.py). A resumed epoch reads no finished unit and drops the
done rows of units in flight as they are read (``rows_to_read``), before measuring.

The unit index is a position in the sorted listing, so a run must resume over the same
listing: ``listing`` (readers.listing_digest: relative paths, row groups, offsets and row
counts of the units, not where the data is mounted) is kept in the state and a resume
over a different listing fails at start (readers.check_listing) instead of leaving out
the wrong rows. Pure numpy.
"""
from __future__ import annotations

import base64
from typing import Any

import numpy as np

ROW_BITS = 32
_ROW_MASK = (1 << ROW_BITS) - 1


def encode_positions(units, rows) -> np.ndarray:
    """(unit, row) -> int64 positions; a negative unit (the end-of-stream row, hand-built rows) -> -1."""
    u = np.asarray(units, dtype=np.int64)
    p = (u << ROW_BITS) | np.asarray(rows, dtype=np.int64)
    return np.where(u < 0, -1, p)


def _bits(a: np.ndarray) -> str:
    return base64.b64encode(np.packbits(a).tobytes()).decode("ascii")


def _unbits(s: str, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(base64.b64decode(s), np.uint8), count=n).astype(bool)


class EpochPosition:
    """Rows done in one epoch: finished units (bitmap) + units in flight (row bitmaps)."""

    def __init__(self) -> None:
        self.finished = np.zeros(0, dtype=bool)
        self.in_flight: dict[int, np.ndarray] = {}

    def unit_finished(self, unit: int) -> bool:
        return 0 <= unit < len(self.finished) and bool(self.finished[unit])

    def rows_to_read(self, unit: int, n_rows: int) -> np.ndarray | None:
        """Mask of the rows of ``unit`` still to train (None: all of them; what the reader keeps)."""
        if self.unit_finished(unit):
            return np.zeros(n_rows, dtype=bool)
        done = self.in_flight.get(unit)
        return None if done is None else ~done[:n_rows]

    def add(self, positions, unit_rows) -> None:
        """Mark rows done (idempotent). ``unit_rows``: the row count of each position's unit."""
        pos = np.asarray(positions, dtype=np.int64)
        ok = pos >= 0
        pos, n = pos[ok], np.asarray(unit_rows, dtype=np.int64)[ok]
        if not len(pos):
            return
        units, rows = pos >> ROW_BITS, pos & _ROW_MASK
        for u in np.unique(units).tolist():
            if self.unit_finished(u):
                continue
            sel = units == u
            bitmap = self.in_flight.get(u)
            if bitmap is None:
                bitmap = self.in_flight[u] = np.zeros(int(n[sel][0]), dtype=bool)
            bitmap[rows[sel]] = True
            if bitmap.all():
                del self.in_flight[u]
                if u >= len(self.finished):
                    self.finished = np.concatenate(
                        [self.finished, np.zeros(max(u + 1, 2 * len(self.finished)) - len(self.finished), bool)])
                self.finished[u] = True

    def contains(self, positions) -> np.ndarray:
        """Per position: already done?"""
        pos = np.asarray(positions, dtype=np.int64)
        units, rows = pos >> ROW_BITS, pos & _ROW_MASK
        out = np.zeros(len(pos), dtype=bool)
        for i, (u, r) in enumerate(zip(units.tolist(), rows.tolist())):
            if u < 0:
                continue
            bitmap = self.in_flight.get(u)
            out[i] = self.unit_finished(u) or (bitmap is not None and r < len(bitmap) and bool(bitmap[r]))
        return out

    def state_dict(self) -> dict[str, Any]:
        n = int(np.flatnonzero(self.finished)[-1]) + 1 if self.finished.any() else 0
        return {"units": n, "finished": _bits(self.finished[:n]),
                "in_flight": {str(u): [len(b), _bits(b)] for u, b in sorted(self.in_flight.items())}}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> EpochPosition:
        ep = cls()
        ep.finished = _unbits(state["finished"], int(state["units"]))
        ep.in_flight = {int(u): _unbits(b, int(n)) for u, (n, b) in state.get("in_flight", {}).items()}
        return ep


class DataPosition:
    """The whole run's position: one EpochPosition per epoch started."""

    def __init__(self) -> None:
        self.epochs: dict[int, EpochPosition] = {}
        self.listing = ""  # digest of the unit listing the indices refer to ('' = not recorded)

    def epoch(self, epoch: int) -> EpochPosition:
        return self.epochs.setdefault(int(epoch), EpochPosition())

    def add(self, epoch: int, positions, unit_rows) -> None:
        self.epoch(epoch).add(positions, unit_rows)

    def contains(self, epoch: int, positions) -> np.ndarray:
        ep = self.epochs.get(int(epoch))
        return ep.contains(positions) if ep is not None else np.zeros(len(positions), dtype=bool)

    def state_dict(self) -> dict[str, Any]:
        state = {"version": 1, "epochs": {str(e): ep.state_dict() for e, ep in sorted(self.epochs.items())}}
        if self.listing:
            state["listing"] = self.listing
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> DataPosition:
        dp = cls()
        dp.listing = str((state or {}).get("listing") or "")
        for e, ep in ((state or {}).get("epochs") or {}).items():
            dp.epochs[int(e)] = EpochPosition.from_state(ep)
        return dp
