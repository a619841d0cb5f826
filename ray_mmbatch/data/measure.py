"""Measure a sample's cost without decoding pixels; apply the oversize policy (materialize: materialize.py).

measure (per batch of RAW rows, cheap)::

    image headers -> (h, w) -> smart_resize -> grid (1, gh, gw)     no pixel decoding
    conversation  -> ids with ONE <|image_pad|> per image, target mask   one batched tokenizer call
    text_tokens  = len(text_ids) - n_images
    image_tokens = sum(gh * gw // merge**2)        patches = sum(gh * gw)
    tokens       = text_tokens + image_tokens      (exact LM sequence length after expansion)

Every input row comes out (same order, same count); a row that cannot be used keeps
zero costs, empty lists and ``skip_reason = "reason: detail"``.

Cost: header reads and one tokenizer call per batch, no pixel decode; measured by
benchmarks/bench_ingest.py and bench_text.py (figures in benchmarks/RESULTS.md).
Pure module: no ray, no torch.
"""
from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from ray_mmbatch import schema as S
from ray_mmbatch.batching.budget import max_tokens_alone
from ray_mmbatch.config import BudgetConfig, ImageConfig, TextConfig
from ray_mmbatch.data.image import ImageSkip, image_grid, image_tokens, probe_image
from ray_mmbatch.data.materialize import _items
from ray_mmbatch.data.text.conversations import TextSkip
from ray_mmbatch.data.text.encoder import encode_conversations, image_token_id, video_token_id
from ray_mmbatch.data.video import VideoSkip, is_video, plan_video

_EMPTY_IDS = np.zeros(0, dtype=np.int32)
_EMPTY_TARGET = np.zeros(0, dtype=np.uint8)
_EMPTY_GRIDS = np.zeros((0, 3), dtype=np.int32)


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


class VideoRefused(ValueError):
    """A video sample for a model family that takes no video: the run stops, naming the family."""


def _grids(images: list, refs: list, cfg: ImageConfig, sample_id: str = "") -> tuple[np.ndarray, int, list]:
    """The media's grids, their LM tokens (data/image.image_tokens; a video's t*h*w / merge**2) and, per
    media item, its VideoPlan (None for an image)."""
    grids, tokens, plans = [], 0, []
    n_images = sum(1 for data in images if data is not None and not is_video(data))
    for j, data in enumerate(images):
        where = f"image {j}" + (f" ({refs[j]})" if j < len(refs) and refs[j] else "")
        try:
            if data is None:
                raise ImageSkip(S.SKIP_EMPTY_FILE, "no bytes")
            if is_video(data):
                if not cfg.video:
                    from ray_mmbatch.models import video_model_types  # the registry's list: it cannot drift

                    raise VideoRefused(f"sample {sample_id}: {where.replace('image', 'media item', 1)} is a video, "
                                       f"and the model's image processing (resize={cfg.resize!r}) takes no video. "
                                       "Checkpoints that train on video (model_type): "
                                       f"{', '.join(video_model_types())}; or --filter the videos out")
                plan = plan_video(data, cfg)
                grids.append(plan.grid)
                tokens += plan.tokens
                plans.append(plan)
                continue
            hw = probe_image(data, cfg)
            grids.append(image_grid(*hw, cfg, n_images=n_images))
            tokens += image_tokens(grids[-1], hw, cfg)
            plans.append(None)
        except (ImageSkip, VideoSkip) as e:
            raise ImageSkip(e.reason, f"{where}: {e.detail}") from None
    return np.asarray(grids, dtype=np.int32).reshape(-1, 3), tokens, plans


