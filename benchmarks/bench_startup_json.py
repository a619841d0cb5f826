"""Start-up on big LLaVA indexes: one huge JSON list and a 10M-line JSON Lines file (issue 33).

Question: LLaVA's 665k mix is one ~1 GB JSON list, MAmmoTH-VL a 21.8 GB one, Cambrian-10M JSON Lines.
The listing (formats/json_stream.py through formats/llava.file_units) must stream them in bounded
memory, and the first training step must come in < 60 s (665k JSON) and < 120 s (10M JSONL) on this
2-core machine, the driver under 1 GB at 10M. This script writes (nothing committed; under --work,
default a temp folder):

    images/NNN/MMMMMM.jpg     --images small real JPEGs, each referenced by many records
    llava_665k/data.json      --json-records records, LLaVA-shaped (~860 bytes each like the real mix;
                              5% text-only without an "image" key), image_root ../images
    cambrian_10m/data.jsonl   --lines-records records, one a line (shorter: ~330 bytes)

and measures, for each file, in a fresh child process (so its peak RSS is the listing's own):
listing time and peak RSS, the number of units, and the time to read the first unit's rows
(``llava.read_unit``: seek, parse, read its images); then per-record read cost at several unit sizes
(``--chunks``); then, unless --no-train, the real CLI to its first step:

    /usr/bin/time -v python jobs/train.py --data FILE --image-root IMAGES --max-steps 1 --output-dir OUT

reporting the time to the first metrics.jsonl record (written at step 1), the whole command, the
driver's peak RSS (VmHWM of the driver process, sampled; /usr/bin/time's figure beside it is
ru_maxrss, which also counts the processes the driver reaped and survives exec, so it can carry this
script's own peak). Figures go to benchmarks/RESULTS.md:

    python benchmarks/bench_startup_json.py --work /tmp/bench_json
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = ["What is shown in the image?", "Describe the picture in detail.", "What colour is the [main] object?",
             'Read the sign: it says "{open}" – what else?', "Wie viele Menschen sind zu sehen? 人はいますか"]


def write_images(root: Path, n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    rels = []
    for k in range(n):
        rel = f"{k // 100:03d}/{k:06d}.jpg"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        w, h = int(rng.integers(64, 200)), int(rng.integers(64, 200))
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=70)
        (root / rel).write_bytes(buf.getvalue())
        rels.append(rel)
    return rels


def record_text(i: int, images: list[str], answer_words: int) -> str:
    q = QUESTIONS[i % len(QUESTIONS)]
    answer = " ".join(("word", "token", "a", "picture", "of", "ü")[(i + j) % 6] for j in range(answer_words))
    rec = {"id": f"{i:09d}", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": answer}]}
    if i % 20:  # 5% text-only, no "image" key, as in the real mix
        rec["image"] = images[(i * 7919) % len(images)]
        rec["conversations"][0]["value"] = "<image>\n" + q
    return json.dumps(rec, ensure_ascii=False)


def write_json(path: Path, n: int, images: list[str], answer_words: int, lines: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        if not lines:
            f.write("[\n")
        for start in range(0, n, 100_000):
            part = [record_text(i, images, answer_words) for i in range(start, min(n, start + 100_000))]
            f.write(("\n" if lines else ",\n").join(part))
            last = start + 100_000 >= n
            f.write("\n" if lines else ("\n" if last else ",\n"))
        if not lines:
            f.write("]\n")


PROBE = r"""
import json, re, sys, time
from ray_mmbatch.config import DataConfig
from ray_mmbatch.formats import llava
path, image_root = sys.argv[1], sys.argv[2]
t0 = time.time(); units = llava.file_units(path, image_root); t1 = time.time()
rss = int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024  # ru_maxrss survives exec
rows = llava.read_unit(units[0], DataConfig(image_root=image_root)); t2 = time.time()
print(json.dumps({"listing_s": round(t1 - t0, 2), "listing_peak_rss_mb": round(rss), "units": len(units),
                  "records": llava.count(units, None), "first_unit_rows": len(rows),
                  "first_unit_read_s": round(t2 - t1, 3),
                  "first_unit_errors": sum(bool(r["read_error"]) for r in rows)}))
