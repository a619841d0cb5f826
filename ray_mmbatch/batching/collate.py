"""Collate one planned batch of materialized samples into arrays (numpy only).

Input samples (from data materialize): ``sample_id`` str, ``input_ids`` int32[L],
``labels`` int32[L] ALREADY shifted (labels[t] is the target of the logits at t,
IGNORE_INDEX where none, and always IGNORE_INDEX on a sample's last token),
``patches`` uint8[P_i, D], ``grids`` int32[n_i, 3] (t, h, w in patches).

Packed layout (``collate_pack``), three samples of lengths 3, 2, 4 -> T = 9::

    input_ids     [ a0 a1 a2 | b0 b1 | c0 c1 c2 c3 ]      shape [1, T], no padding
    position_ids  [  0  1  2 |  0  1 |  0  1  2  3 ]      restart per sample
    labels        [ a1 a2 -- | b1 -- | c1 c2 c3 -- ]      -- = -100; each sample's
                                                          last label is -100, so no
                                                          token learns to predict
                                                          the next sample
    cu_seqlens    [ 0, 3, 5, 9 ]                           int32[n + 1]
    seq_lens      [ 3, 2, 4 ],  max_seqlen = 4

    attention (block-diagonal causal; 1 = may attend)
              a0 a1 a2 b0 b1 c0 c1 c2 c3
        a0  [  1  .  .  .  .  .  .  .  . ]
        a1  [  1  1  .  .  .  .  .  .  . ]
        a2  [  1  1  1  .  .  .  .  .  . ]
        b0  [  .  .  .  1  .  .  .  .  . ]
        b1  [  .  .  .  1  1  .  .  .  . ]
        c0  [  .  .  .  .  .  1  .  .  . ]
        c1  [  .  .  .  .  .  1  1  .  . ]
        c2  [  .  .  .  .  .  1  1  1  . ]
        c3  [  .  .  .  .  .  1  1  1  1 ]

    vision: patches of every image concatenated in sample order
    patches            uint8[sum P, D]
    image_grid_thw     int32[n_img, 3]
    image_sample_index int32[n_img]         which sample each image belongs to
    vision_cu_seqlens  int32[n_img + 1]     patch offsets per image (the vision
                                            encoder's own block-diagonal mask)
    image_sizes        int32[n_img, 2]      only when samples carry it (resize='anyres'):
                                            each image's displayed (h, w)

Padded layout (``collate_pad``): input_ids [B, Lmax] filled with pad_id, labels
-100 on padding, attention_mask bool [B, Lmax], position_ids 0..L-1 then 0, the
same vision fields. Both carry ``sample_ids``, ``real_tokens``, ``target_tokens``.

``encode_batch`` / ``decode_batch``: the dict as bytes with no pickle (a data
file must never execute code): magic, a JSON header (scalars, string lists,
array dtype/shape/offset), then 8-byte aligned raw buffers; decode returns
read-only ``np.frombuffer`` views. Cost: O(total bytes), one copy on encode.
"""
from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

from ..schema import IGNORE_INDEX

_MAGIC = b"MMB1"
_ALIGN = 8
_DTYPES = {"int32", "int64", "uint8", "bool", "float32", "float64", "int16", "uint16", "uint32"}


def _check(samples: list[dict]) -> None:
    if not samples:
        raise ValueError("cannot collate an empty batch")
    for s in samples:
        ids, lab = np.asarray(s["input_ids"]), np.asarray(s["labels"])
        sid = s.get("sample_id", "?")
        if ids.ndim != 1 or ids.shape != lab.shape or len(ids) == 0:
            raise ValueError(f"sample {sid}: input_ids {ids.shape} and labels {lab.shape} "
                             "must be equal, non-empty 1-D")
        if lab[-1] != IGNORE_INDEX:
            raise ValueError(f"sample {sid}: last label must be IGNORE_INDEX ({IGNORE_INDEX}), "
                             "otherwise a packed sample would learn to predict the next one")
        grids = np.asarray(s["grids"]).reshape(-1, 3)
        n_patches = int(np.prod(grids, axis=1).sum()) if len(grids) else 0
        if len(s["patches"]) != n_patches:
            raise ValueError(f"sample {sid}: {len(s['patches'])} patch rows but grids say {n_patches}")


