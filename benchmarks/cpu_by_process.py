"""CPU seconds per process of a command and all its descendants (Ray workers, raylet, GCS ...),
sampled from /proc every 0.5 s: where a Ray pass spends its CPU, robust to other load.

    python benchmarks/cpu_by_process.py OUT -- python RUN.py ARGS...
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def _table() -> tuple[dict[int, int], dict[int, tuple[str, float]]]:
    """(parent of each pid, (command line, utime + stime seconds) of each pid)."""
    parent, info = {}, {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            rest = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:160]
        except OSError:
            continue
        parent[int(pid)] = int(rest[1])
        info[int(pid)] = (cmd, (int(rest[11]) + int(rest[12])) / TICK)
    return parent, info


def run_tree(cmd: list[str], tick: float = 0.5, **popen_kwargs) -> tuple[subprocess.Popen, dict[str, float], str]:
    """Run ``cmd``; (its finished Popen, CPU seconds per process name over its whole tree, its stdout when
    ``stdout=subprocess.PIPE`` was passed). Processes that end between two ticks lose their last tick's CPU."""
    proc = subprocess.Popen(cmd, **popen_kwargs)
    seen: dict[int, tuple[str, float]] = {}
    chunks: list[str] = []
    while proc.poll() is None:
        parent, info = _table()
        tree, grew = {proc.pid}, True
        while grew:
            new = {p for p, pp in parent.items() if pp in tree and p not in tree}
            tree |= new
            grew = bool(new)
        for pid in tree & info.keys():
            name, t = info[pid]
            name = "driver" if pid == proc.pid else name.split(" --")[0].split("site-packages/")[-1]
            if t >= seen.get(pid, ("", -1.0))[1]:
                seen[pid] = (name, t)
        time.sleep(tick)
    if proc.stdout is not None:
        chunks.append(proc.stdout.read())
    totals: dict[str, float] = {}
    for name, t in seen.values():
        totals[name] = totals.get(name, 0.0) + t
    return proc, totals, "".join(chunks)


def main(out_path: str, cmd: list[str]) -> int:
    proc, totals, _ = run_tree(cmd)
    with open(out_path, "w") as f:
        print(f"{sum(totals.values()):8.1f}s  TOTAL", file=f)
        for name, t in sorted(totals.items(), key=lambda x: -x[1])[:25]:
            print(f"{t:8.1f}s  {name[:100]}", file=f)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[3:] if sys.argv[2] == "--" else sys.argv[2:]))
