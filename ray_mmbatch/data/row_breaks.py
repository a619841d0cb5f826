"""Pixtral / Mistral 3: each image's row breaks, spliced into measured ids (resize='pixtral').

HF's ``PixtralProcessor.replace_image_token`` writes, for an image of rows x cols merged patches::

    [IMG] x cols [IMG_BREAK]      (every row but the last)
    [IMG] x cols [IMG_END]        (the last row)

Only ``[IMG]`` is an image token (its features come from the tower); the breaks and the end are plain text
tokens with embeddings of their own. The block depends on the grid, so it cannot be the fixed
``text.image_block``: configure sets that to ``[IMG][IMG_END]`` (the last row's run), which the encoder
renders for every image, and ``splice_row_breaks`` puts ``[IMG][IMG_BREAK]`` in front of it once per other row,
so a sample holds one ``[IMG]`` per row (data/image ``image_runs``) and materialize repeats each ``cols`` times:
the processor's ids. The inserted ids take the target of their image's token. The ids are the added tokens'
own (no tokenizer call): every piece is a special token. Pure module: numpy + the tokenizer, no ray, no torch.
"""
from __future__ import annotations

import numpy as np

from ray_mmbatch.config import ImageConfig, TextConfig
from ray_mmbatch.data.text.tokenizer import token_id


def row_token_ids(tok, text_cfg: TextConfig) -> tuple[int, int, int]:
    """(image, break, end) token ids: text.image_token, text.image_break and the end token that text.image_block's
    text ``image_token + end`` closes each image with. ValueError when the settings or the vocabulary lack one."""
    token, block = tuple(text_cfg.image_block) or ("", "")
    image = text_cfg.image_token
    end = block[len(image):] if token == image and block.startswith(image) else ""
    ids = [token_id(tok, t) if t else None for t in (image, text_cfg.image_break, end)]
    if None in ids:
        raise ValueError(f"resize='pixtral' needs text.image_token, text.image_break and text.image_block = (image "
                         f"token, image token + end token), each a token of the tokenizer; got {image!r}, "
                         f"{text_cfg.image_break!r}, {tuple(text_cfg.image_block)!r}")
    return ids[0], ids[1], ids[2]


def splice_row_breaks(ids: np.ndarray, target: np.ndarray, grids: np.ndarray, image_cfg: ImageConfig, tok,
                      text_cfg: TextConfig) -> tuple[np.ndarray, np.ndarray]:
    """One sample's measured (ids, target), ``[IMG][IMG_END]`` per image (grids in image order) -> one ``[IMG]``
    per row, rows but the last closed by ``[IMG_BREAK]`` (module docstring)."""
    image_id, break_id, end_id = row_token_ids(tok, text_cfg)
    at = np.flatnonzero(ids == image_id)
    if len(at) != len(grids):
        raise ValueError(f"{len(at)} image tokens for {len(grids)} images")
    pieces, targets, start = [], [], 0
    for p, grid in zip(at, grids):
        if p + 1 >= len(ids) or ids[p + 1] != end_id:
            raise ValueError(f"image token at {p} is not followed by the image end token {end_id} (text.image_block)")
        rows = int(grid[1]) // image_cfg.merge_size
        pieces += [ids[start:p], np.tile(np.asarray([image_id, break_id], dtype=ids.dtype), rows - 1)]
        targets += [target[start:p], np.full(2 * (rows - 1), target[p], dtype=target.dtype)]
        start = p
    pieces.append(ids[start:])
    targets.append(target[start:])
    return np.concatenate(pieces).astype(ids.dtype, copy=False), np.concatenate(targets).astype(target.dtype)
