"""Video decode: the plan's sampled frames only, as the decoder outputs them, resized and patchified.

Frame i is the i-th frame the decoder outputs (probe.py's table: the i-th smallest pts of the packets it
does not drop), as HF's PyAV loader (``enumerate(container.decode(video=0))``) and torchcodec index them.
For each run of sampled frames behind one keyframe: seek to that keyframe and decode up to the run's last
frame, taking the frames whose pts is wanted -- GOPs holding no sampled frame are never decoded. That is
exact while the decoder outputs the table's frames; when it does not (a decoded frame whose pts the table
lacks, a wanted frame not met after its seek: a container whose seek lands elsewhere, a stream without
timestamps), the clip is decoded from its start in order and frame i is the i-th output, HF's loader's own
count (``decode_sampled(...).sequential`` says which ran; tests/test_video.py checks both).

Within a run, an H.264 stream's unsampled non-reference frames (nal_ref_idc 0: B-frames outside x264's
b-pyramid, most of a B-frame stream's frames) are not decoded either: the packets are fed to the codec one by
one, each with ``skip_frame`` "NONREF" unless its pts is a wanted one of the run ("DEFAULT"). The codec
skips only pictures no other picture references, so every other frame's pixels are the same; a skipped
frame is not output (and not counted in ``Decoded.decoded``). FFmpeg's frame threads take ``skip_frame``
from the user's context as each packet is submitted (pthread_frame.c update_context_from_user), so it holds
packet by packet with ``thread_type`` "AUTO" too (tests/test_video.py checks the pixels with frame, slice
and no threads). Not for HEVC (its "sub-layer non-reference" pictures may be referenced by pictures of a
higher temporal sub-layer) nor the other codecs: they decode every frame of the run (``SKIP_NONREF``).

Then RGB as HF's loaders convert it, the display rotation the probe applied (np.rot90, as torchcodec turns
the frames), the resize HF's torchvision backend does (torch's uint8 bicubic with antialias, bit for bit), and
``patchify_video`` in HF's row layout (channel, frame, py, px) -- uint8 until the training worker normalizes
it. A sampled frame that cannot be decoded, or a decoder that outputs fewer frames than the probe counted,
is ``corrupt_video``. Pure module: PyAV + numpy; torch only inside resize_frames.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ray_mmbatch import schema as S
from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.video.cost import VideoPlan
from ray_mmbatch.data.video.probe import VideoSkip, _open

# Decoders whose unsampled non-reference frames _by_seek skips (module docstring): H.264 only
SKIP_NONREF = frozenset({"h264"})


class Decoded(NamedTuple):
    frames: list          # RGB uint8 [H, W, 3] per sampled index (coded orientation)
    decoded: int          # frames the decoder output to get them (skipped non-reference frames are not output)
    sequential: bool      # True: decoded in order from the start (the seek table was not followed)


class _OffTable(Exception):
    """The decoder's output is not the probe's table: decode in order instead."""


def _by_seek(container, stream, pts: np.ndarray, seek: np.ndarray) -> tuple[list, int]:
    """Each sampled frame by its pts (``pts[j]``), from the keyframe ``seek[j]``: one seek per run of sampled
    frames behind one keyframe, decoding stops at the run's last frame; an H.264 run skips its unwanted
    non-reference frames (``SKIP_NONREF``)."""
    wanted: dict[int, list[int]] = {}  # pts -> the output slots that frame fills
    for j, p in enumerate(pts.tolist()):
        wanted.setdefault(p, []).append(j)
    out: list[np.ndarray | None] = [None] * len(pts)
    order = sorted(wanted)
    seek_of = {int(p): int(s) for p, s in zip(pts, seek)}
    codec = stream.codec_context
    skip = codec.name in SKIP_NONREF
    decoded, k = 0, 0
    try:
        while k < len(order):
            start, run_end = seek_of[order[k]], k
            while run_end + 1 < len(order) and seek_of[order[run_end + 1]] == start:
                run_end += 1
            last_pts, run = order[run_end], set(order[k:run_end + 1])
            container.seek(start, stream=stream, backward=True, any_frame=False)  # flushes the decoder too
            for frame in (_skipping(container, stream, run) if skip else container.decode(stream)):
                decoded += 1
                if frame.pts is None:
                    raise _OffTable
                if frame.pts in run:  # only this run's frames: one sought past its references may come out broken
                    rgb = frame.to_ndarray(format="rgb24")
                    for j in wanted[frame.pts]:
                        out[j] = rgb
                if frame.pts >= last_pts:
                    break
            if any(out[wanted[p][0]] is None for p in order[k:run_end + 1]):
                raise _OffTable  # the seek landed past a wanted frame (or it never came): not the table's decoder
            k = run_end + 1
    finally:
        if skip:
            codec.skip_frame = "DEFAULT"  # an in-order decode after _OffTable decodes every frame
    return out, decoded


def _skipping(container, stream, run: set[int]):
    """``container.decode(stream)`` (its end-of-stream flush included), with each packet whose pts is not in
    ``run`` sent as "NONREF": the codec skips it if no picture references it (module docstring)."""
    codec = stream.codec_context
    for packet in container.demux(stream):
        codec.skip_frame = "DEFAULT" if packet.pts is None or packet.pts in run else "NONREF"
        yield from packet.decode()


def _in_order(container, stream, indices: np.ndarray, expected: int) -> tuple[list, int]:
    """Frames in decode order from the start, counted as HF's PyAV loader counts them."""
    container.seek(0)
    want, last = set(int(i) for i in indices), int(max(indices))
    got: dict[int, np.ndarray] = {}
    n = -1
    for n, frame in enumerate(container.decode(stream)):
        if n in want:
            got[n] = frame.to_ndarray(format="rgb24")
        if n >= last:
            break
    missing = [int(i) for i in indices if int(i) not in got]
    if missing:
        raise VideoSkip(S.SKIP_CORRUPT_VIDEO, f"frames {missing[:5]} could not be decoded: the decoder output "
                        f"{n + 1} frames, the packets promise {expected}")
    return [got[int(i)] for i in indices], n + 1


