"""Text: the tokenizer, the two conversation formats, image slots and the target mask.

Two formats (``TextConfig.chat_template``):

* **template** (``auto`` and the tokenizer has a chat template: a user's checkpoint):
  the checkpoint's own Jinja template renders OpenAI-style messages whose content is a
  list of ``{"type": "text" | "image"}`` parts; the tokenizer's vocabulary is untouched.
* **plain** (``plain``, or no chat template: the shipped tokenizer)::

    <|im_start|>{role}\\n{content}<|im_end|>\\n          role: system | user | assistant
    target mask:  0 ....... 0  1 ... 1   1      0     (assistant turns; all 0 for system/user)

  an image slot is ``<|vision_start|>{image_token}<|vision_end|>``.

Either way every image has ONE image token (materialize expands it to the image's token
count), and ``<image>`` is an image slot only in user turns of samples that have images.

Special tokens come only from the template, never from data. The template renders the
messages with a sentinel in place of every text content; the render is split at its
added tokens (emitted as ids) and at the sentinels, and each stretch of plain text
between two added tokens (template text with the data spliced in) is encoded with
special-token matching OFF -- exactly how the tokenizer would split ``tok(render)``
itself, so ids equal the template's own tokenization for benign text, while
``<|im_start|>`` or the image token written in the data stay plain bytes. Assistant
turns are targets: each one's span runs from the end of ``render(messages[:i],
add_generation_prompt=True)`` to the end of ``render(messages[:i+1])`` less trailing
whitespace (answer + end-of-turn tokens); a token is a target when it starts in a span.

Cost: ONE fast-tokenizer call (Rust, batched, deduplicated) over every text stretch of
every sample in the batch, then numpy per sample. Renders depend only on a conversation's
*shape* (roles, image/text parts; sentinels stand for text), so the layout is cached per
shape and the prefix renders per shape prefix (a trie): Jinja runs for new shapes only,
O(turns**2) for a long conversation whose prefixes are new. Figures (plain vs template,
cold vs warm caches): benchmarks/RESULTS.md "Text encoding" (benchmarks/bench_text.py).
Pure module: transformers/tokenizers + numpy, no ray, no torch.
"""
from __future__ import annotations

import bisect
import functools
import itertools
import json
import os
import re
import warnings
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from ray_mmbatch import schema as S
from ray_mmbatch.data.errors import SampleSkip

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[2] / "assets" / "tokenizer"
# the one place roles are matched (case-insensitively): LLaVA human/gpt, OpenAI user/assistant
_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}  # of schema.canonical_role's names
_USER, _ASSISTANT = "user", "assistant"
_SENTINEL = re.compile("\ue000(\\d+)\ue001")  # private-use code points: no template writes them
_MAX_SHAPES = 8192  # cached layouts per tokenizer
_MAX_PREFIX_CHARS = 8_000_000  # rendered prefixes kept per tokenizer (~16 MB)


