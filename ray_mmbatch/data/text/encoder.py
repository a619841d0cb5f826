"""The encoder: conversations -> (ids, target mask) per sample, in either format.

``encode_conversations`` validates each conversation (conversations), lays it out as
pieces (plain or template, the format ``tok`` was loaded for) and encodes every text
stretch of the batch with the tokenizer's Rust core copied with special-token matching
OFF (``DataEncoder``): special tokens come only from the format, never from data --
``<|im_start|>`` or the image token written in the data stay plain bytes, and ids equal
the template's own tokenization for benign text. Every image has ONE image token
(materialize expands it to the image's token count).

With ``TextConfig.image_block`` (Gemma 3) the template's per-image token becomes the processor's text
block in every render before it is split (template.render_messages), so newlines around the
block merge with the template's as in the processor's ids.

Cost: ONE fast-tokenizer call (Rust, batched, deduplicated) over every text stretch of
every sample in the batch, then numpy per sample. Figures (plain vs template, cold vs
warm caches): benchmarks/RESULTS.md "Text encoding" (benchmarks/bench_text.py).

``tokenizer_for`` / ``image_token_id`` check a TextConfig against a tokenizer by building
its encoder (which checks a chat template once). The top of the text package: imports
tokenizer, conversations, plain and template; none of them imports this module. Pure:
tokenizers + numpy, no ray, no torch.
"""
from __future__ import annotations

import json
import warnings
import weakref
from typing import Any

import numpy as np

from ray_mmbatch import schema as S
from ray_mmbatch.data.text.conversations import TextSkip, conversation_turns
from ray_mmbatch.data.text.plain import plain_pieces
from ray_mmbatch.data.text.template import (
    ChatTemplateError,
    Prefix,
    added_token_pattern,
    bos_ids,
    render_messages,
    template_pieces,
    template_trims,
)
from ray_mmbatch.data.text.tokenizer import load_tokenizer, special_ids, token_id, uses_template


def tokenizer_for(text_cfg) -> Any:
    """load_tokenizer for a TextConfig, checked: its image_token is in the vocabulary."""
    tok = load_tokenizer(text_cfg.tokenizer, text_cfg.chat_template, getattr(text_cfg, "tokenizer_class", ""))
    image_token_id(tok, text_cfg)
    return tok


def image_token_id(tok, text_cfg) -> int:
    """The id of ``text_cfg.image_token`` (one per image in ``text_ids``; what measure and the models use).

    Raises ValueError when the vocabulary lacks it, or when ``tok`` was loaded for another
    chat_template setting than ``text_cfg``'s (load it with ``tokenizer_for(text_cfg)``).
    """
    chat_template = getattr(text_cfg, "chat_template", None)
    if chat_template is not None:
        want = chat_template == "auto" and bool(getattr(tok, "chat_template", None))
        if want != uses_template(tok):
            raise ValueError(f"tokenizer loaded for the {'template' if uses_template(tok) else 'plain'} format, "
                             f"text.chat_template={chat_template!r} asks for the other: use tokenizer_for(text)")
    return _encoder(tok, text_cfg.image_token, tuple(getattr(text_cfg, "image_block", ()))).image_id


def video_token_id(tok, text_cfg) -> int:
    """The id of ``text_cfg.video_token`` (one per video in ``text_ids``, data/measure.py); -1 when the
    family takes no video (video_token ''). ValueError when the vocabulary lacks it."""
    token = getattr(text_cfg, "video_token", "")
    if not token:
        return -1
    i = token_id(tok, token)
    if i is None:
        raise ValueError(f"video token {token!r} is not in the tokenizer's vocabulary: set text.video_token to the "
                         f"token its chat template writes for a video (Qwen-VL <|video_pad|>)")
    return int(i)


def _image_id(tok, token: str) -> int:
    i = token_id(tok, token)
    if i is None:
        raise ValueError(f"image token {token!r} is not in the tokenizer's vocabulary: set text.image_token to "
                         f"the token its chat template writes for an image (Qwen-VL {S.IMAGE_PAD}, LLaVA <image>)")
    return i