def _video_placeholders(conv: Any, plans: list) -> Any:
    """The conversation with each video's placeholder written as <image> (one media slot for the encoder);
    TextSkip when a <video> placeholder falls on an image. Placeholders count in human turns, in order."""
    if not plans or not isinstance(conv, list):
        return conv
    pattern = re.compile(f"{re.escape(S.IMAGE_PLACEHOLDER)}|{re.escape(S.VIDEO_PLACEHOLDER)}")
    out, k = [], 0
    for turn in conv:
        value = turn.get("value") if isinstance(turn, dict) else None
        if not isinstance(value, str) or S.canonical_role(turn.get("from", turn.get("role"))) != "human":
            out.append(turn)
            continue
        parts, last = [], 0
        for m in pattern.finditer(value):
            if m.group() == S.VIDEO_PLACEHOLDER and (k >= len(plans) or plans[k] is None):
                raise TextSkip(S.SKIP_PLACEHOLDER_MISMATCH, f"placeholder {k} is <video> but media item {k} "
                               "is not a video")
            parts += [value[last:m.start()], S.IMAGE_PLACEHOLDER]
            last, k = m.end(), k + 1
        out.append({**turn, "value": "".join(parts) + value[last:]})
    return out


def _video_pads(ids: np.ndarray, target: np.ndarray, plans: list, image_id: int, video_id: int,
                frame_block=None, wrapper: tuple[int, int] = (-1, -1)) -> tuple[np.ndarray, np.ndarray]:
    """(ids, target) with the image token of each video media item replaced by the video token, or, for
    Qwen3-VL and Gemma 4 (``frame_block(plan)``: the ids of its timestamped per-frame blocks), by that block, which
    also takes the place of the ``wrapper`` (ids) around the token where the template wrote one: HF's
    Qwen3VLProcessor collapses the template's <|vision_start|><|video_pad|><|vision_end|> into the frame blocks
    (each of which has its own pair); Gemma 4's frames replace the image block the template's <|video|> became
    (``frame_block.wrapper``: its <|image>, <image|> ids)."""
    at = np.flatnonzero(ids == image_id)
    kinds = np.asarray([p is not None for p in plans], dtype=bool)
    if len(at) != len(kinds) or not kinds.any():
        return ids, target
    if frame_block is None:
        out = ids.copy()
        out[at[kinds]] = video_id
        return out, target
    parts_ids, parts_target, last = [], [], 0
    for pos, plan in zip(at, plans):
        if plan is None:
            continue
        block = frame_block(plan)
        wrapped = 0 < pos < len(ids) - 1 and (ids[pos - 1], ids[pos + 1]) == wrapper
        parts_ids += [ids[last:pos - wrapped], block]
        parts_target += [target[last:pos - wrapped], np.zeros(len(block), dtype=target.dtype)]
        last = pos + 1 + wrapped
    return (np.concatenate(parts_ids + [ids[last:]]).astype(ids.dtype),
            np.concatenate(parts_target + [target[last:]]).astype(target.dtype))


def qwen3_frame_blocks(tok, video_id: int):
    """plan -> Qwen3-VL's video text: per temporal patch ``<t seconds>`` + <|vision_start|> + ONE video token +
    <|vision_end|> (materialize expands each video token to the frame's tokens), as its processor writes it in
    place of the template's <|vision_start|><|video_pad|><|vision_end|> (_video_pads). Each timestamp sits
    between special tokens, so it encodes alone as in the processor's text."""
    start, end = tok.convert_tokens_to_ids(S.VISION_START), tok.convert_tokens_to_ids(S.VISION_END)
    cache: dict[str, list[int]] = {}

    def block(plan) -> np.ndarray:
        out: list[int] = []
        for text in plan.timestamp_texts():
            if text not in cache:
                cache[text] = list(tok(text, add_special_tokens=False).input_ids)
            out += cache[text] + [start, video_id, end]
        return np.asarray(out, dtype=np.int32)

    return block


