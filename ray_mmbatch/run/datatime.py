"""summary.json ``data_time``: where a run's data time went, and whether to add data CPUs.

Each BATCH row carries the wall seconds its samples (skipped ones included) spent in read,
measure, plan and materialize, and when it was produced (dataflow/timing.py). The train loop
adds up, per rank, every row it takes (``DataClock``) and its own step clocks; each report
all-reduces them into the run's totals (kept in the checkpoint, so a resumed run counts on).
``summarize`` turns the totals into summary.json's ``data_time``::

    read_s .. materialize_s  data-side wall seconds, summed over the data workers
    data_s                   their sum: what the data CPU slots were held for
    transfer_s               produced (end of materialize) -> decoded on a Train worker, on the step's
                             path: from when the loop asked for the batch if it was ready before (time a
                             ready batch sat in Ray's queue is not a cost), summed over batches
    wait_s, step_s           the steps' wait for their batches and their wall seconds, all ranks
    wait_share               wait_s / step_s (the metrics' data_wait_frac over the whole run)
    first_batch_s            mean wait for the first batch of a stream (per rank, epoch and restart)
    steady_wait_share        wait_share without those first steps (pool start-up left out)
    data_cpus                CPU slots the pools may hold (pools.py: measure + materialize at their
                             max + the plan actor); busy_data_cpus = data_s / the training wall seconds
    samples_per_data_cpu_s   samples trained / data_s
    verdict                  the one line the report prints: fed, or ~N more data CPUs (run/sizing.py)

Pure: no ray, no torch.
"""
from __future__ import annotations

import math
from typing import Any

from ray_mmbatch.dataflow.timing import STAGES, unpack

#: What the loop sums per rank (DataClock.take's order) and each report all-reduces.
CLOCKS = STAGES + ("transfer_s", "batches", "wait_s", "step_s", "first_wait_s", "first_step_s", "first_steps")
#: Below this share of step time spent waiting (steady state), the accelerators count as fed.
FED_SHARE = 0.05


class DataClock:
    """One rank's sums between two reports: the rows' stage seconds and the steps' clocks."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys(CLOCKS, 0.0)

    def row(self, cell, asked_at: float | None = None, decoded_at: float | None = None) -> None:
        """A BATCH row's data_time cell; ``asked_at`` / ``decoded_at`` (time.time()): when the loop asked
        for the row and when its batch was decoded (None for a row that is not decoded)."""
        stages, produced_at = unpack(cell)
        for k, v in stages.items():
            self.sums[k] += v
        self.sums["batches"] += 1.0
        if decoded_at is not None and produced_at is not None:  # clocks of two nodes may differ a little
            self.sums["transfer_s"] += max(0.0, decoded_at - max(produced_at, asked_at or produced_at))

    def step(self, wait_s: float, step_s: float, first: bool) -> None:
        """One step: its wait for data and its wall seconds; ``first``: the stream's first step."""
        self.sums["wait_s"] += wait_s
        self.sums["step_s"] += step_s
        if first:
            self.sums["first_wait_s"] += wait_s
            self.sums["first_step_s"] += step_s
            self.sums["first_steps"] += 1.0

    def take(self) -> list[float]:
        """The sums in CLOCKS order (to all-reduce), and start again."""
        out = [self.sums[k] for k in CLOCKS]
        self.sums = dict.fromkeys(CLOCKS, 0.0)
        return out


def add(totals: dict[str, float] | None, reduced: list[float]) -> dict[str, float]:
    """The run's totals + one report's all-reduced ``DataClock.take`` values."""
    out = dict(totals or {})
    for k, v in zip(CLOCKS, reduced):
        out[k] = out.get(k, 0.0) + float(v)
    return out