def _vision(samples: list[dict]) -> dict[str, Any]:
    grids = [np.asarray(s["grids"], np.int32).reshape(-1, 3) for s in samples]
    patch_list = [np.asarray(s["patches"], np.uint8) for s in samples]
    dims = {p.shape[1] for p in patch_list if p.ndim == 2 and len(p)}
    if len(dims) > 1:
        raise ValueError(f"patch rows differ in size across samples: {sorted(dims)}")
    dim = dims.pop() if dims else max((p.shape[1] for p in patch_list if p.ndim == 2), default=0)
    patches = np.concatenate([p.reshape(-1, dim) for p in patch_list]) if patch_list else \
        np.zeros((0, dim), np.uint8)
    grid_thw = np.concatenate(grids).astype(np.int32)
    per_image = np.prod(grid_thw, axis=1) if len(grid_thw) else np.zeros(0, np.int64)
    extra = {}
    if any("image_sizes" in s for s in samples):  # resize='anyres': (h, w) per image, in image order
        extra["image_sizes"] = np.concatenate([np.asarray(s.get("image_sizes", np.zeros((0, 2))), np.int32)
                                               .reshape(-1, 2) for s in samples]).astype(np.int32)
    if any("video_grids" in s for s in samples):  # videos (data/video.py): their own patches, grids, owners
        extra.update(_videos(samples))
    return extra | {
        "patches": patches,
        "image_grid_thw": grid_thw,
        "image_sample_index": np.repeat(np.arange(len(samples), dtype=np.int32),
                                        [len(g) for g in grids]).astype(np.int32),
        "vision_cu_seqlens": np.concatenate([[0], np.cumsum(per_image)]).astype(np.int32),
    }


def _videos(samples: list[dict]) -> dict[str, Any]:
    """video_patches uint8 [sum P, 3*tps*ps*ps], video_grid_thw int32 [n_vid, 3], video_sample_index,
    second_per_grid_ts float32 [n_vid] (Qwen2.5-VL), in sample order."""
    grids = [np.asarray(s.get("video_grids", np.zeros((0, 3))), np.int32).reshape(-1, 3) for s in samples]
    with_rows = [np.asarray(s["video_patches"], np.uint8) for s in samples if "video_patches" in s]
    dims = {p.shape[1] for p in with_rows if p.ndim == 2 and len(p)}
    if len(dims) > 1:
        raise ValueError(f"video patch rows differ in size across samples: {sorted(dims)}")
    dim = dims.pop() if dims else max((p.shape[1] for p in with_rows if p.ndim == 2), default=0)
    patches = [np.asarray(s.get("video_patches", np.zeros((0, dim), np.uint8)), np.uint8).reshape(-1, dim)
               for s in samples]
    for s, g, p in zip(samples, grids, patches):
        if len(p) != int(np.prod(g, axis=1).sum() if len(g) else 0):
            raise ValueError(f"sample {s.get('sample_id', '?')}: {len(p)} video patch rows but video grids "
                             f"say {int(np.prod(g, axis=1).sum())}")
    return {
        "video_patches": np.concatenate(patches),
        "video_grid_thw": np.concatenate(grids).astype(np.int32),
        "video_sample_index": np.repeat(np.arange(len(samples), dtype=np.int32), [len(g) for g in grids]).astype(
            np.int32),
        "second_per_grid_ts": np.concatenate([np.asarray(s.get("second_per_grid_ts", np.zeros(0)), np.float32)
                                              for s in samples]).astype(np.float32),
    }


def _common(samples, lens: np.ndarray, labels_cat: np.ndarray) -> dict[str, Any]:
    return {
        "seq_lens": lens.astype(np.int32),
        "max_seqlen": int(lens.max()),
        "sample_ids": [str(s["sample_id"]) for s in samples],
        "real_tokens": int(lens.sum()),
        "target_tokens": int((labels_cat != IGNORE_INDEX).sum()),
    }


