"""The template format: conversations through the checkpoint's own Jinja chat template.

The template renders OpenAI-style messages whose content is a list of ``{"type": "text" |
"image"}`` parts, with a sentinel in place of every text content; the render is split at
its added tokens (emitted as ids) and at the sentinels, and each stretch of plain text
between two added tokens (template text with the data spliced in) goes to the encoder,
which encodes it with special-token matching OFF -- exactly how the tokenizer would split
``tok(render)`` itself. Assistant turns are targets: each one's span runs from the end of
``render(messages[:i], add_generation_prompt=True)`` to the end of
``render(messages[:i+1])`` less trailing whitespace (answer + end-of-turn tokens); a token
is a target when it starts in a span. A template that writes an earlier turn otherwise once
the conversation goes on (Qwen3.5: the think block only after the last user turn) has that
turn found in the whole render instead (``_history_span``: its text and end-of-turn token);
the last turn must render incrementally. Where the checkpoint's processor writes a block of
text for each image the template writes (``TextConfig.image_block``, Gemma 3's blank lines and
begin / end tokens), every render has it in place before anything is split, so the ids are
the processor's. Where the template trims a role's text parts (Gemma 3's ``| trim``), the data
texts are trimmed the same way; where it trims a message's whole content (Qwen3.5's), only the
message's first part's left and last part's right (``template_trims``).

Renders depend only on a conversation's *shape* (roles, image/text parts; sentinels stand
for text), so the layout is cached per shape and the prefix renders per shape prefix (a
trie): Jinja runs for new shapes only, O(turns**2) for a long conversation whose prefixes
are new.

Imports conversations only (DataEncoder for type checkers); the encoder imports this
module, never the other way. Pure: jinja2 + numpy, no ray, no torch.
"""
from __future__ import annotations

import bisect
import itertools
import os
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from ray_mmbatch import schema as S
from ray_mmbatch.data.text.conversations import ASSISTANT, USER, TextSkip

if TYPE_CHECKING:
    from ray_mmbatch.data.text.encoder import DataEncoder

_SENTINEL = re.compile("\ue000(\\d+)\ue001")  # private-use code points: no template writes them
_MAX_SHAPES = 8192  # cached layouts per tokenizer
_MAX_PREFIX_CHARS = 8_000_000  # rendered prefixes kept per tokenizer (~16 MB)


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used safely (names the template problem)."""


def template_pieces(turns: list[tuple[str, str]], has_images: bool, train_on_prompt: bool, enc: DataEncoder):
    """Same contract as plain.plain_pieces; a text stretch's target is an int or (char ends, flags) when mixed."""
    shape, texts = _shape(turns, has_images)
    if enc.trims:  # the template trims these roles' texts: the data must give the ids it gives
        where = [(role, j == 0, j == len(sig) - 1) for role, sig in shape for j, p in enumerate(sig) if p == "t"]
        texts = [_trim(t, enc.trims.get(r), first, last) for t, (r, first, last) in zip(texts, where)]
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
        else:  # a span boundary inside: the tokens' own offsets decide (encoder.encode_conversations)
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
        if not (has_images and role == USER and S.IMAGE_PLACEHOLDER in content):
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


def render_messages(tok, messages: list, generation_prompt: bool, image_block: tuple[str, ...] = ()) -> str:
    """The chat template's render; with ``image_block`` (token, text) each ``token`` becomes ``text``."""
    out = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return out.replace(image_block[0], image_block[1]) if image_block else out


def template_trims(tok) -> dict[str, tuple[bool, bool, bool]]:
    """{role: (strips the left, strips the right, the message's whole content only)} for the roles whose text the
    template trims: each text part (Gemma 3's ``item['text'] | trim``), or the message's rendered content as a
    whole (Qwen3.5's ``render_content(...) | trim``: only its first part's left and last part's right).

    One render of a user and an assistant text surrounded by whitespace, one of two texts each; a template that
    cannot render it trims nothing (its own errors surface when conversations are laid out).
    """
    from jinja2 import TemplateError

    pad = " \n"
    messages = [{"role": role, "content": [{"type": "text", "text": f"{pad}\ue000{k}\ue001{pad}"}]}
                for k, role in enumerate((USER, ASSISTANT))]
    try:
        out = render_messages(tok, messages, False)
    except (TemplateError, ValueError, TypeError, KeyError, IndexError):
        return {}
    trims = {}
    for k, role in enumerate((USER, ASSISTANT)):
        core = f"\ue000{k}\ue001"
        if core not in out or f"{pad}{core}{pad}" in out:
            continue
        trims[role] = (f"{pad}{core}" not in out, f"{core}{pad}" not in out, False)
    two = [{"role": role, "content": [{"type": "text", "text": f"{pad}\ue000{k}a\ue001{pad}"},
                                      {"type": "text", "text": f"{pad}\ue000{k}b\ue001{pad}"}]}
           for k, role in enumerate((USER, ASSISTANT))]
    try:
        out = render_messages(tok, two, False)
    except (TemplateError, ValueError, TypeError, KeyError, IndexError):
        return trims
    for k, role in enumerate((USER, ASSISTANT)):
        if role in trims and f"\ue000{k}a\ue001{pad}{pad}\ue000{k}b\ue001" in out:
            trims[role] = (*trims[role][:2], True)
    return trims


