"""The run's records travel to the driver through Ray, not through a shared disk.

Every rank used to append its own logs under OUTPUT_DIR (metrics, batches, skip records);
on a multi-node cluster without shared storage those files landed on the workers' local
disks and the driver, on the head, showed no progress and summed no skips. Now:

- each rank buffers its records (``RankEvents.append``) and sends them at every report
  (``flush``: one actor call, waited for, so whatever a checkpoint covers has reached the
  driver before the checkpoint is registered: a restore never loses a skip record);
- one small ``RunChannel`` actor (no CPU slot, on the head node: it lives as long as the
  cluster does, whatever node is preempted) queues them;
- the driver drains the queue twice a second (``follow``) into ``runlog.RunWriter``, the
  one writer of the run dir. ``run.progress.ProgressPrinter`` follows the metrics file it writes;
  the experiment trackers (``--report-to``, run/trackers.py) get the same events right after it.

Rank 0 sends a ``trim`` to the restored step (waited for) before any rank can send a
newer record: the first all-reduce of the step loop orders them.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import ray

from ray_mmbatch.run.rundir import RunWriter

HEAD_RESOURCE = "node:__internal_head__"


@ray.remote(num_cpus=0, max_concurrency=4)
class RunChannel:
    """A queue of run events, filled by the ranks and drained by the driver."""

    def __init__(self):
        self.events: list[tuple] = []
        self.lock = threading.Lock()

    def put(self, events: list[tuple]) -> int:
        with self.lock:
            self.events.extend(events)
            return len(self.events)

    def drain(self) -> list[tuple]:
        with self.lock:
            out, self.events = self.events, []
            return out


class RankEvents:
    """A rank's side: records buffered between reports, sent in one call at each flush."""

    def __init__(self, channel, rank: int, ledger: bool):
        self.channel, self.rank, self.ledger = channel, rank, ledger
        self.buffer: list[tuple] = []

    def append(self, name: str, rec: dict[str, Any]) -> None:
        if name == "metrics" and self.rank != 0:
            return
        if name == "ledger":
            if not self.ledger:
                return
            name = f"ledger/rank{self.rank}"
        self.buffer.append(("append", name, rec))

    def stopped(self, rec: dict[str, Any]) -> None:
        self.buffer.append(("stopped", rec))

    def trim(self, step: int) -> None:
        """Rank 0 at the start of every attempt: undo what the restored checkpoint does not cover."""
        if self.rank == 0:
            self.flush([("trim", int(step))])

    def flush(self, extra: list[tuple] | None = None) -> None:
        events, self.buffer = self.buffer + (extra or []), []
        if events and self.channel is not None:
            ray.get(self.channel.put.remote(events))


class follow:
    """Driver side, as a context manager: a channel on the head node, drained into the run dir.

    ``with follow(out) as channel:`` hands the actor to the Train workers;
    on exit the last events are written and the actor is let go.
    """

    def __init__(self, out, interval: float = 0.5,
                 on_error: Callable[[BaseException], None] | None = None, sink=None):
        self.writer = RunWriter(out)
        self.sink = sink  # run/trackers.TrackerSink (or None): fed the events the writer applies
        self.interval, self.on_error = interval, on_error
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ray_mmbatch_events", daemon=True)
        self.channel = None

    def __enter__(self):
        # the head: Ray's own resource marks it (a node id from the driver's IP is ambiguous
        # where several raylets share one address)
        head = {HEAD_RESOURCE: 0.001} if any(n.get("Alive") and HEAD_RESOURCE in n.get("Resources", {})
                                             for n in ray.nodes()) else {}
        # "DEFAULT": a Tune trial's placement group would otherwise capture it (and has no head slot)
        self.channel = RunChannel.options(resources=head, scheduling_strategy="DEFAULT").remote()
        self._thread.start()
        return self.channel

    def drain(self) -> None:
        events = ray.get(self.channel.drain.remote())
        self.writer.apply(events)
        if self.sink is not None:
            self.sink.apply(events)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.drain()
            except Exception as e:  # the run goes on; the final drain reports for good
                if self.on_error:
                    self.on_error(e)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        try:
            self.drain()
        finally:
            ray.kill(self.channel)
            if self.sink is not None:
                self.sink.close(failed=exc[0] is not None)