def gemma4_frame_blocks(tok, video_id: int, image_block: tuple[str, ...]):
    """plan -> Gemma 4's video text in place of the image block the template's slot became (text.image_block:
    ``<|image>`` ``<|image|>`` ``<image|>``): per sampled frame ``mm:ss `` + ``<|image>`` + ONE video token +
    ``<image|>``, the frames joined by a space (Gemma4Processor.replace_video_token; materialize expands each video
    token to the frame's soft tokens). The text between two frames sits between special tokens and encodes alone,
    as in the processor's ids; the first clock follows the text before the slot, which it cannot change where
    the tokenizer never merges a digit with the text before it (Gemma's splits digits): checked here on this
    tokenizer, a ValueError where it does."""
    image, text = image_block
    boi, eoi = text.split(image)
    ids = {t: tok.convert_tokens_to_ids(t) for t in (boi, eoi)}

    def enc(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False).input_ids)

    cache: dict[str, list[int]] = {}

    def block(plan) -> np.ndarray:
        if not cache:  # the first video: the check above
            for left in ("\n", ":", "?", ".", ",", ")", "a", " it", "Video", "clip:"):
                if enc(left + "00:00 ") != enc(left) + enc("00:00 "):
                    raise ValueError(f"{getattr(tok, 'name_or_path', 'the tokenizer')} merges the text before a video "
                                     f"with its first timestamp ({left!r} + '00:00 '): Gemma 4 video text cannot be "
                                     "spliced exactly")
        out: list[int] = []
        for k, clock in enumerate(plan.clock_texts()):
            text = f" {clock} " if k else f"{clock} "
            if text not in cache:
                cache[text] = enc(text)
            out += cache[text] + [ids[boi], video_id, ids[eoi]]
        return np.asarray(out, dtype=np.int32)

    block.wrapper = (ids[boi], ids[eoi])
    return block


def glm4v_frame_blocks(tok, video_id: int):
    """plan -> GLM-4.1V's video text in place of the image block the template's slot became (``<|begin_of_image|>``
    ``<|image|>`` ``<|end_of_image|>``): ``<|begin_of_video|>``, per temporal patch ``<|begin_of_image|>`` + ONE video
    token + ``<|end_of_image|>`` + its whole second (VideoPlan.seconds_texts), ``<|end_of_video|>`` -- what GLM's
    template writes for a video part with Glm4vProcessor.replace_video_token's frames in it. HF writes ``<|image|>``
    in the frames too; the data path writes the video token (config.json video_token_id, ``<|video|>``) so a frame
    is told from an image, and the adapter gives the model ``<|image|>`` there (models/glm4v.py). Each second sits
    between special tokens and encodes alone, as in the processor's ids."""
    names = ("<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>")
    boi, eoi, bov, eov = (tok.convert_tokens_to_ids(t) for t in names)
    cache: dict[str, list[int]] = {}

    def block(plan) -> np.ndarray:
        out: list[int] = [bov]
        for text in plan.seconds_texts():
            if text not in cache:
                cache[text] = list(tok(text, add_special_tokens=False).input_ids)
            out += [boi, video_id, eoi] + cache[text]
        return np.asarray(out + [eov], dtype=np.int32)

    block.wrapper = (boi, eoi)
    return block


def _frame_block(tok, video_id: int, image_cfg: ImageConfig, text_cfg: TextConfig):
    """The family's per-temporal-patch video text (cost.FRAME_BLOCKS), or None: one video token a clip."""
    if image_cfg.video == "qwen3_vl":
        return qwen3_frame_blocks(tok, video_id)
    if image_cfg.video == "gemma4":
        return gemma4_frame_blocks(tok, video_id, tuple(text_cfg.image_block))
    if image_cfg.video == "glm4v":
        return glm4v_frame_blocks(tok, video_id)
    return None


def _check_media_mix(plans: list, image_cfg: ImageConfig) -> None:
    """GLM-4.1V: a sample with both an image and a video is skipped (unsupported_modality): HF's Glm4v forward
    refuses them in one call (a frame's tokens are <|image|> too, and its image and video placeholder masks each
    take every one), so such a sample has no HF forward to be exact against. Clips and images in different samples
    of a batch are fine (models/glm4v.py places the features itself)."""
    if image_cfg.video == "glm4v" and any(p is None for p in plans) and any(p is not None for p in plans):
        raise ImageSkip(S.SKIP_UNSUPPORTED_MODALITY, "GLM-4.1V / 4.5V: a sample with both an image and a video is "
                        "not trained (HF's Glm4v forward refuses an image and a video in one call); put them in "
                        "separate samples")


