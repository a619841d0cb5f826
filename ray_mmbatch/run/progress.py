"""What a run prints of its own: one progress line per training report, and the summary at the end.

``ProgressPrinter`` follows OUTPUT_DIR/metrics.jsonl (which the driver writes from what rank 0
sends through Ray, train/events.py) and prints one line per report, or redraws one line when
stdout is a terminal; ``format_summary`` is the end-of-run table. ``Progress`` is the meter of
the other long commands (inspect, prepare, verify-packing): done / total, rate and ETA. Pure (no Ray).
"""
from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from ray_mmbatch.run.rundir import RunDir, read_jsonl_from

T = TypeVar("T")


def _fmt_time(s: float | None) -> str:
    if s is None or s != s or s < 0:
        return "--:--"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m:02d}:{sec:02d}"


def _fmt_num(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def done_share(m: dict[str, Any], max_steps: int) -> float | None:
    """How much of the run a report says is done: steps over max_steps, else the share of the data."""
    if max_steps:
        return min(1.0, int(m.get("step", 0)) / max_steps)
    share = m.get("progress")
    return None if share is None else min(1.0, float(share))


def progress_line(m: dict[str, Any], max_steps: int, elapsed: float, eta: float | None = None) -> str:
    """One report as a line: step/total (or share of the data), loss (and the eval loss of a report that has
    one), lr, tokens/s, fill, data wait, memory, time.

    ``eta``: seconds left (default: the elapsed time scaled by the share done)."""
    step = int(m.get("step", 0))
    done = done_share(m, max_steps)
    if max_steps:
        where = f"step {step:>{len(str(max_steps))}}/{max_steps}"
    else:
        where = f"step {step}" + (f" ({100 * done:4.1f}% of data)" if done is not None else "")
    if eta is None and done:
        eta = elapsed * (1 - done) / done
    mem = float(m.get("peak_mem_mb", 0.0))
    mem_s = f"{mem / 1024:.1f} GB" if mem >= 1024 else f"{mem:.0f} MB"
    ev = f"  eval {float(m['eval_loss']):.3f}" if m.get("eval_loss") is not None else ""  # --eval-split / -data
    return (f"{where}  loss {float(m.get('loss', float('nan'))):.3f}{ev}  lr {float(m.get('lr', 0.0)):.2e}  "
            f"{_fmt_num(float(m.get('tokens_per_s', 0.0)))} tok/s  fill {100 * float(m.get('fill', 0.0)):.1f}%  "
            f"data wait {100 * min(1.0, float(m.get('data_wait_frac', 0.0))):.0f}%  mem {mem_s}  "
            f"{_fmt_time(elapsed)} elapsed, eta {_fmt_time(eta)}")


#: bytes before the read position kept to tell a rewritten file (a metrics line is ~0.5 kB: several lines)
_FINGERPRINT = 4096


def _key(record: dict) -> int:
    """A record's identity among the lines read: a hash, so a run of 100k steps keeps ints, not its lines."""
    return hash(json.dumps(record, sort_keys=True))


class ProgressPrinter:
    """Follow OUTPUT_DIR/metrics.jsonl in a thread and print each new report.

    A file (not the forwarded worker output) so the driver sees the reports whatever the
    log settings; on a terminal the line is redrawn in place, elsewhere one line each.
    """

    def __init__(self, metrics_path: str | Path, max_steps: int, stream=None, interval: float = 0.5):
        self.path, self.max_steps = Path(metrics_path), int(max_steps)
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval, self.t0 = interval, time.time()
        self._offset, self._tail, self._seen = 0, b"", []  # read position, the bytes before it, keys of lines read
        self._read(print_new=False)  # a resumed run's old lines: known, not printed
        self._first: tuple[float, float] | None = None  # (time, share done) at the first report: start-up excluded
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ray_mmbatch_progress", daemon=True)
        self.printed = 0

    def __enter__(self) -> ProgressPrinter:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll()
        if self.tty and self.printed:
            self.stream.write("\n")
            self.stream.flush()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception:  # a half-written line: read it next time
                pass

    def poll(self) -> None:
        self._read(print_new=True)

    def _read(self, print_new: bool) -> None:
        """Read the lines appended since the last poll. A restore rewrites the file without the steps it undid
        (RunDir.trim), and it may grow past our position again before we look: when the bytes that ended at
        our position are no longer there, read the file again and print what follows the lines already read."""
        if not self.path.exists():
            return
        if self._rewritten():
            records, end = read_jsonl_from(self.path, 0)
            keys = [_key(r) for r in records]
            same = 0
            while same < min(len(keys), len(self._seen)) and keys[same] == self._seen[same]:
                same += 1
            self._seen, records = self._seen[:same], records[same:]
        else:
            records, end = read_jsonl_from(self.path, self._offset)
        with open(self.path, "rb") as f:  # the bytes just before our new position: what _rewritten checks
            f.seek(max(0, end - _FINGERPRINT))
            self._tail = f.read(end - max(0, end - _FINGERPRINT))
        self._offset = end
        for m in records:
            self._seen.append(_key(m))
            if print_new:
                self._print(m)

    def _rewritten(self) -> bool:
        if not self._offset:
            return False
        if self.path.stat().st_size < self._offset:
            return True
        with open(self.path, "rb") as f:
            f.seek(self._offset - len(self._tail))
            return f.read(len(self._tail)) != self._tail

    def _print(self, m: dict) -> None:
        now, done = time.time(), done_share(m, self.max_steps)
        eta = None
        if done is not None:
            if self._first is None:  # no rate yet: the time so far is mostly start-up
                self._first, eta = (now, done), -1.0
            elif done > self._first[1]:
                eta = (now - self._first[0]) * (1 - done) / (done - self._first[1])
        self.show(progress_line(m, self.max_steps, now - self.t0, eta))

    def show(self, line: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.printed += 1


class Progress:
    """A meter for a long command: ``[inspect] 12.3k/665.0k samples (1.9%)  512 samples/s  00:24 elapsed, eta 21:15``.

    ``update(n)`` counts work done and prints when due: on a terminal the line is redrawn in place at
    most every ``redraw_s``; elsewhere (a log) one line every ``log_every_s``. ``tick()`` prints when
    due without counting (the heartbeat: used as a context manager, a thread ticks, so a command whose
    first result is minutes away still prints). ``total`` None (or passed): done and rate, no ETA.
    The rate runs from the first update (start-up, e.g. actors loading, left out) once a second one
    came, else from the start. Pure: the stream, the terminal test and the clock are injected.
    """

    def __init__(self, label: str, total: int | None = None, unit: str = "samples", stream=None,
                 tty: bool | None = None, log_every_s: float = 5.0, redraw_s: float = 0.25, clock=time.monotonic):
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else bool(tty)
        self.every = redraw_s if self.tty else log_every_s
        self.clock = clock
        self.t0 = self._last = clock()
        self.done = 0
        self._first: tuple[float, int] | None = None  # (time, done) at the first update
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.printed = 0

    def rate(self, now: float) -> float:
        if self._first is not None and self.done > self._first[1] and now > self._first[0]:
            return (self.done - self._first[1]) / (now - self._first[0])
        return self.done / (now - self.t0) if now > self.t0 else 0.0

    def line(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        if not self.done:  # nothing came yet: no rate to show (start-up: actors, tokenizer, first read)
            of = f"/{_fmt_num(self.total)}" if self.total else ""
            return f"[{self.label}] 0{of} {self.unit}, starting ({_fmt_time(now - self.t0)} elapsed)"
        rate = self.rate(now)
        total = self.total if self.total and self.done <= self.total else None  # a low guess: no ETA
        where = f"{_fmt_num(self.done)}/{_fmt_num(total)} {self.unit} ({100 * self.done / total:.1f}%)" \
            if total else f"{_fmt_num(self.done)} {self.unit}"
        eta = f", eta {_fmt_time((total - self.done) / rate if rate > 0 else None)}" if total else ""
        return (f"[{self.label}] {where}  {_fmt_num(rate) if rate >= 10 else f'{rate:.1f}'} {self.unit}/s  "
                f"{_fmt_time(now - self.t0)} elapsed{eta}")

    def update(self, n: int = 1) -> None:
        with self._lock:
            now = self.clock()
            self.done += int(n)
            if self._first is None:
                self._first = (now, self.done)
            self._show_if_due(now)

    def tick(self) -> None:
        with self._lock:
            self._show_if_due(self.clock())

    def _show_if_due(self, now: float) -> None:
        if now - self._last >= self.every:
            self._show(now)

    def _show(self, now: float) -> None:
        self._last = now
        text = self.line(now)
        self.stream.write("\r\033[K" + text if self.tty else text + "\n")
        self.stream.flush()
        self.printed += 1

    def close(self) -> None:
        """The last line (always), and the end of the redrawn one."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            self._show(self.clock())
            if self.tty:
                self.stream.write("\n")
                self.stream.flush()

    def __enter__(self) -> Progress:
        def beat() -> None:
            while not self._stop.wait(max(0.05, min(self.every, 1.0))):
                self.tick()

        self._thread = threading.Thread(target=beat, name="ray_mmbatch_meter", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def counted(items: Iterable[T], meter: Progress) -> Iterator[T]:
    """Yield ``items``, counting one on ``meter`` when the next is asked for: the work done with the one
    before is finished then (a consumer's loop body is what takes the time)."""
    for item in items:
        yield item
        meter.update(1)


def format_summary(summary: dict[str, Any], out_dir: str | Path) -> str:
    """The end of a run: a few figures and where its files are."""
    out = Path(out_dir)
    skipped = summary.get("skipped") or {}
    top = ", ".join(f"{k} {v}" for k, v in sorted(skipped.items(), key=lambda kv: -kv[1])[:4])
    rows = [
        ("steps", f"{summary.get('steps', 0)}"),
        ("samples", f"{summary.get('samples', 0):,} trained, {summary.get('skipped_total', 0):,} skipped"
                    + (f" ({top})" if top else "")),
        *([("files", f"{summary['skipped_files']:,} could not be read (unreadable_file in the skip report)")]
          if summary.get("skipped_files") else []),
        ("loss", f"{_f(summary.get('initial_loss'))} -> {_f(summary.get('final_loss'))}"),
        *([("eval loss", f"{_f(summary['eval_loss'])} (held out, {RunDir.EVAL})")]
          if summary.get("eval_loss") is not None else []),
        ("tokens", f"{summary.get('real_tokens', 0):,} real, fill {100 * float(summary.get('fill') or 0):.1f}%"),
        ("speed", f"{float(summary.get('tokens_per_s') or 0):,.0f} real tokens/s"),
        ("wall", _fmt_time(summary.get("wall_s"))),
        ("summary", str(out / RunDir.SUMMARY)),
        ("skip report", str(out / RunDir.SKIPPED)),
        ("metrics", str(out / RunDir.METRICS)),
    ]
    if summary.get("checkpoint"):
        rows.append(("checkpoint", str(summary["checkpoint"])))
    if (out / RunDir.EXPORT).exists():
        rows.append(("model", str(out / RunDir.EXPORT)))
    if (out / RunDir.ADAPTER).exists():  # a LoRA run: the PEFT adapter (PeftModel.from_pretrained(base, it))
        rows.append(("adapter", str(out / RunDir.ADAPTER)))
    rows.append(("report", f"ray-mmbatch report {out}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _f(x: Any) -> str:
    return "n/a" if x is None else f"{float(x):.3f}"
