"""Video (data/video.py): header cost == HF's video processor, pixels == HF's, packing exact for Qwen2-VL /
Qwen2.5-VL / Qwen3-VL(-MoE) / Qwen3.5 (dense, MoE) and LLaVA-OneVision, a conversation with a clip trained as HF's
assistant mask marks it (Qwen3-VL, Qwen3.5), bad clips skipped with their reason, only the sampled GOPs decoded
(and in H.264 no unsampled non-reference frame).

The clips are made here with PyAV (synthetic/video.py): H.264 with B-frames, MPEG-4 Part 2, VP9 in WebM,
H.264 in Matroska, a variable-frame-rate clip, a rotated (portrait phone) clip, a thin one, a 1-frame one,
and broken bytes. HF's video processors need torchvision, which does not load beside this project's CPU
torch: the reference runs in a second interpreter (``scripts/setup.sh --reference`` makes .venv-ref with
PyPI's torch 2.14.1 + torchvision 0.29.1 and this transformers; tests/video_reference.py), one interpreter
for the whole test session (tests/reference_server.py). Without it the reference tests skip, except under
RAY_MMBATCH_REQUIRE_REFERENCE=1 (.ci/run), where they fail.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ray_mmbatch import schema as S
from ray_mmbatch.batching.collate import collate_pack, collate_pad
from ray_mmbatch.config import Config
from ray_mmbatch.data.materialize import materialize_sample
from ray_mmbatch.data.measure import VideoRefused, measure_batch, qwen3_frame_blocks
from ray_mmbatch.data.text.tokenizer import load_tokenizer
from ray_mmbatch.data.video import (
    VideoSkip,
    _torch_float_arange_int,
    container_rotation,
    decode_sampled,
    decode_video,
    is_video,
    patchify_video,
    plan_video,
    probe_video,
)
from ray_mmbatch.models import qwen_vl
from ray_mmbatch.models.hf_common import normalize_patches, normalize_video_patches
from ray_mmbatch.models.inputs import batch_to_torch
from ray_mmbatch.synthetic.video import clip_frames, encode_clip
from tests import reference_server
from tests.family_harness import TOLERANCE, image, png, token_ids
from tests.family_harness import configure as harness_configure
from tests.hf_checkpoints import make_qwen3_5_checkpoint, make_qwen_checkpoint

_QWEN2_VIDEO = {"video_processor_type": "Qwen2VLVideoProcessor", "do_sample_frames": True, "fps": 4.0,
                "min_frames": 2, "max_frames": 12, "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
                "size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 16 * 28 * 28},
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711]}
# Qwen3-VL: the size bounds are over the whole clip (t x h x w)
VIDEO_PROCESSOR = {"qwen2_vl": _QWEN2_VIDEO, "qwen2_5_vl": _QWEN2_VIDEO,
                   "qwen3_vl": dict(_QWEN2_VIDEO, video_processor_type="Qwen3VLVideoProcessor", patch_size=16,
                                    size={"shortest_edge": 8 * 32 * 32, "longest_edge": 96 * 32 * 32},
                                    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])}
# Qwen3-VL-MoE and Qwen3.5 (dense, MoE) ship Qwen3-VL's processors
VIDEO_PROCESSOR.update(dict.fromkeys(("qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"), VIDEO_PROCESSOR["qwen3_vl"]))
AS_QWEN3_VL = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")  # timestamps in the text, whole-clip bounds
QWEN3_5 = ("qwen3_5", "qwen3_5_moe")


def _clips() -> dict[str, bytes]:
    vfr = [0.0, 0.04, 0.3, 0.35, 0.9, 1.0, 1.6, 1.62, 1.7, 2.5, 2.6, 3.1, 3.2, 3.9]
    return {
        "h264_bframes": encode_clip(clip_frames(23, 48, 64, 1), fps=10, bframes=2),
        # 3 B-frames without x264's b-pyramid: every B-frame a non-reference frame (skipped unless sampled)
        "h264_b3_flat": encode_with(clip_frames(36, 48, 64, 17), 10, "libx264",
                                    {"x264-params": "keyint=12:bframes=3:b-pyramid=none"}),
        "mpeg4_25fps": encode_clip(clip_frames(40, 56, 40, 2), fps=25, codec="mpeg4"),
        "vp9_webm": encode_clip(clip_frames(17, 64, 64, 3), fps=8, container="webm"),
        "h264_mkv": encode_clip(clip_frames(15, 40, 72, 4), fps=12, container="mkv"),
        "vfr": encode_clip(clip_frames(len(vfr), 48, 48, 5), fps=4, pts_seconds=vfr),
        "rotated": encode_clip(np.rot90(clip_frames(12, 64, 32, 6), k=-1, axes=(1, 2)), fps=6, rotation=90),
        "thin": encode_clip(clip_frames(10, 16, 192, 7), fps=5),
        "one_frame": encode_clip(clip_frames(1, 48, 48, 8), fps=1),
        "long_gop": encode_clip(clip_frames(96, 32, 32, 9), fps=24, gop=8),
        # cut as `ffmpeg -ss 1.7 -c copy` cuts (remux_trimmed below): an edit list drops the 9 leading
        # frames the decoder decodes from the keyframe before the cut (the header still counts them)
        "trimmed_mp4": remux_trimmed(encode_clip(clip_frames(40, 32, 48, 12), fps=10, gop=12, bframes=2), 17),
        "trimmed_mov": remux_trimmed(encode_clip(clip_frames(30, 48, 32, 13), fps=10, gop=10, bframes=2), 13,
                                     "mov"),
        "open_gop": encode_open_gop(clip_frames(40, 32, 48, 14)),
        "rotated_mkv": encode_clip(np.rot90(clip_frames(12, 64, 32, 15), k=-1, axes=(1, 2)), fps=6, rotation=90,
                                   container="mkv"),
        "rotated_mov": encode_clip(np.rot90(clip_frames(12, 32, 64, 16), k=2, axes=(1, 2)), fps=6, rotation=180,
                                   container="mov", codec="libx264"),
    }


def remux_trimmed(data: bytes, start_frame: int, container: str = "mp4", first_packet: int | None = None) -> bytes:
    """The clip from ``start_frame`` on, remuxed without re-encoding as ``ffmpeg -ss T -c copy`` does: from the
    keyframe before the cut, the packets before it at negative times (mp4 / mov write them as an edit list the
    decoder drops them by; Matroska shifts every time to start at 0 and keeps them). ``first_packet``: start at
    that packet (decode order) instead, keyframe or not, times kept (a cutter that ignores GOPs)."""
    import av

    with av.open(io.BytesIO(data)) as src:
        stream = src.streams.video[0]
        packets = [p for p in src.demux(stream) if p.size]
        cut = sorted(p.pts for p in packets)[start_frame]
        key = max(p.pts for p in packets if p.is_keyframe and p.pts <= cut)
        first = next(i for i, p in enumerate(packets) if p.pts == key) if first_packet is None else first_packet
        shift = cut if first_packet is None else 0
        buf = io.BytesIO()
        with av.open(buf, "w", format={"mkv": "matroska"}.get(container, container)) as out:
            o = out.add_stream_from_template(stream)
            for p in packets[first:]:
                p.pts, p.dts, p.stream = p.pts - shift, p.dts - shift, o
                out.mux(p)
    return buf.getvalue()


def encode_open_gop(frames: np.ndarray, fps: int = 10, gop: int = 8) -> bytes:
    """H.264 with open GOPs (x264 open-gop: each GOP's leading B-frames reference the GOP before)."""
    return encode_with(frames, fps, "libx264", {
        "x264-params": f"open-gop=1:keyint={gop}:min-keyint={gop}:scenecut=0:bframes=3:b-pyramid=0"})


def encode_with(frames: np.ndarray, fps: int, codec: str, options: dict[str, str]) -> bytes:
    """mp4 of ``codec`` with these encoder options (x264-params, x265-params)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        s = out.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        s.options = options
        for rgb in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    return buf.getvalue()


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> SimpleNamespace:
    d = tmp_path_factory.mktemp("clips")
    data = _clips()
    paths = {}
    for name, b in data.items():
        paths[name] = d / f"{name}.{next((e for e in ('webm', 'mkv', 'mov') if e in name), 'mp4')}"
        paths[name].write_bytes(b)
    return SimpleNamespace(data=data, paths=paths, dir=d)


def _backend(model_type: str):
    """(the backend module, the tiny checkpoint maker) of a Qwen-style model_type."""
    from ray_mmbatch.models import qwen3_5

    return (qwen3_5, make_qwen3_5_checkpoint) if model_type in QWEN3_5 else (qwen_vl, make_qwen_checkpoint)


def _checkpoint(tmp_path_factory, model_type: str) -> Path:
    path = _backend(model_type)[1](tmp_path_factory.mktemp(model_type), model_type)
    (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR[model_type]))
    return path


@pytest.fixture(scope="module", params=("qwen2_vl", "qwen2_5_vl", "qwen3_vl"))
def family(request, tmp_path_factory):
    return _built(_backend(request.param)[0], _checkpoint(tmp_path_factory, request.param), request.param,
                  qwen3=request.param in AS_QWEN3_VL)


def _built(backend, path: Path, name: str, **extra) -> SimpleNamespace:
    """The configured checkpoint at ``path`` and its model (seed 0, eval), with its tokenizer, token ids and the
    family's TOLERANCE[name]; ``extra``: more fields."""
    cfg = harness_configure(backend, path)
    tok = load_tokenizer(cfg.text.tokenizer)
    ids = token_ids(cfg, tok)
    torch.manual_seed(0)
    model = backend.create_model(cfg, ids).eval()
    return SimpleNamespace(name=name, path=path, cfg=cfg, tok=tok, ids=ids, model=model, tol=TOLERANCE[name], **extra)


@pytest.fixture(scope="module")
def reference(clips, family, tmp_path_factory):
    """HF's own video path on every clip (tests/video_reference.py in the reference interpreter)."""
    return _run_reference(family.path, clips.paths, tmp_path_factory.mktemp("reference"))


def _run_reference(checkpoint: Path, clip_paths: dict, out_dir: Path, **spec) -> dict:
    """tests/video_reference.py on ``clip_paths`` with ``checkpoint``'s video processor: HF's indices, grid, pixels
    (in the session's one reference interpreter, tests/reference_server.py)."""
    (out_dir / "spec.json").write_text(json.dumps({"checkpoint": str(checkpoint), **spec,
                                                   "clips": {k: str(v) for k, v in clip_paths.items()}}))
    reference_server.run("tests.video_reference:main", out_dir / "spec.json", out_dir / "out.npz")
    return dict(np.load(out_dir / "out.npz"))


# Published Qwen2-VL / Qwen2.5-VL checkpoints ship this one processor file and no video settings
PUBLISHED_QWEN25_PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136,
                                 "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
                                 "image_mean": [0.48145466, 0.4578275, 0.40821073],
                                 "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True,
                                 "do_normalize": True, "do_rescale": True, "do_resize": True, "resample": 3,
                                 "rescale_factor": 0.00392156862745098}