def measure_batch(batch: dict[str, Any], image_cfg: ImageConfig, tok, text_cfg: TextConfig) -> dict[str, Any]:
    """RAW columns -> MEASURED columns for every row (see module docstring)."""
    n = len(batch[S.SAMPLE_ID])
    reasons = [""] * n
    grids: list[np.ndarray] = [_EMPTY_GRIDS] * n
    img_tokens = [0] * n
    plans: list[list] = [[]] * n
    convs: dict[int, Any] = {}
    for i in range(n):
        reasons[i] = _text(batch[S.READ_ERROR][i]) if S.READ_ERROR in batch else ""
        if reasons[i]:
            continue
        try:
            grids[i], img_tokens[i], plans[i] = _grids(_items(batch[S.IMAGES][i]),
                                                       [_text(r) for r in _items(batch[S.IMAGE_REFS][i])], image_cfg,
                                                       _text(batch[S.SAMPLE_ID][i]))
            _check_media_mix(plans[i], image_cfg)
            convs[i] = _video_placeholders(_parse_conversation(batch[S.CONVERSATIONS][i]), plans[i])
        except (ImageSkip, TextSkip) as e:
            reasons[i] = e.skip_reason()
            convs.pop(i, None)
    rows = list(convs)
    encoded = encode_conversations([convs[i] for i in rows], [len(grids[i]) for i in rows], tok,
                                   train_on_prompt=text_cfg.train_on_prompt, image_token=text_cfg.image_token,
                                   image_block=tuple(text_cfg.image_block), family=text_cfg.family)
    ids: list[np.ndarray] = [_EMPTY_IDS] * n
    target: list[np.ndarray] = [_EMPTY_TARGET] * n
    for i, result in zip(rows, encoded):
        if isinstance(result, TextSkip):
            reasons[i] = result.skip_reason()
        else:
            ids[i], target[i] = result
    image_id = image_token_id(tok, text_cfg)
    video_id = video_token_id(tok, text_cfg)
    frame_block = _frame_block(tok, video_id, image_cfg, text_cfg)
    wrapper = getattr(frame_block, "wrapper", None) or (tok.convert_tokens_to_ids(S.VISION_START),
                                                        tok.convert_tokens_to_ids(S.VISION_END))
    for i in rows:
        if not reasons[i] and any(p is not None for p in plans[i]):
            ids[i], target[i] = _video_pads(ids[i], target[i], plans[i], image_id, video_id, frame_block, wrapper)
    if image_cfg.resize == "split":  # Idefics3 / SmolVLM image splitting: each image's grid-dependent text block
        from ray_mmbatch.data.split_block import splice_split_blocks

        for i in rows:
            if not reasons[i] and len(grids[i]):
                ids[i], target[i] = splice_split_blocks(ids[i], target[i], _items(batch[S.IMAGES][i]), image_cfg,
                                                        tok, text_cfg, image_id)
    if image_cfg.resize == "pixtral":  # Mistral 3: [IMG_BREAK] after each row of an image's tokens but the last
        from ray_mmbatch.data.row_breaks import splice_row_breaks

        for i in rows:
            if not reasons[i] and len(grids[i]):
                ids[i], target[i] = splice_row_breaks(ids[i], target[i], grids[i], image_cfg, tok, text_cfg)
    ok = np.array([not r for r in reasons], dtype=bool)
    n_images = np.array([len(g) for g in grids], dtype=np.int64) * ok
    patches = np.array([int((g[:, 0] * g[:, 1] * g[:, 2]).sum()) for g in grids], dtype=np.int64) * ok
    image_tokens = np.array(img_tokens, dtype=np.int64) * ok
    text_tokens = np.array([len(a) - int(np.count_nonzero((a == image_id) | (a == video_id))) for a in ids],
                           dtype=np.int64) * ok
    videos = [[p for p in row if p is not None] if k else [] for row, k in zip(plans, ok)]
    n_images = n_images - np.array([len(v) for v in videos], dtype=np.int64)
    out = {c: batch[c] for c in S.RAW_COLUMNS if c in batch}
    out.update({
        S.TEXT_IDS: [a if k else _EMPTY_IDS for a, k in zip(ids, ok)],
        S.TEXT_TARGET: [a if k else _EMPTY_TARGET for a, k in zip(target, ok)],
        S.GRIDS: [g if k else _EMPTY_GRIDS for g, k in zip(grids, ok)],
        S.TEXT_TOKENS: text_tokens, S.IMAGE_TOKENS: image_tokens, S.PATCHES: patches, S.N_IMAGES: n_images,
        S.TOKENS: text_tokens + image_tokens,
        S.SKIP_REASON: np.array(reasons, dtype=object),
        S.IMAGE_TOKEN_ID: np.full(n, image_id, dtype=np.int64),
        S.N_FRAMES: np.array([sum(p.frames for p in v) for v in videos], dtype=np.int64),
        S.N_VIDEOS: np.array([len(v) for v in videos], dtype=np.int64),
        S.VIDEO_TOKENS: np.array([sum(p.tokens for p in v) for v in videos], dtype=np.int64),
        S.VIDEO_TOKEN_ID: np.full(n, video_id, dtype=np.int64),
        S.VIDEO_PLANS: [[p.to_json() for p in v] for v in videos],  # materialize decodes by them, no second probe
    })
    return out


