"""Materialize a measured sample: the expensive per-sample step, run for trained samples only.

Decode + resize + patchify each
image at its measured grid, expand each image_pad to that image's token count
(np.repeat), and shift labels for next-token prediction so that the last token of a
sample never has a label (packed samples never predict across a boundary)::

    input_ids  A  B  <vs> <img> <img> <img> <ve>  C  D
    target     0  0   0    0     0     0     0    1  1
    labels     .  .   .    .     .     .     C    D  .      (. = IGNORE_INDEX)

materialize is dominated by image decoding, which grows with the source image's size;
per-image decode costs are in benchmarks/RESULTS.md ("bench_decode"). Pure module: no ray, no torch.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ray_mmbatch import schema as S
from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.image import decode_image, image_runs, image_tokens, patchify, probe_image
from ray_mmbatch.data.video.cost import FRAME_BLOCKS


def _items(value: Any) -> list:
    """A list cell from Ray (ndarray of objects, list, None) -> list."""
    if value is None:
        return []
    return list(value)


def _expand(row: dict, ids: np.ndarray, target: np.ndarray, repeats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels): each media token repeated to its token count, labels shifted (module docstring)."""
    input_ids = np.repeat(ids, repeats)
    expanded_target = np.repeat(target, repeats)
    if len(input_ids) != int(row[S.TOKENS]):
        raise ValueError(f"{row[S.SAMPLE_ID]}: {len(input_ids)} tokens, measured {int(row[S.TOKENS])}")
    labels = np.full(len(input_ids), S.IGNORE_INDEX, dtype=np.int32)
    labels[:-1] = np.where(expanded_target[1:] == 1, input_ids[1:], S.IGNORE_INDEX)
    return input_ids, labels


