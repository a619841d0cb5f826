"""Video: the cost from the container header, the pixels from the sampled frames only (PyAV).

Modules, each importing only those listed before it: ``probe`` (is_video, probe_video: the header),
``sampling`` (sample_indices: HF's samplers), ``cost`` (frame_size, plan_video, VideoPlan), ``decode``
(decode_video, video_patches, patchify_video).

A video is one media item of a sample (schema.IMAGES holds its container bytes; ``is_video`` tells
it from an image by its first bytes). Measure and materialize see it as::

    probe_video(bytes)      one demux, no decoding: the frames as the decoder outputs them (edit lists,
                            B-frame reorder, open GOPs), the rate and rotation as ImageConfig.video_loader's
                            HF loader reports them (torchcodec: display rotation applied; pyav: as coded)
      -> sample_indices     the frames the family's HF video processor samples (Qwen2VLVideoProcessor
                            .sample_frames, formula for formula, torch's float arange emulated)
      -> plan_video         per-frame smart resize (HF's, with cap_pixels_per_frame), temporal patches
                            (frames padded to temporal_patch_size by repeating the last, as HF does):
                            (t, h, w) = (ceil(n / tps), H / ps, W / ps); tokens t*h*w / merge**2; the plan
                            (VideoPlan.to_json) travels with the sample to materialize
    decode_video(plan)      materialize only, by the plan: seek to the keyframe before each run of sampled
                            frames and decode just that run (frames of GOPs holding no sampled frame are never
                            decoded; in order from the start where seeking is not exact), RGB as HF's loaders
                            convert it, the rotation applied, then the resize HF's torchvision backend does
                            (torch's uint8 bicubic with antialias, bit for bit), then ``patchify_video`` in HF's
                            row layout (channel, frame, py, px) -- uint8 until the training worker normalizes it.

Where we differ from HF, deliberately: a clip with fewer frames than temporal_patch_size under fps sampling is
taken whole (HF's sampler computes 0 frames and divides by zero), so a 1-frame clip is one temporal patch of that
frame twice. HF's PyAV loader counts the header's frames (edit-list frames included, 0 for webm / mkv); we count
what its decoder outputs, as torchcodec does (docs/data.md 'Which loader a clip is read as').

A header PyAV cannot read is ``unreadable_video``, no video stream or zero frames ``empty_video``,
a frame over ``ImageConfig.max_decoded_bytes`` ``decompression_bomb``, a sampled frame that cannot be
decoded (or a decoder that outputs fewer frames than its packets promise) ``corrupt_video``: skipped and
counted, never decoded blindly. Pure package: PyAV + numpy at import; torch only inside decode_video.
"""
from ray_mmbatch.data.video.cost import VideoPlan, _frame_pixels, _smart_resize_qwen3, frame_size, plan_video
from ray_mmbatch.data.video.decode import (
    Decoded,
    decode_sampled,
    decode_video,
    patchify_video,
    resize_frames,
    video_patches,
)
from ray_mmbatch.data.video.probe import VideoHeader, VideoSkip, container_rotation, is_video, probe_video
from ray_mmbatch.data.video.sampling import _torch_float_arange_int, sample_indices

__all__ = ["Decoded", "VideoHeader", "VideoPlan", "VideoSkip", "container_rotation", "decode_sampled", "_frame_pixels",
           "_smart_resize_qwen3", "_torch_float_arange_int", "decode_video", "frame_size", "is_video",
           "patchify_video", "plan_video", "probe_video", "resize_frames", "sample_indices", "video_patches"]
