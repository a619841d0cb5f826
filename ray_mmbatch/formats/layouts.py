"""Dataset layouts: how a table's schema holds the dialogue and the images, apart from its file format.

A file format (Parquet, Arrow, JSON, tar) says how rows are stored; a *layout* says which columns
hold the dialogue and the images, and in what shape. Readers yield rows; ``choose`` picks the
layout from a table's schema (no flags needed where the schema says which it is) and the layout
turns each row into canonical turns ``[{"from": human|gpt|system, "value": str}]`` with one
``<image>`` per image where the image goes:

    layout          dialogue column (shape)                         published by
    conversations   list<{from, value}> / JSON string of one        LLaVA, ShareGPT, LLaVA-OneVision
    messages        list<{role, content: str | [{type, text,         HF / TRL (llava-instruct-mix-vsft)
                    index?}]}>; an image part's index points
                    into the images
    texts           list<{user, assistant, source?}>; no            The Cauldron, FineVision, Docmatix
                    <image> in the text: the row's images go
                    before the first user text
    questions       struct<question: list<str>, answer: list<str>>  PixMo-Docs (a Sequence of dicts
                    one user / assistant pair per entry              is stored as a struct of lists)
    caption         a string (``caption``, ``txt``, or any string       PixMo-Cap, CC3M, img2dataset .txt
                    column named): the image (+ --caption-prompt)
                    in the user turn, the caption as the answer

Image columns: ``data.image_column`` (default ``images``; ``image`` is taken when ``images`` is
absent), a list of HF ``Image`` structs {bytes, path} or ONE nullable struct, binary or a list of
binary. A schema whose only image-like column holds URLs (``image_url``, ``url``...) is refused:
this project reads images, it does not download them.

Video columns: ``data.video_column`` when the config has one (default ``videos``, then ``video``): HF
``Video`` structs {bytes, path} (or a list of them), binary, or paths (a string or a list of strings, read
under ``--image-root`` like an Image struct's path). A default-named column of another type is not a
video column (it is left alone); an explicitly named one that does not fit is an error. A row's media
are its images then its videos, put in the order of the ``<image>`` / ``<video>`` placeholders of its
dialogue (records.place_media); a layout that writes the placeholders itself (texts, questions,
caption) writes ``<video>`` for each video.

The explicit flags (``--text-column``, ``--image-column``) still win; the layout of an explicit
text column is told from its type. ``Columns.describe`` is the one line ``inspect`` and the run's
start-up print ("read as: texts [{user, assistant}] + images list<Image>").
Adding a layout is one class with ``detect`` / ``turns`` and one line in LAYOUTS.
Pure module: pyarrow, no ray.
"""
from __future__ import annotations

import dataclasses
import json

import pyarrow as pa

from ray_mmbatch import schema

IMAGE = schema.IMAGE_PLACEHOLDER
DEFAULT_TEXT, DEFAULT_IMAGES, DEFAULT_VIDEOS = "conversations", "images", "videos"
SINGLE_IMAGE, SINGLE_VIDEO = "image", "video"
IMAGE_PARTS, VIDEO_PARTS = ("image", "image_url"), ("video", "video_url")
URL_COLUMNS = ("image_url", "image_urls", "url", "urls", "URL", "img_url")
CAPTION_COLUMNS = ("caption", "txt")  # "text" is taken only when named (--text-column text)


class LayoutError(ValueError):
    """A row that does not fit its layout; str() is the detail of a malformed_record skip."""


def _slots(n_images) -> str:
    """The placeholders a layout writes for a row's media: ``n_images`` <image>, or (a str) the row's own
    placeholders in order (records.media_slots: ``<image><video>``)."""
    return n_images if isinstance(n_images, str) else IMAGE * n_images


def _struct_names(t: pa.DataType) -> set[str]:
    return {t.field(i).name for i in range(t.num_fields)} if pa.types.is_struct(t) else set()


def _list_value(t: pa.DataType) -> pa.DataType | None:
    return t.value_type if pa.types.is_list(t) or pa.types.is_large_list(t) else None


def _is_string(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):  # pyarrow / pandas write categorical text as dictionary<string>
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


class _ListOfStructs:
    """A layout told by its type: a list of structs holding ``fields``."""
    fields: frozenset = frozenset()

    @classmethod
    def detect(cls, t: pa.DataType) -> bool:
        v = _list_value(t)
        return v is not None and cls.fields <= _struct_names(v)


class Conversations(_ListOfStructs):
    name, shape, fields = "conversations", "[{from, value}]", frozenset({"from", "value"})

    @staticmethod
    def turns(value, caption_prompt: str = "") -> list:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise LayoutError("conversations is str, not a list (nor JSON of one)") from None
        return value  # records.conversations_to_json checks the turns


class Messages(Conversations):
    """HF messages; an image part with an ``index`` names its image (``image_order`` reorders to match)."""
    name, shape, fields = "messages", "[{role, content}]", frozenset({"role", "content"})


