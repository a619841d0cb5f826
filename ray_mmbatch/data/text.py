"""Text: the tokenizer, the Qwen-style chat template, image slots and the target mask.

Template (one turn)::

    <|im_start|>{role}\\n{content}<|im_end|>\\n          role: system | user | assistant
    target mask:  0 ....... 0  1 ... 1   1      0     (assistant turns; all 0 for system/user)

An image slot in a user turn is ``<|vision_start|><|image_pad|><|vision_end|>`` with ONE
image_pad (materialize expands it to the image's token count). Special tokens come
only from the template: every piece of data text is encoded with the tokenizer's
special-token matching switched off, so ``<|im_start|>`` or ``<|image_pad|>`` written in
the data are plain bytes, and ``<image>`` is an image slot only in user turns of
samples that have images.

Cost: ONE fast-tokenizer call (Rust, batched, deduplicated) over every text segment
of every sample in the batch, then numpy concatenation per sample; measured ~70 us per
short one-image Q/A sample on one core.
Pure module: transformers/tokenizers + numpy, no ray, no torch.
"""
from __future__ import annotations

import functools
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from ray_mmbatch import schema as S
from ray_mmbatch.data.errors import SampleSkip

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"
_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
_USER, _ASSISTANT = "user", "assistant"


class TextSkip(SampleSkip):
    """A conversation that cannot be used; ``reason`` is a schema.SKIP_* constant."""


def load_tokenizer(path: str = ""):
    """A fast HF tokenizer with every schema.SPECIAL_TOKENS present (cached per process and path).

    Empty path = the byte-level BPE shipped in ray_mmbatch/assets/tokenizer. Any
    other HF tokenizer directory works: missing special tokens are added (so its
    vocabulary may grow; the model reads ``len(tok)``), and a pad token is set
    when it has none.
    """
    return _load_tokenizer(str(path or SHIPPED_TOKENIZER))


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str):
    from tokenizers import AddedToken

    if os.path.realpath(path) == os.path.realpath(SHIPPED_TOKENIZER):
        # Ours is a plain tokenizer.json: the generic fast class loads it without
        # AutoTokenizer's config machinery, which imports torch (~1.4 s per actor).
        from transformers import PreTrainedTokenizerFast as loader
    else:
        from transformers import AutoTokenizer as loader
    tok = loader.from_pretrained(path)
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{path}: a fast (Rust) tokenizer is required, got {type(tok).__name__}")
    vocab = tok.get_vocab()
    missing = [t for t in S.SPECIAL_TOKENS if t not in vocab]
    if missing:
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing], special_tokens=True)
    if tok.pad_token is None:
        tok.add_special_tokens({"pad_token": S.PAD_TOKEN})
    return tok


class _DataEncoder:
    """The tokenizer's Rust core, copied, with special-token matching OFF for data text."""

    def __init__(self, tok):
        from tokenizers import Tokenizer

        self.core = Tokenizer.from_str(tok.backend_tokenizer.to_str())
        self.core.encode_special_tokens = True  # "<|im_start|>" in data -> plain bytes
        self.core.no_truncation()
        self.core.no_padding()
        ids = tok.convert_tokens_to_ids(list(S.SPECIAL_TOKENS))
        self.special = dict(zip(S.SPECIAL_TOKENS, (int(i) for i in ids)))
        self.forbidden = np.array(sorted(set(self.special.values()) | set(tok.all_special_ids)), dtype=np.int64)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        encs = self.core.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]


_ENCODERS: "weakref.WeakKeyDictionary[Any, _DataEncoder]" = weakref.WeakKeyDictionary()


def _encoder(tok) -> _DataEncoder:
    enc = _ENCODERS.get(tok)
    if enc is None:
        enc = _ENCODERS[tok] = _DataEncoder(tok)
    return enc


def special_ids(tok) -> dict[str, int]:
    """Token id of every schema.SPECIAL_TOKENS entry for this tokenizer."""
    return dict(_encoder(tok).special)


