"""Measure a sample's cost without decoding pixels; apply the oversize policy; materialize it.

measure (per batch of RAW rows, cheap)::

    image headers -> (h, w) -> smart_resize -> grid (1, gh, gw)     no pixel decoding
    conversation  -> ids with ONE <|image_pad|> per image, target mask   one batched tokenizer call
    text_tokens  = len(text_ids) - n_images
    image_tokens = sum(gh * gw // merge**2)        patches = sum(gh * gw)
    tokens       = text_tokens + image_tokens      (exact LM sequence length after expansion)

Every input row comes out (same order, same count); a row that cannot be used keeps
zero costs, empty lists and ``skip_reason = "reason: detail"``.

materialize (per trained sample, the expensive step): decode + resize + patchify each
image at its measured grid, expand each image_pad to that image's token count
(np.repeat), and shift labels for next-token prediction so that the last token of a
sample never has a label (packed samples never predict across a boundary)::

    input_ids  A  B  <vs> <img> <img> <img> <ve>  C  D
    target     0  0   0    0     0     0     0    1  1
    labels     .  .   .    .     .     .     C    D  .      (. = IGNORE_INDEX)

Cost (one core, default ImageConfig): measure ~110 us/sample (~9,000 samples/s) for a
one-JPEG short Q/A, ~330 us/sample over the generated mixture (generate.py; long
conversations dominate). materialize is dominated by image decoding, which grows with the
source image's size; per-image decode costs are in benchmarks/RESULTS.md ("bench_decode").
Pure module: no ray, no torch.
"""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from ray_mmbatch import schema as S
from ray_mmbatch.config import BudgetConfig, ImageConfig, TextConfig
from ray_mmbatch.data.image import ImageSkip, decode_image, image_grid, patchify, probe_image
from ray_mmbatch.data.text import TextSkip, encode_conversations, image_token_id

_EMPTY_IDS = np.zeros(0, dtype=np.int32)
_EMPTY_TARGET = np.zeros(0, dtype=np.uint8)
_EMPTY_GRIDS = np.zeros((0, 3), dtype=np.int32)


def _items(value: Any) -> list:
    """A list cell from Ray (ndarray of objects, list, None) -> list."""
    if value is None:
        return []
    return list(value)


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)


def _parse_conversation(value: Any) -> Any:
    if isinstance(value, (list, tuple, np.ndarray)):
        return list(value)
    try:
        return json.loads(value)
    except (TypeError, ValueError) as e:
        raise TextSkip(S.SKIP_MALFORMED_RECORD, f"conversations is not JSON: {e}") from None


def _grids(images: list, refs: list, cfg: ImageConfig) -> np.ndarray:
    grids = []
    for j, data in enumerate(images):
        try:
            if data is None:
                raise ImageSkip(S.SKIP_EMPTY_FILE, "no bytes")
            grids.append(image_grid(*probe_image(data, cfg), cfg))
        except ImageSkip as e:
            where = f"image {j}" + (f" ({refs[j]})" if j < len(refs) and refs[j] else "")
            raise ImageSkip(e.reason, f"{where}: {e.detail}") from None
    return np.asarray(grids, dtype=np.int32).reshape(-1, 3)


