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
from ray_mmbatch.data.image import decode_image, image_tokens, patchify, probe_image


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
    """One measured, usable row -> model-ready arrays (see module docstring). Raises ImageSkip on bad pixels."""
    ids = np.asarray(row[S.TEXT_IDS], dtype=np.int32)
    target = np.asarray(row[S.TEXT_TARGET], dtype=np.uint8)
    grids = np.array([np.asarray(g, dtype=np.int32) for g in _items(row[S.GRIDS])], dtype=np.int32).reshape(-1, 3)
    pad_id = int(row[S.IMAGE_TOKEN_ID] if image_pad_id is None else image_pad_id)
    video_id = int(row.get(S.VIDEO_TOKEN_ID, -1))
    if video_id >= 0 and int(row.get(S.N_VIDEOS, 0)):
        return _materialize_with_videos(row, ids, target, grids, pad_id, video_id, image_cfg)
    pad_at = np.flatnonzero(ids == pad_id)
    # resize='split' (Idefics3 image splitting): one image token per image_size view, views stacked in the grid
    per_image = grids[:, 1] // grids[:, 2] if image_cfg.resize == "split" else np.ones(len(grids), dtype=np.int32)
    if len(pad_at) != int(per_image.sum()):
        raise ValueError(f"{row[S.SAMPLE_ID]}: {len(pad_at)} image_pad tokens for {len(grids)} grids")
    repeats = np.ones(len(ids), dtype=np.int64)
    images = _items(row[S.IMAGES])
    sizes = None
    if image_cfg.resize == "anyres":  # tokens (and the model's image_sizes) from the displayed size
        if len(images) != len(grids):
            raise ValueError(f"{row[S.SAMPLE_ID]}: {len(images)} images for {len(grids)} grids")
        sizes = np.array([probe_image(data, image_cfg) for data in images], dtype=np.int32).reshape(-1, 2)
        repeats[pad_at] = [image_tokens(g, hw, image_cfg) for g, hw in zip(grids, sizes)]
    else:
        repeats[pad_at] = np.repeat(grids[:, 1] * grids[:, 2] // image_cfg.merge_size ** 2 // per_image, per_image)
    input_ids, labels = _expand(row, ids, target, repeats)
    ps = image_cfg.patch_size
    if len(images) != len(grids):
        raise ValueError(f"{row[S.SAMPLE_ID]}: {len(images)} images for {len(grids)} grids")
    patches = [patchify(decode_image(data, g, image_cfg), image_cfg) for data, g in zip(images, grids)]
    patches = np.concatenate(patches) if patches else np.zeros((0, 3 * ps * ps), dtype=np.uint8)
    if patches.shape[0] != int(row[S.PATCHES]):
        raise ValueError(f"{row[S.SAMPLE_ID]}: {patches.shape[0]} patches, measured {int(row[S.PATCHES])}")
    out = {"sample_id": str(row[S.SAMPLE_ID]), "input_ids": input_ids, "labels": labels, "patches": patches,
           "grids": grids}
    if sizes is not None:
        out["image_sizes"] = sizes  # (h, w) per image as displayed: LLaVA-OneVision's image_sizes
    return out


def _materialize_with_videos(row: dict, ids: np.ndarray, target: np.ndarray, grids: np.ndarray, pad_id: int,
                             video_id: int, image_cfg: ImageConfig) -> dict[str, Any]:
    """materialize_sample for a sample with videos (resize='smart', one token per media item in ids):
    images as above, each video's sampled frames decoded (data/video.decode_video) into ``video_patches``."""
    from ray_mmbatch.data.video import decode_video, patchify_video, plan_video

    sid = row[S.SAMPLE_ID]
    media_at = np.flatnonzero((ids == pad_id) | (ids == video_id))
    media = _items(row[S.IMAGES])
    per_frame = image_cfg.video == "qwen3_vl"  # one video token per temporal patch (Qwen3-VL), else per video
    if len(grids) != len(media):
        raise ValueError(f"{sid}: {len(grids)} grids for {len(media)} media items")
    repeats = np.ones(len(ids), dtype=np.int64)
    is_video, k = np.zeros(len(media), dtype=bool), 0
    merged = grids[:, 1] * grids[:, 2] // image_cfg.merge_size ** 2
    for j, grid in enumerate(grids):
        if k >= len(media_at):
            raise ValueError(f"{sid}: {len(media_at)} media tokens for {len(media)} media items")
        is_video[j] = ids[media_at[k]] == video_id
        n = int(grid[0]) if is_video[j] and per_frame else 1
        at = media_at[k:k + n]
        if len(at) != n or (ids[at] != ids[media_at[k]]).any():
            raise ValueError(f"{sid}: media item {j} lacks its {n} tokens")
        repeats[at] = merged[j] * (int(grid[0]) if is_video[j] and not per_frame else 1)
        k += n
    if k != len(media_at):
        raise ValueError(f"{sid}: {len(media_at)} media tokens, {k} for its {len(media)} media items")
    input_ids, labels = _expand(row, ids, target, repeats)
    ps, tps = image_cfg.patch_size, max(1, int(image_cfg.temporal_patch_size))
    image_patches, video_patches, seconds = [], [], []
    for data, grid, video in zip(media, grids, is_video):
        if video:
            plan = plan_video(data, image_cfg)
            if tuple(int(v) for v in plan.grid) != tuple(int(v) for v in grid):
                raise ValueError(f"{sid}: a video's grid is {plan.grid} now, measured {tuple(grid)}")
            video_patches.append(patchify_video(decode_video(data, plan, image_cfg), image_cfg))
            seconds.append(plan.second_per_grid_t)
        else:
            image_patches.append(patchify(decode_image(data, grid, image_cfg), image_cfg))
    patches = np.concatenate(image_patches) if image_patches else np.zeros((0, 3 * ps * ps), dtype=np.uint8)
    vpatches = np.concatenate(video_patches) if video_patches else np.zeros((0, 3 * tps * ps * ps), dtype=np.uint8)
    if patches.shape[0] + vpatches.shape[0] != int(row[S.PATCHES]):
        raise ValueError(f"{sid}: {patches.shape[0] + vpatches.shape[0]} patches, measured {int(row[S.PATCHES])}")
    return {"sample_id": str(sid), "input_ids": input_ids, "labels": labels, "patches": patches,
            "grids": grids[~is_video], "video_patches": vpatches, "video_grids": grids[is_video],
            "second_per_grid_ts": np.asarray(seconds, dtype=np.float32)}
