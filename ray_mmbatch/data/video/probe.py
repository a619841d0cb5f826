"""Video probe: the clip as the decoder will output it, read without decoding a frame (PyAV demuxer).

``is_video`` tells a container from an image by its first bytes. ``probe_video`` opens it, demuxes its
video packets once (no decoding) and reads:

* the frame count: the packets the decoder outputs a frame for -- every packet but the ones an edit list
  marks discard (a clip cut with ``ffmpeg -ss ... -c copy``: the leading packets from the keyframe before
  the cut, which the decoder decodes and drops); what PyAV's decoder yields and what torchcodec's scan
  counts. Not the header's count (mp4 ``stts`` counts the dropped packets; webm / mkv store none);
* the frame table: frame i is the i-th smallest presentation time among those packets (the decoder
  outputs frames in presentation order, B-frames reordered; negative and uneven timestamps as they
  are), with the keyframe to seek to for it; decode.py decodes by this table;
* the rate: as the loader named by ``ImageConfig.video_loader`` reports it -- torchcodec (HF's video
  processors' default for paths): frames over the scanned span (first pts to the last pts + its
  duration); pyav (``transformers.video_utils.load_video``'s default): the header's average rate;
* the display rotation (degrees counter-clockwise, as FFmpeg reports it on the decoded frames): the
  video track's ``tkhd`` matrix (mp4 / mov / QuickTime), Matroska's ProjectionPoseRoll (mkv / webm);
  applied (``height`` / ``width`` as displayed) for torchcodec, which turns the frames; 0 for pyav,
  which returns them as coded.

A header PyAV cannot read is ``unreadable_video``, no video stream or zero frames ``empty_video``, a
frame over ``ImageConfig.max_decoded_bytes`` ``decompression_bomb``. Cost: one demux of the clip (packet
reads, no decoding). Pure module: PyAV + numpy.
"""
from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

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
    """What the container says, read without decoding: frames as decoded, rate, frame size, rotation, and
    the frame table decode.py seeks by (stream time base; None when the packets carry no timestamps)."""

    frames: int
    fps: float
    height: int   # as the frames come out: displayed (the coded size turned by ``rotation``)
    width: int
    rotation: int  # display rotation applied to the frames, degrees counter-clockwise (0, 90, 180, 270)
    pts: np.ndarray | None = field(default=None, compare=False, repr=False)   # int64 [frames]: frame i's pts
    seek: np.ndarray | None = field(default=None, compare=False, repr=False)  # int64 [frames]: where to seek for it
    # the clip's seconds as the loader's VideoMetadata.duration gives them (torchcodec: the scanned span in its
    # double arithmetic; pyav: the frames over the header's rational rate); None: frames / fps
    seconds: float | None = field(default=None, compare=False, repr=False)

    @property
    def duration(self) -> float:
        """HF VideoMetadata.duration (GLM-4.1V's sampler reads it)."""
        if self.seconds is not None:
            return self.seconds
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


def _ebml_vint(data, pos: int, end: int, keep_marker: bool) -> tuple[int, int]:
    """(value, next position) of the EBML variable-length integer at ``pos``; (-1, end) if malformed;
    an all-ones size (unknown) reads as -1."""
    if pos >= end:
        return -1, end
    first = data[pos]
    length = 8 - first.bit_length() + 1
    if first == 0 or pos + length > end:
        return -1, end
    value = first if keep_marker else first & ((1 << (8 - length)) - 1)
    for b in data[pos + 1:pos + length]:
        value = (value << 8) | b
    if not keep_marker and value == (1 << (7 * length)) - 1:
        value = -1
    return value, pos + length


def _ebml_children(data, start: int, end: int):
    """(id, body start, body end) of the EBML elements in data[start:end]; an unknown size runs to ``end``."""
    pos = start
    while pos < end:
        eid, pos = _ebml_vint(data, pos, end, keep_marker=True)
        size, pos = _ebml_vint(data, pos, end, keep_marker=False) if eid >= 0 else (-1, end)
        if eid < 0 or pos > end:
            return
        body_end = end if size < 0 else min(end, pos + size)
        yield eid, pos, body_end
        if size < 0 and eid != 0x18538067:  # only a Segment of unknown size is walked into (live recordings)
            return
        pos = body_end


def _matroska_rotation(data) -> int:
    """The video track's display rotation from Matroska's Projection (ProjectionPoseRoll, degrees counter-
    clockwise, as FFmpeg reads it; 0 if none). Reads the Tracks element only (before the first Cluster)."""
    view = memoryview(data)
    for eid, a, b in _ebml_children(view, 0, len(view)):
        if eid != 0x18538067:  # Segment
            continue
        for sid, sa, sb in _ebml_children(view, a, b):
            if sid == 0x1F43B675:  # a Cluster: the Tracks come before the media
                return 0
            if sid != 0x1654AE6B:  # Tracks
                continue
            for tid, ta, tb in _ebml_children(view, sa, sb):
                if tid != 0xAE:  # TrackEntry
                    continue
                kids = {k: (x, y) for k, x, y in _ebml_children(view, ta, tb)}
                if 0x83 not in kids or bytes(view[slice(*kids[0x83])]) != b"\x01" or 0xE0 not in kids:
                    continue  # not the video track
                for vid, va, vb in _ebml_children(view, *kids[0xE0]):
                    if vid != 0x7670:  # Projection
                        continue
                    for pid, pa, pb in _ebml_children(view, va, vb):
                        if pid == 0x7675 and pb - pa in (4, 8):  # ProjectionPoseRoll, a float
                            roll = struct.unpack(">f" if pb - pa == 4 else ">d", view[pa:pb])[0]
                            return int(round(roll)) % 360 if math.isfinite(roll) else 0
                return 0
    return 0


