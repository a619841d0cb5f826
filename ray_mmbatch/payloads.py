"""Where a measured sample waits while only its costs are planned.

The plan stage is serial (ONE carry actor, stream order), so it must not carry pixels:
measure leaves each usable sample's measured row (image bytes, token ids, grids) in a
payload store and sends on a LIGHT row (id, costs, read position, key: ~100 bytes);
materialize fetches the rows of its batch by key and releases them. One interface
(``put(keys, rows)``, ``get(keys) -> rows``, ``done(keys)``), two stores:

    LocalPayloads   a dict, for the in-process path (local_batches, benchmarks)
    RayPayloads     ``holders`` PayloadHolder actors per dataset, a sample's holder chosen
                    by its key; bytes go measure -> holder -> materialize, in parallel
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

Backpressure - open: Ray Data cannot see what the holders keep (its budget sees only the
light rows), so measure may run ahead of materialize and the holders' memory grows with
that lead. ``put`` must NOT simply wait when a holder is full: with preserve_order the plan
stage takes windows in stream order, so a measure task blocked on an early block while
later blocks fill the holders deadlocks the stream (seen in bench_plan_stage at 4,000
samples with a cap of 8 windows). ``in_flight`` is there for the bound still to design.
"""
from __future__ import annotations

import zlib
from collections import OrderedDict
from typing import Any

import ray


class LocalPayloads:
    """In-process store: measured rows by key."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, Any]] = {}

    def put(self, keys: list[str], rows: list[dict[str, Any]]) -> None:
        self._rows.update(zip(keys, rows))

    def get(self, keys: list[str]) -> list[dict[str, Any]]:
        return [self._rows[k] for k in keys]

    def done(self, keys: list[str]) -> None:
        for k in keys:
            self._rows.pop(k, None)


class PayloadHolder:
    """Keeps measured rows by key until materialized (+ the last ``recent`` released ones)."""

    def __init__(self, recent: int) -> None:
        self.rows: dict[str, Any] = {}
        self.recent: OrderedDict[str, Any] = OrderedDict()
        self.recent_max = max(1, int(recent))

    def put(self, keys: list[str], rows: list) -> int:
        self.rows.update(zip(keys, rows))
        return len(self.rows)

    def in_flight(self) -> int:
        return len(self.rows)

    def get(self, keys: list[str]) -> list:
        try:
            return [self.rows[k] if k in self.rows else self.recent[k] for k in keys]
        except KeyError as e:
            raise KeyError(f"payload {e} is no longer held; failing the stream rather than dropping "
                           "the sample (training restores from its checkpoint)") from None

    def done(self, keys: list[str]) -> None:
        for k in keys:
            row = self.rows.pop(k, None)
            if row is not None:
                self.recent[k] = row
        while len(self.recent) > self.recent_max:
            self.recent.popitem(last=False)


class RayPayloads:
    """Client of the PayloadHolder actors of one dataset; picklable (stages get a copy)."""

    def __init__(self, holders: int, recent: int, **actor_options: Any) -> None:
        cls = ray.remote(num_cpus=0, max_restarts=0)(PayloadHolder)
        self.holders = [cls.options(**actor_options).remote(recent=recent) for _ in range(max(1, int(holders)))]

    def _split(self, keys: list[str]) -> dict[int, list[int]]:
        parts: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            unit = k.split(":", 1)[0]  # a unit's samples share a holder
            parts.setdefault(zlib.crc32(unit.encode()) % len(self.holders), []).append(i)
        return parts

    def put(self, keys: list[str], rows: list[dict[str, Any]]) -> None:
        parts = self._split(keys)
        ray.get([self.holders[h].put.remote([keys[i] for i in idx], [rows[i] for i in idx])
                 for h, idx in parts.items()])

    def get(self, keys: list[str]) -> list[dict[str, Any]]:
        out: list = [None] * len(keys)
        parts = self._split(keys)
        got = ray.get([self.holders[h].get.remote([keys[i] for i in idx]) for h, idx in parts.items()])
        for idx, rows in zip(parts.values(), got):
            for i, r in zip(idx, rows):
                out[i] = r
        return out

    def done(self, keys: list[str]) -> None:
        for h, idx in self._split(keys).items():
            self.holders[h].done.remote([keys[i] for i in idx])
