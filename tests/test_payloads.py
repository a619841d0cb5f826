"""payloads.py: measured rows wait by key until materialized (the holder logic, no Ray)."""
from __future__ import annotations

import pytest

from ray_mmbatch.payloads import LocalPayloads, PayloadHolder


def test_holder_keeps_until_done_then_briefly_for_retries():
    h = PayloadHolder(recent=2)
    assert h.put(["0:0", "0:1", "1:0"], [{"a": 0}, {"a": 1}, {"a": 2}]) == 3
    assert h.put(["0:0"], [{"a": 0}]) == 3  # a retried measure task overwrites, never leaks
    h.done(["0:0", "0:1"])
    assert h.in_flight() == 1
    assert h.get(["0:1", "1:0"]) == [{"a": 1}, {"a": 2}]  # a retried materialize still finds it
    h.done(["1:0"])
    with pytest.raises(KeyError, match="no longer held"):
        h.get(["0:0"])  # fell out of the recent list: loud, never a silent loss


def test_local_store_round_trip():
    s = LocalPayloads()
    s.put(["k1", "k2"], [{"x": 1}, {"x": 2}])
    assert s.get(["k2", "k1"]) == [{"x": 2}, {"x": 1}]
    s.done(["k1"])
    with pytest.raises(KeyError):
        s.get(["k1"])
