"""How many data CPUs feed N accelerators: docs/cluster.md's rule as arithmetic, and its table.

::

    data CPUs  >=  HEADROOM x  accelerators x (samples/s one accelerator trains)  /  (samples/s one data CPU prepares)

``samples/s one data CPU prepares`` is what ``ray-mmbatch inspect --throughput`` measures on your
data (dataflow/throughput.py); an accelerator's samples/s is its real tokens/s (the progress
line's ``tok/s``) over the mean tokens per sample, which the same command prints. HEADROOM: Ray's
own processes and uneven batches; benchmarks/bench_sizing.py checks the rule against Ray runs
with 1 and 2 data CPUs (RESULTS.md "Sizing the data side"). Pure.
"""
from __future__ import annotations

import math
from typing import Any

HEADROOM = 1.3
TABLE_ACCELERATORS = (1, 8, 64)
TABLE_RATES = (10.0, 50.0, 200.0)  # samples/s one accelerator trains


def data_cpus(accelerators: int, samples_per_accelerator: float, samples_per_cpu: float,
              headroom: float = HEADROOM) -> float:
    """Data CPUs (fractional) that keep ``accelerators`` fed at ``samples_per_accelerator`` each."""
    if samples_per_cpu <= 0:
        raise ValueError(f"samples_per_cpu must be > 0, got {samples_per_cpu}")
    return headroom * accelerators * samples_per_accelerator / samples_per_cpu


def supplied(cpus: float, samples_per_cpu: float, headroom: float = HEADROOM) -> float:
    """Samples/s the rule counts on from ``cpus`` data CPUs (its inverse)."""
    return cpus * samples_per_cpu / headroom


def format_sizing(result: dict[str, Any], accelerators: int | None = None,
                  samples_per_accelerator: float | None = None, headroom: float = HEADROOM) -> str:
    """The command's answer: the measured figures, then the CPUs for the given accelerators (a table
    for 1/8/64 accelerators at a few rates when none are given)."""
    r = float(result["samples_per_cpu_s"])
    ms = result["cpu_ms_per_sample"]
    lines = [
        f"  samples       {result['samples']:,} read ({result['samples_ok']:,} usable, "
        f"{result['mean_tokens']:,.0f} tokens each on average), {result['path']}",
        f"  per data CPU  {r:,.1f} samples/s  ({1000 / r if r else 0:.2f} ms of CPU a sample; "
        f"{result['samples_per_wall_s']:,.1f} samples/s of wall time)",
        "  by stage      " + ", ".join(f"{s} {ms[s]:.2f}" for s in ("read", "measure", "plan", "materialize"))
        + f" ms of CPU a sample (the batch's decode on the Train worker {ms['decode']:.2f} ms, not counted)",
        f"  rule          data CPUs >= {headroom:g} x accelerators x samples/s each / {r:,.1f}  (docs/cluster.md)",
    ]
    if accelerators and samples_per_accelerator:
        need = data_cpus(accelerators, samples_per_accelerator, r, headroom)
        lines.append(f"  answer        {accelerators} accelerator(s) x {samples_per_accelerator:.1f} samples/s each "
                     f"-> {need:.2f} data CPUs, i.e. {max(1, math.ceil(need))}")
        return "\n".join(lines)
    lines.append("  data CPUs     " + "".join(f"{f'{x:g}/s each':>14}" for x in TABLE_RATES)
                 + "   (samples/s one accelerator trains: its tok/s / the mean tokens above)")
    for n in TABLE_ACCELERATORS:
        cells = "".join(f"{data_cpus(n, x, r, headroom):>14.1f}" for x in TABLE_RATES)
        lines.append(f"  {n:>3} accel.   {cells}")
    return "\n".join(lines)
