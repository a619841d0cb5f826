"""Video clips for tests, demos and benchmarks, encoded with PyAV (FFmpeg): real containers, real codecs.

``clip_frames`` draws frames whose content moves (a gradient that shifts, a square that travels, the
frame number as a bar), so a frame sampled at the wrong index or a rotation applied wrongly shows in
the pixels. ``encode_clip`` writes them as mp4 (H.264 / MPEG-4 Part 2), webm (VP8 / VP9) or mkv, at
a constant frame rate or at given presentation times (variable frame rate), with an optional
display rotation (the container's display matrix, as phones write it).
"""
from __future__ import annotations

import io
from fractions import Fraction

import numpy as np

CODECS = {"mp4": "libx264", "webm": "libvpx-vp9", "mkv": "libx264"}


def clip_frames(n: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, height, width, 3]: smooth moving content, different in every frame."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, 3)
    yy, xx = np.mgrid[0:height, 0:width]
    out = np.empty((n, height, width, 3), np.uint8)
    side = max(2, min(height, width) // 3)
    for i in range(n):
        shift = 7 * i
        out[i, ..., 0] = (base[0] + xx * 255 // max(width - 1, 1) + shift) % 256
        out[i, ..., 1] = (base[1] + yy * 255 // max(height - 1, 1) + 2 * shift) % 256
        out[i, ..., 2] = base[2]
        top, left = (3 * i) % max(height - side, 1), (5 * i) % max(width - side, 1)
        out[i, top:top + side, left:left + side] = (255 - base) % 256
        bar = min(width, 2 + (i * 3) % max(width - 2, 1))
        out[i, :2, :bar] = 255
    return out


def encode_clip(frames: np.ndarray, fps: float = 10, container: str = "mp4", codec: str | None = None,
                rotation: int = 0, pts_seconds: list[float] | None = None, gop: int = 12,
                bframes: int = 0) -> bytes:
    """Encode uint8 [n, h, w, 3] frames into a container's bytes.

    ``pts_seconds`` gives each frame's presentation time (a variable-frame-rate clip; the stream's
    time base is 1/1000 s); ``rotation`` (degrees counter-clockwise) is written as the display
    matrix (mp4 / mkv). ``gop`` is the keyframe interval.
    """
    codec = codec or CODECS[container]
    buf = io.BytesIO()
    out = __import__("av").open(buf, mode="w", format={"mkv": "matroska"}.get(container, container))
    rate = Fraction(fps).limit_denominator(1001)
    stream = out.add_stream(codec, rate=rate)
    n, height, width = frames.shape[:3]
    stream.width, stream.height = width, height
    stream.pix_fmt = "yuv420p"
    stream.codec_context.gop_size = gop
    if codec in ("libx264", "mpeg4"):
        stream.codec_context.max_b_frames = bframes
    if pts_seconds is not None:
        stream.codec_context.time_base = Fraction(1, 1000)
    if rotation:
        stream.set_display_rotation(rotation)
    av = __import__("av")
    for i, rgb in enumerate(frames):
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
        if pts_seconds is not None:
            frame.pts = int(round(pts_seconds[i] * 1000))
            frame.time_base = Fraction(1, 1000)
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()
    return buf.getvalue()
