"""Experiment trackers (``--report-to tensorboard,wandb,mlflow``), fed by the driver alone.

Ray Train's documented pattern calls the tracker inside the train function on rank 0. Here
the driver already receives every rank's records through the RunChannel and is the only
writer of the run dir (train/events.py, ``RunWriter``); the trackers are a second reader of
those same events (``TrackerSink.apply``, called by ``follow`` right after the writer). That
is the single-writer equivalent of "rank 0 only": one process logs, what it logs is exactly
what ``metrics.jsonl`` holds, the workers need no tracker library or credentials, and a
worker-group restart does not open a second tracker run.

What each tracker gets:

- once, at start: the run config, flattened to ``section.field`` (W&B ``config``, MLflow
  params, TensorBoard hparams plus the whole config as text);
- at every report (one ``metrics`` record), keyed by its ``step``: every numeric field of the
  record (``loss``, ``eval_loss`` when present, ``lr``, ``tokens_per_s``, ``fill``,
  ``data_wait_frac``, ``peak_mem_mb``, ``step_time_s``, the ``total_*`` counters, ...) and
  the skip counts so far, ``skipped/<reason>`` and ``skipped_total`` (deduplicated by sample
  id, as skipped.csv counts them).

A restore (``("trim", step)``) undoes the records after ``step`` in the run dir; the steps
after it are then reported again, and each tracker takes them as it can:

- TensorBoard: a new event file starting with a SessionLog START at ``step + 1``
  (``SummaryWriter(purge_step=...)``): TensorBoard hides the old points after ``step`` and
  shows the new ones in their place (at step 0, a fresh run in an old dir, all older points);
- MLflow: a value logged again at a step is added to the metric's history (both kept); the
  charts draw both, the run's latest value is the new one; the tag
  ``ray_mmbatch.restored_to_step`` says where the restore went;
- W&B: its own ``_step`` must only grow, so the run's step is logged as the metric ``step``,
  the x axis of every other metric (``define_metric``): re-reported steps land at their step,
  beside the values the restore undid; the summary's ``restored_to_step`` says where it went.

Where they write: TensorBoard event files in ``OUTPUT_DIR/tensorboard``; W&B and MLflow where
their own environment variables point (``WANDB_DIR``, ``WANDB_MODE``, ``WANDB_PROJECT``,
``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``, ...). A run already active in this
process (``wandb.run``, ``mlflow.active_run()``) is logged into and left open.

The tracker libraries are optional (``pip install 'ray_mmbatch[trackers]'``) and imported
here only inside functions; ``check_trackers`` runs at start and names the ``pip install``.
A tracker call that fails later is reported once and the run goes on (metrics.jsonl has it all).
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ray_mmbatch.run.rundir import RunDir

#: tracker -> (modules tried in order: the first importable one is used, the pip install to run)
TRACKERS: dict[str, tuple[tuple[str, ...], str]] = {
    # torch's writer needs the tensorboard package; tensorboardX (ray[tune] depends on it) writes the same files
    "tensorboard": (("torch.utils.tensorboard", "tensorboardX"), "pip install tensorboard"),
    "wandb": (("wandb",), "pip install wandb"),
    "mlflow": (("mlflow",), "pip install mlflow-skinny"),
}


class TrackerError(RuntimeError):
    """A tracker asked for is unknown or not installed; str() is the line to print."""


def tracker_names(report_to: Any) -> tuple[str, ...]:
    """``train.report_to`` as names: a tuple / list or 'a,b'; '' / 'none' = none."""
    items = report_to.split(",") if isinstance(report_to, str) else list(report_to or ())
    names = [str(n).strip().lower() for n in items]
    return tuple(dict.fromkeys(n for n in names if n and n != "none"))


def import_tracker(name: str):
    """The module a tracker logs with; TrackerError with the ``pip install`` when none imports."""
    if name not in TRACKERS:
        raise TrackerError(f"--report-to {name}: unknown tracker; choose from {', '.join(TRACKERS)}")
    modules, pip = TRACKERS[name]
    errors = []
    for module in modules:
        try:
            return importlib.import_module(module)
        except ImportError as e:
            errors.append(f"{module}: {e}")
    raise TrackerError(f"--report-to {name}: not installed ({'; '.join(errors)}). Install it with: {pip}   "
                       f"(or all three: pip install 'ray_mmbatch[trackers]')")


def check_trackers(report_to: Any) -> tuple[str, ...]:
    """At start, before any Ray work: every tracker asked for imports (and MLflow's tracking store
    opens: a ``file:`` store MLflow 3 refuses, a server that does not answer); returns their names."""
    names = tracker_names(report_to)
    for name in names:
        module = import_tracker(name)
        if name == "mlflow":
            try:
                module.MlflowClient().search_experiments(max_results=1)
            except Exception as e:
                text = str(e).strip().splitlines()
                raise TrackerError(f"--report-to mlflow: the tracking store {module.get_tracking_uri()!r} "
                                   f"(MLFLOW_TRACKING_URI) does not open: {type(e).__name__}: "
                                   f"{text[0] if text else ''}") from None
    return names


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """{"train.lr": 0.003, ...}: a nested config as ``section.field`` keys."""
    return {f"{s}.{k}": v for s, sub in config.items() for k, v in (sub or {}).items()}


def report_values(rec: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a metrics record but its step (flags, None and text left out)."""
    return {k: float(v) for k, v in rec.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardTracker:
    """Event files in OUTPUT_DIR/tensorboard; a restore starts a new file that purges what it undid."""

    def __init__(self, out: Path, config: dict[str, Any], run_name: str):
        self.module = import_tracker("tensorboard")
        self.dir = Path(out) / RunDir.TENSORBOARD
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config, self.writer, self.files = config, None, 0

    def _open(self, purge_step: int | None) -> None:
        if self.writer is not None:
            self.writer.close()
        self.files += 1
        # a suffix: tensorboardX names files by the second only, and two writers may share one
        self.writer = self.module.SummaryWriter(str(self.dir), purge_step=purge_step,
                                                filename_suffix=f".{self.files:04d}")
        if self.files == 1:
            self._config()

    def _config(self) -> None:
        summary = importlib.import_module(self.module.__name__ + ".summary")  # hparams() of the writer's library
        params = {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v)
                  for k, v in flat_config(self.config).items()}
        writer = self.writer._get_file_writer()
        for part in summary.hparams(params, {"loss": 0.0}):  # the metric is the run's loss scalar
            writer.add_summary(part)
        self.writer.add_text("config", "```\n" + json.dumps(self.config, indent=2, default=str) + "\n```", 0)

    def restore(self, step: int) -> None:
        self._open(step + 1 if step else 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            self._open(None)
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self, failed: bool) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbTracker:
    """A W&B run (WANDB_* variables), its x axis the run's step."""

    def __init__(self, out: Path, config: dict[str, Any], run_name: str):
        wandb = import_tracker("wandb")
        self.own = wandb.run is None
        if self.own:
            self.run = wandb.init(
                project=None if os.environ.get("WANDB_PROJECT") else "ray_mmbatch",
                name=None if os.environ.get("WANDB_NAME") else run_name, config=config,
                # read now: wandb keeps the first run's settings in the process (a notebook's second run)
                dir=os.environ.get("WANDB_DIR") or None, mode=os.environ.get("WANDB_MODE") or None,
                settings=wandb.Settings(console="off"))  # the driver's console stays as it is
        else:
            self.run = wandb.run
            self.run.config.update(config, allow_val_change=True)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def restore(self, step: int) -> None:
        if step:
            self.run.summary["restored_to_step"] = step

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def flush(self) -> None:
        pass

    def close(self, failed: bool) -> None:
        if self.own:
            self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    """An MLflow run (MLFLOW_* variables); params = the flattened config."""

    MAX_PARAM = 6000  # characters of a param value MLflow stores
    BATCH = 100  # params per log_batch call MLflow accepts

    def __init__(self, out: Path, config: dict[str, Any], run_name: str):
        self.mlflow = mlflow = import_tracker("mlflow")
        from mlflow.entities import Param

        active = mlflow.active_run()
        self.own = active is None
        run = active or mlflow.start_run(run_name=run_name)
        self.run_id = run.info.run_id
        self.client = mlflow.MlflowClient()
        params = [Param(k, (v if isinstance(v, str) else json.dumps(v))[:self.MAX_PARAM])
                  for k, v in flat_config(config).items()]
        for i in range(0, len(params), self.BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + self.BATCH])

    def restore(self, step: int) -> None:
        if step:
            self.client.set_tag(self.run_id, "ray_mmbatch.restored_to_step", str(step))

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def flush(self) -> None:
        pass

    def close(self, failed: bool) -> None:
        if self.own:
            status = "FAILED" if failed else "FINISHED"
            active = self.mlflow.active_run()
            if active is not None and active.info.run_id == self.run_id:
                self.mlflow.end_run(status)
            else:  # started in another thread: end it by id
                self.client.set_terminated(self.run_id, status)


OPENERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


class TrackerSink:
    """The run's events (train/events.py's tuples) to every tracker asked for.

    ``apply(events)`` takes what ``RunWriter.apply`` takes, in the same order; ``close(failed)``
    ends the runs this sink started."""

    def __init__(self, names: tuple[str, ...], out: str | Path, config: dict[str, Any], run_name: str):
        self.trackers: dict[str, Any] = {}
        for name in names:
            try:
                self.trackers[name] = OPENERS[name](Path(out), config, run_name)
            except BaseException as e:
                self.close(failed=True)
                if not isinstance(e, Exception) or isinstance(e, TrackerError):
                    raise
                text = str(e).strip().splitlines()
                raise TrackerError(f"--report-to {name}: does not start: {type(e).__name__}: "
                                   f"{text[0] if text else ''}") from e
        self.skipped: dict[str, str] = {}  # sample id -> reason (a restore may send one again)
        self.failures: dict[str, int] = {}

    def apply(self, events: list[tuple]) -> None:
        for ev in events:
            if ev[0] == "append" and ev[1] == "skipped":
                self.skipped[str(ev[2].get("sample_id"))] = str(ev[2].get("reason"))
            elif ev[0] == "append" and ev[1] == "metrics":
                values = {**report_values(ev[2]), **self.skip_counts()}
                self._each("log", int(ev[2].get("step", 0)), values)
            elif ev[0] == "trim":
                self._each("restore", int(ev[1]))
        if events:
            self._each("flush")

    def skip_counts(self) -> dict[str, float]:
        counts: dict[str, float] = {}
        for reason in self.skipped.values():
            counts[f"skipped/{reason}"] = counts.get(f"skipped/{reason}", 0.0) + 1
        return {**counts, "skipped_total": float(len(self.skipped))}

    def _each(self, method: str, *args) -> None:
        for name, tracker in self.trackers.items():
            try:
                getattr(tracker, method)(*args)
            except Exception as e:  # a tracker's outage never stops training
                self.failures[name] = self.failures.get(name, 0) + 1
                if self.failures[name] == 1:
                    print(f"[ray_mmbatch] {name}: {method} failed ({type(e).__name__}: {e}); the run goes on, "
                          f"metrics.jsonl keeps every record", file=sys.stderr, flush=True)

    def close(self, failed: bool = False) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.close(failed)
            except Exception as e:
                print(f"[ray_mmbatch] {name}: close failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        for name, n in getattr(self, "failures", {}).items():
            print(f"[ray_mmbatch] {name}: {n} tracker call(s) failed in this run", file=sys.stderr, flush=True)
        self.trackers = {}


def open_trackers(cfg, out: str | Path, run_name: str = "") -> TrackerSink | None:
    """The sink for ``cfg.train.report_to`` (None when it names none), its config logged."""
    names = check_trackers(cfg.train.report_to)
    if not names:
        return None
    return TrackerSink(names, out, cfg.to_dict(), run_name or cfg.train.run_name or Path(out).name)
