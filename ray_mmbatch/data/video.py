"""Video: the cost from the container header, the pixels from the sampled frames only (PyAV).

A video is one media item of a sample (schema.IMAGES holds its container bytes; ``is_video`` tells
it from an image by its first bytes). Measure and materialize see it as::

    probe_video(bytes)      header only: frame count, average rate, coded size, display rotation
      -> sample_indices     the frames the family's HF video processor samples (Qwen2VLVideoProcessor
                            .sample_frames, formula for formula, torch's float arange emulated)
      -> video_grid         per-frame smart resize (HF's, with cap_pixels_per_frame), temporal patches
                            (frames padded to temporal_patch_size by repeating the last, as HF does):
                            (t, h, w) = (ceil(n / tps), H / ps, W / ps); tokens t*h*w / merge**2
    decode_video(bytes)     materialize only: seek to the keyframe before each run of sampled frames
                            and decode just that run (frames of GOPs holding no sampled frame are never
                            decoded), RGB as HF's PyAV loader converts it, the display rotation applied,
                            then the resize HF's torchvision backend does (torch's uint8 bicubic with
                            antialias, bit for bit), then ``patchify_video`` in HF's row layout
                            (channel, frame, py, px) -- uint8 until the training worker normalizes it.

Where we differ from HF, deliberately:

* the display rotation (a phone's portrait clip) is applied, as players and torchcodec show the
  clip; HF's PyAV loader returns the coded (landscape) frames;
* a clip with fewer frames than temporal_patch_size under fps sampling is taken whole (HF's sampler
  computes 0 frames and divides by zero), so a 1-frame clip is one temporal patch of that frame twice;
* frames are counted from the header (mp4 / mov ``stts``); a container that does not store a count
  (webm / mkv) is counted by demuxing its packets -- still no decoding -- where HF's PyAV loader reads 0.

A header PyAV cannot read is ``unreadable_video``, no video stream or zero frames ``empty_video``,
a frame over ``ImageConfig.max_decoded_bytes`` ``decompression_bomb``, a sampled frame that cannot be
decoded (or a stream holding fewer frames than its header says) ``corrupt_video``: skipped and
counted, never decoded blindly. Pure module: PyAV + numpy at import; torch only inside decode_video.
"""
from __future__ import annotations

import dataclasses
import io
import math
import struct
from dataclasses import dataclass

import numpy as np

from ray_mmbatch import schema as S
from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.image.core import ImageSkip

# ISO base media (mp4 / mov / 3gp) major brands that are still images, not video (AVIF, HEIF)
_IMAGE_BRANDS = {b"avif", b"avis", b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"hevm", b"hevs",
                 b"mif1", b"msf1", b"mif2"}


class VideoSkip(ImageSkip):
    """A video that cannot be used; ``reason`` is a schema.SKIP_* constant. An ImageSkip, so every stage
    that skips a sample for its media skips it for a video too."""


def is_video(data) -> bool:
    """True for the first bytes of a video container: ISO media (mp4 / mov, not AVIF / HEIF), Matroska /
    WebM (EBML), AVI, FLV."""
    head = bytes(data[:16]) if data is not None else b""
    if head[4:8] == b"ftyp":
        return head[8:12] not in _IMAGE_BRANDS
    if head[4:8] in (b"moov", b"mdat", b"wide", b"free"):  # QuickTime without ftyp
        return True
    return head[:4] == b"\x1a\x45\xdf\xa3" or (head[:4] == b"RIFF" and head[8:12] == b"AVI ") or head[:3] == b"FLV"


@dataclass(frozen=True)
class VideoHeader:
    """What the container says, read without decoding: frames, average rate, displayed size, rotation."""

    frames: int
    fps: float
    height: int   # as displayed (the coded size, turned by the rotation)
    width: int
    rotation: int  # display rotation, degrees counter-clockwise (0, 90, 180, 270)

    @property
    def duration(self) -> float:
        return self.frames / self.fps if self.fps else 0.0


def _boxes(data: memoryview, start: int, end: int):
    """(type, body start, box end) of the ISO media boxes in data[start:end]."""
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack(">I4s", data[pos:pos + 8])
        head = 8
        if size == 1:
            if pos + 16 > end:
                return
            size, head = struct.unpack(">Q", data[pos + 8:pos + 16])[0], 16
        elif size == 0:
            size = end - pos
        if size < head or pos + size > end:
            return
        yield kind, pos + head, pos + size
        pos += size


def _mp4_rotation(data) -> int:
    """The video track's display rotation from its ``tkhd`` matrix (degrees counter-clockwise; 0 if none)."""
    view = memoryview(data)
    for kind, a, b in _boxes(view, 0, len(view)):
        if kind != b"moov":
            continue
        for tkind, ta, tb in _boxes(view, a, b):
            if tkind != b"trak":
                continue
            matrix, video = None, False
            for k, xa, xb in _boxes(view, ta, tb):
                if k == b"tkhd" and xb - xa >= 84:
                    version = view[xa]
                    at = xa + (4 + 8 + 8 + 4 + 4 + 8 if version == 1 else 4 + 4 + 4 + 4 + 4 + 4) + 8 + 8
                    if at + 36 <= xb:
                        matrix = struct.unpack(">9i", view[at:at + 36])
                elif k == b"mdia":
                    for mk, ma, mb in _boxes(view, xa, xb):
                        if mk == b"hdlr" and mb - ma >= 12 and bytes(view[ma + 8:ma + 12]) == b"vide":
                            video = True
            if video and matrix is not None:
                a_, b_ = matrix[0] / 65536, matrix[1] / 65536
                return int(round(math.degrees(math.atan2(-b_, a_)))) % 360
    return 0


