"""Video decode: the plan's sampled frames only, as HF's PyAV loader decodes them, resized and patchified.

Seek to the keyframe before each run of sampled frames and decode just that run (frames of GOPs holding no
sampled frame are never decoded), RGB as HF's PyAV loader converts it, the display rotation applied, then the
resize HF's torchvision backend does (torch's uint8 bicubic with antialias, bit for bit), then ``patchify_video``
in HF's row layout (channel, frame, py, px) -- uint8 until the training worker normalizes it. A sampled frame
that cannot be decoded is ``corrupt_video``. Pure module: PyAV + numpy; torch only inside resize_frames.
"""
from __future__ import annotations

import numpy as np

from ray_mmbatch import schema as S
from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.video.cost import VideoPlan
from ray_mmbatch.data.video.probe import VideoSkip, _open


def _decode_sampled(data, indices: np.ndarray, expected: int) -> tuple[list[np.ndarray], int]:
    """RGB uint8 [H, W, 3] of each sampled frame (coded orientation) and the frames the GOPs decoded.

    The packets are demuxed once (no decoding) for their presentation times: frame i is the i-th
    smallest pts, as a decoder outputs them. Each run of sampled frames within one GOP is decoded from
    its keyframe (a seek), up to its last sampled frame; GOPs with no sampled frame are never decoded.
    """
    import av

    container = _open(data)
    try:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        pts, keys = [], []
        for packet in container.demux(stream):
            if packet.size > 0:
                pts.append(packet.pts)
                keys.append(bool(packet.is_keyframe))
        if any(p is None for p in pts) or len(pts) != expected:
            if any(p is None for p in pts):
                return _decode_sequential(container, stream, indices)
            raise VideoSkip(S.SKIP_CORRUPT_VIDEO, f"{len(pts)} frames in the stream, its header says {expected}")
        order = np.argsort(np.asarray(pts, dtype=np.int64), kind="stable")
        by_index = np.asarray(pts, dtype=np.int64)[order]
        is_key = np.asarray(keys, dtype=bool)[order]
        key_at = np.maximum.accumulate(np.where(is_key, np.arange(len(order)), 0))  # keyframe before each frame
        wanted: dict[int, list[int]] = {}  # pts -> the output slots that frame fills
        for j, i in enumerate(indices):
            wanted.setdefault(int(by_index[i]), []).append(j)
        out: list[np.ndarray | None] = [None] * len(indices)
        decoded, k = 0, 0
        unique = sorted(set(int(i) for i in indices))
        while k < len(unique):
            start = int(key_at[unique[k]])
            run_end = k
            while run_end + 1 < len(unique) and key_at[unique[run_end + 1]] == start:
                run_end += 1
            last_pts = int(by_index[unique[run_end]])
            container.seek(int(by_index[start]), stream=stream, backward=True, any_frame=False)
            for frame in container.decode(stream):
                decoded += 1
                if frame.pts is None:
                    continue
                if frame.pts in wanted:
                    rgb = frame.to_ndarray(format="rgb24")
                    for j in wanted[frame.pts]:
                        out[j] = rgb
                if frame.pts >= last_pts:
                    break
            k = run_end + 1
        missing = [int(indices[j]) for j, f in enumerate(out) if f is None]
        if missing:
            raise VideoSkip(S.SKIP_CORRUPT_VIDEO, f"frames {missing[:5]} could not be decoded")
        return out, decoded
    except av.FFmpegError as e:
        raise VideoSkip(S.SKIP_CORRUPT_VIDEO, f"decoding failed: {e}") from None
    finally:
        container.close()


def _decode_sequential(container, stream, indices: np.ndarray) -> tuple[list[np.ndarray], int]:
    """Frames in decode order, counted as HF's PyAV loader counts them (streams without timestamps)."""
    container.seek(0)
    want, last = set(int(i) for i in indices), int(max(indices))
    got: dict[int, np.ndarray] = {}
    n = 0
    for n, frame in enumerate(container.decode(stream)):
        if n in want:
            got[n] = frame.to_ndarray(format="rgb24")
        if n >= last:
            break
    missing = [int(i) for i in indices if int(i) not in got]
    if missing:
        raise VideoSkip(S.SKIP_CORRUPT_VIDEO, f"frames {missing[:5]} could not be decoded")
    return [got[int(i)] for i in indices], n + 1


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [n, H, W, 3] -> uint8 [n, height, width, 3]: HF's torchvision resize (bicubic, antialias, on
    uint8: torch's native kernel), so the pixels equal the processor's bit for bit."""
    import torch

    if frames.shape[1:3] == (height, width):
        return frames
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
    y = torch.nn.functional.interpolate(x, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    return y.permute(0, 2, 3, 1).contiguous().numpy()


def decode_video(data, plan: VideoPlan, cfg: ImageConfig) -> np.ndarray:
    """The plan's sampled frames, displayed orientation, resized to its grid: uint8 [n, H, W, 3]."""
    frames, _ = _decode_sampled(data, plan.indices, plan.header.frames)
    k = (plan.header.rotation // 90) % 4
    if k:
        frames = [np.rot90(f, k=k) for f in frames]
    stacked = np.stack(frames)
    ps = cfg.patch_size
    return resize_frames(stacked, plan.grid[1] * ps, plan.grid[2] * ps)


def video_patches(data, plan: VideoPlan, cfg: ImageConfig) -> np.ndarray:
    """The clip's uint8 patch rows as the family's model takes them: Qwen's (patchify_video), or LLaVA-OneVision's
    one row a frame (channel-major [3, S, S], the frame as its processor resized it)."""
    frames = decode_video(data, plan, cfg)
    if cfg.video == "llava_onevision":
        return np.ascontiguousarray(frames.transpose(0, 3, 1, 2)).reshape(len(frames), -1)
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