# ------------------------------------------------------------------ oversize policy
def _skipped(row: dict, reason: str) -> dict:
    out = dict(row)
    out.update({S.SKIP_REASON: reason, S.TEXT_IDS: _EMPTY_IDS, S.TEXT_TARGET: _EMPTY_TARGET, S.GRIDS: _EMPTY_GRIDS,
                S.TEXT_TOKENS: 0, S.IMAGE_TOKENS: 0, S.PATCHES: 0, S.N_IMAGES: 0, S.TOKENS: 0,
                S.N_FRAMES: 0, S.N_VIDEOS: 0, S.VIDEO_TOKENS: 0, S.VIDEO_PLANS: []})
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
    frames, max_frames = int(row.get(S.N_FRAMES, 0)), getattr(budget, "max_frames", None)
    if max_frames is not None and frames > max_frames:
        return _skipped(row, f"{S.SKIP_OVERSIZE}: {frames} video frames > max_frames={max_frames}")
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
    media = (ids == int(row[S.IMAGE_TOKEN_ID])) | (ids == int(row.get(S.VIDEO_TOKEN_ID, -1)))
    if media.any():  # never cut into an image or video: keep its token and the one the template writes after
        # it (Qwen-VL <|vision_end|>, LLaVA's newline), never past the end of the sample
        last = int(np.flatnonzero(media)[-1])
        floor = min(last + 2, len(ids))
        if floor < len(ids) and ids[floor] == ids[last + 1]:  # Qwen3-VL: a frame's <|vision_end|>, then the clip's
            floor += 1
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
    if getattr(budget, "max_frames", None) is not None and S.N_FRAMES in batch:
        bad |= np.asarray(batch[S.N_FRAMES], dtype=np.int64) > budget.max_frames
    bad &= np.array([not r for r in batch[S.SKIP_REASON]], dtype=bool)
    if not bad.any():
        return batch
    out = dict(batch)
    changed = (S.TEXT_IDS, S.TEXT_TARGET, S.GRIDS, S.TEXT_TOKENS, S.IMAGE_TOKENS, S.PATCHES, S.N_IMAGES, S.TOKENS,
               S.SKIP_REASON) + tuple(c for c in (S.N_FRAMES, S.N_VIDEOS, S.VIDEO_TOKENS, S.VIDEO_PLANS) if c in batch)
    for c in changed:
        out[c] = np.array(batch[c], copy=True) if isinstance(batch[c], np.ndarray) else list(batch[c])
    for i in np.flatnonzero(bad):
        fitted = fit_to_budget({c: batch[c][i] for c in batch}, budget)
        for c in changed:
            out[c][i] = fitted[c]
    return out