def decode_sampled(data, plan: VideoPlan) -> Decoded:
    """RGB uint8 [H, W, 3] of each sampled frame (coded orientation), by seek where exact (module docstring)."""
    import av

    header, indices = plan.header, plan.indices
    container = _open(data)
    try:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        if plan.pts is not None:
            try:
                frames, decoded = _by_seek(container, stream, plan.pts, plan.seek)
                return Decoded(frames, decoded, False)
            except _OffTable:
                pass
        frames, decoded = _in_order(container, stream, indices, header.frames)
        return Decoded(frames, decoded, True)
    except av.FFmpegError as e:
        raise VideoSkip(S.SKIP_CORRUPT_VIDEO, f"decoding failed: {e}") from None
    finally:
        container.close()


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [n, H, W, 3] -> uint8 [n, height, width, 3]: HF's torchvision resize (bicubic, antialias, on
    uint8: torch's native kernel), so the pixels equal the processor's bit for bit.

    The frames go in as they lie, channels last (the [n, 3, H, W] view of NHWC memory), where HF makes them
    contiguous [n, 3, H, W] first: torch's uint8 antialias kernel works on interleaved RGB either way (it packs a
    planar input first, then unpacks), so the pixels are the same (tests/test_video_readers.py checks both
    layouts) and the two layout copies are saved: 3x faster on 20 frames of 224x320 -> 168x252 (issue 46)."""
    import torch

    if frames.shape[1:3] == (height, width):
        return frames
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    y = torch.nn.functional.interpolate(x, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    return np.ascontiguousarray(y.permute(0, 2, 3, 1).numpy())


def decode_video(data, plan: VideoPlan, cfg: ImageConfig) -> np.ndarray:
    """The plan's sampled frames, turned by the probe's rotation, resized to its grid: uint8 [n, H, W, 3]."""
    frames = decode_sampled(data, plan).frames
    k = (plan.header.rotation // 90) % 4
    if k:
        frames = [np.rot90(f, k=k) for f in frames]
    stacked = np.stack(frames)
    ps = cfg.patch_size
    return resize_frames(stacked, plan.grid[1] * ps, plan.grid[2] * ps)


def video_patches(data, plan: VideoPlan, cfg: ImageConfig) -> np.ndarray:
    """The clip's uint8 patch rows as the family's model takes them: Qwen's (patchify_video), LLaVA-OneVision's
    one row a frame (channel-major [3, S, S], the frame as its processor resized it), or Gemma 4's: each frame's
    patches as an image's (data/image patchify: merge-window order, each (c, py, px)), frame after frame."""
    frames = decode_video(data, plan, cfg)
    if cfg.video == "llava_onevision":
        return np.ascontiguousarray(frames.transpose(0, 3, 1, 2)).reshape(len(frames), -1)
    if cfg.video == "gemma4":
        from ray_mmbatch.data.image import patchify

        return np.concatenate([patchify(frame, cfg) for frame in frames])
    return patchify_video(frames, cfg)


def patchify_video(frames: np.ndarray, cfg: ImageConfig) -> np.ndarray:
    """uint8 [n, H, W, 3] -> uint8 [t*gh*gw, 3*tps*ps*ps]: HF Qwen2VLVideoProcessor.patchify's rows
    (merge-window order; each row channel, frame, py, px), the last frame repeated to fill a temporal patch."""
    tps, ps, m = max(1, int(cfg.temporal_patch_size)), cfg.patch_size, cfg.merge_size
    n, height, width, _ = frames.shape
    if pad := -n % tps:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    t, gh, gw = frames.shape[0] // tps, height // ps, width // ps
    x = frames.transpose(0, 3, 1, 2).reshape(t, tps, 3, gh // m, m, ps, gw // m, m, ps)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x).reshape(t * gh * gw, 3 * tps * ps * ps)