class Texts(_ListOfStructs):
    """The Cauldron / FineVision / Docmatix: each {user, assistant} is a user and an assistant turn; the
    row's images go before the first user text (torchtune TheCauldronToMessages, HF's Idefics2 recipe)."""
    name, shape, fields = "texts", "[{user, assistant}]", frozenset({"user", "assistant"})

    @staticmethod
    def turns(value, caption_prompt: str = "", n_images: int | str = 0) -> list:
        if not isinstance(value, list) or not value:
            raise LayoutError(f"texts is {type(value).__name__ if value is not None else 'null'}, "
                              "not a non-empty list of {user, assistant}")
        out = []
        for i, pair in enumerate(value):
            if not isinstance(pair, dict):
                raise LayoutError(f"texts[{i}] is {type(pair).__name__}, not a {{user, assistant}} struct")
            user, assistant = pair.get("user"), pair.get("assistant")
            if not isinstance(user, str) or not isinstance(assistant, str):
                missing = "user" if not isinstance(user, str) else "assistant"
                raise LayoutError(f"texts[{i}] has no {missing} text")
            out += [{"from": "human", "value": (_slots(n_images) if i == 0 else "") + user},
                    {"from": "gpt", "value": assistant}]
        return out


class Questions:
    """PixMo-Docs ``questions``: struct<question: list<str>, answer: list<str>>, one pair per entry."""
    name, shape = "questions", "{question[], answer[]}"

    @staticmethod
    def detect(t: pa.DataType) -> bool:
        names = _struct_names(t)
        return {"question", "answer"} <= names and all(
            _list_value(t.field(n).type) is not None for n in ("question", "answer"))

    @staticmethod
    def turns(value, caption_prompt: str = "", n_images: int | str = 0) -> list:
        if not isinstance(value, dict):
            raise LayoutError(f"questions is {type(value).__name__}, not a struct of question / answer lists")
        qs, ans = value.get("question") or [], value.get("answer") or []
        if not qs or len(qs) != len(ans):
            raise LayoutError(f"questions holds {len(qs)} questions and {len(ans)} answers")
        out = []
        for i, (q, a) in enumerate(zip(qs, ans)):
            if not isinstance(q, str) or not isinstance(a, str):
                raise LayoutError(f"questions entry {i} has a null question or answer")
            out += [{"from": "human", "value": (_slots(n_images) if i == 0 else "") + q}, {"from": "gpt", "value": a}]
        return out


class Caption:
    """A caption: the image(s) and the optional --caption-prompt in the user turn, the caption as the answer.
    A string that holds a JSON list of turns is read as conversations (JSON-stored dialogues)."""
    name, shape = "caption", "(string)"

    @staticmethod
    def detect(t: pa.DataType) -> bool:
        return _is_string(t)

    @staticmethod
    def turns(value, caption_prompt: str = "", n_images: int | str = 0) -> list:
        if isinstance(value, str) and value.lstrip().startswith("["):
            try:
                parsed = json.loads(value)
            except ValueError:
                parsed = None
            if isinstance(parsed, list):
                return parsed
        if not isinstance(value, str):
            raise LayoutError(f"text is {type(value).__name__ if value is not None else 'null'}")
        if not caption_prompt:  # the answer alone: the placeholder rule puts the image(s) in a user turn of their own
            return [{"from": "gpt", "value": value}]
        return [{"from": "human", "value": _slots(n_images) + caption_prompt}, {"from": "gpt", "value": value}]


# Detection order for the default text column: the first column (by these names) whose type fits a layout.
LAYOUTS = {"conversations": Conversations, "messages": Messages, "texts": Texts, "questions": Questions,
           "caption": Caption}
_AUTO_TEXT = (("conversations", Conversations), ("messages", Messages), ("texts", Texts),
              ("questions", Questions), *((c, Caption) for c in CAPTION_COLUMNS))


@dataclasses.dataclass(frozen=True)
class Columns:
    """What one table's schema gives: the layout and its columns (empty image / id: none)."""
    layout: str
    text: str
    image: str = ""
    image_kind: str = ""  # "list<Image>", "Image", "binary", "list<binary>"
    id: str = ""
    video: str = ""
    video_kind: str = ""  # "list<Video>", "Video", "binary", "list<binary>", "path", "list<path>"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Columns:
        return cls(**json.loads(text))

    @property
    def describe(self) -> str:
        images = f"{self.image} {self.image_kind}" + (" (one per row, nullable)" if self.image_kind == "Image"
                                                      else "") if self.image else "no image column"
        videos = f" + {self.video} {self.video_kind}" + (" (under --image-root)" if "path" in self.video_kind
                                                         else "") if self.video else ""
        return f"{self.text} {LAYOUTS[self.layout].shape} + {images}{videos}"


def _image_kind(t: pa.DataType) -> str:
    """'list<Image>', 'Image', 'list<binary>', 'binary', or '' for a type that holds no image bytes."""
    inner = _list_value(t)
    base, prefix = (inner, "list<") if inner is not None else (t, "")
    if pa.types.is_struct(base):
        if "bytes" not in _struct_names(base):
            return ""
        b = base.field(base.get_field_index("bytes")).type
        ok = pa.types.is_binary(b) or pa.types.is_large_binary(b) or pa.types.is_null(b)
        return (prefix + "Image" + (">" if prefix else "")) if ok else ""
    if pa.types.is_binary(base) or pa.types.is_large_binary(base) or pa.types.is_null(base):
        return prefix + "binary" + (">" if prefix else "")
    return ""