def container_rotation(data) -> int:
    """The display rotation the container gives its video track (degrees counter-clockwise, a multiple of 90,
    as FFmpeg reports it on the decoded frames): ISO media / QuickTime ``tkhd``, Matroska / WebM Projection."""
    head = bytes(data[:8])
    if head[4:8] in (b"ftyp", b"moov", b"mdat", b"wide", b"free"):
        rotation = _mp4_rotation(data)
    elif head[:4] == b"\x1a\x45\xdf\xa3":
        rotation = _matroska_rotation(data)
    else:
        return 0
    return int(round(rotation / 90)) * 90 % 360


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


class _Table(NamedTuple):
    pts: np.ndarray          # int64: frame i's pts, in presentation order
    seek: np.ndarray | None  # int64: the keyframe to seek to for frame i; None: decode in order from the start
    dur: np.ndarray          # int64: each frame's duration (0: unknown)


def _packets(container, stream) -> _Table:
    """The frames the decoder outputs, from one demux (no decoding) where the packets tell them exactly: every
    packet the demuxer does not mark discard, in pts order. Where they may not (a packet without a timestamp;
    a stream that starts between keyframes, or whose first keyframe has leading frames -- an open GOP cut at
    its I-frame without an edit list -- which the decoder drops for their missing references), the clip is
    decoded once here, no RGB conversion, and the table is what came out, read in order at decode."""
    import av

    pts, dur, key, drop, untimed = [], [], [], [], False
    try:
        for packet in container.demux(stream):
            if packet.size <= 0:  # the demuxer's end-of-stream flush packet
                continue
            untimed |= packet.pts is None
            pts.append(-1 if packet.pts is None else packet.pts)
            dur.append(int(packet.duration or 0))
            key.append(bool(packet.is_keyframe))
            drop.append(bool(packet.is_discard))
    except av.FFmpegError as e:
        raise VideoSkip(S.SKIP_UNREADABLE_VIDEO, f"cannot demux it: {e}") from None
    pts_a, key_a = np.asarray(pts, dtype=np.int64), np.asarray(key, dtype=bool)
    keep = ~np.asarray(drop, dtype=bool)
    first_key = int(np.argmax(key_a)) if key_a.any() else -1
    leading = first_key >= 0 and bool((keep[first_key:] & (pts_a[first_key:] < pts_a[first_key])).any())
    if untimed or first_key != 0 or leading:
        return _decoded_table(container, stream)
    order = np.argsort(pts_a[keep], kind="stable")
    frame_pts = pts_a[keep][order]
    key_pts = np.sort(pts_a[key_a])  # a keyframe is sought by its pts (FFmpeg's mov and Matroska seeks land on it)
    k = np.searchsorted(key_pts, frame_pts, side="right") - 1  # the keyframe before each frame, in pts order
    return _Table(frame_pts, key_pts[np.maximum(k, 0)], np.asarray(dur, dtype=np.int64)[keep][order])


def _decoded_table(container, stream) -> _Table:
    import av

    pts, dur = [], []
    try:
        container.seek(0)
        for frame in container.decode(stream):
            pts.append(-1 if frame.pts is None else frame.pts)
            dur.append(int(getattr(frame, "duration", 0) or 0))
    except av.FFmpegError as e:
        raise VideoSkip(S.SKIP_CORRUPT_VIDEO, f"decoding it to count its frames failed: {e}") from None
    return _Table(np.asarray(pts, dtype=np.int64), None, np.asarray(dur, dtype=np.int64))


def probe_video(data, cfg: ImageConfig) -> VideoHeader:
    """The clip as the decoder outputs it (no frame decoded: module docstring); VideoSkip when it cannot be used."""
    if data is None or not len(data):
        raise VideoSkip(S.SKIP_EMPTY_FILE, "no bytes")
    container = _open(data)
    try:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        width, height = int(stream.codec_context.width), int(stream.codec_context.height)
        if width <= 0 or height <= 0:
            raise VideoSkip(S.SKIP_UNREADABLE_VIDEO, f"no frame size in the header ({width}x{height})")
        table = _packets(container, stream)
        time_base = stream.time_base
    finally:
        container.close()
    pts, seek, dur = table
    frames = len(pts)
    seconds = float(frames / rate) if rate else None  # HF's PyAV loader: total / the Fraction average_rate
    if frames and cfg.video_loader == "torchcodec" and time_base:
        span = float((int((pts + dur).max()) - int(pts.min())) * time_base)  # torchcodec: frames over the span
        if span > 0:
            rate = frames / span
        # torchcodec's duration_seconds: pts_to_seconds (double(pts) * num / den) of the span's ends, subtracted
        num, den = time_base.numerator, time_base.denominator
        seconds = float(int((pts + dur).max())) * num / den - float(int(pts.min())) * num / den
    if frames <= 0:
        raise VideoSkip(S.SKIP_EMPTY_VIDEO, "zero frames")
    if not rate:
        raise VideoSkip(S.SKIP_UNREADABLE_VIDEO, "no frame rate in the header")
    if cfg.max_decoded_bytes and width * height * 3 > cfg.max_decoded_bytes:
        raise VideoSkip(S.SKIP_DECOMPRESSION_BOMB, f"a {width}x{height} frame decodes to {width * height * 3} "
                        f"bytes > max_decoded_bytes {cfg.max_decoded_bytes}")
    rotation = container_rotation(data) if cfg.video_loader == "torchcodec" else 0
    if rotation % 180:
        width, height = height, width
    return VideoHeader(frames=frames, fps=float(rate), height=height, width=width, rotation=rotation, pts=pts,
                       seek=seek, seconds=seconds)
