"""HF's own video path on clips, for tests/test_video.py: run by the REFERENCE interpreter (torchvision, torchcodec).

    <reference python> tests/video_reference.py SPEC.json OUT.npz

SPEC: {"checkpoint": dir, "clips": {name: path}, "loader": "torchcodec" | "pyav"}. For every clip, what HF does:

* the frames: HF's own loader, ``transformers.video_utils.load_video(path, backend=loader)`` with the checkpoint's
  video processor's ``sample_frames`` as the sampling function (or every frame when the processor does not
  sample). loader 'torchcodec' (the default) is what HF's video processors call for a path
  (``fetch_videos``): frames counted and indexed as its exact scan finds them, turned to their display rotation,
  the rate = frames over the scanned span; 'pyav' is ``load_video``'s own default (``read_video_pyav``): frames
  as coded, the header's count and average rate. Indices, rotation and rate are HF's loader's, never this
  script's;
* the processor: ``AutoVideoProcessor.from_pretrained(checkpoint)`` on those frames with
  ``do_sample_frames=False``: ``pixel_values_videos``, ``video_grid_thw``; for Qwen2VLVideoProcessor, the
  ``second_per_grid_ts`` that Qwen2_5_VLProcessor._process_videos (HF's own code, on the loader's
  VideoMetadata) gives it.

torchcodec runs on PyAV's own FFmpeg build (its libraries, linked under their plain names in
``<reference venv>/ffmpeg-libs``; the script re-executes itself with them on LD_LIBRARY_PATH), so both loaders
decode with the FFmpeg the project's PyAV decodes with, and no system FFmpeg is needed.
A clip with fewer frames than temporal_patch_size makes Qwen2-VL's fps sampler divide by zero (it is then
taken whole, as the project does, docs/data.md; ``<name>/hf_failed`` = "sampler") and Qwen3-VL's resize
raise (``hf_failed`` = "processor: ...", no pixels). Qwen3-VL clips also get ``<name>/text``: the
processor's timestamped video text (Qwen3VLProcessor.replace_video_token); Gemma 4 clips ``<name>/text``
(Gemma4Processor.replace_video_token), ``<name>/tokens`` (soft tokens a frame) and ``<name>/positions``
(video_position_ids), their pixels [frames, max_patches, ps * ps * 3]; GLM-4.1V clips ``<name>/text`` (the
template's ``<|begin_of_video|>`` ... ``<|end_of_video|>`` around Glm4vProcessor.replace_video_token's frames).
Written to OUT: ``<name>/indices``, ``<name>/grid``, ``<name>/pixels`` (float32), ``<name>/second_per_grid``,
``<name>/total`` and ``<name>/fps`` (the loader's VideoMetadata).

SPEC may add "chat": {"messages": [...], "template": str}: the checkpoint's whole processor
(``AutoProcessor.from_pretrained``) renders the messages (a video part ``{"type": "video", "video": path}``) with
that template and HF's ``return_assistant_tokens_mask``: ``chat/ids`` and ``chat/mask`` (the marked positions).
"""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import av
import numpy as np
from transformers import AutoVideoProcessor
from transformers.video_utils import VideoMetadata, load_video