def _video_kind(t: pa.DataType) -> str:
    """_image_kind's kinds (an HF Video struct {bytes, path}: 'Video'), or 'path' / 'list<path>' for file paths;
    '' for a type that holds no video."""
    kind = _image_kind(t)
    if kind:
        return kind.replace("Image", "Video")
    inner = _list_value(t)
    if _is_string(inner if inner is not None else t):
        return "list<path>" if inner is not None else "path"
    return ""


def _video_column(arrow_schema: pa.Schema, data_cfg, taken: set) -> tuple[str, str]:
    """(column, kind) of the videos, or ("", "")."""
    wanted = getattr(data_cfg, "video_column", DEFAULT_VIDEOS)
    if wanted and wanted != DEFAULT_VIDEOS:  # named: it must fit
        if wanted not in arrow_schema.names or wanted in taken:
            return "", ""
        kind = _video_kind(arrow_schema.field(wanted).type)
        if not kind:
            raise LayoutError(f"video column {wanted!r} is {arrow_schema.field(wanted).type}, not binary, "
                              "struct<bytes, path>, a path string or a list of them")
        return wanted, kind
    for column in (DEFAULT_VIDEOS, SINGLE_VIDEO) if wanted else ():
        if column in arrow_schema.names and column not in taken:
            kind = _video_kind(arrow_schema.field(column).type)
            if kind:
                return column, kind
    return "", ""


def _text_layout(arrow_schema: pa.Schema, wanted: str) -> tuple[str, str]:
    """(column, layout name) of the dialogue, or ("", why not)."""
    names = arrow_schema.names
    if wanted != DEFAULT_TEXT or wanted in names:  # an explicit column (or the default, present): its type says
        if wanted not in names:
            return "", f"no text column {wanted!r}; columns are {names}"
        t = arrow_schema.field(wanted).type
        for layout in LAYOUTS.values():
            if layout.detect(t):
                return wanted, layout.name
        return "", (f"text column {wanted!r} is {t}: not a dialogue (list<{{from, value}}>, list<{{role, content}}>, "
                    "list<{user, assistant}>, struct<question: list, answer: list>) nor a string")
    for column, layout in _AUTO_TEXT:
        if column in names and layout.detect(arrow_schema.field(column).type):
            return column, layout.name
    return "", (f"no text column {wanted!r}; columns are {names} (none is a dialogue: conversations, messages, "
                "texts, questions, or a caption / txt / text string)")


def choose(arrow_schema: pa.Schema, data_cfg) -> Columns:
    """The layout and columns of a table; raises LayoutError naming what is wrong (the file is then skipped,
    or the run refused at start when no file fits)."""
    names = arrow_schema.names
    text, layout = _text_layout(arrow_schema, data_cfg.text_column)
    if not text:
        raise LayoutError(layout)
    image, kind = "", ""
    wanted = data_cfg.image_column
    candidates = [wanted] if wanted != DEFAULT_IMAGES else [DEFAULT_IMAGES, SINGLE_IMAGE]
    for column in candidates:
        if column and column in names:
            kind = _image_kind(arrow_schema.field(column).type)
            if not kind:
                raise LayoutError(f"image column {column!r} is {arrow_schema.field(column).type}, not binary, "
                                  "struct<bytes, path> or a list of them")
            image = column
            break
    video, video_kind = _video_column(arrow_schema, data_cfg, {text, image})
    if not image and not video and wanted:
        urls = [c for c in names if c in URL_COLUMNS or c.endswith("_url") or c.endswith("_urls")]
        if urls:
            raise LayoutError(f"column {urls[0]!r} holds image URLs and there is no image column: ray_mmbatch reads "
                              "images, it does not download them. Download them first (e.g. img2dataset "
                              f"--url_col {urls[0]} --output_format webdataset) and point --data at the shards; "
                              "or --image-column '' to train the text alone")
    ident = data_cfg.id_column if data_cfg.id_column in names else ""
    return Columns(layout, text, image, kind, ident, video, video_kind)


def image_order(value, types: tuple[str, ...] = IMAGE_PARTS) -> list[int] | None:
    """For HF messages whose image parts carry an ``index``: the image indices in the order the parts appear
    (the images are attached in that order); None when no part has an index. ``types``: the part types
    counted (VIDEO_PARTS: the video indices)."""
    if not isinstance(value, list):
        return None
    order = []
    for turn in value:
        content = turn.get("content") if isinstance(turn, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") in types and part.get("index") is not None:
                order.append(part["index"])
    return order or None


def row_turns(cols: Columns, value, n_images: int | str, caption_prompt: str = ""):
    """The turns of one row's dialogue cell (raises LayoutError); ``n_images``: the number of images, or the
    row's media placeholders in order (_slots)."""
    layout = LAYOUTS[cols.layout]
    if layout in (Conversations, Messages):
        return layout.turns(value)
    return layout.turns(value, caption_prompt, n_images)
