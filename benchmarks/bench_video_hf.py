"""HF's side of ``bench_video.py --part hf`` (issue 46): run by the reference interpreter (.venv-ref: PyPI torch +
torchvision, which HF's video processors need and which do not load beside the project's CPU torch).

    <reference python> benchmarks/bench_video_hf.py CHECKPOINT CPU [--cap-pixels-per-frame]

Pins itself to core CPU (torch 1 thread), loads ``AutoVideoProcessor.from_pretrained(CHECKPOINT)`` once, then
serves one JSON request a line on stdin, answering one JSON line on stdout: ``{"path": clip, "loader": "pyav" |
"torchcodec", "out": npz or ""}`` -> ``{"cpu_s", "load_s", "process_s", "frames", "grid"}``. Per request, what a
TRL / LLaMA-Factory user of HF runs today on a clip file, timed in CPU seconds of this process
(``time.process_time``, every thread of it: the machine is shared):

    load     transformers.video_utils.load_video(path, backend=loader, sample_indices_fn=processor.sample_frames)
             pyav (read_video_pyav, load_video's default): the header's count and rate -> the processor's fps
             sampler -> decode from the start up to the last sampled frame, rgb24 of the sampled frames;
             torchcodec (what HF's video processors fetch a path with when it is installed): VideoDecoder(exact
             seek mode: a scan of the packets) -> the sampler -> get_frames_at (seeks where a frame lies past
             the current GOP)
    process  processor(videos=[frames], do_sample_frames=False, return_tensors="pt"): torchvision resize
             (bicubic, antialias, uint8), fused rescale + normalize in float32, patchify -> pixel_values_videos

With "out", the loader's indices, the grid and pixel_values_videos (float32) are written there (not timed), for
the parent to check against its own output. torchcodec finds PyAV's FFmpeg libraries as tests/video_reference.py
arranges it (the script re-executes itself with them on LD_LIBRARY_PATH), so both loaders decode with the FFmpeg
build the project's PyAV decodes with.
"""
from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: tests/
    from tests.video_reference import _with_pyav_ffmpeg

    _with_pyav_ffmpeg()
    checkpoint, cpu = sys.argv[1], int(sys.argv[2])
    cap = "--cap-pixels-per-frame" in sys.argv[3:]
    os.sched_setaffinity(0, {cpu})
    import numpy as np
    import torch
    from transformers import AutoVideoProcessor
    from transformers.video_utils import load_video

    torch.set_num_threads(1)
    processor = AutoVideoProcessor.from_pretrained(checkpoint)
    kwargs = {"cap_pixels_per_frame": cap} if hasattr(processor, "cap_pixels_per_frame") else {}
    print(json.dumps({"ready": type(processor).__name__, "torch": torch.__version__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        loader = req.get("loader", "pyav")
        t0 = time.process_time()
        video, meta = load_video(req["path"], backend=loader, sample_indices_fn=processor.sample_frames)
        t1 = time.process_time()
        got = processor(videos=[video], do_sample_frames=False, return_tensors="pt", **kwargs)
        t2 = time.process_time()
        grid = [int(x) for x in got["video_grid_thw"][0]]
        if req.get("out"):
            np.savez(req["out"], indices=np.asarray(meta.frames_indices, dtype=np.int64), grid=np.asarray(grid),
                     pixels=got["pixel_values_videos"].numpy())
        print(json.dumps({"cpu_s": t2 - t0, "load_s": t1 - t0, "process_s": t2 - t1, "frames": len(video),
                          "grid": grid}), flush=True)


if __name__ == "__main__":
    main()
