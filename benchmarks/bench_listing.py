"""What a run reads from the bucket before its first step, for a ``datasets`` save_to_disk folder (issue 44).

Writes a save_to_disk folder with ``datasets`` itself (an Image feature: 100 rows a record batch, as
``datasets`` writes image sets; PNG images of about ``--image-kb``), uploads it to moto's S3 server with
every request recorded (tests/s3_counting.py), and runs the driver's steps of ``ray-mmbatch train`` with
the same functions the command calls: pre-flight (the first 64 samples read and measured), the run plan's
count, the listing digest build_trainer checks, each epoch's dataset listing where the code of that
version lists one (the Train controller's batch_dataset), and summary.json's --filter counts. Reported per
step and in all: LIST requests, GETs, bytes fetched from the bucket, seconds.

``--before PATH``: also run the same steps with the ``ray_mmbatch`` package found under PATH (a checkout of
the code before, e.g. ``mkdir /tmp/before && git archive 708d775 ray_mmbatch | tar -x -C /tmp/before``), each
version in its own process with its own server.

    python benchmarks/bench_listing.py --rows 2000 --shards 4 --before /tmp/before --json /tmp/listing.json
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_folder(root: Path, rows: int, shards: int, image_kb: int) -> None:
    import datasets
    import numpy as np
    from PIL import Image

    side = int((image_kb * 1024 / 3) ** 0.5)  # noise PNG: about 3 bytes a pixel
    pool = []
    for i in range(50):  # 50 distinct images, cycled: the bytes matter here, not the pixels
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
        pool.append(buf.getvalue())
    conv = [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "Noise."}]
    ds = datasets.Dataset.from_dict(
        {"id": [f"r{i}" for i in range(rows)], "image": [{"bytes": pool[i % 50], "path": None} for i in range(rows)],
         "conversations": [conv] * rows, "score": [i % 3 for i in range(rows)]},
        features=datasets.Features({"id": datasets.Value("string"), "image": datasets.Image(),
                                    "conversations": [{"from": datasets.Value("string"),
                                                       "value": datasets.Value("string")}],
                                    "score": datasets.Value("int64")}))
    ds.save_to_disk(str(root), num_shards=shards)


def measure(folder: str, epochs: int, filter_: str) -> dict:
    """In a process of its own: a server, the folder uploaded, the run's driver steps counted."""
    sys.path.insert(0, str(REPO / "tests"))
    from s3_counting import CountingS3

    server = CountingS3().start()
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{server.port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket="bench")
    for p in sorted(Path(folder).iterdir()):
        client.upload_file(str(p), "bench", f"sd/{p.name}")
    shard_bytes = sum(p.stat().st_size for p in Path(folder).glob("data-*.arrow"))

    import ray_mmbatch
    from ray_mmbatch.config import Config, DataConfig
    from ray_mmbatch.dataflow import pipeline
    from ray_mmbatch.formats.units import filtered_counts, listing_digest, read_units
    from ray_mmbatch.run.defaults import resolve_defaults
    from ray_mmbatch.run.preflight import preflight
    from ray_mmbatch.train.trainer import run_plan

    try:
        from ray_mmbatch.formats.listing import one_listing
    except ImportError:  # the code before: no run scope
        one_listing = contextlib.nullcontext
    passes_listing = "reader" in inspect.signature(pipeline.batch_dataset).parameters
    cfg = Config()
    cfg.data = DataConfig(path="s3://bench/sd", filter=filter_)
    cfg.train.epochs = epochs
    resolve_defaults(cfg)
    steps = []

    def step(name, fn):
        server.clear()
        t0 = time.perf_counter()
        out = fn()
        seen = server.seen()
        steps.append({"step": name, "s": round(time.perf_counter() - t0, 3),
                      "lists": len([r for r in seen if r.is_listing()]),
                      "gets": len([r for r in seen if r.method == "GET" and not r.is_listing()]),
                      "heads": len([r for r in seen if r.method == "HEAD"]),
                      "bytes": sum(r.sent for r in seen if r.method == "GET" and not r.is_listing())})
        return out

    step("listing alone (read_units, once)", lambda: read_units(cfg.data.path, cfg.data))
    alone, steps[:] = steps[0], []
    t_all = time.perf_counter()
    with one_listing():
        seen = step("pre-flight (64 samples read)", lambda: preflight(cfg))
        step("run plan: samples counted", lambda: run_plan(cfg, seen["tokens_per_sample"], seen["samples_checked"]))
        step("build_trainer: listing digest", lambda: listing_digest(read_units(cfg.data.path, cfg.data)[0]))
        for e in range(epochs):
            step(f"epoch {e} dataset: listing", (lambda: None) if passes_listing else
                 (lambda: read_units(cfg.data.path, cfg.data)))
        if filter_:
            step("summary.json: --filter counts", lambda: filtered_counts(cfg.data))
    server.stop()
    total = {k: sum(s[k] for s in steps) for k in ("lists", "gets", "heads", "bytes")}
    return {"code": str(Path(ray_mmbatch.__file__).parents[1]), "listing": alone, "steps": steps, "total": total,
            "wall_s": round(time.perf_counter() - t_all, 3), "shard_bytes": shard_bytes,
            "filter": filter_, "epochs": epochs}


def _run(code: Path, folder: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(code))
    out = subprocess.run([sys.executable, __file__, "--measure", folder, "--epochs", str(args.epochs),
                          "--filter", args.filter], env=env, capture_output=True, text=True, cwd=str(code))
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--image-kb", type=int, default=75)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--filter", default="score >= 1", help="--filter of the run ('' for none)")
    ap.add_argument("--before", default="", help="a folder holding the ray_mmbatch package of the code before")
    ap.add_argument("--json", default="")
    ap.add_argument("--measure", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.epochs, args.filter)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "sd"
        write_folder(folder, args.rows, args.shards, args.image_kb)
        results = {}
        for name, code in (("before", Path(args.before)), ("after", REPO)) if args.before else (("after", REPO),):
            results[name] = _run(code.resolve(), str(folder), args)
    mb = 1 << 20
    for name, r in results.items():
        print(f"{name}: {args.rows} rows in {args.shards} shards ({r['shard_bytes'] / mb:.1f} MiB), "
              f"--filter {r['filter']!r}, {r['epochs']} epochs  [{r['code']}]")
        for s in [r["listing"], None] + r["steps"]:
            if s is None:
                print("  a run's driver steps before its first step:")
                continue
            print(f"  {s['step']:<34} {s['lists']:>3} LIST {s['heads']:>3} HEAD {s['gets']:>4} GET "
                  f"{s['bytes'] / mb:>8.1f} MiB {s['s']:>7.2f} s")
        t = r["total"]
        print(f"  {'all':<34} {t['lists']:>3} LIST {t['heads']:>3} HEAD {t['gets']:>4} GET "
              f"{t['bytes'] / mb:>8.1f} MiB {r['wall_s']:>7.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
