"""Does the data path grow with the cluster? Actors started and samples/s against the data node's CPU slots.

For each ``--data-cpus`` value, a fresh 3-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``: a head with no CPU slots, a data node offering that many
``preprocess`` slots, a 2-CPU train node) runs one epoch of ``pipeline.batch_dataset`` with
``--data-resource preprocess`` and auto pool sizes (pools.py), in a child process
(tests/multinode/pools_grow.py, the same script the multi-node test runs). Reported: the pool
sizes chosen (min-max), the most measure / materialize actors alive at once, samples/s.
(2 slots cannot hold 1 + 1 actors and the plan actor: the pre-flight stops such a run.)
On a 2-core machine the samples/s cannot grow with logical slots; the actor counts must.

    python benchmarks/bench_scaling.py [--data-cpus 3 4 8 12] [--samples 1200] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CHILD = ROOT / "tests" / "multinode" / "pools_grow.py"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-cpus", type=int, nargs="+", default=[3, 4, 8, 12])
    ap.add_argument("--samples", type=int, default=1200)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    from ray_mmbatch.synthetic.generate import generate_dataset

    data = os.path.join(tempfile.gettempdir(), f"ray_mmbatch_bench_scaling_{args.samples}")
    if not os.path.exists(os.path.join(data, "manifest.json")):
        generate_dataset(data, args.samples, "parquet", seed=1, shard_size=50, workers=1)
    rows = []
    for cpus in args.data_cpus:
        proc = subprocess.run([sys.executable, str(CHILD), data, str(cpus)], capture_output=True, text=True,
                              timeout=1200, cwd=ROOT)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            raise SystemExit(f"data node of {cpus} CPUs failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        out = json.loads(line[-1][len("RESULT "):])
        rows.append({"data_cpus": cpus, **out})
    print(f"{args.samples} samples (Parquet), pack, auto pools, data node with --data-resource preprocess")
    print(f"{'data CPUs':>9} {'measure':>8} {'materialize':>11} {'peak measure':>12} {'peak mat.':>9} "
          f"{'samples/s':>9} {'exactly once':>12}")
    for r in rows:
        s, p = r["sizes"], r["peak"]
        print(f"{r['data_cpus']:>9} {s['measure'][0]}-{s['measure'][1]:<6} {s['materialize'][0]}-"
              f"{s['materialize'][1]:<9} {p['measure']:>12} {p['materialize']:>9} "
              f"{r['samples'] / r['wall_s']:>9.1f} {str(r['samples'] == r['unique'] == args.samples):>12}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
