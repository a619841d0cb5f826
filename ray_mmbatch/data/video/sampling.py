"""Video sampling: which frames (decode order) the family's HF video processor takes from a clip.

Formula for formula: Qwen2VLVideoProcessor.sample_frames (torch's float arange emulated), Qwen3VLVideoProcessor's
np.linspace, BaseVideoProcessor's default (LLaVA-OneVision, Gemma 4), Glm4vVideoProcessor.sample_frames. Pure
module: numpy only (Gemma 4's token bound reads data/image/budget.py's frame size).
"""
from __future__ import annotations

import math

import numpy as np

from ray_mmbatch import schema as S
from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.video.probe import VideoHeader, VideoSkip


def _torch_float_arange_int(end: int, step: float) -> np.ndarray:
    """``torch.arange(0, end, step).int()`` for a Python float step: float32 values computed in double
    (torch's CPU kernel), truncated to int32; the length ceil(end / step) as torch computes it."""
    n = int(math.ceil(end / step))
    return (np.arange(n, dtype=np.float64) * step).astype(np.float32).astype(np.int32)


def sample_indices(header: VideoHeader, cfg: ImageConfig) -> np.ndarray:
    """Indices (decode order) of the frames the family's HF video processor takes from this clip."""
    total, tps = header.frames, max(1, int(cfg.temporal_patch_size))
    if cfg.video == "qwen3_vl":
        return _sample_qwen3(header, cfg)
    if cfg.video == "glm4v":
        return _sample_glm4v(header, cfg)
    if cfg.video in ("llava_onevision", "gemma4"):
        return _sample_default(header, cfg)
    if cfg.video != "qwen2_vl":
        raise ValueError(f"no video sampler {cfg.video!r}")
    if not cfg.video_sample_frames:
        return np.arange(total, dtype=np.int32)
    num = None
    if cfg.video_num_frames is not None:
        num = round(cfg.video_num_frames / tps) * tps
    elif cfg.video_fps is not None:
        most = math.floor(min(cfg.video_max_frames, total) / tps) * tps
        num = total / header.fps * cfg.video_fps
        num = min(max(num, cfg.video_min_frames), most, total)
        num = math.floor(num / tps) * tps
    if num is None:
        return np.arange(total, dtype=np.int32)
    if num > total:
        raise VideoSkip(S.SKIP_EMPTY_VIDEO, f"{total} frames, fewer than the {num} the processor samples")
    if num <= 0:  # HF divides by zero here; a clip shorter than one temporal patch is taken whole
        return np.arange(total, dtype=np.int32)
    return _torch_float_arange_int(total, total / num)


