"""Every sample prepared: `ray-mmbatch inspect` against the HF-processor DataLoader users run today.

The collate TRL's and LLaMA-Factory's users run: a ``torch.utils.data.DataLoader(num_workers=2)``
whose collate opens each image with Pillow and calls the checkpoint's processor (decode, bicubic
resize, float32 rescale + normalize, patchify; the chat template, image-pad expansion and the
tokenizer's batch call). Against it, ``jobs/inspect_data.py --model CKPT --decode on`` over the same
LLaVA JSON + image folder: read, measure, decode, resize and patchify every sample to uint8 (the
trainer normalizes), with 2 preprocessing actors.

Data (generated, in ``--work``): ``--photos`` real photos (scikit-image's bundled ones, resized so
their areas run log-spaced from 0.1 to 3 MP, JPEG quality 90) and ``--samples`` LLaVA records, one
image each, one to three turns of generated words. Checkpoint: the tiny random Qwen2-VL of
tests/hf_checkpoints.py with the processor settings Qwen2-VL / Qwen2.5-VL publish (min_pixels 3136,
max_pixels 12845056, patch 14, merge 2, temporal 2) unless ``--max-pixels`` says otherwise: both
sides read the same preprocessor_config.json and the same tokenizer.

Timing: each side is a fresh process (``python this.py --side S``), wall time from its spawn to its
exit, imports and Ray's start included, the sides alternating, best of ``--repeat``; and the CPU seconds
of each side's whole process tree (Ray's own processes and actors, the DataLoader's workers; sampled
from /proc as benchmarks/cpu_by_process.py does), which other load on the machine moves far less. Both must agree
on the samples, the image tokens and the text tokens they produced (the same work is timed) or the
script fails.

    python benchmarks/bench_processor.py [--work /tmp/bench_proc] [--samples 3000] [--max-pixels N]
                                         [--repeat 2] [--json PATH]
    python benchmarks/bench_processor.py --in-process 384 ...    # each side's own work, one process
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PUBLISHED = {"min_pixels": 3136, "max_pixels": 12845056}  # Qwen2-VL / Qwen2.5-VL preprocessor_config.json
COLOR = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
         "colorwheel")
GREY = ("camera", "grass", "gravel", "brick", "moon", "clock", "coins", "horse", "page", "text")
WORDS = ("the a image shows picture of person dog cat street car building tree sky water people table "
         "food red blue green white black small large left right next to in on with near behind two three "
         "many what where is are doing describe detail color background foreground holding wearing "
         "sitting standing looking window light dark scene view").split()


# ------------------------------------------------------------------ data
def make_photos(folder: Path, n: int, seed: int = 0) -> list[str]:
    """``n`` JPEGs of real photos, areas log-spaced over 0.1 .. 3 MP, aspect ratios of the originals."""
    from PIL import Image
    from skimage import data as skdata

    folder.mkdir(parents=True, exist_ok=True)
    sources = []
    for name in COLOR + GREY:
        a = getattr(skdata, name)()
        sources.append((name, Image.fromarray(a).convert("RGB")))
    stereo = skdata.stereo_motorcycle()
    sources += [("motorcycle_left", Image.fromarray(stereo[0])), ("motorcycle_right", Image.fromarray(stereo[1]))]
    areas = np.geomspace(0.1e6, 3e6, n)
    names = []
    for k, area in enumerate(areas):
        name, img = sources[k % len(sources)]
        scale = (area / (img.width * img.height)) ** 0.5
        size = (max(16, round(img.width * scale)), max(16, round(img.height * scale)))
        out = f"{k:02d}_{name}.jpg"
        img.resize(size, Image.Resampling.BICUBIC).save(folder / out, "JPEG", quality=90)
        names.append(out)
    return names


def _words(rng, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS, size=int(rng.integers(lo, hi + 1))))


def make_records(path: Path, photos: list[str], n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        turns = []
        for t in range(int(rng.integers(1, 4))):
            q = _words(rng, 5, 25) + "?"
            turns += [{"from": "human", "value": ("<image>\n" + q) if t == 0 else q},
                      {"from": "gpt", "value": _words(rng, 10, 120) + "."}]
        records.append({"id": f"s{i:06d}", "image": photos[int(rng.integers(len(photos)))], "conversations": turns})
    path.write_text(json.dumps(records))


def prepare(work: Path, samples: int, photos: int, max_pixels: int | None) -> dict:
    from tests.hf_checkpoints import make_qwen_checkpoint

    meta = work / "meta.json"
    want = {"samples": samples, "photos": photos, "max_pixels": max_pixels or PUBLISHED["max_pixels"]}
    if meta.exists() and json.loads(meta.read_text()) == want:
        return want
    names = make_photos(work / "images", photos)
    make_records(work / "data.json", names, samples)
    size = {"shortest_edge": PUBLISHED["min_pixels"], "longest_edge": want["max_pixels"]}
    make_qwen_checkpoint(work / "ckpt", "qwen2_vl", image_processor={"size": size})
    meta.write_text(json.dumps(want))
    return want


# ------------------------------------------------------------------ the HF-processor DataLoader
class Records:
    def __init__(self, work: Path):
        self.records, self.root = json.loads((work / "data.json").read_text()), work / "images"

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        return self.records[i]


class ProcessorCollate:
    """What a TRL-style collate does per batch: Pillow opens the images, the chat template renders the
    text, the processor (image processor + pad expansion + tokenizer) makes the tensors, labels are the
    input ids with padding masked."""

    def __init__(self, ckpt: Path, root: Path):
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        # Qwen2VLProcessor itself needs torchvision for its video processor (not installable beside the CPU
        # torch here); its __call__ for images is these three steps, written out
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(ckpt)
        self.tok = AutoTokenizer.from_pretrained(ckpt)
        self.merge = self.image_processor.merge_size ** 2
        self.root = root

    def __call__(self, records: list[dict]) -> dict:
        import torch
        from PIL import Image

        images = [Image.open(self.root / r["image"]).convert("RGB") for r in records]
        out = self.image_processor(images=images, return_tensors="pt")
        grids = out["image_grid_thw"]
        texts = []
        for r, grid in zip(records, grids):
            msgs = [{"role": "user" if t["from"] == "human" else "assistant",
                     "content": [{"type": "image"}, {"type": "text", "text": t["value"].replace("<image>\n", "")}]
                     if "<image>" in t["value"] else [{"type": "text", "text": t["value"]}]}
                    for t in r["conversations"]]
            text = self.tok.apply_chat_template(msgs, tokenize=False)
            texts.append(text.replace("<|image_pad|>", "<|image_pad|>" * int(grid.prod() // self.merge), 1))
        enc = self.tok(texts, padding=True, return_tensors="pt")
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        return {**enc, "labels": labels, "pixel_values": out["pixel_values"], "image_grid_thw": grids,
                "n_text": torch.tensor([t.count("<|image_pad|>") for t in texts])}


def run_dataloader(work: Path, workers: int, batch_size: int) -> dict:
    import torch

    collate = ProcessorCollate(work / "ckpt", work / "images")
    loader = torch.utils.data.DataLoader(Records(work), batch_size=batch_size, num_workers=workers,
                                         collate_fn=collate)
    samples = tokens = image_tokens = 0
    for b in loader:
        samples += len(b["labels"])
        tokens += int(b["attention_mask"].sum())
        image_tokens += int(b["n_text"].sum())
    return {"samples": samples, "tokens": tokens, "image_tokens": image_tokens}


def run_inspect(work: Path, workers: int) -> dict:
    out = work / "inspect.json"
    cmd = [sys.executable, str(ROOT / "jobs" / "inspect_data.py"), "--data", str(work / "data.json"),
           "--image-root", str(work / "images"), "--model", str(work / "ckpt"), "--decode", "on",
           "--preprocess-workers", str(workers), "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    r = json.loads(out.read_text())
    if r["length_mismatch"] or r["samples_skipped"]:
        raise SystemExit(f"inspect: {r['length_mismatch']} length mismatches, {r['samples_skipped']} skipped")
    return {"samples": r["samples_ok"], "tokens": round(r["tokens"]["sum"]),
            "image_tokens": round(r["image_tokens"]["sum"])}


# ------------------------------------------------------------------ per sample, in one process
def per_sample_cpu(work: Path, samples: int, repeat: int) -> dict:
    """CPU ms per sample of each side's own work, in this one process (no Ray, no DataLoader workers),
    alternating, best of ``repeat``: ours = the read of the LLaVA units + InspectStage (measure, decode,
    resize, patchify to uint8), HF's = ProcessorCollate over batches of 8. What the Ray shell and the
    DataLoader's workers add on top is the difference to the whole-process figures."""
    import pyarrow as pa

    from ray_mmbatch.cli import config_from_args
    from ray_mmbatch.commands.inspect_data import build_parser
    from ray_mmbatch.dataflow.inspection import InspectStage
    from ray_mmbatch.formats.units import read_units, read_with_position
    from ray_mmbatch.run.preflight import configure_run

    args = build_parser().parse_args(["--data", str(work / "data.json"), "--image-root", str(work / "images"),
                                      "--model", str(work / "ckpt")])
    cfg = configure_run(config_from_args(args))
    units, read_fn, kw = read_units(cfg.data.path, cfg.data)
    stage = InspectStage(cfg.image, cfg.text, cfg.data.measure_batch, True)
    collate, records = ProcessorCollate(work / "ckpt", work / "images"), Records(work)

    def ours() -> int:
        n = 0
        for i, u in enumerate(units):
            t = read_with_position(pa.Table.from_pylist([dict(u, unit=i, end=False)]), read_fn=read_fn,
                                   read_kwargs=kw, done=None, split=None)
            stage(t)
            n += t.num_rows
            if n >= samples:
                return n
        return n

    def hf() -> int:
        for i in range(0, samples, 8):
            collate([records[j] for j in range(i, min(samples, i + 8))])
        return samples

    best = {"ours": float("inf"), "hf": float("inf")}
    ours(), hf()  # imports, caches
    for _ in range(repeat):
        for side, fn in (("ours", ours), ("hf", hf)):
            c0 = time.process_time()
            n = fn()
            best[side] = min(best[side], 1000 * (time.process_time() - c0) / n)
    return {"ours_ms": best["ours"], "hf_ms": best["hf"], "ratio": best["hf"] / best["ours"]}