def collate_pack(samples: list[dict], pad_id: int) -> dict[str, Any]:
    """One packed row of all samples (layout above); ``pad_id`` unused, kept for symmetry."""
    _check(samples)
    ids = np.concatenate([np.asarray(s["input_ids"], np.int32) for s in samples])
    labels = np.concatenate([np.asarray(s["labels"], np.int32) for s in samples])
    lens = np.array([len(s["input_ids"]) for s in samples], np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    pos = (np.arange(len(ids)) - np.repeat(cu[:-1], lens)).astype(np.int32)
    out = {"mode": "pack", "input_ids": ids[None], "labels": labels[None],
           "position_ids": pos[None], "cu_seqlens": cu}
    out.update(_common(samples, lens, labels))
    out.update(_vision(samples))
    return out


def collate_pad(samples: list[dict], pad_id: int) -> dict[str, Any]:
    """Rows padded to the longest with ``pad_id`` (labels -100, mask 0 on padding)."""
    _check(samples)
    lens = np.array([len(s["input_ids"]) for s in samples], np.int64)
    rows, width = len(samples), int(lens.max())
    ids = np.full((rows, width), pad_id, np.int32)
    labels = np.full((rows, width), IGNORE_INDEX, np.int32)
    mask = np.arange(width)[None, :] < lens[:, None]
    for r, s in enumerate(samples):
        ids[r, :lens[r]] = s["input_ids"]
        labels[r, :lens[r]] = s["labels"]
    pos = np.where(mask, np.arange(width, dtype=np.int32)[None, :], 0).astype(np.int32)
    out = {"mode": "pad", "input_ids": ids, "labels": labels, "attention_mask": mask,
           "position_ids": pos}
    out.update(_common(samples, lens, labels))
    out.update(_vision(samples))
    return out


# ------------------------------------------------------------- serialization
def encode_batch(batch: dict[str, Any]) -> bytes:
    """Arrays, int/float/bool/str scalars and lists of str -> bytes (no pickle)."""
    header: dict[str, Any] = {"scalars": {}, "strings": {}, "arrays": {}}
    chunks, offset = [], 0
    for key, val in batch.items():
        if isinstance(val, np.ndarray):
            if val.dtype.name not in _DTYPES:
                raise TypeError(f"{key}: dtype {val.dtype} is not serializable")
            data = np.ascontiguousarray(val).tobytes()
            header["arrays"][key] = {"dtype": val.dtype.name, "shape": list(val.shape),
                                     "offset": offset, "nbytes": len(data)}
            pad = -len(data) % _ALIGN
            chunks.append(data + b"\0" * pad)
            offset += len(data) + pad
        elif isinstance(val, (list, tuple)) and all(isinstance(v, str) for v in val):
            header["strings"][key] = list(val)
        elif isinstance(val, (bool, int, float, str, np.integer, np.floating, np.bool_)):
            header["scalars"][key] = val.item() if isinstance(val, np.generic) else val
        else:
            raise TypeError(f"{key}: cannot serialize {type(val).__name__}")
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(len(_MAGIC) + 4 + len(head)) % _ALIGN)  # buffers start aligned
    return b"".join([_MAGIC, struct.pack("<I", len(head)), head, *chunks])


def decode_batch(data: bytes) -> dict[str, Any]:
    """Inverse of encode_batch; arrays are read-only views on ``data``."""
    buf = memoryview(data)
    if bytes(buf[:4]) != _MAGIC or len(buf) < 8:
        raise ValueError("not an encoded batch (bad magic)")
    (head_len,) = struct.unpack("<I", buf[4:8])
    start = 8 + head_len
    if start > len(buf):
        raise ValueError("encoded batch truncated in header")
    header = json.loads(bytes(buf[8:start]))
    out: dict[str, Any] = dict(header["scalars"])
    out.update(header["strings"])
    for key, spec in header["arrays"].items():
        dtype = spec["dtype"]
        if dtype not in _DTYPES:
            raise ValueError(f"{key}: dtype {dtype!r} not allowed")
        shape, off, nbytes = tuple(spec["shape"]), int(spec["offset"]), int(spec["nbytes"])
        itemsize = np.dtype(dtype).itemsize
        if int(np.prod(shape, dtype=np.int64)) * itemsize != nbytes or off < 0 \
                or start + off + nbytes > len(buf):
            raise ValueError(f"{key}: array spec {spec} does not match the payload")
        out[key] = np.frombuffer(buf, dtype=dtype, count=nbytes // itemsize,
                                 offset=start + off).reshape(shape)
    return out
