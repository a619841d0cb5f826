"""One reference interpreter (.venv-ref: torchvision, torchcodec) for the whole test session.

HF's video processors need torchvision, which does not load beside this project's CPU torch, so the video
reference checks (tests/video_reference.py, tests/targets_reference.py's video case) run in a second
interpreter. Starting it costs ~10 s (torch + transformers imported twice: once before, once after
video_reference's re-exec onto PyAV's FFmpeg), about all of a reference call; started once per session
and asked for each reference instead, ~20 calls cost one start-up.

    run("tests.video_reference:main", spec, out)   # in the test process: the call, in the reference interpreter

Each call runs the named function with those string arguments, exactly as the script's ``__main__`` would
(the scripts stay runnable on their own); a call that raises fails the asking test with the reference's
traceback and the end of its log, and the interpreter stays up for the next call. A call that kills the
interpreter (or one past its timeout) fails the asking test and the next call starts a fresh one.

Child side (``<reference python> tests/reference_server.py``): JSON lines in on stdin, one JSON line out per
call on the original stdout; everything the called code prints goes to stderr (a log file of the parent's).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = os.environ.get("RAY_MMBATCH_REFERENCE_PYTHON", str(ROOT / ".venv-ref" / "bin" / "python"))

_server = None  # (Popen, log path) of the running reference interpreter, started on the first call


def reference_python() -> str:
    """The reference interpreter's path; skips the asking test where there is none (fails under
    RAY_MMBATCH_REQUIRE_REFERENCE=1, as .ci/run sets)."""
    import pytest

    if Path(REFERENCE).is_file():
        return REFERENCE
    if os.environ.get("RAY_MMBATCH_REQUIRE_REFERENCE") == "1":
        pytest.fail(f"the reference interpreter {REFERENCE} is missing: run scripts/setup.sh --reference")
    pytest.skip(f"no reference interpreter at {REFERENCE} (scripts/setup.sh --reference makes it)")
    raise AssertionError("unreachable")


def _log_tail(log: Path, n: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def stop(keep_log: bool = False) -> None:
    """End the reference interpreter (closing its stdin ends its loop), if one runs; its log is removed unless
    ``keep_log`` (a failure names it)."""
    global _server
    if _server is None:
        return
    proc, log = _server
    _server = None
    try:
        proc.stdin.close()
        proc.wait(timeout=30)
    except Exception:  # noqa: BLE001 - it is going away either way
        proc.kill()
        proc.wait()
    if not keep_log:
        log.unlink(missing_ok=True)


def run(call: str, *args: str, timeout: float = 600) -> None:
    """``call`` ("module:function") with ``args`` in the session's reference interpreter; AssertionError with the
    reference's traceback where it raised."""
    import atexit
    import select
    import subprocess
    import tempfile

    global _server
    python = reference_python()
    if _server is None or _server[0].poll() is not None:
        log = Path(tempfile.mkstemp(prefix="reference_server_", suffix=".log")[1])
        proc = subprocess.Popen([python, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=ROOT,  # noqa: SIM115
                                env=dict(os.environ, PYTHONPATH=str(ROOT)))
        if not _server:
            atexit.register(stop)
        _server = (proc, log)
    proc, log = _server
    try:
        proc.stdin.write(json.dumps({"call": call, "args": [str(a) for a in args]}) + "\n")
        proc.stdin.flush()
    except BrokenPipeError:
        stop(keep_log=True)
        raise AssertionError(f"the reference interpreter died before {call}:\n{_log_tail(log)}") from None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:  # ready with nothing to read: it closed its stdout (died); not ready: past the timeout
        proc.kill()
        stop(keep_log=True)
        raise AssertionError(f"{call}{tuple(args)}: the reference interpreter "
                             f"{'died' if ready else f'took over {timeout} s'} (log {log}):\n{_log_tail(log)}")
    got = json.loads(line)
    assert got["ok"], f"{call}{tuple(args)} failed in the reference interpreter:\n{got['error']}\n" \
                      f"its log ends:\n{_log_tail(log)}"


def _serve() -> None:
    import importlib
    import traceback

    from tests.video_reference import _with_pyav_ffmpeg

    _with_pyav_ffmpeg()  # re-executes this script once, with torchcodec on PyAV's FFmpeg
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the called code prints goes to the log, not into the answers
    sys.stdout = sys.stderr
    for line in sys.stdin:
        request = json.loads(line)
        try:
            module, _, name = request["call"].partition(":")
            getattr(importlib.import_module(module), name)(*request["args"])
            answer = {"ok": True}
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the asking test
            if isinstance(e, KeyboardInterrupt):
                raise
            answer = {"ok": False, "error": traceback.format_exc()}
        print(f"--- {request['call']} {request['args']}: {'ok' if answer['ok'] else 'failed'}", file=sys.stderr,
              flush=True)
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _serve()
