"""Video cost: the frame size, grid and tokens of a clip from its header and sampled indices (no frame decoded).

    probe_video -> sample_indices -> frame_size -> VideoPlan (grid (t, h, w) in patches, tokens t*h*w / merge**2)

Per-frame smart resize (HF's, with cap_pixels_per_frame); Qwen3-VL's bounds are over the whole clip; LLaVA-OneVision
squashes every frame to the tower's square; Gemma 4 keeps the aspect within a per-frame patch budget (its image
resize, data/image/budget.py), one frame a temporal patch. Pure module: numpy only.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

import numpy as np

from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.video.probe import VideoHeader, probe_video
from ray_mmbatch.data.video.sampling import gemma4_frame_size, sample_indices

FRAME_BLOCKS = ("qwen3_vl", "gemma4", "glm4v")
"""Video processors whose text writes one video token per temporal patch (each in a timestamped block of its own;
a Gemma 4 frame is one temporal patch; GLM-4.1V's an image block), which materialize expands to that patch's
tokens; the others write one video token per clip."""


def _smart_resize_qwen3(num_frames: int, height: int, width: int, cfg: ImageConfig, max_pixels: int
                        ) -> tuple[int, int]:
    """HF Qwen3-VL video ``smart_resize``: the bounds are on t x h x w (all the clip's pixels), formula for formula.
    A clip of fewer frames than temporal_patch_size counts as one temporal patch (HF raises there)."""
    from ray_mmbatch.data.image.core import _check_aspect

    tf, factor, min_pixels = max(1, int(cfg.temporal_patch_size)), cfg.factor, cfg.video_min_pixels
    num_frames = max(num_frames, tf)
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _check_aspect(height, width, cfg)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / tf) * tf
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _frame_pixels(n_frames: int, cfg: ImageConfig) -> tuple[int, int]:
    """(min_pixels, max_pixels) of one frame: HF Qwen2VLVideoProcessor.resize's bounds."""
    hi = cfg.video_max_pixels
    if cfg.video_cap_pixels_per_frame:
        total = int(cfg.video_max_tokens * cfg.factor * cfg.factor * 0.9)
        hi = max(min(hi, total * cfg.temporal_patch_size // n_frames), int(cfg.video_min_pixels * 1.05))
    return cfg.video_min_pixels, hi


def frame_size(header: VideoHeader, n_frames: int, cfg: ImageConfig) -> tuple[int, int]:
    """(height, width) every sampled frame is resized to (HF's smart_resize with the video bounds)."""
    from ray_mmbatch.data.image.smart import smart_resize

    if cfg.video == "llava_onevision":  # every frame squashed to the tower's square, as its processor does
        return cfg.image_size, cfg.image_size
    if cfg.video == "gemma4":
        return gemma4_frame_size(header, cfg)
    if cfg.video in ("qwen3_vl", "glm4v"):  # the pixel bounds are the whole clip's; the cap is per frame, x frames
        hi = cfg.video_max_pixels  # GLM-4.1V's video smart_resize is Qwen3-VL's, formula for formula (no cap)
        if cfg.video_cap_pixels_per_frame:
            per_frame = max(min(cfg.video_max_tokens * cfg.factor ** 2, cfg.video_max_pixels // n_frames),
                            int(cfg.video_min_pixels * 1.05))
            hi = per_frame * n_frames
        return _smart_resize_qwen3(n_frames, header.height, header.width, cfg, hi)
    lo, hi = _frame_pixels(n_frames, cfg)
    return smart_resize(header.height, header.width, dataclasses.replace(cfg, min_pixels=lo, max_pixels=hi))


@dataclass(frozen=True)
class VideoPlan:
    """A clip's cost: which frames, at what size, and the grid the model sees."""

    header: VideoHeader
    indices: np.ndarray
    grid: tuple[int, int, int]  # (t, h, w) in patches: HF's video_grid_thw
    tokens: int                  # t * h * w / merge**2
    temporal: int                # temporal_patch_size
    # where decode.py finds each sampled frame: its pts and the keyframe to seek to (stream time base);
    # None: decode in order from the start (a stream without timestamps, or one that starts between keyframes)
    pts: np.ndarray | None = field(default=None, compare=False, repr=False)
    seek: np.ndarray | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> str:
        """The plan as measure hands it to materialize (schema.VIDEO_PLANS): the clip is not probed again."""
        h = self.header
        return json.dumps({"header": [h.frames, h.fps, h.height, h.width, h.rotation],
                           "indices": self.indices.tolist(), "grid": list(self.grid), "tokens": self.tokens,
                           "temporal": self.temporal, "pts": None if self.pts is None else self.pts.tolist(),
                           "seek": None if self.seek is None else self.seek.tolist()}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> VideoPlan:
        d = json.loads(text)
        frames, fps, height, width, rotation = d["header"]
        return cls(VideoHeader(int(frames), float(fps), int(height), int(width), int(rotation)),
                   np.asarray(d["indices"], dtype=np.int32), tuple(int(v) for v in d["grid"]), int(d["tokens"]),
                   int(d["temporal"]), _int64(d["pts"]), _int64(d["seek"]))

    @property
    def frames(self) -> int:
        return len(self.indices)

    @property
    def second_per_grid_t(self) -> float:
        """Qwen2.5-VL's ``second_per_grid_ts``: temporal_patch_size / the sampled frame rate (HF's processor)."""
        sampled_fps = len(self.indices) / self.header.frames * self.header.fps
        return self.temporal / sampled_fps

    def timestamps(self) -> list[float]:
        """Qwen3-VL: the time of each temporal patch, as its processor computes it (``_calculate_timestamps``:
        indices padded to temporal_patch_size by the last, seconds = index / fps, each patch's first and last
        frame averaged)."""
        idx = [int(i) for i in self.indices]
        idx += [idx[-1]] * (-len(idx) % self.temporal)
        t = [i / self.header.fps for i in idx]
        return [(t[k] + t[k + self.temporal - 1]) / 2 for k in range(0, len(t), self.temporal)]

    def clock_texts(self) -> list[str]:
        """Gemma 4: the text before each sampled frame's block, ``mm:ss`` of index / fps, as its processor writes it
        (Gemma4Processor.replace_video_token on the loader's VideoMetadata.timestamps)."""
        return [f"{int(s // 60):02d}:{int(s % 60):02d}" for s in (int(i) / self.header.fps for i in self.indices)]

    def seconds_texts(self) -> list[str]:
        """GLM-4.1V: the text after each temporal patch's image block, the whole seconds of its first frame
        (Glm4vProcessor.replace_video_token: ``int`` of VideoMetadata.timestamps[::2], one per temporal patch, the
        last repeated if short)."""
        stamps = [int(i) / self.header.fps for i in self.indices][::2][:self.grid[0]]
        stamps += [stamps[-1] if stamps else 0] * (self.grid[0] - len(stamps))
        return [str(int(t)) for t in stamps]

    def timestamp_texts(self) -> list[str]:
        """Qwen3-VL's text before each temporal patch's vision block: ``<1.5 seconds>``."""
        return [f"<{t:.1f} seconds>" for t in self.timestamps()]


def _int64(values) -> np.ndarray | None:
    return None if values is None else np.asarray(values, dtype=np.int64)


def plan_video(data, cfg: ImageConfig) -> VideoPlan:
    """probe_video + sample_indices + frame_size: the clip's exact grid and tokens, no frame decoded."""
    header = probe_video(data, cfg)
    indices = sample_indices(header, cfg)
    height, width = frame_size(header, len(indices), cfg)
    where = {} if header.seek is None else {"pts": header.pts[indices], "seek": header.seek[indices]}
    if cfg.video == "llava_onevision":  # one whole-frame "patch" a frame; its features pooled 2 x 2, + a newline
        pooled = math.ceil(cfg.anyres_features / 2)
        return VideoPlan(header, indices, (len(indices), 1, 1), len(indices) * pooled * pooled + 1, 1, **where)
    tps, ps = max(1, int(cfg.temporal_patch_size)), cfg.patch_size
    grid = (-(-len(indices) // tps), height // ps, width // ps)
    return VideoPlan(header, indices, grid, grid[0] * grid[1] * grid[2] // cfg.merge_size ** 2, tps, **where)

