"""Where a measured sample waits while only its costs are planned, in bounded memory.

The plan stage is serial (ONE carry actor, stream order), so it must not carry pixels:
measure leaves each usable sample's measured row (image bytes, token ids, grids) in a
payload store and sends on a LIGHT row (id, costs, read position, key: ~100 bytes);
materialize fetches the rows of its batch by key and releases them. One interface
(``put(keys, rows)``, ``get(keys) -> rows``, ``done(keys)``), two stores:

    LocalPayloads   a dict, for the in-process path (local_batches, benchmarks)
    RayPayloads     ``holders`` PayloadHolder actors per dataset, a sample's holder chosen
                    by its read unit; bytes go measure -> holder -> materialize, in parallel
                    over the holders, never through the plan actor

Why holder actors, not ObjectRefs in the rows: an object dies with its owner, and the
owner of a ``ray.put`` is the process that puts it. Measure actors are stopped by Ray
Data as soon as measuring has consumed its input ("consumed all inputs" downscale),
while the last windows are still being planned and materialized, so refs they own would
be lost at the end of every epoch; Ray 2.56 removed ``ray.put(_owner=...)``; and a ref
serialized into an Arrow column is out-of-band (pinned until its owner exits). The
holders live as long as the dataset. Keys are read positions (unit:row), so a measure
task that Ray retries overwrites its own entries instead of leaking new ones. A released
payload stays in a short ``recent`` list, so a materialize task retried after its actor
died still finds it. A key no holder knows, or a dead holder, raises: the stream fails
and training restores from its checkpoint (never a silent loss).

Memory bound: spill, never wait. Ray Data's backpressure sees only the light rows, so
measure can run ahead of a slow consumer and the holders keep the whole lead (an epoch
of images in the worst case). Each holder keeps at most its share of
``data.payload_memory_mb`` in memory; a put that does not fit is written to a spill file
on the holder's local disk (one file per put, each row at its own offset, so a get reads
only its rows) and read back by ``get``, as Ray's object store spills. A put never waits,
and that is on purpose: with preserve_order the plan stage takes windows in stream
order, and Ray Data runs measure tasks out of that order (several queued per actor), so
a put that waits for memory can sit in front of the very block the stream needs next,
which only the stream's progress would free (a waiting design hung this way in
tests/test_pipeline.py at a 0.25 MB cap). Spill files are deleted when their last row
is released (and out of ``recent``), and the holder's folder when the holder exits.
Memory per holder: at most its cap for held rows plus a quarter of it for released rows
kept for retries (``recent``). Statistics (``stats()``: peak bytes in memory, rows and
bytes spilled, spill reads).
"""
from __future__ import annotations

import atexit
import os
import pickle
import shutil
import tempfile
import zlib
from collections import OrderedDict
from typing import Any

import ray

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


class PayloadLedger:
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
    """Actor: a PayloadLedger (``recent`` bounded to a quarter of the cap too when there is one)."""

    def __init__(self, cap_bytes: float = UNLIMITED, recent: int = 1024, spill_dir: str | None = None) -> None:
        bounded = bool(cap_bytes and cap_bytes > 0 and cap_bytes != UNLIMITED)
        self.ledger = PayloadLedger(cap_bytes, recent, recent_bytes=cap_bytes / 4 if bounded else UNLIMITED,
                                    spill_dir=spill_dir)

    def put(self, keys: list[str], rows: list, sizes: list[int]) -> int:
        return self.ledger.put(keys, rows, sizes)

    def get(self, keys: list[str]) -> list:
        return self.ledger.get(keys)

    def done(self, keys: list[str]) -> None:
        self.ledger.done(keys)

    def stats(self) -> dict[str, Any]:
        return self.ledger.summary()


class RayPayloads:
    """Client of the PayloadHolder actors of one dataset; picklable (stages get a copy).

    ``cap_bytes``: memory for waiting rows over all holders (0 = unbounded); beyond it rows
    spill to ``spill_dir`` (default: the system temp folder) on the holder's node.
    """

    def __init__(self, holders: int, recent: int, cap_bytes: float = 0, spill_dir: str | None = None,
                 **actor_options: Any) -> None:
        n = max(1, int(holders))
        cls = ray.remote(num_cpus=0, max_restarts=0)(PayloadHolder)
        share = cap_bytes / n if cap_bytes and cap_bytes > 0 else UNLIMITED
        self.holders = [cls.options(**actor_options).remote(cap_bytes=share, recent=recent, spill_dir=spill_dir)
                        for _ in range(n)]

    def _split(self, keys: list[str]) -> dict[int, list[int]]:
        parts: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            unit = k.split(":", 1)[0]  # a unit's samples share a holder
            parts.setdefault(zlib.crc32(unit.encode()) % len(self.holders), []).append(i)
        return parts

    def put(self, keys: list[str], rows: list[dict[str, Any]]) -> None:
        # Rows travel and wait as pickled bytes: the holder never builds the dicts of arrays
        # (deserializing them cost the holders ~0.7 ms a row), and its memory count is exact.
        blobs = [pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL) for r in rows]
        sizes = [len(b) + ROW_OVERHEAD for b in blobs]
        ray.get([self.holders[h].put.remote([keys[i] for i in idx], [blobs[i] for i in idx], [sizes[i] for i in idx])
                 for h, idx in self._split(keys).items()])

    def get(self, keys: list[str]) -> list[dict[str, Any]]:
        out: list = [None] * len(keys)
        parts = self._split(keys)
        got = ray.get([self.holders[h].get.remote([keys[i] for i in idx]) for h, idx in parts.items()])
        for idx, rows in zip(parts.values(), got):
            for i, r in zip(idx, rows):
                out[i] = pickle.loads(r)
        return out

    def done(self, keys: list[str]) -> None:
        for h, idx in self._split(keys).items():
            self.holders[h].done.remote([keys[i] for i in idx])

    def stats(self) -> list[dict[str, Any]]:
        return ray.get([h.stats.remote() for h in self.holders])
