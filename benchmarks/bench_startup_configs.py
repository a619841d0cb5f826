"""Start-up on a FineVision-shaped root: how long until the first training step, and the driver's memory?

Question (issue 33): a dataset of many configs (FineVision ships 185, each its own folder of
``train-NNNNN-of-NNNNN.parquet`` with Cauldron ``texts``, an ``images`` list of HF Image structs, a
``source`` column and ``*_min`` rating columns) must start in under 60 s here, read as one source per
config, and blend by weight as any sources do. This script writes such a root (``--configs`` folders of
``--rows`` rows, small real JPEGs; nothing is committed) and times the real CLI:

    jobs/train.py --data ROOT --max-steps 1                 (each config a source, each sample once)
    jobs/train.py --config blend.yaml --max-steps 1         (data.sources: every config with a weight)

reporting the wall time to the end of step 1 (from the command's start to the first metrics.jsonl
record, which is written at step 1), the whole command's wall time and the driver's peak RSS
(/usr/bin/time -v, or getrusage of the child). Figures go to benchmarks/RESULTS.md with this command:

    python benchmarks/bench_startup_configs.py --configs 185 --rows 300
"""
from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
TEXTS = pa.list_(pa.struct([("user", pa.string()), ("assistant", pa.string())]))


def _jpegs(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        w, h = int(rng.integers(48, 160)), int(rng.integers(48, 160))
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=70)
        out.append(buf.getvalue())
    return out


def write_root(root: Path, configs: int, rows: int, seed: int = 0) -> list[str]:
    """A FineVision-shaped root: ``configs`` folders, each train-00000-of-00001.parquet of ``rows`` rows."""
    rng = np.random.default_rng(seed)
    pics = _jpegs(64, seed)
    names = [f"cfg{k:03d}" + ("(cauldron,llava_format)" if k % 5 == 0 else "") for k in range(configs)]
    for k, name in enumerate(names):
        (root / name).mkdir(parents=True, exist_ok=True)
        turns = rng.integers(1, 4, rows)
        table = pa.table({
            "images": pa.array([[{"bytes": pics[(k + i) % len(pics)], "path": None}] for i in range(rows)],
                               pa.list_(IMAGE)),
            "texts": pa.array([[{"user": f"Question {j} about picture {i} of {name}?",
                                 "assistant": "An answer " + "word " * int(rng.integers(3, 40))}
                                for j in range(t)] for i, t in enumerate(turns)], TEXTS),
            "source": pa.array([name] * rows),
            "relevance_min": pa.array(rng.integers(1, 6, rows)),
            "formatting_min": pa.array(rng.integers(1, 6, rows)),
        })
        pq.write_table(table, root / name / "train-00000-of-00001.parquet")
    (root / "README.md").write_text("---\nconfigs: see folders\n---\n")
    return names


def run(cmd: list[str], out_dir: Path) -> dict:
    """Wall time to the first metrics record, the whole wall time, the child's peak RSS (MB)."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics, first = out_dir / "metrics.jsonl", None
    lines = []
    while proc.poll() is None:
        if first is None and metrics.exists() and metrics.stat().st_size:
            first = time.time() - t0
        time.sleep(0.2)
    lines = proc.stdout.read().splitlines()
    wall = time.time() - t0
    if proc.returncode:
        print("\n".join(lines[-30:]))
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}")
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    read_as = [ln for ln in lines if "read as:" in ln]
    return {"first_step_s": round(first or wall, 1), "wall_s": round(wall, 1), "driver_peak_rss_mb": round(rss),
            "read_as_lines": len(read_as)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", type=int, default=185)
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--work", default="", help="folder for the generated root and runs (default: a temp folder)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_startup_configs_"))
    root = work / "finevision"
    t0 = time.time()
    names = write_root(root, args.configs, args.rows)
    print(f"wrote {args.configs} configs x {args.rows} rows under {root} in {time.time() - t0:.1f} s", flush=True)
    train_py = str(Path(__file__).resolve().parents[1] / "jobs" / "train.py")
    cli = [sys.executable, train_py, "--max-steps", "1", "--max-tokens", "2048",
           "--d-model", "64", "--n-layers", "1", "--vision-layers", "1", "--shuffle-buffer", "256"]
    results = {}
    out = work / "run_each_once"
    results["each_once"] = run(cli + ["--data", str(root), "--output-dir", str(out)], out)
    blend = work / "blend.yaml"
    blend.write_text(json.dumps({"data": {"sources": [
        {"path": str(root), "config": n, "weight": 2.0 if k % 2 else 1.0} for k, n in enumerate(names)]}}))
    out = work / "run_blend"
    results["blend"] = run(cli + ["--config", str(blend), "--output-dir", str(out)], out)
    summary = json.loads((out / "summary.json").read_text())
    results["blend"]["sources_in_summary"] = len(summary.get("sources", {}))
    report = {"configs": args.configs, "rows": args.rows, "cpus": os.cpu_count(), **results}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
