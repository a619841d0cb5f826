"""Does `inspect --throughput` predict what Ray delivers with 1 and 2 data CPUs (within 25 %)?

1. ``dataflow.throughput.measure_throughput``: samples per CPU second through read -> measure ->
   plan -> materialize in this process (the command's figure, r);
2. the real training data path, ``pipeline.batch_dataset`` iterated as bench_ingest's
   ``run_ray_train`` does (its helpers, not a copy), with C = 1 and 2 data CPUs: a fresh local
   cluster whose every process (GCS, raylet, actors, this driver) is pinned to C cores
   (``sched_setaffinity`` before ``ray.init``: children inherit it), both pools pinned at C actors
   (``data.preprocess_workers``), ``num_cpus`` 2C+1 logical slots so the pools, the plan actor and
   the payload holder are all placed;
3. predicted = C x r / 1.3 (docs/cluster.md's rule, run/sizing.supplied) against the measured
   samples/s: steady (after the first batch; start-up is Ray's and the tokenizer's, not per sample)
   and over the whole run. The machine is shared: other processes on the pinned cores take CPU the
   data side would have had, so the CPU left to this run is measured too (the cores' busy time from
   /proc/stat less this process tree's own CPU time, sampled with psutil) and the prediction is
   also given for that many CPUs ("load-adjusted").

Window and shuffle buffer are small (--window, --shuffle-buffer) so batches stream from the start on
a few thousand samples; both sides use them.

    python benchmarks/bench_sizing.py [--samples 3000] [--cpus 1 2] [--json PATH]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ingest import _steady, run_ray_train  # noqa: E402

from ray_mmbatch.config import Config  # noqa: E402
from ray_mmbatch.dataflow.throughput import measure_throughput  # noqa: E402
from ray_mmbatch.run.sizing import HEADROOM, supplied  # noqa: E402


def _busy(cores: list[int]) -> float:
    """Busy CPU seconds of ``cores`` since boot (/proc/stat: all but idle and iowait)."""
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *vals = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
                v = [int(x) for x in vals]
                busy += sum(v) - v[3] - v[4]
    return busy / tick


class CpuLeft:
    """CPU the pinned cores had for this process tree: C - (the cores' busy time - ours) / wall."""

    def __init__(self, cores: list[int]):
        import psutil

        self.cores, self.me = cores, psutil.Process()
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()

    def _sample(self) -> None:
        import psutil

        for p in [self.me, *self.me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                self.seen[p.pid] = max(self.seen.get(p.pid, 0.0), t.user + t.system)
            except psutil.Error:
                pass

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            self._sample()

    def __enter__(self) -> CpuLeft:
        self._sample()
        self.start = dict(self.seen)
        self.t0, self.b0 = time.perf_counter(), _busy(self.cores)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.wall = time.perf_counter() - self.t0
        busy = _busy(self.cores) - self.b0
        self.ours = sum(t - self.start.get(pid, 0.0) for pid, t in self.seen.items())
        self.others = max(0.0, busy - self.ours)
        self.left = max(0.05, len(self.cores) - self.others / self.wall)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="Parquet dataset folder (default: generate --samples under a temp dir)")
    p.add_argument("--samples", type=int, default=3000)
    p.add_argument("--sizing-samples", type=int, default=2000, help="samples the in-process measurement takes")
    p.add_argument("--cpus", type=int, nargs="+", default=[1, 2], help="data CPUs of the Ray runs")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--shuffle-buffer", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    if max(args.cpus) > len(cores):
        raise SystemExit(f"--cpus {max(args.cpus)} > the {len(cores)} cores this process may use")
    from common import data_or_generated

    data, tmp = data_or_generated(args.data, args.samples, args.seed, "bench_sizing_")
    cfg = Config()
    cfg.data.path, cfg.data.format = data, "parquet"
    cfg.budget.window, cfg.data.shuffle_buffer = args.window, args.shuffle_buffer
    tp = measure_throughput(cfg, args.sizing_samples)
    r = tp["samples_per_cpu_s"]
    print(f"inspect --throughput: {r:.1f} samples/s per data CPU ({tp['samples']} samples, {tp['cpu_s']:.1f} s CPU, "
          f"{tp['wall_s']:.1f} s wall); stages ms/sample "
          + ", ".join(f"{k} {v:.2f}" for k, v in tp["cpu_ms_per_sample"].items()), flush=True)
    print(f"{'CPUs':>4}{'predicted':>11}{'steady':>9}{'error':>8}{'whole':>9}{'1st s':>7}{'CPU left':>10}"
          f"{'adj. pred.':>12}{'adj. err':>10}{'load 1m':>9}")
    rows = []
    for c in args.cpus:
        run_cfg = copy.deepcopy(cfg)
        run_cfg.data.preprocess_workers = c
        os.sched_setaffinity(0, cores[:c])
        try:
            with CpuLeft(cores[:c]) as left:
                x = run_ray_train(run_cfg, 2 * c + 1)
        finally:
            os.sched_setaffinity(0, cores)
        n = x["samples"] + x["skipped"]
        steady, whole = _steady(x) * n / max(1, x["samples"]), n / x["wall_s"]
        pred, adj = supplied(c, r), supplied(left.left, r)
        row = {"cpus": c, "predicted": pred, "steady": steady, "whole": whole, "first_s": x["first_s"],
               "error": steady / pred - 1, "cpu_left": left.left, "ours_cpu_s": left.ours,
               "others_cpu_s": left.others, "adjusted_predicted": adj, "adjusted_error": steady / adj - 1,
               "load1": os.getloadavg()[0], "run": x}
        rows.append(row)
        print(f"{c:>4}{pred:>11.1f}{steady:>9.1f}{100 * row['error']:>7.0f}%{whole:>9.1f}{x['first_s'] or 0:>7.1f}"
              f"{left.left:>10.2f}{adj:>12.1f}{100 * row['adjusted_error']:>9.0f}%{row['load1']:>9.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "headroom": HEADROOM, "throughput": tp,
                                               "runs": rows}, indent=1, default=str))
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
