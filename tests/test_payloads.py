"""payloads.py: measured rows wait by key until materialized, in bounded memory (spilling beyond)."""
from __future__ import annotations

import os

import pytest

from ray_mmbatch.dataflow.payload_store import LocalPayloads, PayloadStore


def test_ledger_keeps_until_done_then_briefly_for_retries():
    h = PayloadStore(recent=2)
    assert h.put(["0:0", "0:1", "1:0"], [{"a": 0}, {"a": 1}, {"a": 2}], [10, 10, 10]) == 3
    assert h.put(["0:0"], [{"a": 0}], [10]) == 3  # a retried measure task overwrites, never leaks
    assert h.bytes == 30  # ... nor counts its bytes twice
    h.done(["0:0", "0:1"])
    assert h.summary()["held_rows"] == 1 and h.bytes == 10
    assert h.get(["0:1", "1:0"]) == [{"a": 1}, {"a": 2}]  # a retried materialize still finds it
    h.done(["1:0"])
    with pytest.raises(KeyError, match="no longer held"):
        h.get(["0:0"])  # fell out of the recent list: loud, never a silent loss


def test_over_the_cap_rows_spill_to_disk_and_come_back_exactly(tmp_path):
    # rows as RayPayloads sends them: pickled bytes (300 random bytes each here)
    img = [os.urandom(300) for _ in range(6)]
    h = PayloadStore(cap_bytes=700, recent=1, spill_dir=str(tmp_path))
    h.put(["0:0", "0:1"], [img[0], img[1]], [300, 300])  # fits: memory
    h.put(["1:0", "1:1"], [img[2], img[3]], [300, 300])  # 1200 > 700: one spill file
    h.put(["2:0"], [img[4]], [300])  # still over: a second file
    assert h.bytes == 600 and h.stats["spilled_rows"] == 3 and h.stats["spilled_puts"] == 2
    files = sorted(p for p in tmp_path.rglob("*.pkl"))
    assert len(files) == 2
    got = h.get(["2:0", "1:1", "0:0", "1:0"])  # each spilled row read back at its own offset
    assert got == [img[4], img[3], img[0], img[2]]
    assert h.stats["spill_reads"] == 3
    h.done(["0:0", "0:1"])  # memory freed: the next put stays in memory
    h.put(["3:0"], [img[5]], [300])
    assert h.stats["spilled_rows"] == 3 and h.bytes == 300
    h.done(["1:0"])
    assert files[0].exists()  # 1:1 still lives in that file
    h.done(["1:1", "2:0"])  # file 0's last row released and out of `recent` (1 entry): deleted
    assert not files[0].exists() and files[1].exists()  # 2:0 is still kept for a retried materialize
    assert h.get(["2:0"]) == [img[4]]
    h.done(["3:0"])  # pushes 2:0 out of `recent`: its file goes
    assert not files[1].exists()
    assert h.summary()["spill_files"] == 0 and h.stats["peak_held_bytes"] == 600


def test_a_retried_put_replaces_a_spilled_row_without_leaking_its_file(tmp_path):
    h = PayloadStore(cap_bytes=10, recent=1, spill_dir=str(tmp_path))
    h.put(["0:0"], [b"first try"], [100])  # spilled
    h.put(["0:0"], [b"retry"], [5])  # the retried task's row fits: the old file goes
    assert h.get(["0:0"]) == [b"retry"] and not list(tmp_path.rglob("*.pkl"))
    h.close()
    assert not any(p.is_dir() and p.name.startswith("ray_mmbatch_payloads_") for p in tmp_path.iterdir())


def test_local_store_round_trip():
    s = LocalPayloads()
    s.put(["k1", "k2"], [{"x": 1}, {"x": 2}])
    assert s.get(["k2", "k1"]) == [{"x": 2}, {"x": 1}]
    s.done(["k1"])
    with pytest.raises(KeyError):
        s.get(["k1"])