class TextSkip(SampleSkip):
    """A conversation that cannot be used; ``reason`` is a schema.SKIP_* constant."""


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used safely (names the template problem)."""


# ------------------------------------------------------------------ tokenizer
def load_tokenizer(path: str = "", chat_template: str = "auto"):
    """A fast HF tokenizer (cached per process, path and chat_template).

    Empty path = the byte-level BPE shipped in ray_mmbatch/assets/tokenizer. Template
    mode (``auto`` and the tokenizer has a chat template) adds NOTHING to the vocabulary
    (the checkpoint's embeddings fit it); a missing pad token becomes eos (else unk).
    Plain mode adds the missing schema.SPECIAL_TOKENS (the vocabulary may grow; the
    model reads ``len(tok)``) and a pad token when there is none.
    """
    if chat_template not in ("auto", "plain"):
        raise ValueError(f"chat_template must be 'auto' or 'plain', got {chat_template!r}")
    return _load_tokenizer(str(path or SHIPPED_TOKENIZER), chat_template)


def tokenizer_for(text_cfg) -> Any:
    """load_tokenizer for a TextConfig, checked: its image_token is in the vocabulary."""
    tok = load_tokenizer(text_cfg.tokenizer, text_cfg.chat_template)
    image_token_id(tok, text_cfg)
    return tok


_TEMPLATE_MODE: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str, chat_template: str):
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
    if chat_template == "auto" and not getattr(tok, "chat_template", None):
        tok.chat_template = _processor_chat_template(path)
    template = chat_template == "auto" and bool(tok.chat_template)
    if template:
        if tok.pad_token is None:
            if tok.eos_token is None and tok.unk_token is None:
                raise ValueError(f"{path}: no pad, eos or unk token to pad with (template mode adds no tokens)")
            tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    else:
        vocab = tok.get_vocab()
        missing = [t for t in S.SPECIAL_TOKENS if t not in vocab]
        if missing:
            tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing], special_tokens=True)
        if tok.pad_token is None:
            tok.add_special_tokens({"pad_token": S.PAD_TOKEN})
    _TEMPLATE_MODE[tok] = template
    return tok


def _processor_chat_template(path: str) -> str | None:
    """A checkpoint whose template sits with its processor (llava-hf: chat_template.json), not its tokenizer."""
    for name in ("chat_template.json", "processor_config.json"):
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                template = json.load(f).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(template, str) and template:
            return template
    return None


def uses_template(tok) -> bool:
    """Whether conversations go through the tokenizer's own chat template (see load_tokenizer)."""
    mode = _TEMPLATE_MODE.get(tok)
    return bool(getattr(tok, "chat_template", None)) if mode is None else mode


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
    return _encoder(tok, text_cfg.image_token).image_id


def _token_id(tok, token: str) -> int | None:
    i = tok.convert_tokens_to_ids(token)
    return None if i is None or tok.convert_ids_to_tokens(int(i)) != token else int(i)


def _image_id(tok, token: str) -> int:
    i = _token_id(tok, token)
    if i is None:
        raise ValueError(f"image token {token!r} is not in the tokenizer's vocabulary: set text.image_token to "
                         f"the token its chat template writes for an image (Qwen-VL {S.IMAGE_PAD}, LLaVA <image>)")
    return i


def special_ids(tok) -> dict[str, int]:
    """Token id of every schema.SPECIAL_TOKENS entry this tokenizer has (all of them in plain mode)."""
    ids = {t: _token_id(tok, t) for t in S.SPECIAL_TOKENS}
    return {t: i for t, i in ids.items() if i is not None}


class _DataEncoder:
    """The tokenizer's Rust core, copied, with special-token matching OFF for data text.

    Every special added token, schema.SPECIAL_TOKENS and the image token are plain bytes
    in data; non-special added tokens (e.g. Qwen's ``<think>``) match as the tokenizer does.
    """

    def __init__(self, tok, image_token: str):
        from tokenizers import Tokenizer

        self.image_token, self.image_id = image_token, _image_id(tok, image_token)
        spec = json.loads(tok.backend_tokenizer.to_str())
        for t in spec.get("added_tokens") or []:
            if t["content"] == image_token or t["content"] in S.SPECIAL_TOKENS:
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
            self.added = _added_token_pattern(tok)
            self.bos = _bos_ids(tok)
            self.newline = [int(i) for i in self.core.encode("\n", add_special_tokens=False).ids]
            self.after_newline = self._text_after_added_token_needs_newline(tok)
            self.shapes: dict[tuple, Any] = {}
            self.prefixes, self.prefix_chars = _Prefix(), 0

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


_ENCODERS: weakref.WeakKeyDictionary[Any, dict[str, _DataEncoder]] = weakref.WeakKeyDictionary()


def _encoder(tok, image_token: str) -> _DataEncoder:
    per_tok = _ENCODERS.setdefault(tok, {})
    enc = per_tok.get(image_token)
    if enc is None:
        enc = per_tok[image_token] = _DataEncoder(tok, image_token)
        if enc.template:
            try:
                _check_template(tok, image_token)
            except Exception:
                del per_tok[image_token]
                raise
    return enc


# ------------------------------------------------------------------ conversations
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
        role = _ROLES.get(S.canonical_role(t[role_key]))
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
    # The placeholder rule (one place): user turns hold exactly one <image> per image, or none (then
    # the images go first in the first user turn). More placeholders than images - a sample that lost
    # its image on the way (null column, missing member or field) - is skipped, never trained as text.
    found = sum(c.count(S.IMAGE_PLACEHOLDER) for r, c in turns if r == _USER)
    if n_images <= 0 and not found:
        return turns
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


def encode_conversations(convs: list, n_images: list[int], tok, train_on_prompt: bool = False,
                         image_token: str = S.IMAGE_PAD) -> list[tuple[np.ndarray, np.ndarray] | TextSkip]:
    """Per sample: (ids int32[N], target uint8[N]) with ONE image_token per image, or the TextSkip why not.

    The format (template or plain) is the one ``tok`` was loaded for (load_tokenizer).
    All text of all samples is encoded in one batched call (deduplicated). Every piece
    (text stretch or token id) becomes an index into one table of id arrays, so the
    per-sample work is numpy over those indices (lengths, leak check, target mask) plus
    one concatenate; the special-token leak check is one ``np.isin`` for the whole batch.
    """
    enc = _encoder(tok, image_token)
    results: list[Any] = [None] * len(convs)
    plans: dict[int, list] = {}
    table_index: dict[str | int, int] = {}  # text stretch (str) or token id (int) -> table row
    for i, (conv, k) in enumerate(zip(convs, n_images)):
        try:
            turns = _turns(conv, int(k))
            pieces = (_template_pieces if enc.template else _plain_pieces)(turns, int(k) > 0, train_on_prompt, enc)
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


def _encode_table(keys: list, enc: _DataEncoder):
    """Table keys -> (id array per key, starts(j): character start of each token of text key j).

    A key is a token id (int), a text (str), or ("\n", text): text after an added token that
    is encoded behind a newline, the newline's ids dropped (_DataEncoder.after_newline).
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


# ------------------------------------------------------------------ plain format
def _plain_pieces(turns: list[tuple[str, str]], has_images: bool, train_on_prompt: bool, enc: _DataEncoder):
    """[(token id | text str, target, has trainable content)] in sequence order."""
    sp = enc.special
    frame = int(train_on_prompt)
    out: list[tuple[int | str, int, bool]] = []
    for role, content in turns:
        target = 1 if (role == _ASSISTANT or train_on_prompt) else 0
        out += [(sp[S.IM_START], frame, False), (f"{role}\n", frame, False)]
        parts = content.split(S.IMAGE_PLACEHOLDER) if (has_images and role == _USER) else [content]
        for j, part in enumerate(parts):
            if j:
                out += [(sp[S.VISION_START], 0, False), (enc.image_id, 0, False), (sp[S.VISION_END], 0, False)]
            if part:
                out.append((part, target, bool(target)))
        out += [(sp[S.IM_END], target, False), ("\n", frame, False)]
    return out


# ------------------------------------------------------------------ template format
def _template_pieces(turns: list[tuple[str, str]], has_images: bool, train_on_prompt: bool, enc: _DataEncoder):
    """Same contract as _plain_pieces; a text stretch's target is an int or (char ends, flags) when mixed."""
    shape, texts = _shape(turns, has_images)
    layout = enc.shapes.get(shape)
    if layout is None:
        if len(enc.shapes) >= _MAX_SHAPES:
            enc.shapes.clear()
        layout = enc.shapes[shape] = _layout(enc, shape)
    if isinstance(layout, TextSkip):  # a fresh one: re-raising the cached instance would grow its traceback
        raise TextSkip(layout.reason, layout.detail)
    out: list[tuple[Any, Any, bool]] = []
    for item in layout:
        if item.__class__ is tuple:  # (token id, target)
            out.append((item[0], 1 if train_on_prompt else item[1], False))
            continue
        strings = [p if p.__class__ is str else texts[p] for p in item.parts]
        text = "".join(strings)
        key = ("\n", text) if enc.after_newline and not item.first else text
        content = any(texts[d] for d in (item.data if train_on_prompt else item.target_data))
        if train_on_prompt or item.uniform is not None:
            out.append((key, 1 if train_on_prompt else item.uniform, content))
        else:  # a span boundary inside: the tokens' own offsets decide (encode_conversations)
            out.append((key, (list(itertools.accumulate(map(len, strings))), item.flags), content))
    if enc.bos and not (out and out[0][0] == enc.bos[0]):
        out[:0] = [(b, int(train_on_prompt), False) for b in enc.bos]
    return out


def _shape(turns: list[tuple[str, str]], has_images: bool) -> tuple[tuple, list[str]]:
    """-> ((role, "t"/"i" per content part), ...), the data texts in order.

    ``<image>`` in a user turn of a sample with images becomes an image part; the line
    breaks right next to it go (LLaVA's ``<image>\\n`` convention: the template writes its own).
    """
    shape, texts = [], []
    for role, content in turns:
        if not (has_images and role == _USER and S.IMAGE_PLACEHOLDER in content):
            shape.append((role, "t"))
            texts.append(content)
            continue
        parts, sig = content.split(S.IMAGE_PLACEHOLDER), []
        for j, p in enumerate(parts):
            if j:
                sig.append("i")
                p = p.lstrip("\r\n")
            if j < len(parts) - 1:
                p = p.rstrip("\r\n")
            if p:
                sig.append("t")
                texts.append(p)
        shape.append((role, "".join(sig)))
    return tuple(shape), texts


def _render(tok, messages: list, generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _layout(enc: _DataEncoder, shape: tuple):
    """One conversation shape -> items, or the TextSkip for every conversation of that shape.

    An item is (token id, target) or a text stretch [(template str | data index k, target)].
    """
    from jinja2 import TemplateError

    messages, k = [], 0
    for role, sig in shape:
        content = []
        for p in sig:
            if p == "i":
                content.append({"type": "image"})
            else:
                content.append({"type": "text", "text": f"\ue000{k}\ue001"})
                k += 1
        messages.append({"role": role, "content": content})
    try:
        nodes = _prefix_nodes(enc, shape)
        full, spans = nodes[-1].render(enc, messages, False), []
        for i, (role, _) in enumerate(shape):
            if role != _ASSISTANT:
                continue
            if i == 0:
                return TextSkip(S.SKIP_MALFORMED_RECORD,
                                "chat template: the conversation starts with an assistant turn")
            start, upto = nodes[i].render(enc, messages[:i], True), nodes[i + 1].render(enc, messages[:i + 1], False)
            if not (full.startswith(start) and full.startswith(upto) and len(start) <= len(upto)):
                raise ChatTemplateError(
                    "chat template is not incremental: the render of the first messages with add_generation_prompt "
                    f"is not a prefix of the whole conversation's render (assistant turn {i} of {_describe(shape)}); "
                    "the answer spans cannot be found (use text.chat_template=plain)")
            spans.append((len(start), max(len(upto.rstrip()), len(start))))
    except TemplateError as e:
        return TextSkip(S.SKIP_MALFORMED_RECORD, f"chat template: {e}")
    pieces = _SENTINEL.split(full)
    if [int(x) for x in pieces[1::2]] != list(range(k)):
        raise ChatTemplateError("chat template does not write each message text once, verbatim and in order "
                                f"({_describe(shape)}); it cannot be used safely (use text.chat_template=plain)")
    cuts = sorted({c for span in spans for c in span})
    span_starts = [a for a, _ in spans]

    def target(pos: int) -> int:
        j = bisect.bisect_right(span_starts, pos) - 1
        return int(j >= 0 and pos < spans[j][1])

    items, run, pos, n_images = [], [], 0, 0
    for j, piece in enumerate(pieces):
        if j % 2:  # data text k
            run.append((int(piece), target(pos)))
            pos += len(f"\ue000{piece}\ue001")
            continue
        for kind, value, a, b in _split_added(piece, enc.added, pos):
            if kind == "id":
                if run:
                    items.append(_Stretch(run, not items))
                    run = []
                items.append((value, target(a)))
                n_images += value == enc.image_id
            else:  # template text, cut at span boundaries (the mask only; tokenized as one stretch)
                edges = [a] + cuts[bisect.bisect_right(cuts, a):bisect.bisect_left(cuts, b)] + [b]
                run += [(value[x - a:y - a], target(x)) for x, y in zip(edges, edges[1:])]
        pos += len(piece)
    if run:
        items.append(_Stretch(run, not items))
    want = sum(sig.count("i") for _, sig in shape)
    if n_images != want:
        raise ChatTemplateError(f"chat template writes {n_images} {enc.image_token!r} tokens for {want} images "
                                f"({_describe(shape)}): set text.image_token to the token it writes per image")
    return items


class _Stretch:
    """Text between two added tokens of a render: template strings and data texts (by index)."""

    __slots__ = ("parts", "flags", "uniform", "data", "target_data", "first")

    def __init__(self, segments: list[tuple[str | int, int]], first: bool):
        self.parts = [p for p, _ in segments]
        self.flags = np.array([t for _, t in segments], dtype=np.uint8)
        self.uniform = int(self.flags[0]) if (self.flags == self.flags[0]).all() else None
        self.data = [p for p in self.parts if isinstance(p, int)]
        self.target_data = [p for p, t in segments if isinstance(p, int) and t]
        self.first = first  # starts the render (no added token before it)


class _Prefix:
    """A node of the trie of conversation-shape prefixes, holding that prefix's renders.

    Conversations that start alike share these, so a long conversation's O(turns**2)
    template work is paid once per new prefix, not once per conversation shape.
    """

    __slots__ = ("children", "renders")

    def __init__(self):
        self.children: dict[tuple, _Prefix] = {}
        self.renders: dict[bool, str] = {}

    def render(self, enc: _DataEncoder, messages: list, generation_prompt: bool) -> str:
        out = self.renders.get(generation_prompt)
        if out is None:
            out = self.renders[generation_prompt] = _render(enc.tok, messages, generation_prompt)
            enc.prefix_chars += len(out)
        return out


def _prefix_nodes(enc: _DataEncoder, shape: tuple) -> list[_Prefix]:
    """The trie nodes of shape[:0], shape[:1], ..., shape (it restarts when its renders grow too big)."""
    if enc.prefix_chars > _MAX_PREFIX_CHARS:
        enc.prefixes, enc.prefix_chars = _Prefix(), 0
    nodes = [enc.prefixes]
    for step in shape:
        child = nodes[-1].children.get(step)
        if child is None:
            child = nodes[-1].children[step] = _Prefix()
        nodes.append(child)
    return nodes


def _describe(shape: tuple) -> str:
    parts = {"i": "image", "t": "text"}
    return "messages " + ", ".join(f"{r}[{'+'.join(parts[p] for p in sig)}]" for r, sig in shape)


def _added_token_pattern(tok):
    """(regex matching any added token as the tokenizer splits them, [id per alternative])."""
    alts, ids = [], []
    for i, t in sorted(tok.added_tokens_decoder.items(), key=lambda kv: -len(kv[1].content)):
        pat = re.escape(t.content)
        if t.single_word:
            pat = rf"(?<!\w){pat}(?!\w)"
        ws = r"\s*"
        alts.append(f"({ws if t.lstrip else ''}{pat}{ws if t.rstrip else ''})")
        ids.append(int(i))
    return (re.compile("|".join(alts)) if alts else None), ids


def _split_added(text: str, added, offset: int):
    """Template text -> [("id", token id, start, end) | ("text", str, start, end)], positions in the render."""
    pattern, ids = added
    out, at = [], 0
    for m in (pattern.finditer(text) if pattern is not None and text else ()):
        if m.start() > at:
            out.append(("text", text[at:m.start()], offset + at, offset + m.start()))
        out.append(("id", ids[m.lastindex - 1], offset + m.start(), offset + m.end()))
        at = m.end()
    if at < len(text):
        out.append(("text", text[at:], offset + at, offset + len(text)))
    return out


def _bos_ids(tok) -> list[int]:
    """The ids the tokenizer itself puts before a text (Llama's <s>), as ``tok(render)`` would."""
    plain = tok("a", add_special_tokens=False).input_ids
    full = tok("a", add_special_tokens=True).input_ids
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
    return [int(i) for i in full[:at]]


def _check_template(tok, image_token: str) -> None:
    """Once per (tokenizer, image token): one image gives one image token, and ids match ``tok(render)``."""
    conv = [{"role": "user", "content": "<image>\nWhat is in the picture?"},
            {"role": "assistant", "content": "A red circle."}]
    (result,) = encode_conversations([conv], [1], tok, image_token=image_token)
    if isinstance(result, TextSkip):
        raise ChatTemplateError(f"chat template cannot render a one-image question and answer: {result.detail}")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "A red circle."}]}]
    own = tok(_render(tok, messages, False), add_special_tokens=False).input_ids
    enc = _encoder(tok, image_token)
    if enc.bos and own[:len(enc.bos)] != enc.bos:
        own = enc.bos + own
    if list(result[0]) != list(own):
        warnings.warn(f"encoding a conversation piecewise gives {len(result[0])} ids where the tokenizer gives "
                      f"{len(own)} for the template's render: the training text differs from the template's",
                      stacklevel=3)