def test_a_published_qwen_checkpoint_samples_video_as_qwen_vl_utils_exactly_as_hf_with_those_settings(clips, tmp_path):
    """A Qwen2.5-VL checkpoint as published (one preprocessor_config.json, no video settings) samples as the
    Qwen team's qwen-vl-utils does (2 fps, 4..768 frames, 128..768 x 28 x 28 pixels a frame, the per-frame cap),
    not HF's class default (every frame at up to 12.8 MP: 11,520 tokens for a 4 s 30 fps 448 x 336 clip); and its
    frames, grid, tokens and pixels equal HF's Qwen2VLVideoProcessor called with those settings."""
    ckpt = make_qwen_checkpoint(tmp_path / "published", "qwen2_5_vl")
    (ckpt / "preprocessor_config.json").write_text(json.dumps(PUBLISHED_QWEN25_PREPROCESSOR))
    cfg = Config()
    cfg.model.path = str(ckpt)
    im = qwen_vl.configure(cfg).image
    assert (im.video, im.video_sample_frames, im.video_fps, im.video_min_frames, im.video_max_frames) == \
        ("qwen2_vl", True, 2.0, 4, 768)
    assert (im.video_min_pixels, im.video_max_pixels, im.video_cap_pixels_per_frame, im.video_max_tokens) == \
        (128 * 28 * 28, 768 * 28 * 28, True, 128000)
    assert (im.min_pixels, im.max_pixels) == (3136, 12845056)  # the images keep the image processor's bounds
    # HF's processor told the same settings explicitly (a checkpoint copy with them as its video processor)
    explicit = make_qwen_checkpoint(tmp_path / "explicit", "qwen2_5_vl")
    (explicit / "preprocessor_config.json").write_text(json.dumps(PUBLISHED_QWEN25_PREPROCESSOR))
    (explicit / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "Qwen2VLVideoProcessor", "do_sample_frames": True, "fps": 2.0, "min_frames": 4,
        "max_frames": 768, "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28},
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": PUBLISHED_QWEN25_PREPROCESSOR["image_mean"],
        "image_std": PUBLISHED_QWEN25_PREPROCESSOR["image_std"]}))
    four_s = tmp_path / "four_s.mp4"
    four_s.write_bytes(encode_clip(clip_frames(120, 336, 448, 11), fps=30))
    paths = {"four_s": four_s, **{k: clips.paths[k] for k in ("h264_bframes", "mpeg4_25fps", "vp9_webm", "rotated")}}
    (tmp_path / "ref").mkdir()
    reference = _run_reference(explicit, paths, tmp_path / "ref", cap_pixels_per_frame=True)
    for name, path in paths.items():
        data = path.read_bytes()
        plan = plan_video(data, im)
        assert plan.indices.tolist() == reference[f"{name}/indices"].tolist(), name
        assert [list(plan.grid)] == reference[f"{name}/grid"].tolist(), name
        ours = normalize_video_patches(torch.from_numpy(patchify_video(decode_video(data, plan, im), im)),
                                       im.video_mean, im.video_std).numpy()
        assert np.array_equal(ours, reference[f"{name}/pixels"]), name
    four = plan_video(four_s.read_bytes(), im)
    assert (len(four.indices), four.tokens) == (8, 768)  # the issue's figure: 8 frames, 768 tokens
    # --video-sample-frames false: HF's take-every-frame class default, on request
    cfg = Config()
    cfg.model.path = str(ckpt)
    cfg.image.video_sample_frames = False
    every = qwen_vl.configure(cfg).image
    assert len(plan_video(four_s.read_bytes(), every).indices) == 120
    # --video-fps alone turns sampling on at that rate, on a checkpoint that does not sample (HF's class default)
    cfg = Config()
    cfg.model.path = str(explicit)
    (explicit / "video_preprocessor_config.json").write_text(json.dumps({"do_sample_frames": False}))
    cfg.image.video_fps, cfg.image.video_max_frames = 4.0, 12
    fps4 = qwen_vl.configure(cfg).image
    assert (fps4.video_sample_frames, fps4.video_fps, fps4.video_max_frames) == (True, 4.0, 12)
    assert len(plan_video(four_s.read_bytes(), fps4).indices) == 12  # 16 at 4 fps, capped at 12


def test_sampler_edge_cases_equal_hf_or_are_refused_as_hf_refuses_them(clips, tmp_path):
    """Qwen3-VL asked for more frames than a clip holds: np.linspace repeats indices; HF's torchcodec path (the
    default loader) takes such a frame as often as asked, its PyAV loader once: frames, grid and pixels equal HF's
    with either loader. Qwen2-VL settings
    with which HF's sampler divides by zero (num_frames 1 at temporal patch 2, max_frames below one patch) are
    refused, named."""
    ckpt = make_qwen_checkpoint(tmp_path / "q3", "qwen3_vl")
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps(
        dict(VIDEO_PROCESSOR["qwen3_vl"], fps=None, min_frames=20, max_frames=24)))
    cfg = Config()
    cfg.model.path = str(ckpt)
    im = qwen_vl.configure(cfg).image
    for loader, name in (("torchcodec", "h264_mkv"), ("pyav", "rotated")):  # HF's PyAV loader reads no mkv count
        cfg = Config()
        cfg.model.path, cfg.image.video_loader = str(ckpt), loader
        im = qwen_vl.configure(cfg).image
        plan = plan_video(clips.data[name], im)  # 15 / 12 frames, 20 asked
        asked = np.linspace(0, plan.header.frames - 1, 20).round().astype(int)
        # torchcodec repeats a frame asked for twice, HF's PyAV loader yields it once
        assert plan.indices.tolist() == (asked.tolist() if loader == "torchcodec" else np.unique(asked).tolist())
        (tmp_path / loader).mkdir()
        ref = _run_reference(ckpt, {name: clips.paths[name]}, tmp_path / loader, loader=loader)
        theirs = ref[f"{name}/indices"] if loader == "torchcodec" else np.unique(ref[f"{name}/indices"])
        assert plan.indices.tolist() == theirs.tolist(), loader
        assert [list(plan.grid)] == ref[f"{name}/grid"].tolist(), loader
        ours = normalize_video_patches(torch.from_numpy(patchify_video(decode_video(clips.data[name], plan, im),
                                                                       im)), im.video_mean, im.video_std).numpy()
        assert np.array_equal(ours, ref[f"{name}/pixels"]), loader
    q2 = make_qwen_checkpoint(tmp_path / "q2", "qwen2_vl")
    (q2 / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR["qwen2_vl"]))
    for key, value, message in (("video_num_frames", 1, r"video_num_frames = 1 .* rounds to 0 frames"),
                                ("video_max_frames", 1, r"video_max_frames = 1 .* below one temporal patch")):
        cfg = Config()
        cfg.model.path = str(q2)
        setattr(cfg.image, key, value)
        with pytest.raises(ValueError, match=message + r".*divides by zero"):
            qwen_vl.configure(cfg)


# ------------------------------------------------------------------ header cost and pixels == HF
def test_configure_reads_the_video_processor(family):
    im, want = family.cfg.image, VIDEO_PROCESSOR[family.name]
    assert (im.video, im.video_sample_frames, im.video_fps, im.video_min_frames, im.video_max_frames) == \
        ("qwen3_vl" if family.qwen3 else "qwen2_vl", True, 4.0, 2, 12)
    assert (im.video_min_pixels, im.video_max_pixels) == (want["size"]["shortest_edge"], want["size"]["longest_edge"])
    assert im.video_mean == tuple(want["image_mean"])
    assert family.cfg.text.video_token == "<|video_pad|>"


@pytest.mark.parametrize("kind", ["qwen2_vl", "llava_onevision"])
def test_a_video_processor_whose_pixel_steps_differ_is_refused_as_an_image_processor_is(kind, tmp_path):
    """The video processor's resample / rescale / RGB steps are checked as the image processor's are (the data
    path resizes frames bicubic, rescales by 1/255): refused, naming the file; do_normalize off = mean 0, std 1."""
    from ray_mmbatch.models import llava_onevision as ov
    from tests.hf_llava_onevision_checkpoint import make_llava_onevision_checkpoint

    if kind == "qwen2_vl":
        backend, path, base = qwen_vl, make_qwen_checkpoint(tmp_path / kind, kind), dict(VIDEO_PROCESSOR[kind])
    else:
        backend, path, base = ov, make_llava_onevision_checkpoint(tmp_path / "ov"), dict(ONEVISION_VIDEO)
    for bad, message in (({"resample": 2}, r"resample=2; only bicubic"),
                         ({"rescale_factor": 1 / 127.5}, r"rescaled by 1/255"),
                         ({"do_convert_rgb": False}, r"do_convert_rgb=false")):
        (path / "video_preprocessor_config.json").write_text(json.dumps({**base, **bad}))
        cfg = Config()
        cfg.model.path = str(path)
        with pytest.raises(ValueError, match=r"video_preprocessor_config.json: .*" + message):
            backend.configure(cfg)
    (path / "video_preprocessor_config.json").write_text(json.dumps({**base, "do_normalize": False}))
    cfg = Config()
    cfg.model.path = str(path)
    im = backend.configure(cfg).image
    assert (im.video_mean, im.video_std) == ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))


def test_header_cost_equals_the_hf_video_processor(clips, family, reference):
    """Frame indices, video_grid_thw, tokens and second_per_grid_ts from the header alone == HF's processor,
    for every codec / container / rate / rotation / shape; then our decoded pixels == HF's pixel_values_videos."""
    cfg = family.cfg.image
    failed = {name: str(reference[f"{name}/hf_failed"]) for name in clips.data if str(reference[f"{name}/hf_failed"])}
    # the 1-frame clip: Qwen2-VL's sampler divides by zero (both then take the clip whole); Qwen3-VL's resize
    # refuses fewer frames than temporal_patch_size (we pad it to one temporal patch): docs/data.md
    assert list(failed) == ["one_frame"], failed
    assert failed["one_frame"].startswith("processor" if family.qwen3 else "sampler")
    for name, data in clips.data.items():
        plan = plan_video(data, cfg)
        assert plan.indices.tolist() == reference[f"{name}/indices"].tolist(), name
        if f"{name}/grid" not in reference:
            continue
        assert [list(plan.grid)] == reference[f"{name}/grid"].tolist(), name
        assert plan.tokens == int(np.prod(plan.grid)) // 4
        if not family.qwen3:  # HF's Qwen2_5_VLProcessor's second_per_grid_ts (Qwen3-VL has timestamps)
            assert plan.second_per_grid_t == pytest.approx(float(reference[f"{name}/second_per_grid"][0]), rel=1e-9)
        if family.qwen3:  # the timestamped text the processor writes for the clip
            seqlen = plan.grid[1] * plan.grid[2] // 4
            ours_text = "".join(f"{t}<|vision_start|>{'<|video_pad|>' * seqlen}<|vision_end|>"
                                for t in plan.timestamp_texts())
            assert ours_text == str(reference[f"{name}/text"]), name
            one_pad = str(reference[f"{name}/text"]).replace("<|video_pad|>" * seqlen, "<|video_pad|>")
            video_id = family.tok.convert_tokens_to_ids("<|video_pad|>")
            assert qwen3_frame_blocks(family.tok, video_id)(plan).tolist() == \
                family.tok(one_pad, add_special_tokens=False).input_ids, name  # the ids of HF's text
        ours = patchify_video(decode_video(data, plan, cfg), cfg)
        theirs = reference[f"{name}/pixels"]
        assert ours.shape == theirs.shape, name
        normalized = normalize_video_patches(torch.from_numpy(ours), cfg.video_mean, cfg.video_std).numpy()
        assert np.array_equal(normalized, theirs), (name, float(np.abs(normalized - theirs).max()))


def test_the_checks_would_catch_a_wrong_frame_or_rotation(clips, family, reference):
    """Controls: a neighbouring frame, or the rotation left off, gives other pixels than HF's."""
    cfg = family.cfg.image
    plan = plan_video(clips.data["h264_bframes"], cfg)
    shifted = type(plan)(plan.header, np.minimum(plan.indices + 1, plan.header.frames - 1), plan.grid, plan.tokens,
                         plan.temporal)
    ours = patchify_video(decode_video(clips.data["h264_bframes"], shifted, cfg), cfg)
    theirs = reference["h264_bframes/pixels"]
    assert not np.array_equal(normalize_video_patches(torch.from_numpy(ours), cfg.video_mean, cfg.video_std).numpy(),
                              theirs)
    rot = plan_video(clips.data["rotated"], cfg)
    assert (rot.header.rotation, rot.header.height, rot.header.width) == (90, 64, 32)
    unturned = dataclasses.replace(rot, header=dataclasses.replace(rot.header, rotation=0))  # same grid, coded frames
    ours = patchify_video(decode_video(clips.data["rotated"], unturned, cfg), cfg)
    theirs = reference["rotated/pixels"]
    assert ours.shape[0] == theirs.shape[0]  # the same patches, in other orientation: other pixels
    assert not np.array_equal(normalize_video_patches(torch.from_numpy(ours), cfg.video_mean, cfg.video_std).numpy(),
                              theirs)


# ------------------------------------------------------------------ sampling, decoding
def test_the_sampler_equals_torch_arange_as_hf_computes_it():
    for total in range(1, 400, 7):
        for num in range(1, min(total, 64) + 1):
            want = torch.arange(0, total, total / num).int().numpy()
            assert np.array_equal(_torch_float_arange_int(total, total / num), want), (total, num)


def test_only_the_gops_holding_sampled_frames_are_decoded(clips, family):
    """96 frames, a keyframe every 8: 4 sampled frames decode at most 4 GOPs, and equal a full decode's."""
    import av

    data = clips.data["long_gop"]
    indices = np.array([5, 30, 62, 90])
    full = plan_video(data, family.cfg.image)
    plan = dataclasses.replace(full, indices=indices, pts=full.header.pts[indices], seek=full.header.seek[indices])
    frames, decoded, sequential = decode_sampled(data, plan)
    assert decoded <= 4 * 8 < 96 and not sequential
    with av.open(str(clips.paths["long_gop"])) as c:
        every = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    for i, f in zip(indices, frames):
        assert np.array_equal(f, every[i])