def materialize_sample(row: dict, image_cfg: ImageConfig, image_pad_id: int | None = None) -> dict[str, Any]:
    """One measured, usable row -> model-ready arrays (see module docstring). Raises ImageSkip on bad pixels.

    Videos (data/video.py) are media items whose token is the video token: their tokens expand to the
    clip's (Qwen3-VL, Gemma 4: one video token per temporal patch, each a frame's tokens), their sampled frames
    become ``video_patches`` / ``video_grids`` (+ ``second_per_grid_ts``); the images go as without videos."""
    sid = row[S.SAMPLE_ID]
    ids = np.asarray(row[S.TEXT_IDS], dtype=np.int32)
    target = np.asarray(row[S.TEXT_TARGET], dtype=np.uint8)
    grids = np.array([np.asarray(g, dtype=np.int32) for g in _items(row[S.GRIDS])], dtype=np.int32).reshape(-1, 3)
    pad_id = int(row[S.IMAGE_TOKEN_ID] if image_pad_id is None else image_pad_id)
    media = _items(row[S.IMAGES])
    video_id = int(row.get(S.VIDEO_TOKEN_ID, -1))
    is_video = _video_items(ids, pad_id, video_id, grids, image_cfg, sid) if int(row.get(S.N_VIDEOS, 0) or 0) \
        else np.zeros(len(grids), dtype=bool)
    if len(media) != len(grids):
        raise ValueError(f"{sid}: {len(media)} media items for {len(grids)} grids")
    images = [m for m, v in zip(media, is_video) if not v]
    videos = [m for m, v in zip(media, is_video) if v]
    vgrids, grids = grids[is_video], grids[~is_video]
    pad_at = np.flatnonzero(ids == pad_id)
    # one image token per run (data/image Resizer.runs): per view for resize='split', per row for 'pixtral'
    per_image = np.asarray([image_runs(g, image_cfg) for g in grids], dtype=np.int64).reshape(-1)
    if len(pad_at) != int(per_image.sum()):
        raise ValueError(f"{sid}: {len(pad_at)} image_pad tokens for {len(grids)} grids")
    repeats = np.ones(len(ids), dtype=np.int64)
    sizes = None
    if image_cfg.resize == "anyres":  # tokens (and the model's image_sizes) from the displayed size
        sizes = np.array([probe_image(data, image_cfg) for data in images], dtype=np.int32).reshape(-1, 2)
        repeats[pad_at] = [image_tokens(g, hw, image_cfg) for g, hw in zip(grids, sizes)]
    else:
        repeats[pad_at] = np.repeat(grids[:, 1] * grids[:, 2] // image_cfg.merge_size ** 2 // per_image, per_image)
    plans = _video_plans(videos, vgrids, image_cfg, sid, _items(row.get(S.VIDEO_PLANS)))
    if plans:
        per_clip = [int(g[0]) if image_cfg.video in FRAME_BLOCKS else 1 for g in vgrids]
        repeats[ids == video_id] = np.repeat([p.tokens // n for p, n in zip(plans, per_clip)], per_clip)
    input_ids, labels = _expand(row, ids, target, repeats)
    ps = image_cfg.patch_size
    patches = [patchify(decode_image(data, g, image_cfg), image_cfg) for data, g in zip(images, grids)]
    patches = np.concatenate(patches) if patches else np.zeros((0, 3 * ps * ps), dtype=np.uint8)
    out = {"sample_id": str(sid), "input_ids": input_ids, "labels": labels, "patches": patches, "grids": grids}
    n_patches = patches.shape[0]
    if plans:
        from ray_mmbatch.data.video import video_patches

        clips = [video_patches(data, plan, image_cfg) for data, plan in zip(videos, plans)]
        out.update(video_patches=np.concatenate(clips), video_grids=vgrids,
                   second_per_grid_ts=np.asarray([p.second_per_grid_t for p in plans], dtype=np.float32))
        n_patches += out["video_patches"].shape[0]
    if n_patches != int(row[S.PATCHES]):
        raise ValueError(f"{sid}: {n_patches} patches, measured {int(row[S.PATCHES])}")
    if sizes is not None:
        out["image_sizes"] = sizes  # (h, w) per image as displayed: LLaVA-OneVision's image_sizes
    return out


def _video_items(ids: np.ndarray, pad_id: int, video_id: int, grids: np.ndarray, image_cfg: ImageConfig,
                 sid) -> np.ndarray:
    """Which media items are videos: the media tokens in order (an image: one image token per run, image_runs; a
    video: one video token, or one per temporal patch for Qwen3-VL and Gemma 4, cost.FRAME_BLOCKS)."""
    media_at = np.flatnonzero((ids == pad_id) | (ids == video_id))
    is_video, k = np.zeros(len(grids), dtype=bool), 0
    for j, grid in enumerate(grids):
        if k >= len(media_at):
            raise ValueError(f"{sid}: {len(media_at)} media tokens for {len(grids)} media items")
        is_video[j] = ids[media_at[k]] == video_id
        if is_video[j]:
            n = int(grid[0]) if image_cfg.video in FRAME_BLOCKS else 1
        else:
            n = image_runs(grid, image_cfg)
        if len(media_at[k:k + n]) != n or (ids[media_at[k:k + n]] != ids[media_at[k]]).any():
            raise ValueError(f"{sid}: media item {j} lacks its {n} tokens")
        k += n
    if k != len(media_at):
        raise ValueError(f"{sid}: {len(media_at)} media tokens, {k} for its {len(grids)} media items")
    return is_video


def _video_plans(videos: list, vgrids: np.ndarray, image_cfg: ImageConfig, sid, carried: list) -> list:
    """Each video's plan as measure made it (schema.VIDEO_PLANS: the clip is not probed again); a row measured
    without them (an older payload) probes its clips again. Checked against the grid measure gave each."""
    if not videos:
        return []
    from ray_mmbatch.data.video import VideoPlan, plan_video

    if len(carried) == len(videos):
        plans = [VideoPlan.from_json(str(text)) for text in carried]
    else:
        plans = [plan_video(data, image_cfg) for data in videos]
    for plan, grid in zip(plans, vgrids):
        if tuple(int(v) for v in plan.grid) != tuple(int(v) for v in grid):
            raise ValueError(f"{sid}: a video's grid is {plan.grid} now, measured {tuple(grid)}")
    return plans
