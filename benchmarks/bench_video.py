"""Video (issue 37): what the sampled-GOP decode buys per data CPU, and what token-budget packing buys in training.

``--part decode``: per data CPU (the process pinned to one core, torch 1 thread, so FFmpeg's "auto"
threads are 1), on generated H.264 mp4 clips (``encode_clip(clip_frames(n, h, w), fps, gop)``, with
``--noise`` Gaussian noise first for a higher bit rate, with ``--fixed-gop`` x264's scene-cut keyframes
off, with ``--b-pyramid`` x264's b-pyramid set (none: every B-frame non-reference); encoding not timed)
with a Qwen2-VL video processor (a tiny test checkpoint +
video_preprocessor_config.json: fps sampling, ``video_fps`` 2, min 4 / max 768 frames, frame pixels
4..64 x 28 x 28). Per clip, the best of ``--repeat`` runs of each
path (the paths interleaved clip by clip, so they share the load):

    header     plan_video(bytes)                       container header only -> indices, grid, tokens
    sampled    decode_video + patchify_video           ours: seek to the keyframe before each run of sampled
                                                       frames, decode just that run (GOPs with no sampled frame
                                                       never decoded), rgb24 of the sampled frames only
    hf_pyav    HF's read_video_pyav loop               decode from the start up to the last sampled frame,
                                                       rgb24 of the sampled frames only (transformers video_utils)
    all_frames decode every frame, rgb24 of every one  what a decode-everything loader does (torchvision
                                                       read_video style), then pick the sampled frames

Both baselines set the stream's thread_type "AUTO" as ours does (1 thread on the pinned core). Every path then
does the same resize (resize_frames: HF's bicubic antialias on uint8) and
patchify_video; the output of each baseline is checked equal to ours. The header cost is
timed on its own (and is not part of the decode figures: a loader pays it once at measure time).
Reported per path: clips/s, sampled frames/s, decoded frames per sampled frame, speed-up of ours; and
with the shared resize + patchify (timed alone on the decoded frames) taken out: decode ms/clip, its speed-up.

``--part hf`` (issue 46): per core, ours against what a user of HF runs today on the same clip files (the
``--part decode`` clips, written to disk): HF's ``load_video(path, backend=...)`` with the processor's own
``sample_frames`` (``--hf-loaders``: pyav, load_video's default; torchcodec, what HF's video processors fetch a
path with) + ``Qwen2VLVideoProcessor(videos=[frames], do_sample_frames=False)`` (torchvision resize, float32
rescale + normalize, patchify), run by benchmarks/bench_video_hf.py in the reference interpreter (.venv-ref,
``RAY_MMBATCH_REFERENCE_PYTHON``) pinned to the same core, one clip a request; ours: read the file,
``plan_video`` (measure's header probe) + ``decode_video`` + ``patchify_video`` (materialize), uint8; then, apart,
the float32 normalize the trainer does (``normalize_video_patches``, here on the CPU). CPU seconds of each process
(``time.process_time``), per clip the best of ``--repeat``, the sides interleaved clip by clip (their order
turning each repeat). Checked first, per clip and loader: the same sampled indices, grid, and pixels (ours
normalized == HF's ``pixel_values_videos``, bit for bit).

``--part train``: real (non-padding) tokens/s of forward + backward (no optimizer step: both strategies
see the same weights) of the tiny Qwen2-VL (tests/hf_checkpoints.make_qwen_checkpoint, its default
initializer_range, the video processor above) on CPU, on ``--samples`` mixed samples (half short clips of
1-8 s of three sizes, half images of random size; text of varying length), measured by measure_batch and
materialized by materialize_sample (not timed), in one shuffled sample order:

    pack     plan_batches_arrays(tokens, patches, images, Budget(max_tokens, "pack", max_frames=...),
             frames=...) -> collate_pack (one row, no padding)
    pad      the same with Budget(mode="pad") (rows x longest <= max_tokens) -> collate_pad
    fixed    ``--batch-size`` samples at a time in sample order -> collate_pad (padded to the longest)

``--passes`` passes over the samples each (the same batches again), one untimed warm-up step each (its
smallest batch); the strategies' steps interleaved (the one least far through its passes steps next).
Reported: batches, real and processed tokens, padding share, peak tokens (processed) per batch, peak
frames per batch, median step; seconds per pass and real tokens/s two ways: "best" = a pass at each
batch's fastest of its ``--passes`` steps (timeit's convention: the least disturbed on a shared machine), and
"mean" over all passes. On CPU, HF's sdpa
attends a packed row through one [1, 1, T, T] block-causal mask (all T^2 entries computed; varlen flash
attention needs a GPU), so pack pays attention over the whole row; a pad row attends within itself.

    python benchmarks/bench_video.py --part decode [--clips 24 --seconds 10 --fps 30 --size 224x320 --gop 30]
    python benchmarks/bench_video.py --part hf [--clips 24 ... as decode, --hf-loaders pyav,torchcodec]
    python benchmarks/bench_video.py --part train [--samples 48 --max-tokens 2048 --max-frames 64 --batch-size 4]
    python benchmarks/bench_video.py --part sample [--clips 8 --containers mp4,webm,mkv]

``--part sample`` (issue 44: a clip probed once per sample): per clip and container, the pipeline's own
measure_batch (the probe) and materialize_sample (the decode) on a one-video sample, best of ``--repeat``, the
containers interleaved, pinned to one core; CPU time of the process (time.process_time: on a shared machine the
wall time measures the neighbours).

Figures and the exact commands: benchmarks/RESULTS.md ("## Video (issue 37)").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: tests/

from ray_mmbatch import schema as S  # noqa: E402
from ray_mmbatch.config import Config  # noqa: E402
from ray_mmbatch.data.video import (  # noqa: E402
    decode_sampled,
    decode_video,
    patchify_video,
    plan_video,
    resize_frames,
)
from ray_mmbatch.synthetic.video import clip_frames, encode_clip  # noqa: E402

# HF Qwen2VLVideoProcessor settings written into the tiny checkpoint: fps 2 sampling, HF's min / max frames,
# frame pixels 4 .. 64 merged tokens (28 x 28 px each)
VIDEO_PROCESSOR = {"video_processor_type": "Qwen2VLVideoProcessor", "do_sample_frames": True, "fps": 2.0,
                   "min_frames": 4, "max_frames": 768, "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
                   "size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28},
                   "image_mean": [0.48145466, 0.4578275, 0.40821073],
                   "image_std": [0.26862954, 0.26130258, 0.27577711]}


def tiny_checkpoint(directory: str) -> str:
    from tests.hf_checkpoints import make_qwen_checkpoint

    path = make_qwen_checkpoint(directory, "qwen2_vl")
    (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR))
    return str(path)


def configured(path: str) -> Config:
    from ray_mmbatch.models import qwen_vl

    cfg = Config()
    cfg.model.path = path
    qwen_vl.configure(cfg)
    return cfg


def pin_one_cpu(cpu: int | None) -> int:
    """Pin this process to one core (the last allowed one unless given): one data CPU."""
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[-1] if cpu is None else cpu
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    return core


# ------------------------------------------------------------------ part 1: decode
def decode_ours(data: bytes, plan, cfg) -> np.ndarray:
    return patchify_video(decode_video(data, plan, cfg), cfg)


def _finish(frames, plan, cfg) -> np.ndarray:
    """The part every path shares: resize the sampled frames to the plan's grid, patchify."""
    ps = cfg.patch_size
    return patchify_video(resize_frames(np.stack(frames), plan.grid[1] * ps, plan.grid[2] * ps), cfg)


