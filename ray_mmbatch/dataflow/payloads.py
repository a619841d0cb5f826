"""Where a measured sample waits while only its costs are planned, in bounded memory.

The plan stage is serial (ONE carry actor, stream order), so it must not carry pixels:
measure leaves each usable sample's measured row (image bytes, token ids, grids) in a
payload store and sends on a LIGHT row (id, costs, read position, key: ~100 bytes);
materialize fetches the rows of its batch by key and releases them. One interface
(``put(keys, rows)``, ``get(keys) -> rows``, ``done(keys)``), two stores:

    LocalPayloads   a dict, for the in-process path (local_batches, benchmarks;
                    payload_store.py, with the holders' PayloadStore)
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

import pickle
import zlib
from typing import Any

import ray

from ray_mmbatch.dataflow.payload_store import ROW_OVERHEAD, UNLIMITED, PayloadHolder


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
