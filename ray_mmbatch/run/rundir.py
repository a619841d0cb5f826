"""A run folder: every file name it holds (``RunDir``), the one JSONL reader, and the one writer.

Every file a run writes under ``--output-dir`` is named here and nowhere else::

    summary.json            final figures (train/trainer.py)
    metrics.jsonl           one record per report: step, loss, tokens_per_s, fill, ...
    batches.jsonl           one record per trained batch: step, rank, real / padded / target tokens
    skipped.jsonl           the skip records as the ranks sent them (a restore may repeat one)
    skipped.csv             sample_id, reason, detail of every skipped sample (deduplicated)
    ledger/rank<r>.jsonl    the sample ids of every trained batch (train.ledger, for tests)
    stopped.json            the skip guard stopped the run (guards.py)
    latest_checkpoint.json  rank 0's pointer to its newest checkpoint and data position
    eval.jsonl              the held-out loss of each evaluation (--eval-split / --eval-data)
    eval_ids.jsonl          the held-out sample ids (one record per rank; a resumed run adds them again)
    model/                  the trained model in its family's format (export)
    tensorboard/            TensorBoard event files (--report-to tensorboard, run/trackers.py)
    adapter/                a LoRA run's PEFT adapter (PeftModel.from_pretrained(base, adapter/))
    ray_storage/            Ray Train's checkpoints when no --storage is given
    report.html, report.json  `ray-mmbatch report`

A process killed in the middle of an append (the fault the train loop is built to
survive) leaves a torn last line; ``read_jsonl`` drops that line, never a reason to fail a
restart or a summary. A bad line anywhere else is real corruption and raises.

``RunWriter`` is the only writer of the JSONL logs: the ranks send their records through Ray
(train/events.py) and the driver writes them under its own output dir, so a multi-node run
without shared storage still has its progress and summary on the driver's disk. Pure module.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class RunDir:
    """The files of one run folder (names as class constants, paths from an instance)."""

    SUMMARY = "summary.json"
    METRICS = "metrics.jsonl"
    BATCHES = "batches.jsonl"
    SKIP_LOG = "skipped.jsonl"
    SKIPPED = "skipped.csv"
    LEDGER = "ledger"
    STOPPED = "stopped.json"
    LATEST = "latest_checkpoint.json"
    EXPORT = "model"
    ADAPTER = "adapter"  # a LoRA run's PEFT adapter (models/trainable.py)
    EVAL = "eval.jsonl"  # one record per evaluation: step, eval_loss, eval_samples, eval_target_tokens
    EVAL_IDS = "eval_ids.jsonl"  # the held-out sample ids, one record per rank
    RAY_STORAGE = "ray_storage"
    REPORT_HTML = "report.html"
    REPORT_JSON = "report.json"
    FAULT_DRILL = "fault_drill_done"
    TENSORBOARD = "tensorboard"

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def ledger(self, rank: int) -> Path:
        return self.path / self.LEDGER / f"rank{rank}.jsonl"


def read_jsonl(path: str | Path, required: tuple[str, ...] = (), warnings: list[str] | None = None,
               offset: int = 0) -> list[dict[str, Any]]:
    """Every complete record of ``path`` (from byte ``offset``); [] if it does not exist.

    A torn last line is dropped (noted in ``warnings`` when given); a bad line elsewhere, a line
    that is not an object, or one lacking a numeric ``required`` key raises naming its place."""
    return read_jsonl_from(path, offset, required, warnings)[0]


def read_jsonl_from(path: str | Path, offset: int = 0, required: tuple[str, ...] = (),
                    warnings: list[str] | None = None) -> tuple[list[dict[str, Any]], int]:
    """(records, the offset after the last complete line): a follower reads on from there."""
    p = Path(path)
    if not p.exists():
        if warnings is not None:
            warnings.append(f"{p.name} missing")
        return [], offset
    with open(p, "rb") as f:
        f.seek(offset)
        data = f.read()
    lines = data.split(b"\n")
    torn = lines[-1]  # b"" when the file ends with a newline, as every complete append does
    out = []
    for i, ln in enumerate(lines[:-1]):
        if ln.strip():
            out.append(_record(ln, f"{p}:{i + 1}", required))
    end = offset + len(data) - len(torn)
    if torn.strip():
        try:
            out.append(_record(torn, "", required))
            end += len(torn)
        except ValueError:  # cut off mid-write: a follower reads it whole next time
            if warnings is not None:
                warnings.append(f"{p.name}:{len(lines)} ignored (truncated last line)")
    return out, end


def _record(line: bytes, where: str, required: tuple[str, ...]) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in required if not isinstance(row.get(k), (int, float))]
    if missing:
        raise ValueError(f"{where}: missing or non-numeric {missing}")
    return row


def write_jsonl(path: str | Path, records: list[dict[str, Any]]) -> None:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))


class RunWriter:
    """The one writer of a run dir's logs: applies the events the ranks send (train/events.py).

    Events, in the order the driver receives them:
      ("append", name, record)  name: "metrics", "batches", "skipped" or "ledger/rank<r>"
      ("trim", step)            a restore to ``step``: records of later steps are undone
                                (all of them at step 0: a fresh run in an old dir);
                                skip records are kept past a restore (merged by sample id)
      ("stopped", record)       the skip guard stopped the run (RunDir.STOPPED)
    """

    FILES = {"metrics": RunDir.METRICS, "batches": RunDir.BATCHES, "skipped": RunDir.SKIP_LOG, "eval": RunDir.EVAL,
             "eval_ids": RunDir.EVAL_IDS}

    def __init__(self, out: str | Path):
        self.dir = Path(out)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stopped = self.dir / RunDir.STOPPED

    def path(self, name: str) -> Path:
        return self.dir / (self.FILES.get(name) or f"{name}.jsonl")

    def _logs(self) -> list[Path]:
        ledger = self.dir / RunDir.LEDGER
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
            elif p.exists() and p not in (self.path("skipped"), self.path("eval_ids")):
                write_jsonl(p, [r for r in read_jsonl(p) if r.get("step", 0) <= step])