def _sample_default(header: VideoHeader, cfg: ImageConfig) -> np.ndarray:
    """HF BaseVideoProcessor.sample_frames (``default_sample_indices_fn``; LLaVA-OneVision, Gemma 4): num_frames,
    or max(1, int(duration x fps)), spread as arange(n) * total // n; every frame when it does not sample. The fps
    count is bounded by video_min_frames..video_max_frames and by the frames video_max_tokens holds (HF has no
    such bounds: models/llava_onevision.py and models/gemma4.py set them unbounded unless the user or LLaVA-NeXT's
    defaults give them; the frames are then HF's for num_frames = that count)."""
    total = header.frames
    if not cfg.video_sample_frames:
        return np.arange(total, dtype=np.int32)
    num = cfg.video_num_frames
    if num is None and cfg.video_fps is not None:
        num = max(1, int(total / header.fps * cfg.video_fps))
        most = cfg.video_max_frames
        if cfg.video == "llava_onevision" and cfg.anyres_features:  # frames x ceil(g / 2)**2 tokens, + 1
            most = min(most, max(1, (cfg.video_max_tokens - 1) // math.ceil(cfg.anyres_features / 2) ** 2))
        if cfg.video == "gemma4":  # frames x the frame's pooled grid
            most = min(most, max(1, cfg.video_max_tokens // gemma4_frame_tokens(header, cfg)))
        num = min(max(num, cfg.video_min_frames), most)
    if num is None:
        return np.arange(total, dtype=np.int32)
    if num > total:  # HF's sampler refuses more frames than the clip holds
        raise VideoSkip(S.SKIP_EMPTY_VIDEO, f"{total} frames, fewer than the {num} the processor samples")
    return (np.arange(num, dtype=np.int64) * total // num).astype(np.int32)


def gemma4_frame_size(header: VideoHeader, cfg: ImageConfig) -> tuple[int, int]:
    """(height, width) of every frame of a clip for Gemma 4: HF Gemma4VideoProcessor's aspect-kept resize into the
    per-frame patch budget (data/image/budget.py with max_pixels = video_max_pixels; ImageSkip where HF raises)."""
    import dataclasses

    from ray_mmbatch.data.image.budget import budget_resize

    return budget_resize(header.height, header.width, dataclasses.replace(cfg, max_pixels=cfg.video_max_pixels))


def gemma4_frame_tokens(header: VideoHeader, cfg: ImageConfig) -> int:
    """A Gemma 4 frame's soft tokens: its patch grid pooled merge_size x merge_size."""
    h, w = gemma4_frame_size(header, cfg)
    return (h // cfg.patch_size) * (w // cfg.patch_size) // cfg.merge_size ** 2


def _sample_qwen3(header: VideoHeader, cfg: ImageConfig) -> np.ndarray:
    """HF Qwen3VLVideoProcessor.sample_frames: int(duration x fps) frames within min..max_frames (and the
    clip), spread by np.linspace over the clip and rounded; every frame when it does not sample."""
    total = header.frames
    if not cfg.video_sample_frames:
        return np.arange(total, dtype=np.int32)
    num = cfg.video_num_frames
    if num is None and cfg.video_fps is not None:
        num = int(total / header.fps * cfg.video_fps)
        num = min(max(num, cfg.video_min_frames), cfg.video_max_frames, total)
    if num is None:
        num = min(max(total, cfg.video_min_frames), cfg.video_max_frames)
    # more frames than the clip holds (num_frames, or min_frames over a short clip): linspace repeats indices; HF's
    # torchcodec path (get_frames_at) returns each as often as it is asked, its PyAV loader (read_video_pyav:
    # `i in indices`) once: as the loader chosen does (docs/data.md). Nothing is refused here
    indices = np.linspace(0, total - 1, num).round().astype(np.int32)
    return np.unique(indices) if cfg.video_loader == "pyav" else indices



def _sample_glm4v(header: VideoHeader, cfg: ImageConfig) -> np.ndarray:
    """HF Glm4vVideoProcessor.sample_frames, formula for formula: over a clip of at most video_max_duration seconds
    (the loader's VideoMetadata.duration), floor(duration x fps) frames (at least 1), frame i at ceil(i x clip fps /
    fps); a longer clip max_duration x fps frames at np.linspace(0, duration) seconds (every frame if the clip holds
    no more); repeats dropped in order and the last repeated to an even count. Every frame when it does not
    sample. GLM's sampler has no frame-count bounds and ignores num_frames (models/glm4v.py refuses them)."""
    total = header.frames
    if not cfg.video_sample_frames:
        return np.arange(total, dtype=np.int32)
    want = float(cfg.video_fps if cfg.video_fps is not None else 2)
    last = total - 1
    duration = header.duration or round(last / header.fps) + 1
    if duration <= cfg.video_max_duration:
        n = max(int(math.floor(duration * want)), 1)
        picked = [min(last, int(math.ceil(i * header.fps / want))) for i in range(n)]
    else:
        n = int(cfg.video_max_duration * want)
        if n >= total:
            picked = list(range(total))
        else:
            picked = [min(last, int(math.ceil(t * header.fps))) for t in np.linspace(0, duration, n, endpoint=True)]
    unique = list(dict.fromkeys(picked))
    if len(unique) & 1:
        unique.append(unique[-1])
    return np.asarray(unique, dtype=np.int32)