def decode_hf_pyav(data: bytes, plan, cfg) -> tuple[np.ndarray, int]:
    """transformers.video_utils.read_video_pyav's loop: decode from the start to the last sampled frame,
    rgb24 of the sampled ones only."""
    import io

    import av

    want, last = set(int(i) for i in plan.indices), int(plan.indices[-1])
    kept, n = [], 0
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        stream.thread_type = "AUTO"
        for n, frame in enumerate(c.decode(stream)):
            if n > last:
                break
            if n in want:
                kept.append(frame)
    rgb = {i: f.to_ndarray(format="rgb24") for i, f in zip(sorted(want), kept)}
    return _finish([rgb[int(i)] for i in plan.indices], plan, cfg), n + 1


def decode_all(data: bytes, plan, cfg) -> tuple[np.ndarray, int]:
    """Decode every frame and convert every one to rgb24, then pick the sampled frames."""
    import io

    import av

    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        stream.thread_type = "AUTO"
        every = [f.to_ndarray(format="rgb24") for f in c.decode(stream)]
    return _finish([every[int(i)] for i in plan.indices], plan, cfg), len(every)


def _encode_h264(frames: np.ndarray, fps: float, gop: int, bframes: int, x264_params: str) -> bytes:
    """An H.264 mp4 of ``frames`` with x264's GOP size, B-frames and these x264-params."""
    import io
    from fractions import Fraction

    import av

    buf = io.BytesIO()
    out = av.open(buf, mode="w", format="mp4")
    stream = out.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001),
                            options={"x264-params": x264_params})
    stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
    stream.codec_context.gop_size = gop
    stream.codec_context.max_b_frames = bframes
    for rgb in frames:
        for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()
    return buf.getvalue()


def encode_fixed_gop(frames: np.ndarray, fps: float, gop: int) -> bytes:
    """encode_clip's H.264 mp4 with x264's scene-cut keyframes off (``scenecut=0``): a keyframe exactly every
    ``gop`` frames. encode_clip leaves scene-cut detection on, which adds keyframes where the drawn content
    jumps (its gradient wraps) and, on noisy frames, every few frames."""
    return _encode_h264(frames, fps, gop, 0, "scenecut=0")


def encode_b_pyramid(frames: np.ndarray, fps: float, gop: int, bframes: int, pyramid: str) -> bytes:
    """encode_clip's H.264 mp4 (scene-cut on) with x264's ``b-pyramid`` set: "none" makes every B-frame a
    non-reference frame (encode_clip leaves x264's default, "normal": the middle B-frame of a run referenced)."""
    return _encode_h264(frames, fps, gop, bframes, f"b-pyramid={pyramid}")


