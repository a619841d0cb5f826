"""The payload stores' pure half: in-process rows by key, and one holder's bounded store.

``LocalPayloads`` (the in-process path) and ``PayloadStore`` (what each PayloadHolder actor
of dataflow/payloads.py keeps: rows by key in at most its memory cap, the rest spilled to
local disk, a bounded ``recent`` list for retried tasks). Why they exist and how the bound
works: dataflow/payloads.py. No Ray here.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections import OrderedDict
from typing import Any

ROW_OVERHEAD = 512  # bytes per held row besides its pickled bytes (key, bookkeeping)
UNLIMITED = float("inf")


class LocalPayloads:
    """In-process store: measured rows by key (one process plans in order: nothing to bound)."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, Any]] = {}

    def put(self, keys: list[str], rows: list[dict[str, Any]]) -> None:
        self._rows.update(zip(keys, rows))

    def get(self, keys: list[str]) -> list[dict[str, Any]]:
        return [self._rows[k] for k in keys]

    def done(self, keys: list[str]) -> None:
        for k in keys:
            self._rows.pop(k, None)


class _Spilled:
    """Where a spilled row lies: file, offset, length."""

    __slots__ = ("path", "offset", "length")

    def __init__(self, path: str, offset: int, length: int) -> None:
        self.path, self.offset, self.length = path, offset, length


class PayloadStore:
    """One holder's rows: in memory up to ``cap_bytes``, spilled to ``spill_dir`` beyond (no Ray).

    Rows are opaque while held; a row that spills must be ``bytes`` (RayPayloads sends rows
    pickled), and is written and read back as it is.
    """

    def __init__(self, cap_bytes: float = UNLIMITED, recent: int = 1024, recent_bytes: float = UNLIMITED,
                 spill_dir: str | None = None) -> None:
        self.cap = float(cap_bytes) if cap_bytes and cap_bytes > 0 else UNLIMITED
        self.rows: dict[str, Any] = {}  # key -> row (in memory) or _Spilled
        self.sizes: dict[str, int] = {}  # in-memory bytes of each held row (0 when spilled)
        self.bytes = 0
        self.recent: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.recent_bytes = 0
        self.recent_max, self.recent_max_bytes = max(1, int(recent)), recent_bytes
        self.spill_root, self.spill_dir = spill_dir, None
        self.file_refs: dict[str, int] = {}
        self.files = 0
        self.stats = {"puts": 0, "rows_put": 0, "peak_bytes": 0, "peak_rows": 0, "spilled_puts": 0,
                      "spilled_rows": 0, "spilled_bytes": 0, "spill_reads": 0,
                      "peak_held_bytes": 0}

    def _spill(self, keys: list[str], rows: list) -> list[_Spilled]:
        if self.spill_dir is None:
            self.spill_dir = tempfile.mkdtemp(prefix="ray_mmbatch_payloads_", dir=self.spill_root or None)
            atexit.register(shutil.rmtree, self.spill_dir, True)
        path = os.path.join(self.spill_dir, f"{self.files:08d}.pkl")
        self.files += 1
        out = []
        with open(path, "wb") as f:
            for r in rows:
                out.append(_Spilled(path, f.tell(), len(r)))
                f.write(r)
            self.stats["spilled_bytes"] += f.tell()
        self.file_refs[path] = len(rows)
        self.stats["spilled_puts"] += 1
        self.stats["spilled_rows"] += len(rows)
        return out

    def _unref(self, entry: Any) -> None:
        if isinstance(entry, _Spilled):
            self.file_refs[entry.path] -= 1
            if self.file_refs[entry.path] <= 0:
                del self.file_refs[entry.path]
                os.remove(entry.path)

    def _drop(self, key: str) -> None:  # a retried measure task overwrites its own keys
        if key in self.rows:
            self.bytes -= self.sizes.pop(key)
            self._unref(self.rows.pop(key))

    def put(self, keys: list[str], rows: list, sizes: list[int]) -> int:
        for k in keys:
            self._drop(k)
        need = int(sum(sizes))
        if self.bytes + need <= self.cap:
            self.rows.update(zip(keys, rows))
            self.sizes.update(zip(keys, (int(b) for b in sizes)))
            self.bytes += need
        else:
            self.rows.update(zip(keys, self._spill(keys, rows)))
            self.sizes.update((k, 0) for k in keys)
        self.stats["puts"] += 1
        self.stats["rows_put"] += len(keys)
        self.stats["peak_bytes"] = max(self.stats["peak_bytes"], self.bytes + self.recent_bytes)
        self.stats["peak_held_bytes"] = max(self.stats["peak_held_bytes"], self.bytes)
        self.stats["peak_rows"] = max(self.stats["peak_rows"], len(self.rows))
        return len(self.rows)

    def _load(self, entry: Any) -> Any:
        if not isinstance(entry, _Spilled):
            return entry
        self.stats["spill_reads"] += 1
        with open(entry.path, "rb") as f:
            f.seek(entry.offset)
            return f.read(entry.length)

    def get(self, keys: list[str]) -> list:
        try:
            return [self._load(self.rows[k] if k in self.rows else self.recent[k][0]) for k in keys]
        except KeyError as e:
            raise KeyError(f"payload {e} is no longer held; failing the stream rather than dropping "
                           "the sample (training restores from its checkpoint)") from None

    def done(self, keys: list[str]) -> None:
        for k in keys:
            entry = self.rows.pop(k, None)
            if entry is None:
                continue
            b = self.sizes.pop(k)
            self.bytes -= b
            if k in self.recent:  # released twice (a retried materialize): keep one entry
                old, ob = self.recent.pop(k)
                self.recent_bytes -= ob
                self._unref(old)
            self.recent[k] = (entry, b)
            self.recent_bytes += b
        while self.recent and (len(self.recent) > self.recent_max or self.recent_bytes > self.recent_max_bytes):
            entry, b = self.recent.popitem(last=False)[1]
            self.recent_bytes -= b
            self._unref(entry)

    def summary(self) -> dict[str, Any]:
        return dict(self.stats, held_bytes=self.bytes, held_rows=len(self.rows), spill_files=len(self.file_refs),
                    cap_bytes=self.cap if self.cap != UNLIMITED else 0)

    def close(self) -> None:
        if self.spill_dir is not None:
            shutil.rmtree(self.spill_dir, ignore_errors=True)


class PayloadHolder:
    """Actor: a PayloadStore (``recent`` bounded to a quarter of the cap too when there is one)."""

    def __init__(self, cap_bytes: float = UNLIMITED, recent: int = 1024, spill_dir: str | None = None) -> None:
        bounded = bool(cap_bytes and cap_bytes > 0 and cap_bytes != UNLIMITED)
        self.store = PayloadStore(cap_bytes, recent, recent_bytes=cap_bytes / 4 if bounded else UNLIMITED,
                                    spill_dir=spill_dir)

    def put(self, keys: list[str], rows: list, sizes: list[int]) -> int:
        return self.store.put(keys, rows, sizes)

    def get(self, keys: list[str]) -> list:
        return self.store.get(keys)

    def done(self, keys: list[str]) -> None:
        self.store.done(keys)

    def stats(self) -> dict[str, Any]:
        return self.store.summary()
