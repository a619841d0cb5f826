"""HF's own video path on clips, for tests/test_video.py: run by the REFERENCE interpreter (torchvision).

    <reference python> tests/video_reference.py SPEC.json OUT.npz

SPEC: {"checkpoint": dir, "clips": {name: path}}. For every clip, what HF does with it:

* the frames: HF's PyAV loader (``transformers.video_utils.read_video_pyav``) with the checkpoint's
  video processor's own ``sample_frames`` as the sampling function (or every frame when the processor
  does not sample), so the indices and the decoded RGB are HF's; the frames are then turned by the
  rotation PyAV reports on the decoded frame (HF's loader leaves them coded; the project shows them
  as displayed, docs/data.md says so);
* the processor: ``AutoVideoProcessor.from_pretrained(checkpoint)`` on those frames with
  ``do_sample_frames=False``: ``pixel_values_videos``, ``video_grid_thw``; for Qwen2VLVideoProcessor, the
  ``second_per_grid_ts`` that Qwen2_5_VLProcessor._process_videos (HF's own code, on the clip's
  VideoMetadata with the sampled indices) gives it.

Containers that store no frame count (webm / mkv: PyAV reads 0, and HF's loader then samples nothing)
get the decoded frame count as ``total_num_frames``; the project counts their packets.
A clip with fewer frames than temporal_patch_size makes Qwen2-VL's fps sampler divide by zero (it is then
taken whole, as the project does, docs/data.md; ``<name>/hf_failed`` = "sampler") and Qwen3-VL's resize
raise (``hf_failed`` = "processor: ...", no pixels). Qwen3-VL clips also get ``<name>/text``: the
processor's timestamped video text (Qwen3VLProcessor.replace_video_token).
Written to OUT: ``<name>/indices``, ``<name>/grid``, ``<name>/pixels`` (float32), ``<name>/second_per_grid``.
"""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import av
import numpy as np
from transformers import AutoVideoProcessor
from transformers.video_utils import VideoMetadata


def _frames(path: str, processor) -> tuple[np.ndarray, np.ndarray, VideoMetadata, bool]:
    with av.open(path) as c:
        s = c.streams.video[0]
        total, fps = int(s.frames), float(s.average_rate)
    if total == 0:
        with av.open(path) as c:
            total = sum(1 for _ in c.decode(video=0))
    meta = VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps)
    fell_back = False
    if getattr(processor, "do_sample_frames", False):
        try:
            indices = np.asarray(processor.sample_frames(meta), dtype=np.int64)
        except ZeroDivisionError:  # fewer frames than temporal_patch_size: HF samples 0 and divides by it
            indices, fell_back = np.arange(total, dtype=np.int64), True
    else:
        indices = np.arange(total, dtype=np.int64)
    # HF's read_video_pyav, with those indices: decode in order, keep the i-th frames
    frames, rotation = [], 0
    with av.open(path) as c:
        for i, frame in enumerate(c.decode(video=0)):
            if i > indices[-1]:
                break
            if i in indices:
                frames.append(frame.to_ndarray(format="rgb24"))
                rotation = int(frame.rotation or 0)
    video = np.stack(frames)
    if rotation % 360:
        video = np.rot90(video, k=(rotation // 90) % 4, axes=(1, 2))
    meta.frames_indices = [int(i) for i in indices]
    return np.ascontiguousarray(video), indices, meta, fell_back


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


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    processor = AutoVideoProcessor.from_pretrained(spec["checkpoint"])
    qwen3 = type(processor).__name__ == "Qwen3VLVideoProcessor"
    out = {}
    for name, path in spec["clips"].items():
        try:
            video, indices, meta, fell_back = _frames(path, processor)
        except ValueError as e:  # HF's default sampler refuses a clip shorter than the frames it asks for
            out[f"{name}/hf_failed"] = np.array(f"refused: {e}")
            continue
        out[f"{name}/indices"] = indices
        out[f"{name}/hf_failed"] = np.array("sampler" if fell_back else "")
        cap = ({"cap_pixels_per_frame": bool(spec.get("cap_pixels_per_frame", False))}
               if hasattr(processor, "cap_pixels_per_frame") else {})
        try:
            got = processor(videos=[video], do_sample_frames=False, return_tensors="np", **cap)
        except ValueError as e:  # Qwen3-VL's resize refuses fewer frames than temporal_patch_size
            out[f"{name}/hf_failed"] = np.array(f"processor: {e}")
            continue
        pixels = np.asarray(got["pixel_values_videos"], dtype=np.float32)
        if "video_grid_thw" in got:
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
        if qwen3:
            with av.open(path) as c:
                fps = float(c.streams.video[0].average_rate)
            out[f"{name}/text"] = np.array(_qwen3_text(processor, got["video_grid_thw"], indices, fps))
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