def measure_batch(batch: dict[str, Any], image_cfg: ImageConfig, tok, text_cfg: TextConfig) -> dict[str, Any]:
    """RAW columns -> MEASURED columns for every row (see module docstring)."""
    n = len(batch[S.SAMPLE_ID])
    reasons = [""] * n
    grids: list[np.ndarray] = [_EMPTY_GRIDS] * n
    convs: dict[int, Any] = {}
    for i in range(n):
        reasons[i] = _text(batch[S.READ_ERROR][i]) if S.READ_ERROR in batch else ""
        if reasons[i]:
            continue
        try:
            grids[i] = _grids(_items(batch[S.IMAGES][i]), [_text(r) for r in _items(batch[S.IMAGE_REFS][i])],
                              image_cfg)
            convs[i] = _parse_conversation(batch[S.CONVERSATIONS][i])
        except (ImageSkip, TextSkip) as e:
            reasons[i] = e.skip_reason()
    rows = list(convs)
    encoded = encode_conversations([convs[i] for i in rows], [len(grids[i]) for i in rows], tok,
                                   train_on_prompt=text_cfg.train_on_prompt, image_token=text_cfg.image_token)
    ids: list[np.ndarray] = [_EMPTY_IDS] * n
    target: list[np.ndarray] = [_EMPTY_TARGET] * n
    for i, result in zip(rows, encoded):
        if isinstance(result, TextSkip):
            reasons[i] = result.skip_reason()
        else:
            ids[i], target[i] = result
    merge2 = image_cfg.merge_size ** 2
    ok = np.array([not r for r in reasons], dtype=bool)
    n_images = np.array([len(g) for g in grids], dtype=np.int64) * ok
    patches = np.array([int((g[:, 0] * g[:, 1] * g[:, 2]).sum()) for g in grids], dtype=np.int64) * ok
    image_tokens = np.array([int((g[:, 1] * g[:, 2] // merge2).sum()) for g in grids], dtype=np.int64) * ok
    text_tokens = (np.array([len(a) for a in ids], dtype=np.int64) - n_images) * ok
    out = {c: batch[c] for c in S.RAW_COLUMNS if c in batch}
    out.update({
        S.TEXT_IDS: [a if k else _EMPTY_IDS for a, k in zip(ids, ok)],
        S.TEXT_TARGET: [a if k else _EMPTY_TARGET for a, k in zip(target, ok)],
        S.GRIDS: [g if k else _EMPTY_GRIDS for g, k in zip(grids, ok)],
        S.TEXT_TOKENS: text_tokens, S.IMAGE_TOKENS: image_tokens, S.PATCHES: patches, S.N_IMAGES: n_images,
        S.TOKENS: text_tokens + image_tokens,
        S.SKIP_REASON: np.array(reasons, dtype=object),
        S.IMAGE_TOKEN_ID: np.full(n, image_token_id(tok, text_cfg), dtype=np.int64),
    })
    return out


# ------------------------------------------------------------------ oversize policy
def max_tokens_alone(budget: BudgetConfig) -> int:
    """Largest sequence length T with T + attn_weight * T**2 <= max_tokens."""
    m, w = int(budget.max_tokens), float(budget.attn_weight or 0.0)
    if w <= 0:
        return m
    t = int((-1 + math.sqrt(1 + 4 * w * m)) / (2 * w))
    while t + w * t * t > m:  # float rounding at the boundary
        t -= 1
    while (t + 1) + w * (t + 1) ** 2 <= m:
        t += 1
    return max(t, 0)


def _skipped(row: dict, reason: str) -> dict:
    out = dict(row)
    out.update({S.SKIP_REASON: reason, S.TEXT_IDS: _EMPTY_IDS, S.TEXT_TARGET: _EMPTY_TARGET, S.GRIDS: _EMPTY_GRIDS,
                S.TEXT_TOKENS: 0, S.IMAGE_TOKENS: 0, S.PATCHES: 0, S.N_IMAGES: 0, S.TOKENS: 0})
    return out


def fit_to_budget(row: dict, budget: BudgetConfig) -> dict:
    """One measured row -> itself if it fits a batch alone, else truncated (text after the last image) or skipped."""
    if row[S.SKIP_REASON]:
        return row
    tokens, patches, n_images = int(row[S.TOKENS]), int(row[S.PATCHES]), int(row[S.N_IMAGES])
    if budget.max_images is not None and n_images > budget.max_images:
        return _skipped(row, f"{S.SKIP_TOO_MANY_IMAGES}: {n_images} images > max_images={budget.max_images}")
    if budget.max_patches is not None and patches > budget.max_patches:
        return _skipped(row, f"{S.SKIP_OVERSIZE}: {patches} patches > max_patches={budget.max_patches}")
    cap = max_tokens_alone(budget)
    if tokens <= cap:
        return row
    what = f"{tokens} tokens > {cap} that fit max_tokens={budget.max_tokens}"
    if getattr(budget, "oversize", "truncate") != "truncate":
        return _skipped(row, f"{S.SKIP_OVERSIZE}: {what}")
    ids = np.asarray(row[S.TEXT_IDS], dtype=np.int32)
    target = np.asarray(row[S.TEXT_TARGET], dtype=np.uint8)
    keep = len(ids) - (tokens - cap)
    floor = 0
    if n_images:  # never cut into an image: keep its token and the one the template writes after it
        # (Qwen-VL <|vision_end|>, LLaVA's newline), never past the end of the sample
        floor = min(int(np.flatnonzero(ids == int(row[S.IMAGE_TOKEN_ID]))[-1]) + 2, len(ids))
    if keep < floor:
        return _skipped(row, f"{S.SKIP_OVERSIZE}: {what}; its images alone need {tokens - (len(ids) - floor)}")
    if not target[1:keep].any():  # labels are shifted: target[0] never becomes a label
        return _skipped(row, f"{S.SKIP_OVERSIZE}: {what}; nothing trainable left after truncation")
    out = dict(row)
    out.update({S.TEXT_IDS: ids[:keep], S.TEXT_TARGET: target[:keep],
                S.TEXT_TOKENS: int(row[S.TEXT_TOKENS]) - (len(ids) - keep), S.TOKENS: cap})
    return out


def fit_batch_to_budget(batch: dict[str, Any], budget: BudgetConfig) -> dict[str, Any]:
    """Columnar fit_to_budget: only rows that do not fit alone are touched (vectorized check)."""
    tokens = np.asarray(batch[S.TOKENS], dtype=np.int64)
    bad = tokens > max_tokens_alone(budget)
    if budget.max_patches is not None:
        bad |= np.asarray(batch[S.PATCHES], dtype=np.int64) > budget.max_patches
    if budget.max_images is not None:
        bad |= np.asarray(batch[S.N_IMAGES], dtype=np.int64) > budget.max_images
    bad &= np.array([not r for r in batch[S.SKIP_REASON]], dtype=bool)
    if not bad.any():
        return batch
    out = dict(batch)
    changed = (S.TEXT_IDS, S.TEXT_TARGET, S.GRIDS, S.TEXT_TOKENS, S.IMAGE_TOKENS, S.PATCHES, S.N_IMAGES, S.TOKENS,
               S.SKIP_REASON)
    for c in changed:
        out[c] = np.array(batch[c], copy=True) if isinstance(batch[c], np.ndarray) else list(batch[c])
    for i in np.flatnonzero(bad):
        fitted = fit_to_budget({c: batch[c][i] for c in batch}, budget)
        for c in changed:
            out[c][i] = fitted[c]
    return out


# ------------------------------------------------------------------ materialize
def materialize_sample(row: dict, image_cfg: ImageConfig, image_pad_id: int | None = None) -> dict[str, Any]:
    """One measured, usable row -> model-ready arrays (see module docstring). Raises ImageSkip on bad pixels."""
    ids = np.asarray(row[S.TEXT_IDS], dtype=np.int32)
    target = np.asarray(row[S.TEXT_TARGET], dtype=np.uint8)
    grids = np.array([np.asarray(g, dtype=np.int32) for g in _items(row[S.GRIDS])], dtype=np.int32).reshape(-1, 3)
    pad_id = int(row[S.IMAGE_TOKEN_ID] if image_pad_id is None else image_pad_id)
    pad_at = np.flatnonzero(ids == pad_id)
    if len(pad_at) != len(grids):
        raise ValueError(f"{row[S.SAMPLE_ID]}: {len(pad_at)} image_pad tokens for {len(grids)} grids")
    repeats = np.ones(len(ids), dtype=np.int64)
    repeats[pad_at] = grids[:, 1] * grids[:, 2] // image_cfg.merge_size ** 2
    input_ids = np.repeat(ids, repeats)
    expanded_target = np.repeat(target, repeats)
    if len(input_ids) != int(row[S.TOKENS]):
        raise ValueError(f"{row[S.SAMPLE_ID]}: {len(input_ids)} tokens, measured {int(row[S.TOKENS])}")
    labels = np.full(len(input_ids), S.IGNORE_INDEX, dtype=np.int32)
    labels[:-1] = np.where(expanded_target[1:] == 1, input_ids[1:], S.IGNORE_INDEX)
    ps = image_cfg.patch_size
    images = _items(row[S.IMAGES])
    if len(images) != len(grids):
        raise ValueError(f"{row[S.SAMPLE_ID]}: {len(images)} images for {len(grids)} grids")
    patches = [patchify(decode_image(data, g, image_cfg), image_cfg) for data, g in zip(images, grids)]
    patches = np.concatenate(patches) if patches else np.zeros((0, 3 * ps * ps), dtype=np.uint8)
    if patches.shape[0] != int(row[S.PATCHES]):
        raise ValueError(f"{row[S.SAMPLE_ID]}: {patches.shape[0]} patches, measured {int(row[S.PATCHES])}")
    return {"sample_id": str(row[S.SAMPLE_ID]), "input_ids": input_ids, "labels": labels, "patches": patches,
            "grids": grids}