def _decoded(data: bytes) -> list[np.ndarray]:
    """Every frame PyAV's decoder outputs, in order: what HF's PyAV loader indexes (enumerate(decode))."""
    import av

    with av.open(io.BytesIO(data)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


def test_frames_are_counted_and_indexed_as_the_decoder_outputs_them(clips):
    """Edit lists (a clip cut with ffmpeg -ss -c copy), B-frame reorder, open GOPs, uneven and negative
    timestamps: the frame count is what PyAV's decoder outputs, and frame i -- decoded alone, by seeking to its
    keyframe -- is the decoder's i-th frame. A cut that keeps an open GOP's broken leading frames (Matroska, no
    edit list) or starts between keyframes is counted by decoding it and read in order (the seek table is not
    what the decoder does there). Was: the header's count, frame i the i-th packet time: the trimmed clips
    skipped as corrupt_video or off by the dropped frames."""
    import av

    cfg = Config().image
    cfg.video, cfg.video_sample_frames = "qwen2_vl", False
    cut_open_gop = remux_trimmed(clips.data["open_gop"], 17, "mkv")  # starts at an open GOP's I-frame
    mid_gop = remux_trimmed(clips.data["open_gop"], 0, "mkv", first_packet=3)  # starts between keyframes
    cases = {**{k: clips.data[k] for k in ("trimmed_mp4", "trimmed_mov", "open_gop", "h264_bframes", "vfr",
                                           "vp9_webm", "h264_mkv")}, "cut_open_gop": cut_open_gop, "mid_gop": mid_gop}
    for name, data in cases.items():
        every, plan = _decoded(data), plan_video(data, cfg)
        assert plan.header.frames == len(every), name
        got = decode_sampled(data, plan)
        assert got.sequential == (name in ("cut_open_gop", "mid_gop")), name
        assert all(np.array_equal(a, b) for a, b in zip(got.frames, every, strict=True)), name
        if got.sequential:
            continue
        for i in range(len(every)):  # each frame alone: one seek, the GOP up to it
            alone = dataclasses.replace(plan, indices=plan.indices[[i]], pts=plan.pts[[i]], seek=plan.seek[[i]])
            one = decode_sampled(data, alone)
            assert not one.sequential and np.array_equal(one.frames[0], every[i]), (name, i)
    with av.open(io.BytesIO(clips.data["trimmed_mp4"])) as c:
        assert c.streams.video[0].frames == 32  # the header counts the 9 packets the edit list drops
    assert plan_video(clips.data["trimmed_mp4"], cfg).header.frames == 23 == 40 - 17
    assert len(_decoded(cut_open_gop)) < sum(1 for _ in av.open(io.BytesIO(cut_open_gop)).demux(video=0)) - 1


def _h264_refs(data: bytes) -> tuple[int, int]:
    """(B-frames, non-reference frames) of an H.264 mp4: packets shown before one decoded earlier, and packets
    whose slices have nal_ref_idc 0 (the mp4's 4-byte NAL lengths)."""
    import av

    bframes, nonref, shown = 0, 0, -1
    with av.open(io.BytesIO(data)) as c:
        for p in c.demux(video=0):
            if not p.size:
                continue
            bframes, shown = bframes + (p.pts < shown), max(shown, p.pts)
            b, i, refs = bytes(p), 0, []
            while i + 4 < len(b):
                if b[i + 4] & 31 in (1, 5):  # a slice: its nal_ref_idc
                    refs.append(b[i + 4] >> 5 & 3)
                i += 4 + int.from_bytes(b[i:i + 4], "big")
            nonref += refs[0] == 0
    return bframes, nonref


def _decoded_by_seek(data: bytes, plan, thread_type: str) -> tuple[list, int]:
    """decode._by_seek on the plan's frames with this thread_type (frame threads: 4 of them, even on fewer cores)."""
    import av

    from ray_mmbatch.data.video.decode import _by_seek

    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        stream.thread_type = thread_type
        if thread_type == "FRAME":
            stream.thread_count = 4
        return _by_seek(c, stream, plan.pts, plan.seek)


def test_h264_skips_the_unsampled_non_reference_frames_and_every_sampled_frame_is_exact(clips, monkeypatch):
    """Issue 46: an H.264 run sends each unwanted packet as skip_frame NONREF: the codec skips the non-reference
    frames among them (nobody references them), so the sampled frames equal a full decode's, bit for bit, with
    frame, slice and no threads, and fewer frames are decoded than without skipping (SKIP_NONREF emptied).
    Streams: 3 B-frames without b-pyramid (every B-frame non-reference), x264's default b-pyramid with 2 and 3
    B-frames (some B-frames referenced: those are decoded), a clip cut with an edit list. HF's pixels on the
    first two: test_header_cost_equals_the_hf_video_processor (h264_b3_flat, h264_bframes)."""
    from ray_mmbatch.data.video import decode as decode_module

    cfg = Config().image
    cfg.video, cfg.video_sample_frames = "qwen2_vl", False
    cases = {"h264_b3_flat": clips.data["h264_b3_flat"], "h264_bframes": clips.data["h264_bframes"],
             "b3_pyramid": encode_clip(clip_frames(50, 32, 48, 18), fps=10, gop=25, bframes=3),
             "trimmed_mp4": clips.data["trimmed_mp4"]}
    bframes, nonref = _h264_refs(cases["h264_b3_flat"])
    assert bframes == nonref > 0  # no pyramid: every B-frame is a non-reference frame
    bframes, nonref = _h264_refs(cases["b3_pyramid"])
    assert 0 < nonref < bframes  # b-pyramid: some B-frames are references
    rng = np.random.default_rng(0)
    for name, data in cases.items():
        every, full = _decoded(data), plan_video(data, cfg)
        n = len(every)
        subsets = [[i] for i in range(n)] + [list(range(0, n, 3)), list(range(1, n, 4)), [0, n - 1], list(range(n))]
        subsets += [sorted(rng.choice(n, size=int(rng.integers(1, 7)), replace=False).tolist()) for _ in range(12)]
        skipped = 0
        for indices in subsets:
            idx = np.array(indices)
            plan = dataclasses.replace(full, indices=idx, pts=full.pts[idx], seek=full.seek[idx])
            got = decode_sampled(data, plan)
            assert not got.sequential and all(np.array_equal(a, every[i]) for a, i in zip(got.frames, indices)), \
                (name, indices)
            for thread_type in ("FRAME", "SLICE", "NONE"):
                frames, _ = _decoded_by_seek(data, plan, thread_type)
                assert all(np.array_equal(a, every[i]) for a, i in zip(frames, indices)), (name, indices, thread_type)
            with monkeypatch.context() as m:
                m.setattr(decode_module, "SKIP_NONREF", frozenset())
                plain = decode_sampled(data, plan)
            assert all(np.array_equal(a, b) for a, b in zip(got.frames, plain.frames, strict=True))
            assert got.decoded <= plain.decoded, (name, indices)
            skipped += plain.decoded - got.decoded
            if len(indices) == n and name != "trimmed_mp4":  # every frame sampled: nothing to skip (the cut clip
                assert got.decoded == plain.decoded, name   # skips the unshown ones the edit list drops)
        assert skipped > 0, name  # the skip happened (the count above could not catch a codec that ignores it)


def test_other_codecs_decode_every_frame_of_a_run(clips, monkeypatch):
    """MPEG-4 Part 2 (its B-frames are never referenced) and HEVC (a "sub-layer non-reference" picture may be
    referenced by a higher temporal sub-layer) are not skipped: the same frames decoded as without SKIP_NONREF.
    Control: HEVC put in SKIP_NONREF would skip frames here (x265 writes TRAIL_N pictures)."""
    from ray_mmbatch.data.video import decode as decode_module

    cfg = Config().image
    cfg.video, cfg.video_sample_frames = "qwen2_vl", False
    cases = {"mpeg4": encode_clip(clip_frames(30, 48, 64, 19), fps=10, codec="mpeg4", gop=15, bframes=2),
             "hevc": encode_with(clip_frames(30, 48, 64, 20), 10, "libx265",
                                 {"x265-params": "keyint=15:bframes=3:log-level=none"})}
    for name, data in cases.items():
        every, full = _decoded(data), plan_video(data, cfg)
        idx = np.arange(0, len(every), 4)
        plan = dataclasses.replace(full, indices=idx, pts=full.pts[idx], seek=full.seek[idx])
        got = decode_sampled(data, plan)
        assert not got.sequential and all(np.array_equal(a, every[i]) for a, i in zip(got.frames, idx)), name
        with monkeypatch.context() as m:
            m.setattr(decode_module, "SKIP_NONREF", frozenset())
            assert decode_sampled(data, plan).decoded == got.decoded, name
        with monkeypatch.context() as m:
            m.setattr(decode_module, "SKIP_NONREF", frozenset({"mpeg4", "hevc"}))
            assert decode_sampled(data, plan).decoded < got.decoded, name  # the control: this stream would skip


def test_rotation_is_read_from_mp4_mov_and_matroska_and_the_pyav_loader_leaves_it(clips, tmp_path):
    """The display rotation comes from the container as FFmpeg reports it on the decoded frames (mp4 / mov tkhd,
    Matroska Projection); --video-loader pyav reads the clip as HF's load_video default (PyAV) does: frames as
    coded, the header's rate -- indices, grid and pixels equal HF's own PyAV loader + processor."""
    import av

    for name, want in (("rotated", 90), ("rotated_mkv", 90), ("rotated_mov", 180), ("h264_mkv", 0), ("vp9_webm", 0)):
        assert container_rotation(clips.data[name]) == want, name
        with av.open(io.BytesIO(clips.data[name])) as c:
            assert int(next(c.decode(video=0)).rotation or 0) % 360 == want, name
    ckpt = make_qwen_checkpoint(tmp_path / "q2", "qwen2_vl")
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR["qwen2_vl"]))
    cfg = Config()
    cfg.model.path, cfg.image.video_loader = str(ckpt), "pyav"
    im = qwen_vl.configure(cfg).image
    names = ("rotated", "rotated_mov", "h264_bframes")
    (tmp_path / "ref").mkdir()
    ref = _run_reference(ckpt, {k: clips.paths[k] for k in names}, tmp_path / "ref", loader="pyav")
    for name in names:
        plan = plan_video(clips.data[name], im)
        assert plan.header.rotation == 0 and plan.header.fps == float(ref[f"{name}/fps"]), name
        assert plan.indices.tolist() == ref[f"{name}/indices"].tolist(), name
        assert [list(plan.grid)] == ref[f"{name}/grid"].tolist(), name
        ours = normalize_video_patches(torch.from_numpy(patchify_video(decode_video(clips.data[name], plan, im),
                                                                       im)), im.video_mean, im.video_std).numpy()
        assert np.array_equal(ours, ref[f"{name}/pixels"]), name
    cfg = Config()
    cfg.model.path, cfg.image.video_loader = str(ckpt), "decord"
    with pytest.raises(ValueError, match=r"--video-loader 'decord': one of torchcodec, pyav"):
        qwen_vl.configure(cfg)


def test_is_video_tells_containers_from_images(clips):
    for name, data in clips.data.items():
        assert is_video(data), name
    assert not is_video(png(image(20, 20, 0)))
    assert not is_video(b"\x00\x00\x00\x1cftypavif" + b"\x00" * 20)  # AVIF still image