def _with_pyav_ffmpeg() -> None:
    """Re-execute with PyAV's FFmpeg libraries where torchcodec's loader finds them (plain sonames)."""
    if os.environ.get("RAY_MMBATCH_REFERENCE_FFMPEG"):
        return
    libs = os.path.join(os.path.dirname(av.__file__), os.pardir, "av.libs")
    libs = os.path.realpath(libs)
    linked = os.path.join(sys.prefix, "ffmpeg-libs")
    os.makedirs(linked, exist_ok=True)
    for name in os.listdir(libs):  # libavcodec-5e6b81c2.so.62.28.102 -> libavcodec.so.62
        stem, _, version = name.partition(".so.")
        if stem.split("-")[0] in ("libavcodec", "libavdevice", "libavfilter", "libavformat", "libavutil",
                                  "libswresample", "libswscale"):
            target = os.path.join(linked, f"{stem.split('-')[0]}.so.{version.split('.')[0]}")
            if not os.path.exists(target):
                os.symlink(os.path.join(libs, name), target)
    env = dict(os.environ, RAY_MMBATCH_REFERENCE_FFMPEG="1",
               LD_LIBRARY_PATH=os.pathsep.join(p for p in (linked, libs, os.environ.get("LD_LIBRARY_PATH")) if p))
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def _frames(path: str, processor, loader: str):
    """(frames as HF's loader returns them, indices, VideoMetadata, sampler fell back) of one clip."""
    fell_back = []

    def sample(metadata, **kwargs):
        if not getattr(processor, "do_sample_frames", False):
            return np.arange(metadata.total_num_frames)
        try:
            return np.asarray(processor.sample_frames(metadata), dtype=np.int64)
        except ZeroDivisionError:  # fewer frames than temporal_patch_size: HF samples 0 and divides by it
            fell_back.append(True)
            return np.arange(metadata.total_num_frames)

    video, meta = load_video(path, backend=loader, sample_indices_fn=sample)
    return video, np.asarray(meta.frames_indices, dtype=np.int64), meta, bool(fell_back)


def _second_per_grid(processor, video: np.ndarray, meta: VideoMetadata, **kwargs) -> np.ndarray:
    """second_per_grid_ts as Qwen2_5_VLProcessor._process_videos computes it (HF's code, run on this processor)."""
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

    proc = object.__new__(Qwen2_5_VLProcessor)  # only its video step runs: no tokenizer needed
    proc.video_processor = processor
    got, _ = proc._process_videos([video], video_metadata=[meta], do_sample_frames=False, return_tensors="np",
                                  return_metadata=True, **kwargs)
    return np.asarray(got["second_per_grid_ts"], dtype=np.float64)


def _qwen3_text(processor, grid, indices, fps: float) -> str:
    """Qwen3VLProcessor.replace_video_token's text for this clip (timestamps, per-frame vision blocks)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    ns = SimpleNamespace(video_processor=processor, vision_start_token="<|vision_start|>",
                         vision_end_token="<|vision_end|>", video_token="<|video_pad|>")
    ns._calculate_timestamps = lambda *a: Qwen3VLProcessor._calculate_timestamps(ns, *a)
    meta = VideoMetadata(total_num_frames=int(indices.max()) + 1, fps=fps, frames_indices=list(indices))
    return Qwen3VLProcessor.replace_video_token(ns, {"video_grid_thw": grid, "video_metadata": [meta]}, 0)


def _gemma4_text(got, meta: VideoMetadata) -> str:
    """Gemma4Processor.replace_video_token's text for this clip (mm:ss per frame, its block of soft tokens), on the
    loader's VideoMetadata as the processor gets it."""
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    ns = SimpleNamespace(boi_token="<|image>", eoi_token="<image|>", video_token="<|video|>")
    inputs = {"num_soft_tokens_per_video": list(got["num_soft_tokens_per_video"]), "video_metadata": [meta]}
    return Gemma4Processor.replace_video_token(ns, inputs, 0)