"""

CHUNKS = r"""
import json, sys, time
from ray_mmbatch.config import DataConfig
from ray_mmbatch.formats import llava
path, image_root, chunks = sys.argv[1], sys.argv[2], [int(c) for c in sys.argv[3].split(",")]
out = {}
for chunk in chunks:  # the first ~4096 records' units, read as a worker reads them
    units = llava.file_units(path, image_root, chunk=chunk)
    t0 = time.time(); n = sum(len(llava.read_unit(u, DataConfig())) for u in units[:max(1, 4096 // chunk)])
    out[chunk] = {"units": len(units), "us_per_record": round((time.time() - t0) / n * 1e6, 1)}
print(json.dumps(out))
"""


def child(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def train(path: Path, image_root: Path, out_dir: Path, timeout: int) -> dict:
    """The real CLI to its first step: time to the first metrics record, the driver's peak RSS."""
    cmd = ["/usr/bin/time", "-v", sys.executable, str(REPO / "jobs" / "train.py"), "--data", str(path),
           "--image-root", str(image_root), "--max-steps", "1", "--max-tokens", "2048", "--d-model", "64",
           "--n-layers", "1", "--vision-layers", "1", "--output-dir", str(out_dir)]
    shutil.rmtree(out_dir, ignore_errors=True)  # a run folder left over would resume, not start
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    metrics, first, hwm, driver = out_dir / "metrics.jsonl", None, 0, None
    while proc.poll() is None:
        if first is None and metrics.exists() and metrics.stat().st_size:
            first = time.time() - t0
        if driver is None:  # /usr/bin/time's child: the python driver
            kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
            pids = kids.read_text().split() if kids.exists() else []
            driver = int(pids[0]) if pids else None
        if driver is not None:
            try:
                m = re.search(r"VmHWM:\s+(\d+)", Path(f"/proc/{driver}/status").read_text())
                hwm = max(hwm, int(m.group(1)) // 1024) if m else hwm
            except OSError:
                pass
        if time.time() - t0 > timeout:
            proc.kill()
            break
        time.sleep(0.2)
    text = proc.stdout.read()
    wall = time.time() - t0
    if proc.returncode:
        print(text[-4000:])
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    return {"first_step_s": round(first, 1) if first else None, "wall_s": round(wall, 1), "rc": proc.returncode,
            "driver_peak_rss_mb": hwm, "time_v_max_rss_mb": int(m.group(1)) // 1024 if m else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="")
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--json-records", type=int, default=665_000)
    ap.add_argument("--lines-records", type=int, default=10_000_000)
    ap.add_argument("--chunks", default="64,256,512,1024")
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--only", choices=("json", "jsonl", ""), default="")
    ap.add_argument("--timeout", type=int, default=600)
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_startup_json_"))
    images_root = work / "images"
    if not images_root.exists():
        write_images(images_root, args.images)
    images = sorted(p.relative_to(images_root).as_posix() for p in images_root.rglob("*.jpg"))
    sets = {"json": (work / "llava_665k" / "data.json", args.json_records, 140, False),
            "jsonl": (work / "cambrian_10m" / "data.jsonl", args.lines_records, 20, True)}
    report = {"cpus": os.cpu_count(), "images": len(images)}
    for key, (path, n, words, lines) in sets.items():
        if args.only and key != args.only:
            continue
        if not path.exists():
            t0 = time.time()
            write_json(path, n, images, words, lines)
            print(f"wrote {path} ({path.stat().st_size / 1e6:.0f} MB, {n:,} records) in {time.time() - t0:.0f} s",
                  flush=True)
        res = {"file_mb": round(path.stat().st_size / 1e6), "records": n}
        res.update(child(PROBE, str(path), str(images_root)))
        res["unit_sizes"] = child(CHUNKS, str(path), str(images_root), args.chunks) if key == "json" else None
        print(key, json.dumps(res), flush=True)
        if not args.no_train:
            res["train"] = train(path, images_root, work / f"run_{key}", args.timeout)
            print(key, "train", json.dumps(res["train"]), flush=True)
        report[key] = res
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
