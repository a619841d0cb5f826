"""The run dir's append-only JSONL logs: read back, and written by the driver alone.

A process killed in the middle of an append (the fault the train loop is built to
survive) leaves a torn last line; that line is dropped, never a reason to fail a
restart or a summary. A bad line anywhere else is real corruption and raises.

``RunWriter`` is the only writer of those logs: the ranks send their records through Ray
(train/events.py) and the driver writes them under its own output dir, so a multi-node
run without shared storage still has its progress and summary on the driver's disk.
Pure module.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ray_mmbatch import schema as S


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every complete record of ``path``; [] if it does not exist."""
    p = Path(path)
    if not p.exists():
        return []
    lines = p.read_text().split("\n")
    torn = lines[-1]  # "" when the file ends with a newline, as every complete append does
    out = []
    for i, ln in enumerate(lines[:-1]):
        if ln:
            try:
                out.append(json.loads(ln))
            except ValueError as e:
                raise ValueError(f"{p}:{i + 1}: not JSON ({e})") from None
    if torn:
        try:
            out.append(json.loads(torn))
        except ValueError:
            pass  # cut off mid-write
    return out


def write_jsonl(path: str | Path, records: list[dict[str, Any]]) -> None:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))


class RunWriter:
    """The one writer of a run dir's logs: applies the events the ranks send (train/events.py).

    Events, in the order the driver receives them:
      ("append", name, record)  name: "metrics", "batches", "skipped" or "ledger/rank<r>"
      ("trim", step)            a restore to ``step``: records of later steps are undone
                                (all of them at step 0: a fresh run in an old dir);
                                skip records are kept past a restore (merged by sample id)
      ("stopped", record)       the skip guard stopped the run (guards.STOPPED_FILE)
    """

    FILES = {"metrics": S.RUN_METRICS, "batches": S.RUN_BATCHES, "skipped": S.RUN_SKIP_LOG}

    def __init__(self, out: str | Path, stopped_file: str):
        self.dir = Path(out)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stopped = self.dir / stopped_file

    def path(self, name: str) -> Path:
        return self.dir / (self.FILES.get(name) or f"{name}.jsonl")

    def _logs(self) -> list[Path]:
        ledger = self.dir / S.RUN_LEDGER
        return [self.path(n) for n in self.FILES] + (sorted(ledger.glob("rank*.jsonl")) if ledger.is_dir() else [])

    def apply(self, events: list[tuple]) -> None:
        handles: dict[str, Any] = {}
        try:
            for ev in events:
                if ev[0] == "append":
                    _, name, rec = ev
                    if name not in handles:
                        p = self.path(name)
                        p.parent.mkdir(parents=True, exist_ok=True)
                        handles[name] = open(p, "a")
                    handles[name].write(json.dumps(rec) + "\n")
                    continue
                for h in handles.values():
                    h.close()
                handles = {}
                if ev[0] == "trim":
                    self.trim(int(ev[1]))
                elif ev[0] == "stopped":
                    self.stopped.write_text(json.dumps(ev[1]))
                else:
                    raise ValueError(f"unknown run event {ev[0]!r}")
        finally:
            for h in handles.values():
                h.close()

    def trim(self, step: int) -> None:
        for p in self._logs():
            if step == 0:
                p.unlink(missing_ok=True)
            elif p.exists() and p != self.path("skipped"):
                write_jsonl(p, [r for r in read_jsonl(p) if r.get("step", 0) <= step])