def _open(data):
    import av

    try:
        container = av.open(io.BytesIO(bytes(data)), mode="r")
    except (av.FFmpegError, ValueError, OSError, EOFError) as e:
        raise VideoSkip(S.SKIP_UNREADABLE_VIDEO, f"PyAV cannot open it: {e}") from None
    if not container.streams.video:
        container.close()
        raise VideoSkip(S.SKIP_EMPTY_VIDEO, "no video stream")
    return container


def _count_packets(container, stream) -> int:
    import av

    n = 0
    try:
        for packet in container.demux(stream):
            n += packet.size > 0 and packet.pts is not None
    except av.FFmpegError as e:
        raise VideoSkip(S.SKIP_UNREADABLE_VIDEO, f"cannot demux it to count frames: {e}") from None
    return n


def probe_video(data, cfg: ImageConfig) -> VideoHeader:
    """The header of a video (no frame decoded); VideoSkip when it cannot be used."""
    if data is None or not len(data):
        raise VideoSkip(S.SKIP_EMPTY_FILE, "no bytes")
    container = _open(data)
    try:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        if not rate:
            raise VideoSkip(S.SKIP_UNREADABLE_VIDEO, "no frame rate in the header")
        width, height = int(stream.codec_context.width), int(stream.codec_context.height)
        if width <= 0 or height <= 0:
            raise VideoSkip(S.SKIP_UNREADABLE_VIDEO, f"no frame size in the header ({width}x{height})")
        frames = int(stream.frames) or _count_packets(container, stream)
    finally:
        container.close()
    if frames <= 0:
        raise VideoSkip(S.SKIP_EMPTY_VIDEO, "zero frames")
    if cfg.max_decoded_bytes and width * height * 3 > cfg.max_decoded_bytes:
        raise VideoSkip(S.SKIP_DECOMPRESSION_BOMB, f"a {width}x{height} frame decodes to {width * height * 3} "
                        f"bytes > max_decoded_bytes {cfg.max_decoded_bytes}")
    rotation = _mp4_rotation(data) if is_video(data) and bytes(data[4:8]) == b"ftyp" else 0
    if rotation % 180:
        width, height = height, width
    return VideoHeader(frames=frames, fps=float(rate), height=height, width=width, rotation=rotation)


# ------------------------------------------------------------------ sampling (HF's formulas)
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
    if cfg.video == "llava_onevision":
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
    """HF BaseVideoProcessor.sample_frames (``default_sample_indices_fn``; LLaVA-OneVision): num_frames, or
    max(1, int(duration x fps)), spread as arange(n) * total // n; every frame when it does not sample."""
    total = header.frames
    if not cfg.video_sample_frames:
        return np.arange(total, dtype=np.int32)
    num = cfg.video_num_frames
    if num is None and cfg.video_fps is not None:
        num = max(1, int(total / header.fps * cfg.video_fps))
    if num is None:
        return np.arange(total, dtype=np.int32)
    if num > total:
        raise VideoSkip(S.SKIP_EMPTY_VIDEO, f"{total} frames, fewer than the {num} the processor samples")
    return (np.arange(num, dtype=np.int64) * total // num).astype(np.int32)


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
    # more frames than the clip holds (num_frames, or min_frames over a short clip): linspace repeats indices, and
    # HF's PyAV loader (read_video_pyav: `i in indices`) then yields each of those frames once; so do we (HF's
    # torchcodec path would repeat them: docs/data.md). Nothing is refused here (was: skipped as empty_video)
    return np.unique(np.linspace(0, total - 1, num).round().astype(np.int32))


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
    if cfg.video == "qwen3_vl":  # the pixel bounds are the whole clip's; the cap is per frame, times frames
        hi = cfg.video_max_pixels
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

    def timestamp_texts(self) -> list[str]:
        """Qwen3-VL's text before each temporal patch's vision block: ``<1.5 seconds>``."""
        return [f"<{t:.1f} seconds>" for t in self.timestamps()]


def plan_video(data, cfg: ImageConfig) -> VideoPlan:
    """probe_video + sample_indices + frame_size: the clip's exact grid and tokens, no frame decoded."""
    header = probe_video(data, cfg)
    indices = sample_indices(header, cfg)
    height, width = frame_size(header, len(indices), cfg)
    if cfg.video == "llava_onevision":  # one whole-frame "patch" a frame; its features pooled 2 x 2, + a newline
        pooled = math.ceil(cfg.anyres_features / 2)
        return VideoPlan(header, indices, (len(indices), 1, 1), len(indices) * pooled * pooled + 1, 1)
    tps, ps = max(1, int(cfg.temporal_patch_size)), cfg.patch_size
    grid = (-(-len(indices) // tps), height // ps, width // ps)
    return VideoPlan(header, indices, grid, grid[0] * grid[1] * grid[2] // cfg.merge_size ** 2, tps)


# ------------------------------------------------------------------ decoding the sampled frames
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