class DataEncoder:
    """The tokenizer's Rust core, copied, with special-token matching OFF for data text.

    Every special added token, schema.SPECIAL_TOKENS and the image token are plain bytes
    in data; non-special added tokens (e.g. Qwen's ``<think>``) match as the tokenizer does.
    """

    def __init__(self, tok, image_token: str, image_block: tuple[str, ...] = ()):
        from tokenizers import Tokenizer

        self.image_token, self.image_id = image_token, _image_id(tok, image_token)
        if image_block and (len(image_block) != 2 or image_block[1].count(image_token) != 1):
            raise ValueError(f"text.image_block must be (token, text) with text.image_token {image_token!r} once "
                             f"in the text, got {image_block!r}")
        self.image_block = tuple(image_block)
        spec = json.loads(tok.backend_tokenizer.to_str())
        for t in spec.get("added_tokens") or []:
            if t["content"] in (image_token, *self.image_block[:1]) or t["content"] in S.SPECIAL_TOKENS:
                t["special"] = True
        spec["post_processor"] = None  # no BOS/EOS per piece, offsets untrimmed
        self.core = Tokenizer.from_str(json.dumps(spec))
        self.core.encode_special_tokens = True  # "<|im_start|>" in data -> plain bytes
        self.core.no_truncation()
        self.core.no_padding()
        self.special = special_ids(tok)
        special_added = {i for i, t in tok.added_tokens_decoder.items() if t.special}
        # unk is what plain text with an unknown character gives (the template's own encoding gives it too)
        self.forbidden = np.array(sorted((set(self.special.values()) | set(tok.all_special_ids) | special_added
                                          | {self.image_id}) - {tok.unk_token_id}), dtype=np.int64)
        self.template = uses_template(tok)
        if self.template:
            self.tok = weakref.proxy(tok)
            self.added = added_token_pattern(tok)
            self.bos = bos_ids(tok)
            self.trims = template_trims(tok)
            self.newline = [int(i) for i in self.core.encode("\n", add_special_tokens=False).ids]
            self.after_newline = self._text_after_added_token_needs_newline(tok)
            self.shapes: dict[tuple, Any] = {}
            self.prefixes, self.prefix_chars = Prefix(), 0

    def encode(self, texts: list[str]):
        return self.core.encode_batch(texts, add_special_tokens=False)

    def _text_after_added_token_needs_newline(self, tok) -> bool:
        """Whether text after an added token must be encoded behind a newline (then dropped) to match ``tok``.

        SentencePiece-style tokenizers (Metaspace, prepend_scheme "first": Llama-2 / LLaVA-1.5
        non-legacy) prefix "▁" to a string's start but not to text after an added token; the
        newline trick (as transformers' own sanitized encoding does) encodes it without that prefix.
        """
        added_vocab = tok.get_added_vocab()
        added = self.image_token if self.image_token in added_vocab else next(iter(added_vocab), None)
        if added is None:
            return False
        probe = "\nWhat is it? ASSISTANT: A red circle."
        want = tok(added + probe, add_special_tokens=False).input_ids[1:]
        if self.core.encode(probe, add_special_tokens=False).ids == want:
            return False
        behind = self.core.encode("\n" + probe, add_special_tokens=False).ids
        return behind[:len(self.newline)] == self.newline and behind[len(self.newline):] == want


_ENCODERS: weakref.WeakKeyDictionary[Any, dict[str, DataEncoder]] = weakref.WeakKeyDictionary()


def _encoder(tok, image_token: str, image_block: tuple[str, ...] = ()) -> DataEncoder:
    per_tok = _ENCODERS.setdefault(tok, {})
    key = (image_token, *image_block)
    enc = per_tok.get(key)
    if enc is None:
        enc = per_tok[key] = DataEncoder(tok, image_token, image_block)
        if enc.template:
            try:
                _check_template(tok, image_token, image_block)
            except Exception:
                del per_tok[key]
                raise
    return enc