def summarize(totals: dict[str, float] | None, samples: int, train_s: float, data_cpus: float,
              ranks: int) -> dict[str, Any]:
    """summary.json ``data_time`` from the loop's totals (see the module header); {} without any."""
    t = {k: float((totals or {}).get(k, 0.0)) for k in CLOCKS}
    if not t["batches"] and not t["step_s"]:
        return {}
    data_s = sum(t[k] for k in STAGES)
    steady_step = t["step_s"] - t["first_step_s"]
    out: dict[str, Any] = {k: round(t[k], 3) for k in STAGES + ("transfer_s", "wait_s", "step_s")}
    out.update({
        "data_s": round(data_s, 3),
        "batches": int(t["batches"]),
        "wait_share": round(t["wait_s"] / t["step_s"], 4) if t["step_s"] > 0 else 0.0,
        "first_batch_s": round(t["first_wait_s"] / t["first_steps"], 3) if t["first_steps"] else None,
        "steady_wait_share": round((t["wait_s"] - t["first_wait_s"]) / steady_step, 4) if steady_step > 0 else None,
        "data_cpus": round(float(data_cpus), 2),
        "busy_data_cpus": round(data_s / train_s, 2) if train_s > 0 else None,
        "samples_per_data_cpu_s": round(samples / data_s, 2) if data_s > 0 else None,
        # samples/s one Train worker trains when not waiting (its compute rate): what the data must supply
        "samples_per_worker_s": round(samples / (t["step_s"] - t["wait_s"]), 2) if t["step_s"] > t["wait_s"] else None,
        "ranks": int(ranks),
    })
    out["verdict"] = verdict(out)
    return out


def verdict(dt: dict[str, Any]) -> str:
    """One line: are the accelerators fed, or how many more data CPUs would feed them (run/sizing.py's rule)."""
    from ray_mmbatch.run.sizing import HEADROOM, data_cpus

    steady = dt.get("steady_wait_share")
    share = float(steady if steady is not None else dt.get("wait_share", 0.0))
    where = "" if steady is None else f" after the first batch ({dt['first_batch_s']:.1f} s)"
    if share < FED_SHARE:
        return f"data wait {share:.0%} of step time{where}: the accelerators are fed"
    head = f"data wait {share:.0%} of step time{where}: the data side is the bottleneck"
    per_cpu, per_worker = dt.get("samples_per_data_cpu_s"), dt.get("samples_per_worker_s")
    if not per_cpu or not per_worker:
        return head
    need = data_cpus(int(dt.get("ranks") or 1), per_worker, per_cpu)
    have = float(dt.get("data_cpus") or 0.0)
    if need > have:
        return (f"{head}; ~{math.ceil(need - have)} more data CPUs ({need:.1f} in all, {HEADROOM:g}x headroom, "
                f"at {per_cpu:,.1f} samples/s each) would feed {dt.get('ranks', 1)} worker(s) at "
                f"{per_worker:,.1f} samples/s each")
    return (f"{head}, yet its {have:g} data CPUs should supply it ({need:.1f} needed at {per_cpu:,.1f} samples/s "
            f"each; {dt.get('busy_data_cpus')} busy on average): the pools are not kept busy (start-up, "
            f"--preprocess-workers, or CPU slots shared with other work)")


def table(dt: dict[str, Any]) -> list[tuple[str, str]]:
    """The report's rows for ``data_time``: (label, text), the stages first, the verdict last."""
    if not dt:
        return []
    data_s = float(dt.get("data_s") or 0.0)
    rows = [(f"data: {k[:-2]}", f"{float(dt.get(k, 0.0)):,.2f} s ({float(dt.get(k, 0.0)) / data_s:.0%})"
             if data_s else f"{float(dt.get(k, 0.0)):,.2f} s") for k in STAGES]
    rows += [
        ("data: all stages", f"{data_s:,.2f} s over {dt.get('batches', 0):,} batches"),
        ("data: produced -> decoded on Train", f"{float(dt.get('transfer_s', 0.0)):,.2f} s (on the step's path)"),
        ("data: step waited", f"{float(dt.get('wait_s', 0.0)):,.2f} s of {float(dt.get('step_s', 0.0)):,.2f} s "
                              f"({float(dt.get('wait_share', 0.0)):.0%}"
                              + (f"; {dt['steady_wait_share']:.0%} after the first batch)"
                                 if dt.get("steady_wait_share") is not None else ")")),
        ("data: first batch", "" if dt.get("first_batch_s") is None else f"{dt['first_batch_s']:.2f} s"),
        ("data CPUs", f"{dt.get('data_cpus')} slots, {dt.get('busy_data_cpus')} busy on average"),
        ("samples/s per data CPU", "" if dt.get("samples_per_data_cpu_s") is None
         else f"{dt['samples_per_data_cpu_s']:,.1f}"),
        ("data verdict", str(dt.get("verdict", ""))),
    ]
    return rows