# ------------------------------------------------------------------ driver
def timed_side(side: str, args) -> dict:
    """One side in a fresh process: its wall time, and the CPU seconds of its whole process tree (Ray's
    processes, the DataLoader's workers; benchmarks/cpu_by_process.py), which other load on the machine
    does not move much."""
    import tempfile

    from cpu_by_process import run_tree

    cmd = [sys.executable, __file__, "--side", side, "--work", args.work, "--workers", str(args.workers),
           "--batch-size", str(args.batch_size)]
    with tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc, cpu, stdout = run_tree(cmd, tick=0.2, stdout=subprocess.PIPE, stderr=err, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            err.seek(0)
            raise SystemExit(f"{side} failed ({proc.returncode}):\n{err.read()[-4000:]}")
    out = json.loads(stdout.strip().splitlines()[-1])
    return {**out, "side": side, "wall_s": wall, "samples_per_s": out["samples"] / wall,
            "cpu_s": sum(cpu.values()), "cpu_ms_per_sample": 1000 * sum(cpu.values()) / out["samples"],
            "cpu_by_process": dict(sorted(cpu.items(), key=lambda x: -x[1])[:8]), "load_1m": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/bench_proc")
    p.add_argument("--samples", type=int, default=3000)
    p.add_argument("--photos", type=int, default=20)
    p.add_argument("--max-pixels", type=int, default=None, help="default: the published 12845056")
    p.add_argument("--workers", type=int, default=2, help="DataLoader num_workers = inspect's actors")
    p.add_argument("--batch-size", type=int, default=8, help="DataLoader batch (TRL's default per device)")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--in-process", type=int, default=0, metavar="N",
                   help="instead: CPU ms per sample of each side's own work on the first N samples, in this one "
                        "process (no Ray shell, no DataLoader workers), best of --repeat")
    p.add_argument("--side", choices=("dataloader", "inspect"), help=argparse.SUPPRESS)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    work = Path(args.work)
    if args.side:  # one side in this process; the driver times the process
        fn = run_dataloader(work, args.workers, args.batch_size) if args.side == "dataloader" \
            else run_inspect(work, args.workers)
        print(json.dumps(fn))
        return 0
    setup = prepare(work, args.samples, args.photos, args.max_pixels)
    if args.in_process:
        r = per_sample_cpu(work, args.in_process, args.repeat)
        print(f"CPU ms per sample, in one process, best of {args.repeat} over {args.in_process} samples: ours "
              f"{r['ours_ms']:.2f}, HF processor {r['hf_ms']:.2f}: {r['ratio']:.2f}x less")
        if args.json:
            Path(args.json).write_text(json.dumps({"setup": setup, **r}, indent=1))
        return 0
    rows = []
    print(f"{'run':>3} {'side':<10} {'samples':>7} {'tokens':>9} {'wall s':>7} {'samples/s':>9} {'ray/DL':>6} "
          f"{'CPU s':>6} {'CPU ms/sample':>13} {'DL/ray CPU':>10} {'load':>5}")
    for rep in range(args.repeat):
        pair = {}
        for side in ("dataloader", "inspect"):
            pair[side] = r = timed_side(side, args)
            r["run"] = rep
            rows.append(r)
            ratio = (r["samples_per_s"] / pair["dataloader"]["samples_per_s"]) if side == "inspect" else None
            cpu_ratio = (pair["dataloader"]["cpu_s"] / r["cpu_s"]) if side == "inspect" else None
            print(f"{rep:>3} {side:<10} {r['samples']:>7} {r['tokens']:>9} {r['wall_s']:>7.2f} "
                  f"{r['samples_per_s']:>9.1f} {'' if ratio is None else f'{ratio:.2f}':>6} {r['cpu_s']:>6.1f} "
                  f"{r['cpu_ms_per_sample']:>13.2f} {'' if cpu_ratio is None else f'{cpu_ratio:.2f}':>10} "
                  f"{r['load_1m']:>5.2f}", flush=True)
        a, b = pair["dataloader"], pair["inspect"]
        if (a["samples"], a["tokens"], a["image_tokens"]) != (b["samples"], b["tokens"], b["image_tokens"]):
            raise SystemExit(f"the sides did different work: dataloader {a}, inspect {b}")
    best = {s: min(r["wall_s"] for r in rows if r["side"] == s) for s in ("dataloader", "inspect")}
    cpu = {s: min(r["cpu_s"] for r in rows if r["side"] == s) for s in ("dataloader", "inspect")}
    summary = {"setup": setup, "rows": rows, "best_wall_s": best, "ratio_best": best["dataloader"] / best["inspect"],
               "best_cpu_s": cpu, "cpu_ratio_best": cpu["dataloader"] / cpu["inspect"]}
    print(f"best of {args.repeat}: dataloader {best['dataloader']:.2f} s, inspect {best['inspect']:.2f} s, "
          f"inspect / dataloader speed {summary['ratio_best']:.2f}x; CPU s {cpu['dataloader']:.1f} vs "
          f"{cpu['inspect']:.1f}: {summary['cpu_ratio_best']:.2f}x less")
    for r in rows:
        print(f"  run {r['run']} {r['side']}: " + ", ".join(f"{k} {v:.1f}" for k, v in r["cpu_by_process"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
