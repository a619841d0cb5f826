"""run/progress.Progress, the meter of inspect / prepare / verify-packing: its lines, ETA and log-mode rate."""
from __future__ import annotations

import io

from ray_mmbatch.run.progress import Progress, counted


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_log_mode_prints_a_line_every_interval_with_rate_and_eta():
    clock, out = Clock(), io.StringIO()
    meter = Progress("inspect", total=1000, stream=out, tty=False, log_every_s=5.0, clock=clock)
    assert meter.line() == "[inspect] 0/1000 samples, starting (00:00 elapsed)"
    for _ in range(12):  # 100 samples a second for 12 s, the first at 1 s (start-up)
        clock.t += 1.0
        meter.update(100)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # at 5 s and 10 s, not on every update
    # at 5 s: 500 done, the rate from the first update (at 1 s): 400 in 4 s
    assert lines[0] == "[inspect] 500/1000 samples (50.0%)  100 samples/s  00:05 elapsed, eta 00:05"
    meter.tick()  # nothing due
    clock.t += 5.0
    meter.tick()  # the heartbeat prints when due, without counting
    meter.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and lines[-1] == lines[-2]
    # 1200 of a total of 1000 (a low guess): done and rate, no share or ETA
    assert lines[-1] == "[inspect] 1200 samples  69 samples/s  00:17 elapsed"


def test_eta_from_the_rate_since_the_first_result_and_no_total():
    clock, out = Clock(), io.StringIO()
    meter = Progress("verify-packing", total=8, unit="batches", stream=out, tty=False, log_every_s=0, clock=clock)
    clock.t += 30.0  # start-up: the model loads
    meter.update(1)  # one result: the rate is all the time so far
    assert out.getvalue().splitlines()[-1].endswith("0.0 batches/s  00:30 elapsed, eta 03:30")
    clock.t += 4.0
    meter.update(2)  # two more in 4 s: 0.5/s, 5 left -> 10 s
    assert out.getvalue().splitlines()[-1] == \
        "[verify-packing] 3/8 batches (37.5%)  0.5 batches/s  00:34 elapsed, eta 00:10"
    bare = Progress("prepare", stream=io.StringIO(), tty=False, clock=clock)
    clock.t += 2.0
    bare.update(50_000)
    assert bare.line() == "[prepare] 50.0k samples  25.0k samples/s  00:02 elapsed"


def test_terminal_mode_redraws_one_line_and_ends_it():
    clock, out = Clock(), io.StringIO()
    meter = Progress("prepare", total=4, stream=out, tty=True, redraw_s=0.25, clock=clock)
    for _ in counted(range(4), meter):
        clock.t += 1.0
    meter.close()
    text = out.getvalue()
    assert text.count("\r\033[K") == 5 and text.count("\n") == 1 and text.endswith("eta 00:00\n")
    assert "[prepare] 4/4 samples (100.0%)" in text


def test_progress_after_a_restore_that_trims_and_regrows_the_metrics(tmp_path):
    """A restore rewrites metrics.jsonl without the steps it undid (RunDir.trim); when the file has grown past the
    follower's position again before it looks, the follower must neither read from mid-line (it crashed at exit
    with 'metrics.jsonl:1: not JSON') nor miss the redone steps."""
    import io
    import json

    from ray_mmbatch.run.progress import ProgressPrinter
    from ray_mmbatch.run.rundir import write_jsonl

    path = tmp_path / "metrics.jsonl"
    old = {"step": 1, "loss": 9.0}
    path.write_text(json.dumps(old) + "\n")  # an earlier run's line: known, not shown
    stream = io.StringIO()
    with ProgressPrinter(path, max_steps=6, stream=stream, interval=60) as p:
        lines = [{"step": s, "loss": 5.0 - s / 10, "time_s": 1.0} for s in (2, 3, 4)]
        with open(path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in lines))
        p.poll()
        # restored to step 2: steps 3-4 undone, then redone (other values) and step 5-6 run, before the next poll
        write_jsonl(path, [old, lines[0]])
        with open(path, "a") as f:
            for s in (3, 4, 5, 6):
                f.write(json.dumps({"step": s, "loss": 2.0 - s / 10, "time_s": 12.345678}) + "\n")
        p.poll()
    out = stream.getvalue().splitlines()
    steps = [int(line.split()[1].split("/")[0]) for line in out]
    assert steps == [2, 3, 4, 3, 4, 5, 6], out  # the redone 3 and 4 shown again, the old line never
    assert "loss 1.700" in out[3] and "loss 9" not in stream.getvalue()