def _glm4v_text(processor, grid, meta: VideoMetadata) -> str:
    """The text GLM's template and Glm4vProcessor.replace_video_token write for this clip: <|begin_of_video|>, per
    temporal patch an image block of <|image|> tokens and its second, <|end_of_video|>; on the loader's metadata."""
    from transformers.models.glm4v.processing_glm4v import Glm4vProcessor

    ns = SimpleNamespace(video_processor=processor, image_token="<|image|>")
    ns.replace_frame_token_id = lambda *a, **k: Glm4vProcessor.replace_frame_token_id(ns, *a, **k)
    return ("<|begin_of_video|>" + Glm4vProcessor.replace_video_token(ns, {"video_grid_thw": grid,
                                                                          "video_metadata": [meta]}, 0)
            + "<|end_of_video|>")


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    loader = spec.get("loader", "torchcodec")
    processor = AutoVideoProcessor.from_pretrained(spec["checkpoint"])
    qwen3 = type(processor).__name__ == "Qwen3VLVideoProcessor"
    out = {}
    for name, path in spec["clips"].items():
        try:
            video, indices, meta, fell_back = _frames(path, processor, loader)
        except (ValueError, RuntimeError, IndexError) as e:  # HF's sampler refuses, or its loader fails
            out[f"{name}/hf_failed"] = np.array(f"refused: {type(e).__name__}: {e}")
            continue
        out[f"{name}/indices"] = indices
        out[f"{name}/total"] = np.array(int(meta.total_num_frames))
        out[f"{name}/fps"] = np.array(float(meta.fps))
        out[f"{name}/hf_failed"] = np.array("sampler" if fell_back else "")
        cap = ({"cap_pixels_per_frame": bool(spec.get("cap_pixels_per_frame", False))}
               if hasattr(processor, "cap_pixels_per_frame") else {})
        try:
            got = processor(videos=[video], do_sample_frames=False, return_tensors="np", **cap)
        except ValueError as e:  # Qwen3-VL's resize refuses fewer frames than temporal_patch_size
            out[f"{name}/hf_failed"] = np.array(f"processor: {e}")
            continue
        pixels = np.asarray(got["pixel_values_videos"], dtype=np.float32)
        if type(processor).__name__ == "Gemma4VideoProcessor":  # [frames, max_patches, ps * ps * 3], per-frame blocks
            out[f"{name}/positions"] = np.asarray(got["video_position_ids"], dtype=np.int64)
            out[f"{name}/tokens"] = np.asarray(got["num_soft_tokens_per_video"], dtype=np.int64)
            out[f"{name}/text"] = np.array(_gemma4_text(got, meta))
        elif "video_grid_thw" in got:
            out[f"{name}/grid"] = np.asarray(got["video_grid_thw"], dtype=np.int64)
        else:  # LLaVA-OneVision: [1, frames, 3, S, S]; its tokens by LlavaOnevisionProcessor.replace_video_token
            from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

            ns = SimpleNamespace(num_image_tokens=spec["num_image_tokens"], video_token="<video>")
            text = LlavaOnevisionProcessor.replace_video_token(ns, {"pixel_values_videos": pixels}, 0)
            out[f"{name}/grid"] = np.array([[pixels.shape[1], 1, 1]])
            out[f"{name}/tokens"] = np.array(text.count("<video>"))
            pixels = pixels.reshape(pixels.shape[1], -1)
        out[f"{name}/pixels"] = pixels
        if type(processor).__name__ == "Qwen2VLVideoProcessor":  # Qwen2-VL / 2.5-VL (Qwen3-VL writes timestamps)
            out[f"{name}/second_per_grid"] = _second_per_grid(processor, video, meta, **cap)
        if type(processor).__name__ == "Glm4vVideoProcessor":
            out[f"{name}/text"] = np.array(_glm4v_text(processor, got["video_grid_thw"], meta))
        if qwen3:
            out[f"{name}/text"] = np.array(_qwen3_text(processor, got["video_grid_thw"], indices, float(meta.fps)))
    if "chat" in spec:
        from transformers import AutoProcessor

        chat = AutoProcessor.from_pretrained(spec["checkpoint"]).apply_chat_template(
            spec["chat"]["messages"], chat_template=spec["chat"]["template"], tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True, video_load_backend=loader)
        out["chat/ids"] = np.asarray(chat["input_ids"][0], dtype=np.int64)
        out["chat/mask"] = np.flatnonzero(np.asarray(chat["assistant_masks"][0]))
    np.savez(out_path, **out)


if __name__ == "__main__":
    _with_pyav_ffmpeg()
    main(sys.argv[1], sys.argv[2])
