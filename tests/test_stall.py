"""No silent stall (train/stall.py): rows pass through, errors surface, and a stream that stops
yielding raises DataStalled naming what Ray cannot place."""
from __future__ import annotations

import time

import pytest

from ray_mmbatch.train.stall import DataStalled, guarded, pending_demands


def _slow(n: int, gap: float, then_hang: bool = False):
    for i in range(n):
        yield i
        time.sleep(gap)
    if then_hang:
        time.sleep(60)


def test_rows_and_errors_pass_through():
    assert list(guarded(_slow(5, 0.01), timeout=5)) == [0, 1, 2, 3, 4]
    assert list(guarded(iter(range(3)), timeout=0)) == [0, 1, 2]

    def broken():
        yield 1
        raise KeyError("unit 3")

    it = guarded(broken(), timeout=5)
    assert next(it) == 1
    with pytest.raises(KeyError, match="unit 3"):
        next(it)


def test_a_stream_that_stops_yielding_raises_with_the_reason():
    got, t0 = [], time.perf_counter()
    with pytest.raises(DataStalled, match=r"no batch for 0.5 s .*pending: X"):
        for row in guarded(_slow(2, 0.05, then_hang=True), timeout=0.5, describe=lambda: "pending: X"):
            got.append(row)
    assert got == [0, 1] and time.perf_counter() - t0 < 5


@pytest.mark.ray
def test_pending_demands_names_the_actor_ray_cannot_place(ray_cluster):
    import ray

    @ray.remote(num_cpus=0, resources={"no_such_node_kind": 1})
    class Unplaceable:
        pass

    a = Unplaceable.remote()
    try:
        deadline = time.time() + 30
        text = ""
        while time.time() < deadline and "Unplaceable" not in text:
            text = pending_demands()
            time.sleep(0.5)
        assert "Unplaceable needs {" in text and "no_such_node_kind: 1" in text, text
        assert "Free now: {" in text and "CPU:" in text
    finally:
        ray.kill(a)


def test_a_pump_pulls_before_it_is_iterated_and_hands_on_rows_and_errors():
    """The train loop starts its first epoch's stream before building the model (train/loop.py):
    the Pump must pull at once, hold at most ``ahead`` rows, and give every row then the error."""
    import time

    from ray_mmbatch.train.stall import Pump, guarded

    pulled = []

    def rows():
        for i in range(5):
            pulled.append(i)
            yield i
        raise ValueError("stream broke")

    pump = Pump(rows(), ahead=2)
    deadline = time.time() + 10
    while len(pulled) < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert pulled == [0, 1, 2]  # started without a consumer; two held, the third waits to be put
    got = []
    with pytest.raises(ValueError, match="stream broke"):
        for r in guarded(pump, timeout=30):
            got.append(r)
    assert got == [0, 1, 2, 3, 4]
    assert list(Pump(iter([7, 8]))) == [7, 8]