def _trim(text: str, trim: tuple[bool, bool, bool] | None, first: bool = True, last: bool = True) -> str:
    """``text`` as the template trims it (template_trims); ``first`` / ``last``: it starts / ends its message."""
    if not trim:
        return text
    left, right, whole = trim
    left, right = left and (first or not whole), right and (last or not whole)
    return text.strip() if left and right else text.lstrip() if left else text.rstrip() if right else text


def _layout(enc: DataEncoder, shape: tuple):
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
        last = max((i for i, (role, _) in enumerate(shape) if role == ASSISTANT), default=-1)
        for i, (role, _) in enumerate(shape):
            if role != ASSISTANT:
                continue
            if i == 0:
                return TextSkip(S.SKIP_MALFORMED_RECORD,
                                "chat template: the conversation starts with an assistant turn")
            start, upto = nodes[i].render(enc, messages[:i], True), nodes[i + 1].render(enc, messages[:i + 1], False)
            if full.startswith(start) and full.startswith(upto) and len(start) <= len(upto):
                spans.append((len(start), max(len(upto.rstrip()), len(start))))
                continue
            span = None if i == last else _history_span(full, start, upto, messages[i])
            if span is None:
                raise ChatTemplateError(
                    "chat template is not incremental: the render of the first messages with add_generation_prompt "
                    f"is not a prefix of the whole conversation's render (assistant turn {i} of {_describe(shape)}); "
                    "the answer spans cannot be found (use text.chat_template=plain)")
            spans.append(span)
    except TemplateError as e:
        return TextSkip(S.SKIP_MALFORMED_RECORD, f"chat template: {e}")
    pieces = _SENTINEL.split(full)
    if "{'type': 'text', 'text': " in full:  # GLM-4.1V-9B-Thinking's {{ msg.content }} on system / assistant turns
        raise ChatTemplateError("chat template writes a message's content parts as Python text ([{'type': 'text', "
                                f"...}}]): it takes a string content only ({_describe(shape)}); use a checkpoint whose "
                                "template renders content parts, or text.chat_template=plain")
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


def _history_span(full: str, start: str, upto: str, message: dict) -> tuple[int, int] | None:
    """An earlier assistant turn's span in the whole render ``full``, for a template that writes a turn otherwise
    once the conversation goes on (Qwen3.5's: a think block only on the turns after the last user turn, so
    ``start`` / ``upto`` -- the render up to the turn with the generation prompt / through it -- are not prefixes
    of ``full``): from where ``start`` parts from ``full`` to the end of the turn's last text plus what the
    template closes the turn with (``upto`` after that text, less trailing whitespace: ``<|im_end|>``). None
    when ``full`` does not hold the turn so. The last assistant turn must be incremental (``_layout``): that is
    the render the model continues at inference."""
    texts = [c["text"] for c in message["content"] if c.get("type") == "text"]
    if not texts or texts[-1] not in upto or texts[0] not in full:
        return None
    begin = len(os.path.commonprefix([start, full]))
    first, end = full.index(texts[0]), full.index(texts[-1]) + len(texts[-1])
    close = upto[upto.rindex(texts[-1]) + len(texts[-1]):].rstrip()
    if begin > first or not full.startswith(close, end):
        return None
    return begin, end + len(close)


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


class Prefix:
    """A node of the trie of conversation-shape prefixes, holding that prefix's renders.

    Conversations that start alike share these, so a long conversation's O(turns**2)
    template work is paid once per new prefix, not once per conversation shape.
    """

    __slots__ = ("children", "renders")

    def __init__(self):
        self.children: dict[tuple, Prefix] = {}
        self.renders: dict[bool, str] = {}

    def render(self, enc: DataEncoder, messages: list, generation_prompt: bool) -> str:
        out = self.renders.get(generation_prompt)
        if out is None:
            out = render_messages(enc.tok, messages, generation_prompt, enc.image_block)
            self.renders[generation_prompt] = out
            enc.prefix_chars += len(out)
        return out


def _prefix_nodes(enc: DataEncoder, shape: tuple) -> list[Prefix]:
    """The trie nodes of shape[:0], shape[:1], ..., shape (it restarts when its renders grow too big)."""
    if enc.prefix_chars > _MAX_PREFIX_CHARS:
        enc.prefixes, enc.prefix_chars = Prefix(), 0
    nodes = [enc.prefixes]
    for step in shape:
        child = nodes[-1].children.get(step)
        if child is None:
            child = nodes[-1].children[step] = Prefix()
        nodes.append(child)
    return nodes


def _describe(shape: tuple) -> str:
    parts = {"i": "image", "t": "text"}
    return "messages " + ", ".join(f"{r}[{'+'.join(parts[p] for p in sig)}]" for r, sig in shape)


def added_token_pattern(tok):
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


def bos_ids(tok) -> list[int]:
    """The ids the tokenizer itself puts before a text (Llama's <s>), as ``tok(render)`` would."""
    plain = tok("a", add_special_tokens=False).input_ids
    full = tok("a", add_special_tokens=True).input_ids
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
    return [int(i) for i in full[:at]]
