"""Video probe: what the container says, read without decoding a frame (PyAV demuxer).

``is_video`` tells a container from an image by its first bytes; ``probe_video`` opens it and reads the
frame count, average rate, coded size and display rotation into a VideoHeader. A header PyAV cannot read
is ``unreadable_video``, no video stream or zero frames ``empty_video``, a frame over
``ImageConfig.max_decoded_bytes`` ``decompression_bomb``. Pure module: PyAV + numpy.
"""
from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass

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