def keyframes(data: bytes) -> int:
    import io

    import av

    with av.open(io.BytesIO(data)) as c:
        return sum(bool(p.is_keyframe) for p in c.demux(video=0) if p.size)


def noisy(frames: np.ndarray, sigma: float, seed: int) -> np.ndarray:
    """Gaussian noise of ``sigma`` grey levels on every pixel (a higher, camera-like bit rate); 0 = as drawn."""
    if not sigma:
        return frames
    noise = np.random.default_rng(seed).standard_normal(frames.shape, dtype=np.float32)
    noise *= sigma
    noise += frames
    return np.clip(noise, 0, 255, out=noise).astype(np.uint8)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def make_clips(args) -> tuple[int, int, int, list[bytes], np.ndarray, float]:
    """--clips generated H.264 mp4 clips (--size, --seconds, --fps, --gop, --bframes, --noise, --fixed-gop):
    (h, w, frames per clip, the clips, keyframes per clip, encode seconds)."""
    h, w = (int(x) for x in args.size.split("x"))
    n = int(round(args.seconds * args.fps))
    t0 = time.perf_counter()
    if args.fixed_gop:
        if args.bframes:
            raise SystemExit("--fixed-gop encodes without B-frames")
        clips = [encode_fixed_gop(noisy(clip_frames(n, h, w, seed=i), args.noise, i), args.fps, args.gop)
                 for i in range(args.clips)]
    elif args.b_pyramid:
        clips = [encode_b_pyramid(noisy(clip_frames(n, h, w, seed=i), args.noise, i), args.fps, args.gop,
                                  args.bframes, args.b_pyramid) for i in range(args.clips)]
    else:
        clips = [encode_clip(noisy(clip_frames(n, h, w, seed=i), args.noise, i), fps=args.fps, gop=args.gop,
                             bframes=args.bframes) for i in range(args.clips)]
    kf = np.array([keyframes(c) for c in clips])
    return h, w, n, clips, kf, time.perf_counter() - t0


def part_decode(args, tmp: str) -> dict:
    core = pin_one_cpu(args.cpu)
    cfg = configured(tiny_checkpoint(os.path.join(tmp, "ckpt"))).image
    h, w, n, clips, kf, encode_s = make_clips(args)
    paths = ("sampled", "hf_pyav", "all_frames")
    best = {p: np.full(len(clips), np.inf) for p in ("header", "resize_patchify") + paths}
    decoded = {p: np.zeros(len(clips), np.int64) for p in paths}
    sampled = np.zeros(len(clips), np.int64)
    plans, raw = [], []
    for k, data in enumerate(clips):
        plan = plan_video(data, cfg)
        plans.append(plan)
        sampled[k] = plan.frames
        got, decoded["sampled"][k], _ = decode_sampled(data, plan)
        raw.append(np.stack(got))
        ref = decode_ours(data, plan, cfg)
        for fn, p in ((decode_hf_pyav, "hf_pyav"), (decode_all, "all_frames")):
            out, decoded[p][k] = fn(data, plan, cfg)
            assert np.array_equal(out, ref), (p, k)
    t0 = time.perf_counter()
    for _ in range(args.repeat):
        for k, data in enumerate(clips):
            plan = plans[k]
            best["header"][k] = min(best["header"][k], timed(plan_video, data, cfg))
            best["resize_patchify"][k] = min(best["resize_patchify"][k], timed(_finish, raw[k], plan, cfg))
            for p, fn in (("sampled", decode_ours), ("hf_pyav", decode_hf_pyav), ("all_frames", decode_all)):
                best[p][k] = min(best[p][k], timed(fn, data, plan, cfg))
    measure_s = time.perf_counter() - t0
    p0 = plans[0]
    setup = {"clips": args.clips, "seconds": args.seconds, "fps": args.fps, "size": f"{h}x{w}", "gop": args.gop,
             "bframes": args.bframes, "noise": args.noise, "fixed_gop": args.fixed_gop,
             "keyframes_per_clip": [int(kf.min()), float(kf.mean()), int(kf.max())], "frames_per_clip": n,
             "mb_per_clip": float(np.mean([len(c) for c in clips]) / 2**20),
             "sampled_frames_per_clip": float(sampled.mean()), "grid": list(p0.grid), "tokens_per_clip": p0.tokens,
             "repeat": args.repeat, "cpu": core, "encode_s": encode_s, "measure_s": measure_s}
    rows = []
    common = float(best["resize_patchify"].sum())
    for p in paths:
        total = float(best[p].sum())
        rows.append({"path": p, "ms_per_clip": 1000 * total / len(clips), "clips_per_s": len(clips) / total,
                     "sampled_frames_per_s": float(sampled.sum()) / total,
                     "decoded_per_sampled": float(decoded[p].sum() / sampled.sum()),
                     "speedup_of_sampled": total / float(best["sampled"].sum()),
                     "decode_ms_per_clip": 1000 * (total - common) / len(clips),
                     "decode_speedup_of_sampled": (total - common) / (float(best["sampled"].sum()) - common)})
    header_ms = 1000 * best["header"]
    out = {"part": "decode", **setup, "resize_patchify_ms_per_clip": 1000 * common / len(clips),
           "header_ms_mean": float(header_ms.mean()),
           "header_ms_median": float(np.median(header_ms)), "header_ms_max": float(header_ms.max()), "rows": rows}
    print(f"clips {args.clips} x {args.seconds:g} s, {n} frames {h}x{w} @ {args.fps:g} fps, H.264 GOP {args.gop} "
          f"({'fixed' if args.fixed_gop else 'x264 scene-cut on'}: keyframes/clip {kf.min()}..{kf.max()}, "
          f"mean {kf.mean():.1f}), b-frames {args.bframes}, noise {args.noise:g}, {setup['mb_per_clip']:.2f} MB/clip "
          f"({setup['mb_per_clip'] * 8 * 2**20 / 1e6 / args.seconds:.2f} Mbit/s); "
          f"sampled {sampled.mean():g} frames/clip, grid {tuple(p0.grid)}, {p0.tokens} tokens/clip; "
          f"best of {args.repeat}, pinned to CPU {core}")
    print(f"header (plan_video) per clip: mean {header_ms.mean():.2f} ms, median {np.median(header_ms):.2f} ms, "
          f"max {header_ms.max():.2f} ms")
    print(f"resize + patchify (every path, in its ms/clip): {1000 * common / len(clips):.1f} ms/clip")
    print(f"{'path':<11}{'ms/clip':>9}{'clips/s':>9}{'sampled fr/s':>14}{'decoded/sampled':>17}{'ours x':>8}"
          f"{'decode ms':>11}{'decode x':>10}")
    for r in rows:
        print(f"{r['path']:<11}{r['ms_per_clip']:9.1f}{r['clips_per_s']:9.2f}{r['sampled_frames_per_s']:14.1f}"
              f"{r['decoded_per_sampled']:17.2f}{r['speedup_of_sampled']:8.2f}{r['decode_ms_per_clip']:11.1f}"
              f"{r['decode_speedup_of_sampled']:10.2f}")
    print(f"(encode {encode_s:.1f} s untimed; measuring {measure_s:.1f} s)")
    return out


