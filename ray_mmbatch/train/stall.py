"""No silent stall: a data iterator that gives up after ``timeout`` seconds without a row.

A stream whose actors cannot be placed waits forever in Ray (pending actors do not fail).
``guarded(rows, timeout, describe)`` pulls ``rows`` in a daemon thread through a small queue;
when no row arrives for ``timeout`` seconds it raises DataStalled with ``describe()``, by
default Ray's pending actors and their resource requests next to what the cluster has free
(``pending_demands``). The train loop wraps each epoch's rows with it (data.stall_timeout_s).
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

_END = object()


class DataStalled(RuntimeError):
    """No batch arrived within data.stall_timeout_s; str() says what Ray is waiting for."""


class Pump:
    """``rows`` pulled from now on in a daemon thread, at most ``ahead`` held until taken: the
    train loop starts its first epoch's stream this way before it builds the model, so the data
    pools start while the weights load. Iterating it yields the rows and raises what ``rows`` raised."""

    def __init__(self, rows: Iterable[Any], ahead: int = 2) -> None:
        self.q: queue.Queue = queue.Queue(maxsize=ahead)
        threading.Thread(target=self._run, args=(rows,), name="ray_mmbatch-rows", daemon=True).start()

    def _run(self, rows: Iterable[Any]) -> None:
        try:
            for row in rows:
                self.q.put((row, None))
            self.q.put((_END, None))
        except BaseException as e:  # handed to the consumer, raised there
            self.q.put((_END, e))

    def get(self, timeout: float | None = None) -> Any:
        """The next row, or _END; raises what the stream raised, queue.Empty after ``timeout``."""
        row, err = self.q.get(timeout=timeout)
        if err is not None:
            raise err
        return row

    def __iter__(self) -> Iterator[Any]:
        while (row := self.get()) is not _END:
            yield row


def guarded(rows: Iterable[Any], timeout: float, describe: Callable[[], str] | None = None) -> Iterator[Any]:
    """``rows`` (or a started Pump) as they come; DataStalled when one takes longer than ``timeout``
    seconds (0 = never)."""
    if not timeout or timeout <= 0:
        yield from rows
        return
    pump = rows if isinstance(rows, Pump) else Pump(rows)
    while True:
        try:
            row = pump.get(timeout=timeout)
        except queue.Empty:
            why = (describe or pending_demands)()
            raise DataStalled(
                f"no batch for {timeout:g} s (data.stall_timeout_s): the data stream makes no progress. {why} "
                "Give the preprocessing nodes more CPU slots, lower --preprocess-workers / --num-workers, or raise "
                "--set data.stall_timeout_s=N if the stream is just slow.") from None
        if row is _END:
            return
        yield row


def pending_demands(limit: int = 20) -> str:
    """Ray's pending actors with their resource requests, and the cluster's free resources."""
    import ray

    try:
        parts = [f"{name} needs {_fmt(need)}" for name, need in _pending_actors()[:limit]]
        waiting = "Ray is waiting to place: " + "; ".join(parts) + "." if parts else "No actor is pending."
    except Exception as e:  # the state API can be unavailable; say so rather than fail the message
        waiting = f"(Ray's pending actors unavailable: {type(e).__name__})"
    free = {k: v for k, v in ray.available_resources().items() if not k.startswith(("node:", "memory",
                                                                                  "object_store"))}
    return f"{waiting} Free now: {_fmt(free)}."


def _pending_actors() -> list[tuple[str, dict]]:
    """(class name, resources it asks for) of actors waiting for a place. Read from the GCS actor
    table (Ray's private state accessor, pyproject pins ray < 2.64), which works without the
    dashboard that ray.util.state needs (local runs start none); that API otherwise."""
    try:
        from ray._private.state import state
        from ray.core.generated import gcs_pb2

        table = state._connect_and_get_accessor().get_actor_table(None, "PENDING_CREATION")
        rows = [gcs_pb2.ActorTableData.FromString(t) for t in table]
        return [(r.class_name, dict(r.required_resources)) for r in rows]
    except (ImportError, AttributeError, TypeError):
        from ray.util.state import list_actors

        return [(a.class_name, dict(getattr(a, "required_resources", None) or {}))
                for a in list_actors(filters=[("state", "=", "PENDING_CREATION")], detail=True)]


def _fmt(res: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(res.items())) + "}"