def test_bad_clips_are_skipped_with_their_reason(clips, family):
    cfg = family.cfg
    good = clips.data["h264_bframes"]
    rows = {
        "truncated": (good[:200], "<video>\nWhat?"),
        "garbage": (b"\x00\x00\x00\x18ftypmp42" + os.urandom(300), "<video>\nWhat?"),
        "huge": (good, "<video>\nWhat?"),
        "video_on_image": (png(image(40, 40, 1)), "<video>\nWhat?"),
    }
    raw = {S.SAMPLE_ID: list(rows), S.CONVERSATIONS: [json.dumps([{"from": "human", "value": t},
                                                                  {"from": "gpt", "value": "A clip."}])
                                                      for _, t in rows.values()],
           S.IMAGES: [[b] for b, _ in rows.values()], S.IMAGE_REFS: [[k] for k in rows], S.READ_ERROR: [""] * len(rows)}
    small = Config().image
    small.__dict__.update(cfg.image.__dict__)
    measured = measure_batch(raw, cfg.image, family.tok, cfg.text)
    reasons = dict(zip(rows, (S.parse_skip(r)[0] for r in measured[S.SKIP_REASON])))
    assert reasons["truncated"] in (S.SKIP_UNREADABLE_VIDEO, S.SKIP_EMPTY_VIDEO, S.SKIP_CORRUPT_VIDEO)
    assert reasons["garbage"] == S.SKIP_UNREADABLE_VIDEO
    assert reasons["video_on_image"] == S.SKIP_PLACEHOLDER_MISMATCH
    assert reasons["huge"] == ""
    small.max_decoded_bytes = 48 * 64 * 3 - 1
    measured = measure_batch({k: v[2:3] for k, v in raw.items()}, small, family.tok, cfg.text)
    assert S.parse_skip(measured[S.SKIP_REASON][0])[0] == S.SKIP_DECOMPRESSION_BOMB
    with pytest.raises(VideoSkip, match="no bytes"):
        probe_video(b"", cfg.image)


def test_a_family_without_video_refuses_a_video_sample(clips):
    cfg = Config()  # the built-in model: images only
    tok = load_tokenizer("")
    raw = {S.SAMPLE_ID: ["v"], S.CONVERSATIONS: [json.dumps([{"from": "human", "value": "<video>\nWhat?"},
                                                              {"from": "gpt", "value": "A clip."}])],
           S.IMAGES: [[clips.data["vfr"]]], S.IMAGE_REFS: [["clips/vfr.mp4"]], S.READ_ERROR: [""]}
    with pytest.raises(VideoRefused, match=r"clips/vfr.mp4.*takes no video") as refused:
        measure_batch(raw, cfg.image, tok, cfg.text)
    from ray_mmbatch.models import REGISTRY, backend_module

    families = [t for n in REGISTRY for t in getattr(backend_module(n), "VIDEO_MODEL_TYPES", ())]
    assert {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision"} <= set(families)
    assert all(t in str(refused.value) for t in families), str(refused.value)


# ------------------------------------------------------------------ exact packing of clips and images
def _samples(family, clips) -> tuple[list[dict], dict]:
    convs = {
        "clip": ("<video>\nWhat happens in the clip?", "A square moves to the right.", [clips.data["h264_bframes"]]),
        "clip_and_image": ("Compare <image> with <video> please.", "The clip moves; the picture does not.",
                           [png(image(60, 40, 3)), clips.data["vfr"]]),
        "text": ("Name three primes.", "Two, three and five.", []),
        "image": ("<image>\nWhat is it?", "Stripes.", [png(image(50, 70, 4))]),
        "rotated": ("<image>\nDescribe it.", "A portrait clip.", [clips.data["rotated"]]),  # <image> for a video
    }
    return _measured_samples(family, convs)


def _measured_samples(family, convs: dict) -> tuple[list[dict], dict]:
    """{sample id: (question, answer, media)} -> (the materialized samples, the measured columns); none skipped."""
    raw = {S.SAMPLE_ID: list(convs),
           S.CONVERSATIONS: [json.dumps([{"from": "human", "value": u}, {"from": "gpt", "value": a}])
                             for u, a, _ in convs.values()],
           S.IMAGES: [m for *_, m in convs.values()], S.IMAGE_REFS: [[""] * len(m) for *_, m in convs.values()],
           S.READ_ERROR: [""] * len(convs)}
    measured = measure_batch(raw, family.cfg.image, family.tok, family.cfg.text)
    assert not any(measured[S.SKIP_REASON]), list(measured[S.SKIP_REASON])
    rows = [{c: measured[c][i] for c in measured} for i in range(len(convs))]
    return [materialize_sample(r, family.cfg.image) for r in rows], measured


def _alone_ce(family, s: dict) -> torch.Tensor:
    """The sample alone through HF's standard forward: HF builds its M-RoPE ids from mm_token_type_ids."""
    ids = torch.as_tensor(s["input_ids"], dtype=torch.long)[None]
    image_id, video_id = family.ids["image_token_id"], family.tok.convert_tokens_to_ids("<|video_pad|>")
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False,
              "mm_token_type_ids": (ids == image_id).int() + 2 * (ids == video_id).int()}
    im = family.cfg.image
    if len(s["grids"]):
        from ray_mmbatch.models.hf_common import normalize_patches

        kwargs.update(pixel_values=normalize_patches(torch.as_tensor(s["patches"]), im.image_mean, im.image_std,
                                                     im.temporal_patch_size),
                      image_grid_thw=torch.as_tensor(s["grids"], dtype=torch.long))
    if len(s.get("video_grids", ())):
        kwargs.update(pixel_values_videos=normalize_video_patches(torch.as_tensor(s["video_patches"]), im.video_mean,
                                                                  im.video_std),
                      video_grid_thw=torch.as_tensor(s["video_grids"], dtype=torch.long))
        if family.name == "qwen2_5_vl":
            kwargs["second_per_grid_ts"] = torch.as_tensor(s["second_per_grid_ts"])
    return _shifted_ce(family.model.hf_model, kwargs, s["labels"])


def _shifted_ce(hf_model, kwargs: dict, labels) -> torch.Tensor:
    """CE of HF's logits at the sample's target positions (our labels are already shifted)."""
    logits = hf_model(**kwargs).logits[0]
    labels = torch.as_tensor(labels, dtype=torch.long)
    at = torch.nonzero(labels != S.IGNORE_INDEX).flatten()
    return F.cross_entropy(logits[at].float(), labels[at], reduction="none")


def _batch_equals_alone(fam, clips, mode: str, alone_ce) -> tuple[dict, torch.Tensor, dict]:
    """The five samples of _samples collated in ``mode``: their target CE equals each sample alone through HF
    (``alone_ce(fam, sample)``) within the family's tolerance. Returns (batch, the CE alone, the measured rows)."""
    samples, measured = _samples(fam, clips)
    assert list(measured[S.N_VIDEOS]) == [1, 1, 0, 0, 1] and list(measured[S.N_IMAGES]) == [0, 1, 0, 1, 0]
    batch = batch_to_torch((collate_pack if mode == "pack" else collate_pad)(samples, fam.ids["pad_id"]), "cpu")
    with torch.no_grad():
        ours = fam.model.target_ce(batch)
        want = torch.cat([alone_ce(fam, s) for s in samples])
    assert ours.shape == want.shape
    diff = float((ours - want).abs().max())
    assert diff <= fam.tol.ce, diff
    return batch, want, measured


@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_a_batch_of_clips_and_images_equals_each_sample_alone_through_hf(family, clips, mode):
    batch, want, measured = _batch_equals_alone(family, clips, mode, _alone_ce)
    assert all(measured[S.N_FRAMES][i] > 0 for i in (0, 1, 4))
    if mode == "pack":  # controls: a naive pack (positions restarting, no M-RoPE) is visibly off
        _naive_pack_controls(family, batch, want)


@pytest.mark.parametrize("family", ["qwen3_vl_moe"], indirect=True)
def test_qwen3_vl_moe_takes_video_as_qwen3_vl_does(family, clips):
    """Qwen3-VL-MoE: Qwen3-VL's video settings and timestamps, and a packed batch of clips and images exact."""
    assert family.cfg.image.video == "qwen3_vl" and family.cfg.text.video_token == "<|video_pad|>"
    test_a_batch_of_clips_and_images_equals_each_sample_alone_through_hf(family, clips, "pack")


@pytest.mark.parametrize("family", QWEN3_5, indirect=True)
def test_qwen3_5_takes_video_as_qwen3_vl_does(family, clips, reference):
    """Qwen3.5 (dense, MoE; its repos ship Qwen3-VL's processors): configure takes the checkpoint's
    Qwen3VLVideoProcessor settings and the video token; every clip's frames, grid, tokens, timestamped text and
    pixels equal HF's Qwen3VLVideoProcessor / Qwen3VLProcessor; the budget counts its frames and video tokens."""
    assert family.cfg.image.video == "qwen3_vl" and family.cfg.text.video_token == "<|video_pad|>"
    test_configure_reads_the_video_processor(family)
    test_header_cost_equals_the_hf_video_processor(clips, family, reference)
    test_the_budget_counts_frames_and_video_tokens(family, clips)


@pytest.mark.parametrize("mode", ["pack", "pad"])
@pytest.mark.parametrize("family", QWEN3_5, indirect=True)
def test_qwen3_5_batch_of_clips_and_images_equals_each_sample_alone_through_hf(family, clips, mode):
    """Clips, images and text packed (each Gated DeltaNet layer told the row's samples) or padded: each sample's CE
    equals it alone through HF's Qwen3.5 forward; controls (pack): the naive positions, and HF's own packed
    forward (no DeltaNet segments: a clip's recurrent state and conv window leak into the next sample)."""
    from ray_mmbatch.models import deltanet

    test_a_batch_of_clips_and_images_equals_each_sample_alone_through_hf(family, clips, mode)
    if mode == "pack":
        samples, _ = _samples(family, clips)
        batch = batch_to_torch(collate_pack(samples, family.ids["pad_id"]), "cpu")
        with torch.no_grad():
            want = torch.cat([_alone_ce(family, s) for s in samples])
            kwargs = family.model.forward_inputs(batch)
            assert kwargs.pop(deltanet.SEGMENTS) == tuple(batch["cu_seqlens"].tolist())
            hidden = family.model.hf_model.model(**kwargs).last_hidden_state
            leaked = family.model._target_ce(hidden, batch["labels"], "none")
        assert float((leaked - want).abs().max()) > 100 * family.tol.ce


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"], indirect=True)
def test_qwen3_trains_the_assistant_turns_of_a_conversation_with_a_clip(family, clips, tmp_path):
    """A clip in the first user turn (tests/test_targets.py's check, with a video): the ids are those of HF's
    Qwen3VLProcessor rendering the checkpoint's chat template with the clip loaded and expanded (timestamps, frame
    blocks in place of the template's <|vision_start|><|video_pad|><|vision_end|>), and the trained tokens exactly
    what HF's ``return_assistant_tokens_mask`` marks on the template with generation blocks (Qwen3.5:
    test_targets._qwen3_5_marked, the think block on the last turn only)."""
    from tests import targets_reference as R
    from tests.test_targets import _qwen3_5_marked

    turns = [("system", "Answer briefly."), ("human", "<video>\nWhat happens in the clip?"),
             ("gpt", "A square moves."), ("human", "And then?"), ("gpt", "It stops.")]
    raw = {S.SAMPLE_ID: ["s"], S.CONVERSATIONS: [json.dumps([{"from": f, "value": v} for f, v in turns])],
           S.IMAGES: [[clips.data["h264_bframes"]]], S.IMAGE_REFS: [["clip.mp4"]], S.READ_ERROR: [""]}
    measured = measure_batch(raw, family.cfg.image, family.tok, family.cfg.text)
    assert not measured[S.SKIP_REASON][0] and measured[S.N_VIDEOS][0] == 1
    sample = materialize_sample({c: measured[c][0] for c in measured}, family.cfg.image)
    role = {"system": "system", "human": "user", "gpt": "assistant"}
    messages = [{"role": role[f], "content": [{"type": "text", "text": v}]} for f, v in turns]
    messages[1]["content"] = [{"type": "video", "video": str(clips.paths["h264_bframes"])},
                              {"type": "text", "text": "What happens in the clip?"}]
    template = _qwen3_5_marked() if family.name == "qwen3_5" else R.with_generation_blocks(family.tok.chat_template,
                                                                                          "qwen")
    ref = _run_reference(family.path, {}, tmp_path, chat={"messages": messages, "template": template})
    assert sample["input_ids"].tolist() == ref["chat/ids"].tolist()
    video_id = family.tok.convert_tokens_to_ids("<|video_pad|>")
    assert int((ref["chat/ids"] == video_id).sum()) == int(measured[S.VIDEO_TOKENS][0]) > 0
    trained = R.trained_positions(sample["labels"])
    assert trained == ref["chat/mask"].tolist()
    assert family.tok.decode(ref["chat/ids"][trained]).count("It stops.") == 1  # the turns really are trained