# ------------------------------------------------------------------ part 1b: against HF's loader and processor
REFERENCE_PYTHON = os.environ.get("RAY_MMBATCH_REFERENCE_PYTHON",
                                  os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                               ".venv-ref", "bin", "python"))


class HFSide:
    """benchmarks/bench_video_hf.py in the reference interpreter, pinned to ``core``: one clip a request."""

    def __init__(self, checkpoint: str, core: int, cap: bool):
        import subprocess

        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_video_hf.py")
        cmd = [REFERENCE_PYTHON, script, checkpoint, str(core)] + (["--cap-pixels-per-frame"] if cap else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = json.loads(self.proc.stdout.readline())

    def __call__(self, path: str, loader: str, out: str = "") -> dict:
        self.proc.stdin.write(json.dumps({"path": path, "loader": loader, "out": out}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the HF side stopped (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def ours_timed(path: str, cfg) -> tuple[np.ndarray, dict]:
    """Ours on a clip file, as the pipeline runs it (measure's plan_video, materialize's decode_video +
    patchify_video), each step's CPU seconds; then the float32 normalize HF's processor does (the trainer's
    normalize_video_patches, here on the CPU) timed on its own."""
    from ray_mmbatch.models.hf_common import normalize_video_patches

    t0 = time.process_time()
    with open(path, "rb") as f:
        data = f.read()
    plan = plan_video(data, cfg)
    t1 = time.process_time()
    frames = decode_video(data, plan, cfg)
    t2 = time.process_time()
    patches = patchify_video(frames, cfg)
    t3 = time.process_time()
    normalize_video_patches(torch.from_numpy(patches), cfg.video_mean, cfg.video_std)
    t4 = time.process_time()
    return patches, {"cpu_s": t3 - t0, "plan_s": t1 - t0, "decode_s": t2 - t1, "patchify_s": t3 - t2,
                     "normalize_s": t4 - t3}


def part_hf(args, tmp: str) -> dict:
    """Per core: ours (plan_video + decode_video + patchify_video) against HF's load_video(backend=each of
    --hf-loaders) + Qwen2VLVideoProcessor on the same clip files, in CPU seconds, clip by clip interleaved (the
    order of the sides turning each repeat), best of --repeat per clip and side."""
    from ray_mmbatch.models.hf_common import normalize_video_patches

    core = pin_one_cpu(args.cpu)
    ckpt = tiny_checkpoint(os.path.join(tmp, "ckpt"))
    cfg = configured(ckpt).image
    h, w, n, clips, kf, encode_s = make_clips(args)
    paths = []
    for k, data in enumerate(clips):
        paths.append(os.path.join(tmp, f"clip{k:03d}.mp4"))
        with open(paths[-1], "wb") as f:
            f.write(data)
    loaders = args.hf_loaders.split(",")
    hf = HFSide(ckpt, core, cfg.video_cap_pixels_per_frame)
    keys = {"ours": ("cpu_s", "plan_s", "decode_s", "patchify_s", "normalize_s"),
            **{f"hf_{lo}": ("cpu_s", "load_s", "process_s") for lo in loaders}}
    best = {(side, key): np.full(len(clips), np.inf) for side, ks in keys.items() for key in ks}
    sampled = np.zeros(len(clips), np.int64)
    decoded = np.zeros(len(clips), np.int64)  # frames our decoder output per clip (untimed count)

    def run(side: str, path: str) -> dict:
        return ours_timed(path, cfg)[1] if side == "ours" else hf(path, side[3:])

    try:
        for k, path in enumerate(paths):  # the same work on every side (also the warm-up, untimed)
            plan = plan_video(clips[k], cfg)
            sampled[k] = plan.frames
            decoded[k] = decode_sampled(clips[k], plan)[1]
            ours, _ = ours_timed(path, cfg)
            normalized = normalize_video_patches(torch.from_numpy(ours), cfg.video_mean, cfg.video_std).numpy()
            for lo in loaders:
                out = os.path.join(tmp, f"hf_{lo}{k:03d}.npz")
                hf(path, lo, out)
                ref = np.load(out)
                assert plan.indices.tolist() == ref["indices"].tolist(), (lo, k, plan.indices, ref["indices"])
                assert list(plan.grid) == ref["grid"].tolist(), (lo, k, plan.grid, ref["grid"])
                assert np.array_equal(normalized, ref["pixels"]), (lo, k,
                                                                   float(np.abs(normalized - ref["pixels"]).max()))
        sides = list(keys)
        t0 = time.perf_counter()
        for r in range(args.repeat):
            for k, path in enumerate(paths):
                for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                    for key, v in run(side, path).items():
                        if (side, key) in best:
                            best[side, key][k] = min(best[side, key][k], v)
        measure_s = time.perf_counter() - t0
    finally:
        hf.close()
    ms = {key: 1000 * float(v.mean()) for key, v in best.items()}
    p0 = plan_video(clips[0], cfg)
    fr = float(sampled.mean())
    ours_ms, with_norm = ms["ours", "cpu_s"], ms["ours", "cpu_s"] + ms["ours", "normalize_s"]
    out = {"part": "hf", "clips": args.clips, "seconds": args.seconds, "fps": args.fps, "size": f"{h}x{w}",
           "gop": args.gop, "bframes": args.bframes, "noise": args.noise, "fixed_gop": args.fixed_gop,
           "keyframes_per_clip": float(kf.mean()), "frames_per_clip": n,
           "mb_per_clip": float(np.mean([len(c) for c in clips]) / 2**20),
           "sampled_frames_per_clip": fr, "grid": list(p0.grid), "tokens_per_clip": p0.tokens,
           "b_pyramid": args.b_pyramid, "ours_decoded_per_clip": float(decoded.mean()),
           "repeat": args.repeat, "cpu": core, "hf": hf.ready, "encode_s": encode_s, "measure_s": measure_s,
           "ms_per_clip": {f"{side}/{key[:-2]}": v for (side, key), v in ms.items()},
           "ours_faster": {lo: ms[f"hf_{lo}", "cpu_s"] / ours_ms for lo in loaders},
           "ours_with_normalize_faster": {lo: ms[f"hf_{lo}", "cpu_s"] / with_norm for lo in loaders}}
    print(f"clips {args.clips} x {args.seconds:g} s, {n} frames {h}x{w} @ {args.fps:g} fps, H.264 GOP {args.gop} "
          f"({'fixed' if args.fixed_gop else 'x264 scene-cut on'}, keyframes/clip mean {kf.mean():.1f}), b-frames "
          f"{args.bframes}, noise {args.noise:g}, {out['mb_per_clip']:.2f} MB/clip; sampled {fr:g} frames/clip, grid "
          f"{tuple(p0.grid)}, {p0.tokens} tokens/clip; ours decodes {decoded.mean():.1f} frames/clip; CPU ms per clip, "
          f"best of {args.repeat}, every side pinned to CPU {core}; HF: {hf.ready}")
    print("| side | CPU ms / clip | steps (CPU ms / clip, each its own best) | sampled frames / CPU s | "
          + " | ".join(f"ours vs HF {lo}" for lo in loaders) + " |")
    print("|---|---:|---|---:|" + "---:|" * len(loaders))
    for lo in loaders:
        t = ms[f"hf_{lo}", "cpu_s"]
        print(f"| HF load_video({lo}) + processor | {t:.1f} | load {ms[f'hf_{lo}', 'load_s']:.1f}, process "
              f"{ms[f'hf_{lo}', 'process_s']:.1f} | {1000 * fr / t:.0f} | "
              + " | ".join("" for _ in loaders) + " |")
    print(f"| ours: plan + decode + patchify (uint8) | {ours_ms:.1f} | plan {ms['ours', 'plan_s']:.1f}, decode + "
          f"resize {ms['ours', 'decode_s']:.1f}, patchify {ms['ours', 'patchify_s']:.2f} | {1000 * fr / ours_ms:.0f} | "
          + " | ".join(f"{out['ours_faster'][lo]:.2f}x" for lo in loaders) + " |")
    print(f"| ours + float32 normalize on the CPU | {with_norm:.1f} | normalize {ms['ours', 'normalize_s']:.2f} | "
          f"{1000 * fr / with_norm:.0f} | " + " | ".join(f"{out['ours_with_normalize_faster'][lo]:.2f}x"
                                                       for lo in loaders) + " |")
    print(f"(encode {encode_s:.1f} s untimed; measuring {measure_s:.1f} s wall)")
    return out


# ------------------------------------------------------------------ part 2: train
WORDS = ("the a square moves left right up down red green blue slowly quickly across frame picture shows "
         "striped noise pattern bright dark corner centre then stops again").split()


def mixed_raw(n: int, seed: int) -> dict:
    """n samples in one shuffled order: half clips (1-8 s, 30 fps, three sizes), half images (random size)."""
    import io

    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = [(112, 160), (168, 224), (224, 320)]
    rows = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS, int(rng.integers(4, 80))))
        if i % 2 == 0:
            secs = int(rng.integers(1, 9))
            h, w = sizes[int(rng.integers(len(sizes)))]
            media = encode_clip(clip_frames(30 * secs, h, w, seed=i), fps=30, gop=30)
            rows.append((f"clip{i:02d}_{secs}s_{h}x{w}", "<video>\nWhat happens in the clip?", words, media))
        else:
            w, h = (int(x) for x in rng.integers(48, 640, 2))
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
            rows.append((f"img{i:02d}_{w}x{h}", "<image>\nDescribe the picture.", words, buf.getvalue()))
    rows = [rows[k] for k in rng.permutation(n)]
    return {S.SAMPLE_ID: [r[0] for r in rows],
            S.CONVERSATIONS: [json.dumps([{"from": "human", "value": u}, {"from": "gpt", "value": a}])
                              for _, u, a, _ in rows],
            S.IMAGES: [[m] for *_, m in rows], S.IMAGE_REFS: [[""] for _ in rows], S.READ_ERROR: [""] * n}


def part_train(args, tmp: str) -> dict:
    from ray_mmbatch.batching.budget import Budget
    from ray_mmbatch.batching.collate import collate_pack, collate_pad
    from ray_mmbatch.batching.plan import plan_batches_arrays
    from ray_mmbatch.data.materialize import materialize_sample
    from ray_mmbatch.data.measure import measure_batch
    from ray_mmbatch.data.text.tokenizer import load_tokenizer
    from ray_mmbatch.models import qwen_vl
    from ray_mmbatch.models.inputs import batch_to_torch

    torch.set_num_threads(args.threads)
    cfg = configured(tiny_checkpoint(os.path.join(tmp, "ckpt")))
    tok = load_tokenizer(cfg.text.tokenizer)
    ids = {"vocab_size": len(tok), "image_token_id": tok.convert_tokens_to_ids(cfg.text.image_token),
           "pad_id": tok.pad_token_id}
    t0 = time.perf_counter()
    raw = mixed_raw(args.samples, args.seed)
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    measured = measure_batch(raw, cfg.image, tok, cfg.text)
    measure_s = time.perf_counter() - t0
    bad = [r for r in measured[S.SKIP_REASON] if r]
    assert not bad, bad
    t0 = time.perf_counter()
    samples = [materialize_sample({c: measured[c][i] for c in measured}, cfg.image) for i in range(args.samples)]
    materialize_s = time.perf_counter() - t0
    tokens = np.asarray(measured[S.TOKENS], np.int64)
    frames = np.asarray(measured[S.N_FRAMES], np.int64)
    patches, images = np.asarray(measured[S.PATCHES], np.int64), np.asarray(measured[S.N_IMAGES], np.int64)
    fixed = f"fixed{args.batch_size}"
    groups = {}
    for name in args.strategies.split(","):
        mode, _, limit = name.partition("@")
        if mode in ("pack", "pad"):
            budget = Budget(max_tokens=int(limit or args.max_tokens), mode=mode, max_frames=args.max_frames)
            groups[name] = plan_batches_arrays(tokens, patches, images, budget, seed=args.seed, frames=frames)
        elif name == "fixed":
            groups[fixed] = [list(range(i, min(i + args.batch_size, args.samples)))
                             for i in range(0, args.samples, args.batch_size)]
        else:
            raise SystemExit(f"unknown strategy {name!r}: pack, pad, fixed")
    pad_id = ids["pad_id"]
    batches = {name: [batch_to_torch((collate_pack if name.startswith("pack") else collate_pad)(
        [samples[i] for i in g], pad_id), "cpu") for g in gs] for name, gs in groups.items()}
    torch.manual_seed(args.seed)
    model = qwen_vl.create_model(cfg, ids).train()

    def step(b) -> float:
        t = time.perf_counter()
        ce, n_target = model(b, loss_only=True)
        (ce / n_target.clamp(min=1)).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    for bs in batches.values():  # warm-up: first-call costs, not batch size
        step(min(bs, key=lambda b: b["input_ids"].numel()))
    step_s = {name: [] for name in batches}
    t0 = time.perf_counter()
    while True:
        todo = [n for n in batches if len(step_s[n]) < args.passes * len(batches[n])]
        if not todo:
            break
        name = min(todo, key=lambda n: len(step_s[n]) / len(batches[n]))
        step_s[name].append(step(batches[name][len(step_s[name]) % len(batches[name])]))
    train_wall = time.perf_counter() - t0
    rows = []
    for name, bs in batches.items():
        real = sum(int(b["real_tokens"]) for b in bs)  # per pass
        processed = sum(int(b["input_ids"].numel()) for b in bs)
        fr = [int(frames[g].sum()) for g in groups[name]]
        secs = float(sum(step_s[name])) / args.passes  # mean seconds per pass
        per_batch = np.asarray(step_s[name]).reshape(args.passes, len(bs))
        best = float(per_batch.min(axis=0).sum())  # a pass at each batch's best step (timeit's convention)
        big = max(bs, key=lambda b: b["input_ids"].numel())
        rows.append({"strategy": name, "batches": len(bs), "samples": sum(len(g) for g in groups[name]),
                     "real_tokens": real, "processed_tokens": processed, "padding_share": 1 - real / processed,
                     "peak_tokens": int(big["input_ids"].numel()),
                     "peak_shape": "x".join(map(str, big["input_ids"].shape)),
                     "peak_real_tokens": max(int(b["real_tokens"]) for b in bs), "peak_frames": max(fr),
                     "train_s_per_pass": secs, "best_s_per_pass": best,
                     "step_s_median": float(np.median(step_s[name])),
                     "real_tokens_per_s": real / best, "real_tokens_per_s_mean": real / secs})
    base = next((r for r in rows if r["strategy"] == fixed), None)
    for r in rows:
        r["speedup_vs_fixed"] = r["real_tokens_per_s"] / base["real_tokens_per_s"] if base else float("nan")
        r["speedup_vs_fixed_mean"] = r["real_tokens_per_s_mean"] / base["real_tokens_per_s_mean"] if base else \
            float("nan")
    is_clip = np.asarray(measured[S.N_VIDEOS], np.int64) > 0
    setup = {"samples": args.samples, "clips": int(is_clip.sum()), "images": int((~is_clip).sum()),
             "tokens_total": int(tokens.sum()), "tokens_min": int(tokens.min()), "tokens_max": int(tokens.max()),
             "clip_tokens_mean": float(tokens[is_clip].mean()), "image_tokens_mean": float(tokens[~is_clip].mean()),
             "frames_per_clip": [int(frames[is_clip].min()), int(frames[is_clip].max())],
             "max_tokens": args.max_tokens, "max_frames": args.max_frames, "batch_size": args.batch_size,
             "passes": args.passes,
             "threads": args.threads, "generate_s": gen_s, "measure_s": measure_s, "materialize_s": materialize_s,
             "train_wall_s": train_wall,
             "parameters": sum(p.numel() for p in model.parameters())}
    out = {"part": "train", **setup, "rows": rows}
    print(f"{args.samples} samples ({setup['clips']} clips {setup['frames_per_clip'][0]}-{setup['frames_per_clip'][1]} "
          f"frames, mean {setup['clip_tokens_mean']:.0f} tokens; {setup['images']} images, mean "
          f"{setup['image_tokens_mean']:.0f} tokens), {setup['tokens_total']} tokens, {setup['tokens_min']}.."
          f"{setup['tokens_max']} per sample; tiny Qwen2-VL {setup['parameters'] / 1e6:.2f} M params, "
          f"{args.threads} torch thread(s), forward + backward, {args.passes} pass(es) each")
    print(f"(generate {gen_s:.1f} s, measure_batch {measure_s:.1f} s, materialize {materialize_s:.1f} s, "
          f"training {train_wall:.1f} s wall)")
    print(f"{'strategy':<10}{'batches':>8}{'real tok':>9}{'proc tok':>9}{'padding':>8}{'peak tok':>9}{'peak shape':>11}"
          f"{'peak fr':>8}{'step s':>7}{'best s':>8}{'real tok/s':>11}{'x':>6}{'mean s':>8}{'tok/s':>7}{'x':>6}")
    for r in rows:
        print(f"{r['strategy']:<10}{r['batches']:>8}{r['real_tokens']:>9}{r['processed_tokens']:>9}"
              f"{100 * r['padding_share']:7.1f}%{r['peak_tokens']:>9}{r['peak_shape']:>11}{r['peak_frames']:>8}"
              f"{r['step_s_median']:7.2f}{r['best_s_per_pass']:8.2f}{r['real_tokens_per_s']:11.0f}"
              f"{r['speedup_vs_fixed']:6.2f}{r['train_s_per_pass']:8.2f}{r['real_tokens_per_s_mean']:7.0f}"
              f"{r['speedup_vs_fixed_mean']:6.2f}")
    return out


def part_sample(args, tmp: str) -> dict:
    """Per clip and container: measure_batch (the probe: cost before decode) and materialize_sample (the decode),
    the same functions the pipeline runs, one video sample per call; best of --repeat, containers interleaved."""
    from ray_mmbatch.data.materialize import materialize_sample
    from ray_mmbatch.data.measure import measure_batch
    from ray_mmbatch.data.text.tokenizer import load_tokenizer

    core = pin_one_cpu(args.cpu)
    cfg = configured(tiny_checkpoint(os.path.join(tmp, "ckpt")))
    tok = load_tokenizer(cfg.text.tokenizer)
    h, w = (int(x) for x in args.size.split("x"))
    n = int(round(args.seconds * args.fps))
    containers = args.containers.split(",")
    clips = {c: [encode_clip(clip_frames(n, h, w, seed=args.seed + i), fps=args.fps, gop=args.gop, container=c)
                 for i in range(args.clips)] for c in containers}
    conv = json.dumps([{"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "A clip."}])
    best = {c: {"measure": [float("inf")] * args.clips, "materialize": [float("inf")] * args.clips}
            for c in containers}
    for _ in range(args.repeat):
        for i in range(args.clips):
            for c in containers:
                raw = {S.SAMPLE_ID: [f"{c}{i}"], S.CONVERSATIONS: [conv], S.IMAGES: [[clips[c][i]]],
                       S.IMAGE_REFS: [[""]], S.READ_ERROR: [""]}
                t0 = time.process_time()  # CPU seconds of this process: the machine is shared
                measured = measure_batch(raw, cfg.image, tok, cfg.text)
                t1 = time.process_time()
                assert not measured[S.SKIP_REASON][0], measured[S.SKIP_REASON][0]
                materialize_sample({k: v[0] for k, v in measured.items()}, cfg.image)
                t2 = time.process_time()
                best[c]["measure"][i] = min(best[c]["measure"][i], t1 - t0)
                best[c]["materialize"][i] = min(best[c]["materialize"][i], t2 - t1)
    out = {"part": "sample", "core": core, "clips": args.clips, "frames": n, "size": args.size, "gop": args.gop,
           "per_clip_ms": {}}
    print(f"{args.clips} clips per container, {n} frames {h}x{w} at {args.fps} fps, GOP {args.gop}; best of "
          f"{args.repeat}, one core")
    print("| container | MB / clip | measure CPU ms / clip | materialize CPU ms / clip | sum |")
    print("|---|---:|---:|---:|---:|")
    for c in containers:
        m, d = (1000 * float(np.mean(best[c][k])) for k in ("measure", "materialize"))
        mb = float(np.mean([len(b) for b in clips[c]])) / 1e6
        out["per_clip_ms"][c] = {"measure": m, "materialize": d, "mb": mb}
        print(f"| {c} | {mb:.3f} | {m:.2f} | {d:.2f} | {m + d:.2f} |")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("decode", "hf", "train", "sample"), required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="write the result here too")
    d = ap.add_argument_group("decode")
    d.add_argument("--clips", type=int, default=24)
    d.add_argument("--seconds", type=float, default=10.0)
    d.add_argument("--fps", type=float, default=30.0)
    d.add_argument("--size", default="224x320", help="HxW of the clips")
    d.add_argument("--gop", type=int, default=30, help="keyframe interval (frames)")
    d.add_argument("--bframes", type=int, default=0)
    d.add_argument("--b-pyramid", choices=("none", "strict", "normal"), default=None,
                   help="x264's b-pyramid (default: x264's own, normal); none: every B-frame a non-reference frame")
    d.add_argument("--fixed-gop", action="store_true",
                   help="x264 scene-cut off (encode_fixed_gop): a keyframe exactly every --gop frames")
    d.add_argument("--noise", type=float, default=0.0,
                   help="Gaussian noise (grey levels) on the drawn frames before encoding: a camera-like bit rate")
    d.add_argument("--repeat", type=int, default=3, help="best of this many runs per clip and path")
    d.add_argument("--cpu", type=int, default=None, help="the core to pin to (default: the last allowed)")
    d.add_argument("--containers", default="mp4,webm,mkv", help="--part sample: the containers, interleaved")
    d.add_argument("--hf-loaders", default="pyav,torchcodec",
                   help="--part hf: HF's load_video backends to time (pyav: its default; torchcodec: what its video "
                        "processors fetch a path with)")
    t = ap.add_argument_group("train")
    t.add_argument("--samples", type=int, default=48)
    t.add_argument("--max-tokens", type=int, default=2048)
    t.add_argument("--max-frames", type=int, default=64)
    t.add_argument("--batch-size", type=int, default=4)
    t.add_argument("--strategies", default="pack,pad,fixed",
                   help="pack / pad: token budget (--max-tokens, --max-frames) in that mode, pack@N / pad@N: budget N "
                        "tokens; fixed: --batch-size")
    t.add_argument("--passes", type=int, default=8, help="timed passes over the samples per strategy")
    t.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_video_") as tmp:
        out = {"decode": part_decode, "hf": part_hf, "train": part_train, "sample": part_sample}[args.part](args, tmp)
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
