"""Ray's internal noise off the driver's console (``--verbose``: all of it).

``quiet_ray(verbose)`` (before and after ``ray.init``) keeps Ray's bookkeeping off the
driver's console while Ray's log files under ``/tmp/ray/session_*/logs`` keep everything:

- worker / actor lines forwarded to the driver (``log_to_driver``) pass a deny-list of
  Ray-internal chatter (placement-group cleaner polling, ``core_worker.cc`` notes about
  constructor arguments, Train's ``TrainingReport`` dumps, worker-group start-up, Ray
  Data execution plans, Ray's own deprecation warnings); anything not on the list, a
  user warning, an error or a traceback, still shows;
- the driver's ``ray`` loggers show WARNING and up (Ray Data's file log keeps DEBUG);
- Ray's deprecation warnings raised in the driver are ignored, and its scheduling UserWarnings
  (``RAY_USER_WARNINGS``, by message: a user's own UserWarning still shows);
- the driver's own stderr (fd 2, where Ray's C++ core prints, e.g. ``core_worker.cc`` and
  the token-authentication note) passes the same deny-list through a pipe.

``--verbose`` (``quiet_ray(True)``) changes nothing: Ray prints as it always does.
What a run prints of its own (progress lines, the summary) is run/progress.py.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

# Lines (of forwarded worker output) that are Ray's internal bookkeeping, not the user's run.
NOISE = re.compile("|".join((
    r"has constructor arguments in the object store",        # core_worker.cc, every actor pool
    r"Reporting training result \d+: ",                       # Train V2 dumps every report
    r"Checkpoint successfully created at",
    r"Requesting resources: ", r"Attempting to start training worker group", r"Started training worker group",
    r"^- \(ip=[^)]*\) world_rank=", r"Setting up process group for", r"Moving model to device",
    r"Starting execution of Dataset", r"Execution plan of Dataset", r"Dataset .* execution finished in",
    r"Progress bars disabled", r"Registered dataset logger", r"Full logs are in .*ray-data",
    r"falling back to serialize as pickled python objects",   # an image column of structs, read as objects
    r"Failed to query Ray Train Controller actor state",
    r"Token authentication is enabled for this Ray cluster",
    r"A new progress UI is available", r"PYTHON worker processes have been started on node",
    r"To visualize your results with TensorBoard",
    # Ray Data's own actors going away: at the end of a --max-steps run (ray.kill of the pools)
    # and while Ray restarts a lost one (it retries the task; a real failure fails the stream)
    r"Task MapWorker\(.*\)\.submit failed",
)))
# Ray-internal messages that Ray itself calls safe to ignore; the traceback after them goes too
NOISE_WITH_TRACEBACK = re.compile("|".join((
    r"Failed to send resource request for train-",            # Train V2 autoscaling coordinator, CPU busy
)))
TRACEBACK_LINE = re.compile(r"^(Traceback \(most recent call last\):|\s|[\w.]+(Error|Exception|Interrupt)\b)")
# Ray's UserWarnings about how it schedules, not about the user's run (message starts): e.g. an actor pool
# of min size 2 given a dataset of one block (inspect on a two-row set)
RAY_USER_WARNINGS = (r"The minimum number of concurrent actors for .* is set to \d+, but the operator only received",)
# Python warnings of these categories come with a message line or two and the source line
WARNING_HEADER = re.compile(r"\.py:\d+: ((Ray)?DeprecationWarning: |UserWarning: ("
                            + "|".join(RAY_USER_WARNINGS) + "))")
NOISY_ACTORS = ("PlacementGroupCleaner",)

_state: dict[str, Any] = {"verbose": True, "own_progress": False}


def is_noise(line: str) -> bool:
    return bool(NOISE.search(line))


def filter_lines(lines: list[str]) -> list[str]:
    """Drop Ray's internal lines; a deprecation warning goes with the lines that continue it
    (its message and the indented source line, at most three)."""
    out: list[str] = []
    skip_continuation, in_traceback = 0, False
    for line in lines:
        if in_traceback:
            if TRACEBACK_LINE.match(line) or not line.strip():
                in_traceback = line[:1].isspace() or not line.strip() or line.startswith("Traceback")
                continue  # the block ends with its exception line
            in_traceback = False
        if NOISE_WITH_TRACEBACK.search(line):
            in_traceback = True
            continue
        if skip_continuation:
            skip_continuation -= 1
            if line.startswith("  "):   # the source line ends a Python warning
                skip_continuation = 0
            continue
        if WARNING_HEADER.search(line):
            skip_continuation = 3
            continue
        if not is_noise(line):
            out.append(line)
    return out


def _wrap_handler(handler: Callable[[dict], None]) -> Callable[[dict], None]:
    def filtered(data: dict) -> None:
        if data.get("actor_name") in NOISY_ACTORS or any(a in str(data.get("actor_name", "")) for a in NOISY_ACTORS):
            return
        lines = filter_lines(list(data.get("lines", [])))
        if lines:
            handler({**data, "lines": lines})
    return filtered


def quiet_ray(verbose: bool = False, own_progress: bool = False) -> None:
    """Turn Ray's console noise off in this (driver) process (``after_connect`` again after ``ray.init``).

    ``own_progress``: this command prints its own progress line, so Ray Data's bars stay off.
    """
    _state["verbose"], _state["own_progress"] = verbose, own_progress
    if verbose:
        return
    os.environ.setdefault("RAY_MMBATCH_QUIET", "1")
    try:
        from ray.util.annotations import RayDeprecationWarning

        warnings.filterwarnings("ignore", category=RayDeprecationWarning)
    except ImportError:
        pass
    for message in RAY_USER_WARNINGS:  # raised in the driver (Ray Data's executor runs there)
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    for name in ("ray", "ray.train", "ray.tune", "ray.air"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Ray Data logs DEBUG to its file and INFO to the console: raise the console's bar only
    for h in logging.getLogger("ray.data").handlers:
        if not isinstance(h, logging.FileHandler) and type(h).__name__ != "SessionFileHandler":
            h.setLevel(logging.WARNING)
    _filter_stderr()
    try:  # private API: the driver's handler of forwarded worker output
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        with dispatcher._lock:
            dispatcher.handlers = [(n, h if getattr(h, "_rmb_filtered", False) else _mark(_wrap_handler(h)))
                                   for n, h in dispatcher.handlers]
    except Exception:  # moved in another Ray version: Ray prints as usual
        pass
    try:  # private API: messages the GCS pushes to the driver (raylet warnings) print through this
        from ray._private import worker as ray_worker

        if not getattr(ray_worker.print_to_stdstream, "_rmb_filtered", False):
            original = ray_worker.print_to_stdstream

            def print_filtered(data, ignore_prefix: bool) -> None:
                lines = filter_lines(list(data.get("lines", [])))
                if lines:
                    original({**data, "lines": lines}, ignore_prefix)

            ray_worker.print_to_stdstream = _mark(print_filtered)
    except Exception:
        pass


def _filter_stderr() -> None:
    """Send fd 2 through a pipe whose reader drops NOISE lines (C++ code writes there directly)."""
    if _state.get("stderr_pump") is not None:
        return
    try:
        sys.stderr.flush()
        original = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
    except (OSError, ValueError):  # no real fd 2 (an embedding host): leave it
        return

    def pump() -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(read_end, 65536)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            kept = filter_lines([ln.decode("utf-8", "replace") for ln in lines])
            if b"\r" in buf:  # a progress bar redraws without a newline: pass it on now
                kept_tail, buf = buf, b""
            else:
                kept_tail = b""
            data = "".join(k + "\n" for k in kept).encode() + kept_tail
            if data:
                os.write(original, data)
        if buf:
            os.write(original, buf)

    t = threading.Thread(target=pump, name="ray_mmbatch_stderr", daemon=True)
    t.start()
    _state["stderr_pump"] = t

    def restore() -> None:  # at exit: give fd 2 back, let the pump drain what is in the pipe
        try:
            sys.stderr.flush()
            os.dup2(original, 2)
        except (OSError, ValueError):
            return
        t.join(timeout=1.0)

    atexit.register(restore)


def after_connect() -> None:
    """Called by ``train.trainer.connect`` after ``ray.init``: filter the forwarded worker output
    it just set up. Nothing changes unless a command asked for quiet (library use is untouched)."""
    if _state["verbose"]:
        return
    quiet_ray(False, _state["own_progress"])
    if _state["own_progress"]:
        import ray

        ray.data.DataContext.get_current().enable_progress_bars = False


def _mark(fn):
    fn._rmb_filtered = True
    return fn