def _naive_pack_controls(family, batch: dict, want: torch.Tensor) -> None:
    with torch.no_grad():  # restored even when an assertion fails
        kwargs = family.model.forward_inputs(batch)
        kwargs["position_ids"] = kwargs["position_ids"][:1].expand(4, -1, -1).clone()
        kwargs["position_ids"][1:] = kwargs["position_ids"][0]
        hidden = family.model.hf_model.model(**kwargs).last_hidden_state
        naive = family.model._target_ce(hidden, batch["labels"], "none")
        assert float((naive - want).abs().max()) > 100 * family.tol.ce
        if family.name == "qwen2_5_vl":  # without second_per_grid_ts the temporal positions step by 1 s
            kwargs = family.model.forward_inputs(batch)
            batch2 = dict(batch, second_per_grid_ts=torch.ones_like(batch["second_per_grid_ts"]))
            kwargs["position_ids"] = family.model._adapter.packed_position_ids(batch2)
            hidden = family.model.hf_model.model(**kwargs).last_hidden_state
            wrong = family.model._target_ce(hidden, batch["labels"], "none")
            assert float((wrong - want).abs().max()) > 100 * family.tol.ce


def test_the_budget_counts_frames_and_video_tokens(family, clips):
    samples, measured = _samples(family, clips)
    for i, s in enumerate(samples):
        assert len(s["input_ids"]) == int(measured[S.TOKENS][i])
        vtok = sum(int(np.prod(g)) // 4 for g in s.get("video_grids", []))
        assert vtok == int(measured[S.VIDEO_TOKENS][i])
        n_frames = sum(len(plan_video(m, family.cfg.image).indices)
                       for m in measured[S.IMAGES][i] if is_video(m))
        assert n_frames == int(measured[S.N_FRAMES][i])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# ------------------------------------------------------------------ a mixed run through Ray
@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A Qwen2-VL checkpoint configured (no model built): the Ray run needs its settings and token ids only."""
    path = _checkpoint(tmp_path_factory, "qwen2_vl")
    cfg = harness_configure(qwen_vl, path)
    return SimpleNamespace(path=path, cfg=cfg, ids=token_ids(cfg, load_tokenizer(cfg.text.tokenizer)))


def test_each_clip_is_probed_once_per_sample_materialize_decodes_by_the_carried_plan(clips, qwen2, monkeypatch):
    """measure probes each clip (one open, one demux) and hands its plan on (schema.VIDEO_PLANS); materialize
    opens the clip once, to decode by that plan, and never probes it again (was: probed again in materialize,
    and WebM / Matroska demuxed three times: measure's count, materialize's probe, decode's timestamp pass).
    A row measured without the plans (an older payload) is probed again and gives the same sample."""
    from ray_mmbatch.data.video import decode as video_decode
    from ray_mmbatch.data.video import probe as video_probe

    cfg, opens = qwen2.cfg.image, {"probe": 0, "decode": 0}

    def counted(where, real):
        def _open(data):
            opens[where] += 1
            return real(data)
        return _open

    monkeypatch.setattr(video_probe, "_open", counted("probe", video_probe._open))  # the real opener, counted
    monkeypatch.setattr(video_decode, "_open", counted("decode", video_decode._open))
    names = ["vp9_webm", "h264_mkv", "trimmed_mp4"]
    tok = load_tokenizer(qwen2.cfg.text.tokenizer)
    raw = {S.SAMPLE_ID: names, S.CONVERSATIONS: [json.dumps([{"from": "human", "value": "<video>\nWhat?"},
                                                             {"from": "gpt", "value": "A clip."}])] * 3,
           S.IMAGES: [[clips.data[k]] for k in names], S.IMAGE_REFS: [[k] for k in names], S.READ_ERROR: [""] * 3}
    measured = measure_batch(raw, cfg, tok, qwen2.cfg.text)
    assert not any(measured[S.SKIP_REASON]) and opens == {"probe": 3, "decode": 0}
    assert [len(p) for p in measured[S.VIDEO_PLANS]] == [1, 1, 1]
    rows = [{c: measured[c][i] for c in measured} for i in range(3)]
    carried = [materialize_sample(r, cfg) for r in rows]
    assert opens == {"probe": 3, "decode": 3}  # no second probe
    again = [materialize_sample({k: v for k, v in r.items() if k != S.VIDEO_PLANS}, cfg) for r in rows]
    assert opens == {"probe": 6, "decode": 6}
    for a, b in zip(carried, again):
        assert np.array_equal(a["video_patches"], b["video_patches"]) and np.array_equal(a["input_ids"],
                                                                                         b["input_ids"])


@pytest.mark.ray
def test_a_mixed_image_and_video_run_trains_every_sample_once_within_every_budget(ray_cluster, clips, qwen2,
                                                                                   tmp_path, monkeypatch):
    """LLaVA-Video-style JSON (video, image, both, text, a broken clip) through read -> measure -> plan ->
    materialize on Ray under --max-tokens and --max-frames: every sample once (trained or skipped with its
    reason), no batch over a budget, and a batch's decoded video pixels bounded by its frames."""
    from ray_mmbatch.batching.collate import decode_batch
    from ray_mmbatch.data.errors import decode_skips
    from ray_mmbatch.dataflow.pipeline import batch_dataset

    names = ["h264_bframes", "vfr", "rotated", "mpeg4_25fps", "vp9_webm", "one_frame", "h264_mkv", "thin"]
    (tmp_path / "media").mkdir()
    for n in names:
        (tmp_path / "media" / clips.paths[n].name).write_bytes(clips.data[n])
    (tmp_path / "media" / "broken.mp4").write_bytes(clips.data["vfr"][:300])
    for k in range(4):
        (tmp_path / "media" / f"p{k}.png").write_bytes(png(image(40 + 30 * k, 60, k)))
    records, frames = [], {}
    for k in range(24):
        clip = clips.paths[names[k % len(names)]].name
        kind = k % 4
        rec = {"id": f"r{k}",
               "conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": f"Answer {k}."}]}
        if kind == 0:
            rec.update(video=f"media/{clip}")
            rec["conversations"][0]["value"] = "<video>\nWhat happens?"
        elif kind == 1:
            rec.update(image=f"media/p{k % 4}.png", video=f"media/{clip}")
            rec["conversations"][0]["value"] = "Compare <image> and <video>."
        elif kind == 2:
            rec.update(image=f"media/p{k % 4}.png")
            rec["conversations"][0]["value"] = "<image>\nWhat is it?"
        else:
            rec["conversations"][0]["value"] = "Say something."
        records.append(rec)
        frames[f"r{k}"] = len(plan_video(clips.data[names[k % len(names)]], qwen2.cfg.image).indices) \
            if kind in (0, 1) else 0
    records.append({"id": "bad", "video": "media/broken.mp4",
                    "conversations": [{"from": "human", "value": "<video>\nWhat?"}, {"from": "gpt", "value": "No."}]})
    (tmp_path / "data.json").write_text(json.dumps(records))
    cfg = Config()
    cfg.model.path = str(qwen2.path)
    cfg = qwen_vl.configure(cfg)
    cfg.data.path, cfg.data.format = str(tmp_path / "data.json"), "llava"
    cfg.budget.window, cfg.budget.max_tokens, cfg.budget.max_frames = 16, 1024, 24
    rows = batch_dataset(cfg, qwen2.ids["pad_id"]).take_all()
    trained, skipped, batches = [], {}, 0
    for row in rows:
        for rec in decode_skips(row[S.BATCH_SKIPPED]):
            skipped[rec.sample_id] = rec.reason
        if not int(row[S.BATCH_N_SAMPLES]):
            continue
        b = decode_batch(bytes(row[S.BATCH_PAYLOAD]))
        ids = [s.split("#")[-1] for s in b["sample_ids"]]
        batches += 1
        assert int(b["seq_lens"].sum()) <= cfg.budget.max_tokens
        assert sum(frames[i] for i in ids) <= cfg.budget.max_frames
        if "video_patches" in b:  # decoded video pixels: at most (frames + a padding frame per clip) frames
            bound = (sum(frames[i] for i in ids) + len(b["video_grid_thw"])) * cfg.image.video_max_pixels * 3
            assert b["video_patches"].nbytes <= bound
        trained += list(b["sample_ids"])
    short = {s.split("#")[-1]: r for s, r in skipped.items()}
    assert short == {"bad": S.SKIP_UNREADABLE_VIDEO} or short.get("bad") in (S.SKIP_EMPTY_VIDEO, S.SKIP_CORRUPT_VIDEO)
    assert len(short) == 1
    assert sorted(s.split("#")[-1] for s in trained) == sorted(f"r{k}" for k in range(24))
    assert len(trained) == len(set(trained))
    assert batches > sum(frames.values()) // cfg.budget.max_frames  # the frame budget split the clips

    # `inspect --model` on the same data: the video figures per sample, the clips decoded and checked against
    # measure, with the checkpoint's video processor (the command configures it as train does)
    from ray_mmbatch.commands import inspect_data
    from ray_mmbatch.run import raylogs

    monkeypatch.setattr(raylogs, "_filter_stderr", lambda: None)  # keep pytest's fd 2 (the command pipes it)
    monkeypatch.setattr(raylogs, "_state", dict(raylogs._state))
    monkeypatch.setenv("RAY_MMBATCH_QUIET", "1")
    assert inspect_data.main(["--model", str(qwen2.path), "--data", cfg.data.path, "--max-tokens", "1024",
                              "--max-frames", "24", "--json", str(tmp_path / "inspect.json")]) == 0
    report = json.loads((tmp_path / "inspect.json").read_text())
    assert report["model"]["model_type"] == "qwen2_vl" and report["model"]["video"]["processor"] == "qwen2_vl"
    with_video = [k for k in range(24) if k % 4 in (0, 1)]
    assert report["samples_read"] == 25 and report["skipped"] == {short["bad"]: 1}
    assert report["length_mismatch"] == 0 and report["pixels_decoded"]
    assert report["samples_with_video"] == len(with_video)
    assert report["videos_per_sample"] == {"0": 12, "1": 12}
    assert report["video_frames"]["sum"] == sum(frames.values())
    assert report["video_frames"]["max"] == max(frames.values())
    video_tokens = [plan_video(clips.data[names[k % len(names)]], cfg.image).tokens for k in with_video]
    assert report["video_tokens"]["sum"] == sum(video_tokens)
    frames_fit = report["suggested_budgets"]["max_frames"][0]
    assert frames_fit["oversize"] == 0 and max(frames.values()) <= frames_fit["value"] < max(frames.values()) + 8


