"""Edits of a collated batch that keep its layout valid (batching/collate.py draws the layout).

Used by the train loop: ``mask_samples`` takes samples a restored checkpoint already
trained out of the loss; ``zero_target`` is a rank's step when it has run dry (joins the
gradient all-reduce, adds nothing); ``filler_batch`` is that step for a rank that never
received a batch. Pure numpy, no torch, no ray.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ray_mmbatch.schema import IGNORE_INDEX


def zero_target(batch: dict[str, Any]) -> dict[str, Any]:
    """A copy of a batch that contributes no loss and no gradient (for a rank that ran dry)."""
    b = dict(batch)
    labels = batch["labels"]  # numpy, or torch (same type back: a Trainer's batches are on the device)
    b["labels"] = labels.new_full(labels.shape, IGNORE_INDEX) if hasattr(labels, "new_full") else \
        np.full_like(labels, IGNORE_INDEX)
    b["target_tokens"] = 0
    b["real_tokens"] = 0  # it trains nothing: no sample is in it
    b["sample_ids"] = []
    return b


def mask_samples(batch: dict[str, Any], keep: np.ndarray) -> dict[str, Any]:
    """Take the samples where ``keep`` is False out of the loss (their tokens stay as
    context-free segments: attention never crosses samples) and out of the sample list."""
    b = dict(batch)
    labels = np.array(batch["labels"], copy=True)
    if batch["mode"] == "pack":
        cu = batch["cu_seqlens"]
        for i in np.flatnonzero(~keep):
            labels[0, cu[i]:cu[i + 1]] = IGNORE_INDEX
    else:
        labels[~keep] = IGNORE_INDEX
    b["labels"] = labels
    b["sample_ids"] = [s for s, k in zip(batch["sample_ids"], keep) if k]
    b["target_tokens"] = int((labels != IGNORE_INDEX).sum())
    b["real_tokens"] = int(np.asarray(batch["seq_lens"])[keep].sum())
    return b


def patch_dim(image_cfg) -> int:
    """Values per patch row of a batch: temporal x 3 channels x patch x patch (data/image.patchify)."""
    return int(image_cfg.temporal_patch_size) * 3 * int(image_cfg.patch_size) ** 2


def filler_batch(patch_dim: int) -> dict[str, Any]:
    """A 2-token text-only pack with no targets, for a rank that never received a batch."""
    return {"mode": "pack", "input_ids": np.zeros((1, 2), np.int32), "labels": np.full((1, 2), IGNORE_INDEX, np.int32),
            "position_ids": np.arange(2, dtype=np.int32)[None], "cu_seqlens": np.array([0, 2], np.int32),
            "max_seqlen": 2, "seq_lens": np.array([2], np.int32), "patches": np.zeros((0, patch_dim), np.uint8),
            "image_grid_thw": np.zeros((0, 3), np.int32), "image_sample_index": np.zeros(0, np.int32),
            "vision_cu_seqlens": np.zeros(1, np.int32), "sample_ids": [], "real_tokens": 0, "target_tokens": 0}


def split_batch(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """The inverse of collate: a collated batch (pack or pad) -> its samples, each as collate takes them
    (sample_id, input_ids, labels, patches, grids; video_patches, video_grids, second_per_grid_ts when the batch
    has videos), in batch order."""
    grids = np.asarray(batch["image_grid_thw"]).reshape(-1, 3)
    owner = np.asarray(batch["image_sample_index"])
    vcu = np.asarray(batch["vision_cu_seqlens"])
    lens = np.asarray(batch["seq_lens"])
    if batch["mode"] == "pack":
        cu = np.asarray(batch["cu_seqlens"])
        rows = [(0, int(cu[i]), int(cu[i + 1])) for i in range(len(lens))]
    else:
        rows = [(i, 0, int(n)) for i, n in enumerate(lens)]
    out = []
    for i, (r, a, b) in enumerate(rows):
        mine = np.flatnonzero(owner == i)
        patches = [batch["patches"][vcu[j]:vcu[j + 1]] for j in mine]
        out.append({
            "sample_id": str(batch["sample_ids"][i]) if i < len(batch["sample_ids"]) else f"#{i}",
            "input_ids": np.asarray(batch["input_ids"][r, a:b]), "labels": np.asarray(batch["labels"][r, a:b]),
            "patches": np.concatenate(patches) if patches else batch["patches"][:0],
            "grids": grids[mine],
        })
        if "image_sizes" in batch:
            out[-1]["image_sizes"] = np.asarray(batch["image_sizes"]).reshape(-1, 2)[mine]
    if "video_grid_thw" in batch:  # videos (collate._videos): each sample's clips, patches and seconds
        vgrids = np.asarray(batch["video_grid_thw"]).reshape(-1, 3)
        vowner = np.asarray(batch["video_sample_index"])
        vstart = np.concatenate([[0], np.cumsum(np.prod(vgrids, axis=1))]).astype(np.int64)
        seconds = np.asarray(batch["second_per_grid_ts"])
        for i, sample in enumerate(out):
            mine = np.flatnonzero(vowner == i)
            clips = [batch["video_patches"][vstart[j]:vstart[j + 1]] for j in mine]
            sample.update(video_grids=vgrids[mine], second_per_grid_ts=seconds[mine],
                          video_patches=np.concatenate(clips) if clips else batch["video_patches"][:0])
    return out