def _turns(conv: Any, n_images: int) -> list[tuple[str, str]]:
    """Validate one conversation -> [(role, content)] with exactly n_images placeholders in user turns."""
    if not isinstance(conv, (list, tuple)):
        raise TextSkip(S.SKIP_MALFORMED_RECORD, f"conversation is {type(conv).__name__}, not a list")
    turns = []
    for i, t in enumerate(conv):
        if not isinstance(t, dict):
            raise TextSkip(S.SKIP_MALFORMED_RECORD, f"turn {i} is {type(t).__name__}, not a dict")
        role_key, content_key = ("from", "value") if "from" in t else ("role", "content")
        if role_key not in t or content_key not in t:
            raise TextSkip(S.SKIP_MALFORMED_RECORD, f"turn {i} needs from/value or role/content, has {sorted(t)}")
        role = _ROLES.get(t[role_key].strip().lower()) if isinstance(t[role_key], str) else None
        if role is None:
            raise TextSkip(S.SKIP_MALFORMED_RECORD, f"turn {i}: unknown role {t[role_key]!r}")
        content = t[content_key]
        if not isinstance(content, str):
            raise TextSkip(S.SKIP_TEXT_ENCODING, f"turn {i}: content is {type(content).__name__}, not str")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TextSkip(S.SKIP_TEXT_ENCODING, f"turn {i}: {e.reason} at {e.start}") from None
        turns.append((role, content))
    if n_images <= 0:
        return turns
    found = sum(c.count(S.IMAGE_PLACEHOLDER) for r, c in turns if r == _USER)
    if found == 0:  # HF datasets convention: images go first in the first user turn
        slots = S.IMAGE_PLACEHOLDER * n_images
        first_user = next((i for i, (r, _) in enumerate(turns) if r == _USER), None)
        if first_user is None:
            at = next((i for i, (r, _) in enumerate(turns) if r != "system"), len(turns))
            turns.insert(at, (_USER, slots))
        else:
            turns[first_user] = (_USER, slots + "\n" + turns[first_user][1])
    elif found != n_images:
        raise TextSkip(S.SKIP_PLACEHOLDER_MISMATCH, f"{found} {S.IMAGE_PLACEHOLDER} placeholders for {n_images} images")
    return turns


def _pieces(turns: list[tuple[str, str]], has_images: bool, train_on_prompt: bool, enc: _DataEncoder):
    """[(special id | text str, target, is_content)] in sequence order."""
    sp = enc.special
    frame = int(train_on_prompt)
    out: list[tuple[int | str, int, bool]] = []
    for role, content in turns:
        target = 1 if (role == _ASSISTANT or train_on_prompt) else 0
        out += [(sp[S.IM_START], frame, False), (f"{role}\n", frame, False)]
        parts = content.split(S.IMAGE_PLACEHOLDER) if (has_images and role == _USER) else [content]
        for j, part in enumerate(parts):
            if j:
                out += [(sp[S.VISION_START], 0, False), (sp[S.IMAGE_PAD], 0, False), (sp[S.VISION_END], 0, False)]
            if part:
                out.append((part, target, True))
        out += [(sp[S.IM_END], target, False), ("\n", frame, False)]
    return out


def encode_conversations(convs: list, n_images: list[int], tok, train_on_prompt: bool = False,
                         ) -> list[tuple[np.ndarray, np.ndarray] | TextSkip]:
    """Per sample: (ids int32[N], target uint8[N]) with one image_pad per image, or the TextSkip why not.

    All text segments of all samples are encoded in one batched call (deduplicated). Every
    piece (text segment or special id) becomes an index into one table of id arrays, so the
    per-sample work is numpy over those indices (lengths, leak check, target mask) plus
    one concatenate; the special-token leak check is one ``np.isin`` for the whole batch.
    """
    enc = _encoder(tok)
    results: list[Any] = [None] * len(convs)
    plans: dict[int, list] = {}
    table_index: dict[str | int, int] = {}  # text segment (str) or special id (int) -> table row
    for i, (conv, k) in enumerate(zip(convs, n_images)):
        try:
            pieces = _pieces(_turns(conv, int(k)), int(k) > 0, train_on_prompt, enc)
        except TextSkip as e:
            results[i] = e
            continue
        plans[i] = pieces
        for p, _, _ in pieces:
            table_index.setdefault(p, len(table_index))
    keys = list(table_index)
    texts = [p for p in keys if isinstance(p, str)]
    encoded = iter(enc.encode(texts) if texts else [])
    table = [next(encoded) if isinstance(p, str) else np.array([p], dtype=np.int32) for p in keys]
    table_len = np.fromiter((len(a) for a in table), dtype=np.int64, count=len(table))
    # a text segment that encodes to a special id (cannot happen with special matching off; a guard)
    flat = np.concatenate(table) if table else np.zeros(0, dtype=np.int32)
    hits = np.concatenate([[0], np.cumsum(np.isin(flat, enc.forbidden))])
    ends = np.cumsum(table_len)
    table_leaked = (hits[ends] - hits[ends - table_len]) > 0
    table_leaked[[j for j, p in enumerate(keys) if not isinstance(p, str)]] = False
    for i, pieces in plans.items():
        idx = np.fromiter((table_index[p] for p, _, _ in pieces), dtype=np.int64, count=len(pieces))
        leaked = table_leaked[idx]
        if leaked.any():
            p = keys[int(idx[np.argmax(leaked)])]
            results[i] = TextSkip(S.SKIP_TEXT_ENCODING, f"data text encodes to a special token: {p[:40]!r}")
            continue
        lengths = table_len[idx]
        targets = np.fromiter((t for _, t, _ in pieces), dtype=np.uint8, count=len(pieces))
        content = np.fromiter((c for _, _, c in pieces), dtype=bool, count=len(pieces))
        if not (lengths * targets * content).any():
            results[i] = TextSkip(S.SKIP_EMPTY_TEXT, "no answer tokens to train on")
            continue
        ids = np.concatenate([table[j] for j in idx]).astype(np.int32, copy=False)
        results[i] = (ids, np.repeat(targets, lengths))
    return results