def test_preflight_names_the_family_that_takes_no_video(clips, tmp_path):
    from ray_mmbatch.run.preflight import PreflightError, preflight

    (tmp_path / "clip.mp4").write_bytes(clips.data["vfr"])
    (tmp_path / "data.json").write_text(json.dumps([{"id": "v", "video": "clip.mp4", "conversations": [
        {"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "A square moves."}]}]))
    cfg = Config()
    cfg.data.path = str(tmp_path / "data.json")
    with pytest.raises(PreflightError, match=r"the built-in model \(builtin backend\) takes no video.*clip.mp4"):
        preflight(cfg)


# ------------------------------------------------------------------ LLaVA-OneVision: frames pooled 2 x 2
ONEVISION_VIDEO = {"video_processor_type": "LlavaOnevisionVideoProcessor", "size": {"height": 42, "width": 42},
                   "do_sample_frames": True, "fps": 3.0}


@pytest.fixture(scope="module")
def onevision(tmp_path_factory):
    from ray_mmbatch.models import llava_onevision as ov
    from tests.hf_llava_onevision_checkpoint import make_llava_onevision_checkpoint

    path = make_llava_onevision_checkpoint(tmp_path_factory.mktemp("onevision"))
    (path / "video_preprocessor_config.json").write_text(json.dumps(ONEVISION_VIDEO))
    return _built(ov, path, "llava_onevision")


def _hf_frames(ref: dict, name: str, data: bytes, cfg, asked: int):
    """Our plan of a clip, its frames HF's (``ref``: tests/video_reference.py); None for the 1-frame clip, which HF's
    sampler refuses (``asked`` frames of one) and the data path skips."""
    if name == "one_frame":
        assert str(ref[f"{name}/hf_failed"]).startswith("refused"), ref[f"{name}/hf_failed"]
        with pytest.raises(VideoSkip, match=f"fewer than the {asked}"):
            plan_video(data, cfg)
        return None
    assert not str(ref[f"{name}/hf_failed"]), name
    plan = plan_video(data, cfg)
    assert plan.indices.tolist() == ref[f"{name}/indices"].tolist(), name
    return plan


def test_onevision_header_cost_and_pixels_equal_its_video_processor(clips, onevision, tmp_path):
    """Frames sampled, frames x 4 pooled features + 1 newline tokens, and the 42 px frames == HF's
    LlavaOnevisionVideoProcessor / LlavaOnevisionProcessor for every clip."""
    cfg = onevision.cfg.image
    assert (cfg.video, cfg.video_sample_frames, cfg.video_fps, onevision.cfg.text.video_token) == \
        ("llava_onevision", True, 3.0, "<video>")
    ref = _run_reference(onevision.path, clips.paths, tmp_path, num_image_tokens=9)
    from ray_mmbatch.data.video import video_patches

    for name, data in clips.data.items():
        plan = _hf_frames(ref, name, data, cfg, 3)  # 1 frame at 1 fps, 3 fps asked: refused
        if plan is None:
            continue
        assert [list(plan.grid)] == ref[f"{name}/grid"].tolist() and plan.tokens == int(ref[f"{name}/tokens"]), name
        ours = normalize_video_patches(torch.from_numpy(video_patches(data, plan, cfg)), cfg.video_mean,
                                       cfg.video_std).numpy()
        assert np.array_equal(ours, ref[f"{name}/pixels"]), name


def test_onevision_samples_as_llava_next_without_video_settings_and_honours_the_frame_and_token_caps(tmp_path):
    """LLaVA-OneVision (issue 44, part 1 for every video family): a checkpoint that ships no video settings samples
    as LLaVA-NeXT trains OneVision (1 fps, at most 32 frames; HF's class default would take every frame);
    --video-fps, --video-min-frames, --video-max-frames and --video-max-tokens (frames x 4 + 1 tokens here) bound
    the count, and the frames, grid, tokens and pixels then equal HF's LlavaOnevisionVideoProcessor told that
    count (HF's sampler has no bounds: num_frames is how it is told); --video-max-pixels is refused in one line
    (every frame is the tower's square). Was: every frame, the bounds ignored."""
    from ray_mmbatch.data.video import video_patches
    from ray_mmbatch.models import llava_onevision as ov
    from tests.hf_llava_onevision_checkpoint import make_llava_onevision_checkpoint

    bare = make_llava_onevision_checkpoint(tmp_path / "bare")  # no video processor file, no video keys
    clip = tmp_path / "forty_s.mp4"
    clip.write_bytes(encode_clip(clip_frames(80, 42, 42, 21), fps=2))  # 40 s at 2 fps

    def configured(**settings):
        cfg = Config()
        cfg.model.path = str(bare)
        for k, v in settings.items():
            setattr(cfg.image, k, v)
        return ov.configure(cfg).image

    toolkit = configured()
    assert (toolkit.video_sample_frames, toolkit.video_fps, toolkit.video_min_frames, toolkit.video_max_frames) == \
        (True, 1.0, 1, 32)
    six = {"fps 0.5, max 6": configured(video_fps=0.5, video_max_frames=6),
           "fps 0.1, min 6": configured(video_fps=0.1, video_min_frames=6),
           "25 tokens": configured(video_max_tokens=6 * 4 + 1)}
    with pytest.raises(ValueError, match=r"^image.video_max_pixels = 1000 \(--video-max-pixels\) contradicts .*42x42"):
        configured(video_max_pixels=1000)
    data = clip.read_bytes()
    for n, cases in ((32, {"LLaVA-NeXT defaults": toolkit}), (6, six)):
        told = tmp_path / f"hf_{n}"
        told.mkdir()  # the same checkpoint, its video processor told num_frames (configured above, read no more)
        (bare / "video_preprocessor_config.json").write_text(json.dumps(dict(ONEVISION_VIDEO, fps=None, num_frames=n)))
        ref = _run_reference(bare, {"clip": clip}, told, num_image_tokens=9)
        for what, im in cases.items():
            plan = plan_video(data, im)
            assert plan.indices.tolist() == ref["clip/indices"].tolist(), what
            assert [list(plan.grid)] == ref["clip/grid"].tolist() and plan.tokens == int(ref["clip/tokens"]), what
            ours = normalize_video_patches(torch.from_numpy(video_patches(data, plan, im)), im.video_mean,
                                           im.video_std).numpy()
            assert np.array_equal(ours, ref["clip/pixels"]), what


def _check_qwen3_clips(clips, names, im, ref: dict) -> None:
    """Each named clip's frames, grid, timestamps and pixels by ``im`` equal HF's Qwen3VLVideoProcessor's (``ref``)."""
    for name in names:
        plan = plan_video(clips.data[name], im)
        assert plan.indices.tolist() == ref[f"{name}/indices"].tolist(), name
        assert [list(plan.grid)] == ref[f"{name}/grid"].tolist(), name
        assert "".join(plan.timestamp_texts()) in str(ref[f"{name}/text"]).replace("<|vision_start|>", "").replace(
            "<|video_pad|>", "").replace("<|vision_end|>", ""), name
        ours = normalize_video_patches(torch.from_numpy(patchify_video(decode_video(clips.data[name], plan, im), im)),
                                       im.video_mean, im.video_std).numpy()
        assert np.array_equal(ours, ref[f"{name}/pixels"]), name


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen3_5"])
def test_qwen3_vl_honours_the_video_flags_exactly_as_hf_told_the_same(clips, tmp_path, kind):
    """Qwen3-VL (issue 44, part 1 for every video family) and Qwen3.5 (its processors): --video-fps,
    --video-min-frames, --video-max-frames, --video-max-pixels (Qwen3-VL's bound is the whole clip's pixels, as its
    processor has it) and --video-max-tokens (its per-frame token cap, which the flag turns on: HF's
    cap_pixels_per_frame) win over the checkpoint, and frames, grid, timestamps and pixels equal HF's
    Qwen3VLVideoProcessor whose settings say the same. Qwen2-VL: --video-max-tokens turns its per-frame share on
    too (was accepted and ignored)."""
    backend, make = _backend(kind)
    ckpt = make(tmp_path / "q3", kind)
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR[kind]))
    cfg = Config()
    cfg.model.path = str(ckpt)
    flags = {"video_fps": 2.0, "video_min_frames": 3, "video_max_frames": 6, "video_max_pixels": 40 * 32 * 32,
             "video_max_tokens": 6}
    for k, v in flags.items():
        setattr(cfg.image, k, v)
    im = backend.configure(cfg).image
    assert im.video == "qwen3_vl"
    assert im.video_cap_pixels_per_frame and {k: getattr(im, k) for k in flags} == flags
    told = ckpt  # configured above: its video processor now says what the flags said
    (told / "video_preprocessor_config.json").write_text(json.dumps(dict(
        VIDEO_PROCESSOR["qwen3_vl"], fps=2.0, min_frames=3, max_frames=6, max_video_tokens=6,
        size={"shortest_edge": 8 * 32 * 32, "longest_edge": 40 * 32 * 32})))
    names = ("h264_bframes", "vfr", "trimmed_mp4", "rotated_mkv", "long_gop")
    (tmp_path / "ref").mkdir()
    ref = _run_reference(told, {k: clips.paths[k] for k in names}, tmp_path / "ref", cap_pixels_per_frame=True)
    _check_qwen3_clips(clips, names, im, ref)
    if kind != "qwen3_vl":
        return
    q2 = make_qwen_checkpoint(tmp_path / "q2", "qwen2_vl")
    (q2 / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR["qwen2_vl"]))
    cfg = Config()
    cfg.model.path, cfg.image.video_max_tokens = str(q2), 500
    assert qwen_vl.configure(cfg).image.video_cap_pixels_per_frame


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen3_5"])
def test_qwen3_vl_settings_left_out_are_hf_qwen3vl_video_processor_defaults(clips, tmp_path, kind):
    """A Qwen3-VL / Qwen3.5 video processor file that names only its class: every setting is
    Qwen3VLVideoProcessor's class default (2 fps, 4..768 frames, 128..768 x 32 x 32 pixels over the clip, mean /
    std 0.5), and frames, grid, timestamps and pixels equal HF's processor loaded from that file."""
    backend, make = _backend(kind)
    ckpt = make(tmp_path / kind, kind)
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps({"video_processor_type": "Qwen3VLVideoProcessor"}))
    cfg = Config()
    cfg.model.path = str(ckpt)
    im = backend.configure(cfg).image
    assert (im.video, im.video_sample_frames, im.video_fps, im.video_min_frames, im.video_max_frames) == \
        ("qwen3_vl", True, 2.0, 4, 768)
    assert (im.video_min_pixels, im.video_max_pixels, im.video_cap_pixels_per_frame, im.video_max_tokens) == \
        (128 * 32 * 32, 768 * 32 * 32, False, 768)
    assert im.video_mean == im.video_std == (0.5, 0.5, 0.5)
    names = ("h264_bframes", "mpeg4_25fps", "rotated")
    (tmp_path / "ref").mkdir()
    ref = _run_reference(ckpt, {k: clips.paths[k] for k in names}, tmp_path / "ref")
    _check_qwen3_clips(clips, names, im, ref)


def _onevision_alone_ce(fam, s: dict) -> torch.Tensor:
    """The sample alone through HF's standard forward, pixel_values_videos as [1, frames, 3, S, S]."""
    from ray_mmbatch.models import llava_onevision as ov

    ids = torch.as_tensor(s["input_ids"], dtype=torch.long)[None]
    im, side = fam.cfg.image, fam.cfg.image.image_size
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    if len(s["grids"]):
        kwargs.update(pixel_values=ov.pixel_values(torch.as_tensor(s["patches"]), side, im.image_mean, im.image_std),
                      image_sizes=torch.as_tensor(s["image_sizes"]).long(), batch_num_images=[len(s["grids"])])
    if len(s.get("video_grids", ())):
        frames = normalize_video_patches(torch.as_tensor(s["video_patches"]), im.video_mean, im.video_std)
        kwargs["pixel_values_videos"] = frames.view(1, -1, 3, side, side)
    return _shifted_ce(fam.model.hf_model, kwargs, s["labels"])


@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_onevision_batch_of_clips_and_images_equals_each_sample_alone_through_hf(onevision, clips, mode):
    batch, want, _ = _batch_equals_alone(onevision, clips, mode, _onevision_alone_ce)
    with torch.no_grad():
        if mode == "pack":  # control: the clips' features in the wrong order (swap the first two clips)
            b2 = dict(batch)
            g = batch["video_grid_thw"]
            n0, n1 = int(g[0, 0]), int(g[1, 0])
            vp = batch["video_patches"]
            b2["video_patches"] = torch.cat([vp[n0:n0 + n1], vp[:n0], vp[n0 + n1:]])
            b2["video_grid_thw"] = torch.cat([g[1:2], g[0:1], g[2:]])
            assert float((onevision.model.target_ce(b2) - want).abs().max()) > 100 * onevision.tol.ce


def test_split_batch_gives_back_each_samples_clips(family, clips):
    """verify-packing splits a batch into its samples: each keeps its clips, patches and seconds."""
    from ray_mmbatch.batching.layout import split_batch

    samples, _ = _samples(family, clips)
    for collate in (collate_pack, collate_pad):
        back = split_batch(collate(samples, family.ids["pad_id"]))
        for s, b in zip(samples, back):
            assert np.array_equal(b["video_patches"], s.get("video_patches", b["video_patches"][:0]))
            assert np.array_equal(b["video_grids"], np.asarray(s.get("video_grids", np.zeros((0, 3)))).reshape(-1, 3))
            assert np.array_equal(b["second_per_grid_ts"], s.get("second_per_grid_ts", np.zeros(0, np.float32)))
            assert np.array_equal(b["patches"], s["patches"]) and np.array_equal(b["input_ids"], s["input_ids"])


def test_a_configured_run_crosses_to_the_workers_with_its_video_settings(family):
    """The train workers rebuild the config from its dict: tuples with an empty default (video mean / std,
    LLaVA-OneVision's pinpoints) keep their items' type (they came back as strings, and training stopped)."""
    from ray_mmbatch.config import apply_overrides, flatten

    back = apply_overrides(Config(), flatten(family.cfg.to_dict()))
    assert back == family.cfg
    assert all(isinstance(v, float) for v in back.image.video_mean + back.image.video_std)
    back.image.grid_pinpoints = (42, 84)
    assert apply_overrides(Config(), flatten(back.to_dict())).image.grid_pinpoints == (42, 84)


# ------------------------------------------------------------------ Gemma 4: frames as images in mm:ss blocks
@pytest.fixture(scope="module")
def gemma4_video(tmp_path_factory):
    """The tiny Gemma 4 checkpoint (tests/hf_gemma4_checkpoint.py) with its video processor as published checkpoints
    nest it in processor_config.json (the tower's 4 px patches, 70 soft tokens a frame, num_frames 4)."""
    from ray_mmbatch.models import gemma4
    from tests.hf_gemma4_checkpoint import make_gemma4_checkpoint

    return _built(gemma4, make_gemma4_checkpoint(tmp_path_factory.mktemp("gemma4")), "gemma4")


def _gemma4_video_text(fam, data: bytes) -> list[int]:
    """The ids measure writes for one clip (data/measure.gemma4_frame_blocks), each frame's video token expanded to
    its soft tokens as materialize expands it."""
    from ray_mmbatch.data.measure import gemma4_frame_blocks

    plan = plan_video(data, fam.cfg.image)
    video_id = fam.tok.convert_tokens_to_ids("<|video|>")
    block = gemma4_frame_blocks(fam.tok, video_id, fam.cfg.text.image_block)(plan)
    return np.repeat(block, np.where(block == video_id, plan.tokens // plan.frames, 1)).tolist()


def test_gemma4_header_cost_text_and_pixels_equal_its_video_processor(clips, gemma4_video, tmp_path):
    """For every clip: the frames HF's Gemma4VideoProcessor samples (num_frames 4 of the checkpoint, spread as
    BaseVideoProcessor spreads them), each frame's soft tokens from the header (its image budget resize), the
    processor's text (Gemma4Processor.replace_video_token: ``mm:ss`` + a block of soft tokens per frame) tokenized,
    and pixel_values_videos / video_position_ids ([frames, 630, 48], bit for bit) equal HF's; the 1-frame clip HF
    refuses (fewer frames than num_frames) is skipped."""
    from ray_mmbatch.data.video import video_patches

    fam, cfg = gemma4_video, gemma4_video.cfg.image
    assert (cfg.video, cfg.video_sample_frames, cfg.video_num_frames, cfg.video_fps, fam.cfg.text.video_token) == \
        ("gemma4", True, 4, None, "<|video|>")
    ref = _run_reference(fam.path, clips.paths, tmp_path)
    adapter = fam.model._adapter
    for name, data in clips.data.items():
        plan = _hf_frames(ref, name, data, cfg, 4)
        if plan is None:
            continue
        per_frame = int(ref[f"{name}/tokens"][0])
        assert plan.grid[0] == 4 and plan.tokens == 4 * per_frame, (name, plan.grid, per_frame)
        assert _gemma4_video_text(fam, data) == fam.tok(str(ref[f"{name}/text"]), add_special_tokens=False).input_ids
        got = adapter.video_inputs(torch.from_numpy(video_patches(data, plan, cfg)), torch.tensor([plan.grid]))
        assert got["pixel_values_videos"].shape == ref[f"{name}/pixels"].shape, name
        assert np.array_equal(got["pixel_values_videos"].numpy(), ref[f"{name}/pixels"]), name
        assert np.array_equal(got["video_position_ids"].numpy(), ref[f"{name}/positions"]), name
        assert got["num_frames_per_video"].tolist() == [4]


def _gemma4_alone_ce(fam, s: dict) -> torch.Tensor:
    """The sample alone through HF's own forward: attention_mask of ones and mm_token_type_ids (1 image, 2 video soft
    tokens, as HF's processor types them), HF building its per-layer masks; pixels as its processors give them
    (test above and tests/test_models_gemma4.py)."""
    ids = torch.as_tensor(s["input_ids"], dtype=torch.long)[None]
    kwargs = {k: v for k, v in fam.model.forward_inputs(batch_to_torch(collate_pad([s], fam.ids["pad_id"]), "cpu"))
              .items() if k not in ("position_ids", "attention_mask")}
    kwargs.update(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert torch.equal(kwargs["mm_token_type_ids"], (ids == fam.ids["image_token_id"]).long()
                       + 2 * (ids == fam.tok.convert_tokens_to_ids("<|video|>")).long())
    return _shifted_ce(fam.model.hf_model, kwargs, s["labels"])


@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_gemma4_batch_of_clips_and_images_equals_each_sample_alone_through_hf(gemma4_video, clips, mode):
    """Clips, a clip beside an image, text, an image and a rotated clip: a packed and a padded batch equal each
    sample alone through HF; packed, HF's own packing from restarting position ids (the naive packed feed) is off
    by more than 0.1 nats and frames typed as text (causal frame blocks) by more than 100 x the tolerance."""
    fam = gemma4_video
    batch, want, measured = _batch_equals_alone(fam, clips, mode, _gemma4_alone_ce)
    assert list(measured[S.N_FRAMES]) == [4, 4, 0, 0, 4]
    if mode != "pack":
        return
    with torch.no_grad():
        hidden = fam.model.hf_model.model
        kwargs = fam.model.forward_inputs(batch)
        del kwargs["attention_mask"]  # HF finds the samples from the restarting position ids itself
        naive = fam.model._target_ce(hidden(**kwargs).last_hidden_state, batch["labels"], "none")
        assert float((naive - want).abs().max()) > 0.1
        kwargs = fam.model.forward_inputs(batch)
        as_text = kwargs["mm_token_type_ids"] * (kwargs["mm_token_type_ids"] != 2)
        kwargs["attention_mask"] = fam.model._adapter.packed_masks(batch, as_text)
        causal = fam.model._target_ce(hidden(**kwargs).last_hidden_state, batch["labels"], "none")
        assert float((causal - want).abs().max()) > 100 * fam.tol.ce


def test_gemma4_packed_masks_are_hfs_masks_of_each_sample_alone(gemma4_video, clips):
    """The packed row's per-layer masks, cut at each sample, are exactly what HF builds for that sample alone
    (create_masks_for_vision_model from its mm_token_type_ids: each frame's soft tokens a bidirectional block on the
    sliding layers, causal on the full ones), and nothing crosses samples."""
    from transformers.models.gemma4.modeling_gemma4 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    fam = gemma4_video
    samples, _ = _samples(fam, clips)
    batch = batch_to_torch(collate_pack(samples, fam.ids["pad_id"]), "cpu")
    masks = fam.model.forward_inputs(batch)["attention_mask"]
    text_config = fam.model.hf_model.config.get_text_config()
    at = 0
    for s in samples:
        ids = torch.as_tensor(s["input_ids"], dtype=torch.long)[None]
        n = ids.shape[1]
        types = fam.model._adapter(batch_to_torch(collate_pad([s], fam.ids["pad_id"]), "cpu"))["mm_token_type_ids"]
        alone = create_masks_for_vision_model(config=text_config, inputs_embeds=torch.empty(1, n, 1),
                                              attention_mask=torch.ones_like(ids), cache=None,
                                              position_ids=torch.arange(n)[None],
                                              block_sequence_ids=get_block_sequence_ids_for_mask(types, "cpu"))
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        alone = {k: causal if m is None else m[0, 0] for k, m in alone.items()}  # None: sdpa's own causal mask
        for kind, mask in masks.items():
            assert torch.equal(mask[0, 0, at:at + n, at:at + n], alone[kind]), kind
            assert not mask[0, 0, at:at + n, :at].any() and not mask[0, 0, at:at + n, at + n:].any()
        if (types == 2).any():  # the frames are bidirectional blocks on the sliding layers
            assert (alone["sliding_attention"] & ~causal).sum() > 4 * 10  # 4 frames' blocks, many tokens each
        at += n


def test_gemma4_configure_takes_the_video_settings_hf_would_and_refuses_what_it_cannot_reproduce(gemma4_video, clips,
                                                                                                 tmp_path):
    """Without video settings HF's Gemma4VideoProcessor defaults apply (16 px patches: they do not fit the tiny
    tower, so it takes no video and a clip stops the run at measure); --video-fps samples at that rate (HF's own
    default_sample_indices_fn with num_frames unset: HF refuses fps and num_frames together, as configure does for a
    file that sets both); --video-max-pixels takes another of HF's frame budgets and nothing else; a shipped video
    processor of another class or patch size is refused."""
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    from ray_mmbatch.models import gemma4
    from tests.family_harness import variant

    fam = gemma4_video
    proc = json.loads((fam.path / "processor_config.json").read_text())

    def configured(name: str, video: dict | None, **flags):
        d = variant(fam.path, tmp_path / name, proc={"video_processor": video} if video is not None else None)
        if video is None:
            (d / "processor_config.json").write_text(json.dumps({k: v for k, v in proc.items()
                                                                  if k != "video_processor"}))
        return harness_configure(gemma4, d, **flags)

    (tmp_path / "bare").mkdir()
    bare = configured("bare", None)
    assert (bare.image.video, bare.text.video_token) == ("", "")
    raw = {S.SAMPLE_ID: ["v"], S.CONVERSATIONS: [json.dumps([{"from": "human", "value": "<video>\nWhat?"},
                                                              {"from": "gpt", "value": "A clip."}])],
           S.IMAGES: [[clips.data["vfr"]]], S.IMAGE_REFS: [["vfr.mp4"]], S.READ_ERROR: [""]}
    with pytest.raises(VideoRefused, match="gemma4"):
        measure_batch(raw, bare.image, fam.tok, bare.text)
    (tmp_path / "fps").mkdir()
    fps = configured("fps", proc["video_processor"], **{"image.video_fps": 3.0})
    assert (fps.image.video_fps, fps.image.video_num_frames) == (3.0, None)
    for name in ("h264_bframes", "mpeg4_25fps", "vfr"):
        header = probe_video(clips.data[name], fps.image)
        want = default_sample_indices_fn(VideoMetadata(total_num_frames=header.frames, fps=header.fps), fps=3.0)
        assert plan_video(clips.data[name], fps.image).indices.tolist() == want.tolist(), name
    (tmp_path / "capped").mkdir()  # --video-max-tokens: the fps count bounded by frames x a frame's tokens
    capped = configured("capped", proc["video_processor"], **{"image.video_fps": 3.0, "image.video_max_tokens": 200})
    plan = plan_video(clips.data["mpeg4_25fps"], capped.image)  # 1.6 s: 4 frames at 3 fps, of 63 tokens each
    header = probe_video(clips.data["mpeg4_25fps"], capped.image)
    want = default_sample_indices_fn(VideoMetadata(total_num_frames=header.frames, fps=header.fps), num_frames=3)
    assert (plan.tokens, plan.indices.tolist()) == (3 * 63, want.tolist())
    (tmp_path / "budget").mkdir()
    assert configured("budget", proc["video_processor"], **{"image.video_max_pixels": 140 * 9 * 16}
                      ).image.video_max_pixels == 140 * 9 * 16
    for name, video, flags, match in (
            ("both", dict(proc["video_processor"], fps=2.0), {}, "HF's sampler refuses them together"),
            ("other", dict(proc["video_processor"], video_processor_type="Qwen2VLVideoProcessor"), {},
             "Gemma4VideoProcessor only"),
            ("patch", dict(proc["video_processor"], patch_size=8), {}, "vision tower has 4 / 3"),
            ("tokens", dict(proc["video_processor"], max_soft_tokens=100), {}, "max_soft_tokens=100"),
            ("pixels", proc["video_processor"], {"image.video_max_pixels": 1000}, "none of Gemma 4's frame budgets")):
        (tmp_path / name).mkdir()
        with pytest.raises(ValueError, match=match):
            configured(name, video, **flags)


def test_gemma4_video_text_is_refused_where_a_tokenizer_would_merge_the_first_timestamp(gemma4_video, clips):
    """The first ``mm:ss`` follows the text before the video in HF's string; the data path splices it as its own
    ids, which is exact only where no token spans a digit and the text before it (Gemma's tokenizer splits digits;
    the tiny one's pre-tokenizer does): a BPE trained to merge ``:0`` is refused at its first clip."""
    import string

    from tokenizers import Tokenizer, models, trainers
    from transformers import PreTrainedTokenizerFast

    from ray_mmbatch.data.measure import gemma4_frame_blocks

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.train_from_iterator(["Video clip:00:00 what?"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>"], initial_alphabet=list(string.printable), show_progress=False))
    merging = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    merging.add_tokens(["<|image>", "<image|>", "<|image|>"], special_tokens=True)
    plan = plan_video(clips.data["vfr"], gemma4_video.cfg.image)
    with pytest.raises(ValueError, match="merges the text before a video with its first timestamp"):
        gemma4_frame_blocks(merging, 7, gemma4_video.cfg.text.image_block)(plan)
    assert len(gemma4_frame_blocks(gemma4_video.tok, 7, gemma4_video.cfg.text.image_block)(plan)) > 4 * 3


# ------------------------------------------------------------------ GLM-4.1V / 4.5V: each temporal patch an image block
@pytest.fixture(scope="module", params=("glm4v", "glm4v_moe"))
def glm_video(request, tmp_path_factory):
    """The tiny GLM-4.1V / GLM-4.5V checkpoint (tests/hf_glm4v_checkpoint.py) with its video_preprocessor_config.json
    (3 fps, max_duration 3 s, 4 .. 96 merged tokens' pixels over the whole clip)."""
    from ray_mmbatch.models import glm4v
    from tests.hf_glm4v_checkpoint import make_glm4v_checkpoint

    fam = _built(glm4v, make_glm4v_checkpoint(tmp_path_factory.mktemp(request.param), request.param), request.param)
    fam.video_id = fam.tok.convert_tokens_to_ids("<|video|>")
    return fam


def _glm_as_hf(fam, ids: np.ndarray) -> list[int]:
    """Our ids as HF's processor writes them: <|image|> in the frames too (the data path writes <|video|> there)."""
    return np.where(ids == fam.video_id, fam.ids["image_token_id"], ids).tolist()


def test_glm4v_header_cost_text_and_pixels_equal_its_video_processor(clips, glm_video, tmp_path):
    """For every clip (B-frames, VFR, rotated, trimmed by edit lists, open GOPs, one frame, a 4 s clip over
    max_duration): the frames HF's Glm4vVideoProcessor samples (its own fps sampler over the loader's duration,
    the linspace branch past max_duration, an even count), the grid from the header (whole-clip smart resize), the
    text GLM's template and Glm4vProcessor.replace_video_token write (an image block and its second per temporal
    patch, in <|begin_of_video|> ... <|end_of_video|>) tokenized, and pixel_values_videos bit for bit equal HF's."""
    from ray_mmbatch.data.measure import glm4v_frame_blocks
    from ray_mmbatch.data.video import video_patches

    fam, cfg = glm_video, glm_video.cfg.image
    assert (cfg.video, cfg.video_sample_frames, cfg.video_fps, cfg.video_max_duration, fam.cfg.text.video_token) == \
        ("glm4v", True, 3.0, 3.0, "<|video|>")
    ref = _run_reference(fam.path, clips.paths, tmp_path)
    block = glm4v_frame_blocks(fam.tok, fam.video_id)
    long_clips = 0
    for name, data in clips.data.items():
        assert not str(ref[f"{name}/hf_failed"]), name
        plan = plan_video(data, cfg)
        assert plan.indices.tolist() == ref[f"{name}/indices"].tolist(), name
        assert [list(plan.grid)] == ref[f"{name}/grid"].tolist(), name
        assert len(plan.indices) % 2 == 0
        long_clips += probe_video(data, cfg).duration > 3
        text = block(plan)
        ids = np.repeat(text, np.where(text == fam.video_id, plan.tokens // plan.grid[0], 1))
        assert _glm_as_hf(fam, ids) == fam.tok(str(ref[f"{name}/text"]), add_special_tokens=False).input_ids, name
        pixels = normalize_video_patches(torch.from_numpy(video_patches(data, plan, cfg)), cfg.video_mean,
                                         cfg.video_std).numpy()
        assert pixels.shape == ref[f"{name}/pixels"].shape and np.array_equal(pixels, ref[f"{name}/pixels"]), name
    assert long_clips >= 2  # the linspace branch ran


def test_glm4v_every_frame_without_sampling_equals_its_video_processor(clips, glm_video, tmp_path):
    """do_sample_frames false (--video-sample-frames false): every frame, an odd count's last repeated into its
    temporal patch, the seconds of every other frame -- frames, grid, text and pixels HF's; a 1-frame clip, which
    HF's resize refuses (fewer frames than temporal_patch_size), is taken as one temporal patch (docs/data.md)."""
    from ray_mmbatch.data.measure import glm4v_frame_blocks
    from ray_mmbatch.data.video import video_patches
    from ray_mmbatch.models import glm4v
    from tests.family_harness import variant

    fam = glm_video
    d = variant(fam.path, tmp_path)
    video = json.loads((d / "video_preprocessor_config.json").read_text())
    (d / "video_preprocessor_config.json").write_text(json.dumps(dict(video, do_sample_frames=False)))
    cfg = harness_configure(glm4v, d).image
    assert cfg.video_sample_frames is False
    names = ("h264_bframes", "mpeg4_25fps", "rotated", "one_frame")
    ref = _run_reference(d, {n: clips.paths[n] for n in names}, tmp_path)
    for name in names:
        plan = plan_video(clips.data[name], cfg)
        assert plan.indices.tolist() == list(range(probe_video(clips.data[name], cfg).frames)), name
        if name == "one_frame":
            assert "must be larger than temporal_factor" in str(ref[f"{name}/hf_failed"])
            assert plan.grid[0] == 1
            continue
        assert plan.indices.tolist() == ref[f"{name}/indices"].tolist() and [list(plan.grid)] == \
            ref[f"{name}/grid"].tolist(), name
        text = glm4v_frame_blocks(fam.tok, fam.video_id)(plan)
        ids = np.repeat(text, np.where(text == fam.video_id, plan.tokens // plan.grid[0], 1))
        assert _glm_as_hf(fam, ids) == fam.tok(str(ref[f"{name}/text"]), add_special_tokens=False).input_ids, name
        pixels = normalize_video_patches(torch.from_numpy(video_patches(clips.data[name], plan, cfg)),
                                         cfg.video_mean, cfg.video_std).numpy()
        assert np.array_equal(pixels, ref[f"{name}/pixels"]), name


def _glm_samples(fam, clips) -> tuple[list[dict], dict]:
    convs = {
        "clip": ("<video>\nWhat happens in the clip?", "A square moves to the right.", [clips.data["h264_bframes"]]),
        "image": ("<image>\nWhat is it?", "Stripes.", [png(image(50, 70, 4))]),
        "text": ("Name three primes.", "Two, three and five.", []),
        "long": ("What is in <video>?", "Squares at odd times.", [clips.data["vfr"]]),
        "rotated": ("<image>\nDescribe it.", "A portrait clip.", [clips.data["rotated"]]),  # <image> for a video
        "two_images": ("<image> or <image>?", "The first.", [png(image(40, 60, 5)), png(image(90, 30, 6))]),
    }
    samples, measured = _measured_samples(fam, convs)
    assert list(measured[S.N_VIDEOS]) == [1, 0, 0, 1, 1, 0] and list(measured[S.N_IMAGES]) == [0, 1, 0, 0, 0, 2]
    return samples, measured


def _glm_alone_ce(fam, s: dict) -> torch.Tensor:
    """The sample alone through HF's own GLM forward, fed as HF's processor feeds it: <|image|> in the frames,
    mm_token_type_ids as Glm4vProcessor.create_mm_token_type_ids types them (2 inside <|begin_of_video|> ...
    <|end_of_video|>), pixel_values or pixel_values_videos with their grids; HF builds the 3-D ids."""
    from ray_mmbatch.models.hf_common import normalize_patches

    ids = torch.tensor(_glm_as_hf(fam, s["input_ids"]))[None]
    start, end = (fam.tok.convert_tokens_to_ids(t) for t in ("<|begin_of_video|>", "<|end_of_video|>"))
    in_video = torch.cumsum(ids == start, 1) > torch.cumsum(ids == end, 1)
    is_image = ids == fam.ids["image_token_id"]
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False,
              "mm_token_type_ids": (is_image & ~in_video).int() + 2 * (is_image & in_video).int()}
    im = fam.cfg.image
    if len(s["grids"]):
        kwargs.update(pixel_values=normalize_patches(torch.as_tensor(s["patches"]), im.image_mean, im.image_std,
                                                     im.temporal_patch_size, True),
                      image_grid_thw=torch.as_tensor(s["grids"], dtype=torch.long))
    if len(s.get("video_grids", ())):
        kwargs.update(pixel_values_videos=normalize_video_patches(torch.as_tensor(s["video_patches"]), im.video_mean,
                                                                  im.video_std),
                      video_grid_thw=torch.as_tensor(s["video_grids"], dtype=torch.long))
    return _shifted_ce(fam.model.hf_model, kwargs, s["labels"])


@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_glm4v_batch_of_clips_and_images_equals_each_sample_alone_through_hf(glm_video, clips, mode):
    """Clips, images (one and two a sample), text and a rotated clip in one packed or padded batch: each sample's CE,
    and the gradient of their sum in every weight (the vision tower's through both feature paths), equal it alone
    through HF's own GLM forward within the family's tolerance -- though HF's forward refuses images and clips in
    one call, the adapter placing the features itself. Controls (pack): the naive packed feed (1-D
    positions restarting per sample, no 3-D ids) is off by more than 0.1 nats, and HF's own forward given the row's
    images and clips as pixel_values / pixel_values_videos refuses it."""
    from tests.family_harness import check_exact, grads

    fam = glm_video
    samples, measured = _glm_samples(fam, clips)
    batch = batch_to_torch((collate_pack if mode == "pack" else collate_pad)(samples, fam.ids["pad_id"]), "cpu")
    fam.model.zero_grad(set_to_none=True)
    alone = [_glm_alone_ce(fam, s) for s in samples]
    torch.stack([ce.sum() for ce in alone]).sum().backward()
    want = torch.cat(alone).detach()
    check_exact(fam.model, batch, (want, grads(fam.model)), mode, fam.tol)  # the CE and every weight's gradient
    if mode != "pack":
        return
    with torch.no_grad():
        hidden = fam.model.hf_model.model
        kwargs = fam.model.forward_inputs(batch)
        kwargs["position_ids"] = kwargs["position_ids"][:1].expand(4, -1, -1).clone()
        naive = fam.model._target_ce(hidden(**kwargs).last_hidden_state, batch["labels"], "none")
        assert float((naive - want).abs().max()) > 0.1
        kwargs = fam.model.forward_inputs(batch)  # HF's own feed of the row: both pixel kinds, HF placing them
        feats = kwargs.pop("mm_encoder_outputs")["image"].pooler_output[0]
        im = fam.cfg.image
        kwargs.update(pixel_values=normalize_patches(batch["patches"], im.image_mean, im.image_std, 2, True),
                      pixel_values_videos=normalize_video_patches(batch["video_patches"], im.video_mean,
                                                                  im.video_std),
                      image_grid_thw=batch["image_grid_thw"].long(), video_grid_thw=batch["video_grid_thw"].long())
        with pytest.raises((ValueError, RuntimeError), match="tokens do not match"):
            hidden(**kwargs)
    assert feats.shape[0] == int((batch["input_ids"] == fam.video_id).sum() + (batch["input_ids"] == fam.ids[
        "image_token_id"]).sum())


def test_glm4v_a_sample_with_both_an_image_and_a_clip_is_skipped_as_hf_refuses_it(glm_video, clips):
    """HF's GLM forward refuses an image and a clip in one call (a frame's tokens are <|image|> too): shown here on
    one sequence holding both (an image sample's ids, then a clip sample's), so such a sample, which has no HF
    forward to be exact against, is skipped as unsupported_modality naming why; the clip and the image each alone
    are measured."""
    fam = glm_video
    raw = {S.SAMPLE_ID: ["both", "clip", "image"],
           S.CONVERSATIONS: [json.dumps([{"from": "human", "value": u}, {"from": "gpt", "value": "Yes."}])
                             for u in ("Compare <image> with <video>.", "<video> ok?", "<image> ok?")],
           S.IMAGES: [[png(image(60, 40, 3)), clips.data["vfr"]], [clips.data["vfr"]], [png(image(60, 40, 3))]],
           S.IMAGE_REFS: [["", ""], [""], [""]], S.READ_ERROR: [""] * 3}
    measured = measure_batch(raw, fam.cfg.image, fam.tok, fam.cfg.text)
    reason = str(measured[S.SKIP_REASON][0])
    assert reason.startswith(S.SKIP_UNSUPPORTED_MODALITY) and "both an image and a video" in reason, reason
    assert not measured[S.SKIP_REASON][1] and not measured[S.SKIP_REASON][2]
    clip, pic = (materialize_sample({c: measured[c][i] for c in measured}, fam.cfg.image) for i in (1, 2))
    both = {"input_ids": np.concatenate([pic["input_ids"], clip["input_ids"]]),
            "labels": np.concatenate([pic["labels"], clip["labels"]]), "grids": pic["grids"],
            "patches": pic["patches"], "video_grids": clip["video_grids"], "video_patches": clip["video_patches"]}
    with pytest.raises((ValueError, RuntimeError), match="tokens do not match"), torch.no_grad():
        _glm_alone_ce(fam, both)