def encode_conversations(convs: list, n_images: list[int], tok, train_on_prompt: bool = False,
                         image_token: str = S.IMAGE_PAD,
                         image_block: tuple[str, ...] = (),
                         family: str = "") -> list[tuple[np.ndarray, np.ndarray] | TextSkip]:
    """Per sample: (ids int32[N], target uint8[N]) with ONE image_token per image, or the TextSkip why not.

    The format (template or plain) is the one ``tok`` was loaded for (load_tokenizer).
    All text of all samples is encoded in one batched call (deduplicated). Every piece
    (text stretch or token id) becomes an index into one table of id arrays, so the
    per-sample work is numpy over those indices (lengths, leak check, target mask) plus
    one concatenate; the special-token leak check is one ``np.isin`` for the whole batch. ``family``: the
    checkpoint family a refused modality's skip names (TextConfig.family).
    """
    enc = _encoder(tok, image_token, tuple(image_block))
    results: list[Any] = [None] * len(convs)
    plans: dict[int, list] = {}
    table_index: dict[str | int, int] = {}  # text stretch (str) or token id (int) -> table row
    for i, (conv, k) in enumerate(zip(convs, n_images)):
        try:
            turns = conversation_turns(conv, int(k), family)
            pieces = (template_pieces if enc.template else plain_pieces)(turns, int(k) > 0, train_on_prompt, enc)
        except TextSkip as e:
            results[i] = e
            continue
        plans[i] = pieces
        for p, _, _ in pieces:
            table_index.setdefault(p, len(table_index))
    keys = list(table_index)
    table, starts = _encode_table(keys, enc)
    table_len = np.fromiter((len(a) for a in table), dtype=np.int64, count=len(table))
    # a text piece that encodes to a special id (cannot happen with special matching off; a guard)
    flat = np.concatenate(table) if table else np.zeros(0, dtype=np.int32)
    hits = np.concatenate([[0], np.cumsum(np.isin(flat, enc.forbidden))])
    ends = np.cumsum(table_len)
    table_leaked = (hits[ends] - hits[ends - table_len]) > 0
    table_leaked[[j for j, p in enumerate(keys) if isinstance(p, int)]] = False
    for i, pieces in plans.items():
        idx = np.fromiter((table_index[p] for p, _, _ in pieces), dtype=np.int64, count=len(pieces))
        leaked = table_leaked[idx]
        if leaked.any():
            p = keys[int(idx[np.argmax(leaked)])]
            p = p if isinstance(p, str) else p[1]
            results[i] = TextSkip(S.SKIP_TEXT_ENCODING, f"data text encodes to a special token: {p[:40]!r}")
            continue
        lengths = table_len[idx]
        if not any(c for _, _, c in pieces):
            results[i] = TextSkip(S.SKIP_EMPTY_TEXT, "no answer tokens to train on")
            continue
        ids = np.concatenate([table[j] for j in idx]).astype(np.int32, copy=False)
        flags = [t for _, t, _ in pieces]
        mixed = [m for m, t in enumerate(flags) if t.__class__ is not int]
        target = np.repeat(np.array([t if t.__class__ is int else 0 for t in flags] if mixed else flags,
                                    dtype=np.uint8), lengths)
        if mixed:  # text stretches with a span boundary inside: each token's target is where it starts
            at = np.cumsum(lengths) - lengths
            for m in mixed:
                ends, seg_flags = flags[m]
                cut = np.searchsorted(ends, starts(int(idx[m])), side="right")
                target[at[m]:at[m] + lengths[m]] = seg_flags[np.minimum(cut, len(seg_flags) - 1)]
        results[i] = (ids, target)
    return results


def _encode_table(keys: list, enc: DataEncoder):
    """Table keys -> (id array per key, starts(j): character start of each token of text key j).

    A key is a token id (int), a text (str), or ("\n", text): text after an added token that
    is encoded behind a newline, the newline's ids dropped (DataEncoder.after_newline).
    """
    texts = [p if isinstance(p, str) else "\n" + p[1] for p in keys if not isinstance(p, int)]
    encoded = iter(enc.encode(texts) if texts else [])
    table, encodings, drops = [], [], []
    for p in keys:
        e, drop = (None, 0) if isinstance(p, int) else (next(encoded), 0 if isinstance(p, str) else len(enc.newline))
        if drop and e.ids[:drop] != enc.newline:  # the newline merged with the text: encode it as it is
            e, drop = enc.encode([p[1]])[0], 0
        table.append(np.array([p], dtype=np.int32) if e is None else np.asarray(e.ids[drop:], dtype=np.int32))
        encodings.append(e)
        drops.append(drop)

    def starts(j: int) -> np.ndarray:
        e, drop = encodings[j], drops[j]
        return np.fromiter((s for s, _ in e.offsets[drop:]), dtype=np.int64, count=len(e.ids) - drop) - (drop > 0)

    return table, starts


def _check_template(tok, image_token: str, image_block: tuple[str, ...] = ()) -> None:
    """Once per (tokenizer, image token): one image gives one image token, and ids match ``tok(render)``."""
    conv = [{"role": "user", "content": "<image>\nWhat is in the picture?"},
            {"role": "assistant", "content": "A red circle."}]
    (result,) = encode_conversations([conv], [1], tok, image_token=image_token, image_block=image_block)
    if isinstance(result, TextSkip):
        raise ChatTemplateError(f"chat template cannot render a one-image question and answer: {result.detail}")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "A red circle."}]}]
    own = tok(render_messages(tok, messages, False, image_block), add_special_tokens=False).input_ids
    enc = _encoder(tok, image_token, image_block)
    if enc.bos and own[:len(enc.bos)] != enc.bos:
        own = enc.bos + own
    if list(result[0]) != list(own):
        warnings.warn(f"encoding a conversation piecewise gives {len(result[0])} ids where the tokenizer gives "
                      f"{len(own)} for the template's render: the training text differs from the template's",
                      stacklevel=3)
