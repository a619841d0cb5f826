"""Idefics3 / SmolVLM image splitting: the processor's text block of each image, spliced into measured ids.

With ``do_image_splitting`` HF's processor writes, for an image split into rows x cols views plus
its global view (``_prompt_split_image``; ``<image>`` x N per view)::

    <fake_token_around_image><row_1_col_1><image>..<fake_token_around_image><row_1_col_2><image>..\\n
    ...                                                                           (one line per row)
    \\n<fake_token_around_image><global-img><image>..<fake_token_around_image>

and for an image that is one view (rows = cols = 0) only the last line without its newline
(``_prompt_single_image``). The block depends on the grid, so it cannot be the fixed
``text.image_block`` the encoder renders: the encoder writes the single-view block (configure sets
it), which ends every image's block, and ``splice_split_blocks`` puts the rows' ids in front of it,
with ONE ``<image>`` per view (materialize repeats each N times, data/materialize.py). Every piece
of the block is an added token or a newline between two of them, so the ids do not depend on the
text around the block: they are the tokenizer's ids of the processor's text (tests/test_models_idefics3).
The grid comes from the image header again (data/image.split_grid; ~10-50 us an image).
Pure module: numpy + the tokenizer, no ray, no torch.
"""
from __future__ import annotations

import weakref

import numpy as np

from ray_mmbatch.config import ImageConfig, TextConfig
from ray_mmbatch.data.image import probe_image, split_grid

ROW_COL = "<row_{row}_col_{col}>"


def split_block_text(rows: int, cols: int, fake: str, image: str, glob: str, per_view: int = 1) -> str:
    """HF ``get_image_prompt_string`` (SmolVLM; Idefics3's processor writes the same) for one image."""
    single = f"{fake}{glob}{image * per_view}{fake}"
    if not rows:
        return single
    lines = ["".join(f"{fake}{ROW_COL.format(row=r + 1, col=c + 1)}{image * per_view}" for c in range(cols)) + "\n"
             for r in range(rows)]
    return "".join(lines) + "\n" + single


def block_tokens(text_cfg: TextConfig) -> tuple[str, str, str]:
    """(fake, image, global) token strings from text.image_block, the single-view block fake + global + image + fake."""
    image = text_cfg.image_token
    token, block = tuple(text_cfg.image_block) or (image, image)
    head, _, fake = block.partition(image)
    if token != image or not fake or not head.startswith(fake) or len(head) == len(fake):
        raise ValueError(f"resize='split' needs text.image_block (image token, fake + global + image + fake), got "
                         f"{tuple(text_cfg.image_block)!r}")
    return fake, image, head[len(fake):]


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _prefix_ids(tok, text_cfg: TextConfig, rows: int, cols: int) -> np.ndarray:
    """Ids of the block before its single-view tail (the rows' lines and the newline before the global view)."""
    per_tok = _CACHE.setdefault(tok, {})
    key = (*block_tokens(text_cfg), rows, cols)
    if key not in per_tok:
        fake, image, glob = key[:3]
        full = tok(split_block_text(rows, cols, fake, image, glob), add_special_tokens=False).input_ids
        tail = tok(split_block_text(0, 0, fake, image, glob), add_special_tokens=False).input_ids
        if full[len(full) - len(tail):] != tail:
            raise ValueError(f"the tokenizer does not keep the image block's tail {tail} apart: {full}")
        per_tok[key] = np.asarray(full[:len(full) - len(tail)], dtype=np.int32)
    return per_tok[key]


def splice_split_blocks(ids: np.ndarray, target: np.ndarray, images: list, image_cfg: ImageConfig, tok,
                        text_cfg: TextConfig, image_id: int) -> tuple[np.ndarray, np.ndarray]:
    """One sample's measured (ids, target), one image token per image in its single-view block -> the split
    blocks' ids, one image token per view; the inserted ids take the target of their image's token."""
    at = np.flatnonzero(ids == image_id)
    if len(at) != len(images):
        raise ValueError(f"{len(at)} image tokens for {len(images)} images")
    fake, image, glob = block_tokens(text_cfg)
    head = tok(f"{fake}{glob}{image}{fake}", add_special_tokens=False).input_ids
    pieces, targets, start = [], [], 0
    for p, data in zip(at, images):
        rows, cols = split_grid(*probe_image(data, image_cfg), image_cfg)
        prefix = _prefix_ids(tok, text_cfg, rows, cols) if rows else np.zeros(0, dtype=np.int32)
        cut = int(p) - 2  # the single-view block starts two tokens before its image token
        if cut < start or ids[cut:p + 2].tolist() != head:
            raise ValueError(f"image token at {p} is not inside the single-view block {head}: "
                             f"{ids[max(cut, 0):p + 2].tolist()}")
        pieces += [ids[start:cut], prefix]
        targets += [target[start:cut], np.full(len(prefix), target[p], dtype=target.dtype)]
        start = cut
    pieces.append(ids[start:])
    targets.append(target[start:])
    return np.concatenate(pieces).astype(ids.dtype, copy=False), np.concatenate(targets)
