"""What does exact decode cost? data/image/ ``decode_image`` exact (default) vs ``fast_decode``.

Per image (real photo, skimage coffee, resized and encoded): header probe + grid, then the
decode materialize does (decode, EXIF, RGB, bicubic resize, crop), the best of ``--repeat``
runs on one core (timeit's convention: on a shared machine the least disturbed run).
Columns: exact ms, fast ms (JPEG DCT draft + reducing_gap), their ratio, and for reference
HF's own path (Image.open + exif_transpose + the PIL-backend processor, normalization
included) at the same settings.

    python benchmarks/bench_decode.py [--repeat 7] [--json PATH]
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import time

import numpy as np
from PIL import Image, ImageOps
from skimage import data as skdata

from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.image import decode_image, image_grid, probe_image

SETTINGS = {
    # the project default (max 256 merged tokens) and HF Qwen2-VL's own default (max 1280); LLaVA-1.5 336 px
    "smart_256": ImageConfig(),
    "smart_1280": ImageConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 1280),
    "fixed_336": ImageConfig(resize="fixed", image_size=336, merge_size=1),
}
SIZES = [(640, 480), (1024, 768), (2000, 1500), (4000, 3000)]


def files() -> dict[str, bytes]:
    photo = Image.fromarray(skdata.coffee())
    out = {}
    for w, h in SIZES:
        buf = io.BytesIO()
        photo.resize((w, h), Image.Resampling.BICUBIC).save(buf, "JPEG", quality=90)
        out[f"jpeg {w}x{h}"] = buf.getvalue()
    buf = io.BytesIO()
    photo.resize((1024, 768)).save(buf, "PNG")
    out["png 1024x768"] = buf.getvalue()
    buf = io.BytesIO()  # a scanned A4 page at 300 dpi (grey): the largest images in document sets
    Image.fromarray(skdata.text()).resize((2480, 3508)).save(buf, "PNG")
    out["grey png 2480x3508"] = buf.getvalue()
    return out


def best_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def hf_processor(cfg: ImageConfig):
    if cfg.resize == "smart":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    s = cfg.image_size
    return CLIPImageProcessorPil(size={"shortest_edge": s}, crop_size={"height": s, "width": s})


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'setting':<11} {'image':<19} {'grid':>10} {'exact ms':>9} {'fast ms':>8} {'x':>5} {'HF ms':>7}")
    for name, cfg in SETTINGS.items():
        fast = dataclasses.replace(cfg, fast_decode=True)
        proc = hf_processor(cfg)
        for label, data in files().items():
            grid = image_grid(*probe_image(data, cfg), cfg)
            exact_ms = best_ms(lambda: decode_image(data, image_grid(*probe_image(data, cfg), cfg), cfg), args.repeat)
            fast_ms = best_ms(lambda: decode_image(data, image_grid(*probe_image(data, fast), fast), fast),
                                args.repeat)
            hf_ms = best_ms(lambda: proc(images=ImageOps.exif_transpose(Image.open(io.BytesIO(data))),
                                           return_tensors="np"), args.repeat)
            diff = np.abs(decode_image(data, grid, cfg).astype(int) - decode_image(data, grid, fast).astype(int))
            rows.append({"setting": name, "image": label, "grid": list(grid), "exact_ms": exact_ms,
                         "fast_ms": fast_ms, "hf_ms": hf_ms, "fast_mean_abs_diff": float(diff.mean())})
            print(f"{name:<11} {label:<19} {'x'.join(map(str, grid[1:])):>10} {exact_ms:9.1f} {fast_ms:8.1f} "
                  f"{exact_ms / fast_ms:5.1f} {hf_ms:7.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return {"rows": rows}


if __name__ == "__main__":
    main()
