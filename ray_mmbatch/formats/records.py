"""RAW rows shared by every format: the fixed Arrow schema, conversation normalization, safe text.

A RAW row (schema.RAW_COLUMNS) carries the conversation as a JSON string and the images
as undecoded bytes. Problems found while reading do not raise: the row keeps its id and
gets ``read_error`` = "reason: detail" so later stages count and report it. A read unit
that cannot be read at all (a corrupt file, a FIFO, a dangling link) becomes ONE row
whose id is the file's path and whose reason is schema.SKIP_UNREADABLE_FILE: the run
goes on and the report names the file.

Conversations are normalized to a list of {"from": "system"|"human"|"gpt", "value": str}:

    LLaVA / ShareGPT   [{"from": "human", "value": "<image>\\nWhat?"}, {"from": "gpt", ...}]
    HF / TRL messages  [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]
                       (an image part is an <image> placeholder, a video part a <video> one; content may be
                       a plain string)
    a JSON string of either of these

Media (schema.IMAGES) may hold videos beside images (mp4 / webm / mkv ... containers), one item per
``<image>`` / ``<video>`` placeholder, in the order of the placeholders in the human turns.
``place_media`` orders a row's media that way when it holds a video: a ``<video>`` takes the next
video, an ``<image>`` the next image, the items left over follow (so an ``<image>`` past the images
stands for the next video: LLaVA-NeXT exports write ``<image>`` for a video, and the measure stage
accepts it). A row with a video and no placeholder at all gets its placeholders at read time, where
the placeholder rule (data/text/conversations.py) would put the images: first in the first human turn,
one per item, ``<video>`` for a video. Rows of images only are left exactly as they were.

Roles are matched case-insensitively by schema.canonical_role (Human, GPT, USER work).
Values are re-encoded as UTF-8 JSON, except when one holds a lone surrogate: then the JSON
is ASCII-escaped ("\\ud800") so Arrow can store it and the measure stage reports text_encoding.
Ids and paths that are not valid text (non-UTF-8 names, lone surrogates, NUL) go through
``safe_text``: escaped, never a crash.
Pure module: pyarrow, no ray.
"""
from __future__ import annotations

import json
import re

import pyarrow as pa

from ray_mmbatch import schema

RAW_ARROW_SCHEMA = pa.schema([
    (schema.SAMPLE_ID, pa.string()), (schema.CONVERSATIONS, pa.string()),
    (schema.IMAGES, pa.list_(pa.binary())), (schema.IMAGE_REFS, pa.list_(pa.string())),
    (schema.READ_ERROR, pa.string()),
])
IMAGE_PART_TYPES = frozenset({"image", "image_url"})
VIDEO_PART_TYPES = frozenset({"video", "video_url"})
AUDIO_PART_TYPES = frozenset({"audio", "input_audio", "audio_url"})  # -> <audio>: measure refuses the sample
IMAGE, VIDEO = "image", "video"  # a media item's kind (place_media)
PLACEHOLDERS = {IMAGE: schema.IMAGE_PLACEHOLDER, VIDEO: schema.VIDEO_PLACEHOLDER}
# file name endings of video containers (WebDataset members; the bytes are told apart again by data/video.is_video)
VIDEO_EXTS = frozenset({"mp4", "m4v", "webm", "mkv", "mov", "avi"})
_SLOT = re.compile(f"{re.escape(schema.IMAGE_PLACEHOLDER)}|{re.escape(schema.VIDEO_PLACEHOLDER)}")


def safe_text(value) -> str:
    """``str(value)`` made storable: lone surrogates (and undecodable bytes of file names) become
    backslash escapes, NUL becomes "\\x00"."""
    s = value.decode("utf-8", "backslashreplace") if isinstance(value, (bytes, bytearray)) else str(value)
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        try:  # a file / member name decoded with surrogateescape: show its raw bytes, "caf\\xe9"
            s = s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:  # a lone surrogate from JSON: "\\ud800"
            s = s.encode("utf-8", "backslashreplace").decode("utf-8")
    return s.replace("\x00", "\\x00")


def raw_row(sample_id: str, conversations: str = "[]", images: list[bytes] | None = None,
            image_refs: list[str] | None = None, read_error: str = "") -> dict:
    return {schema.SAMPLE_ID: safe_text(sample_id), schema.CONVERSATIONS: conversations,
            schema.IMAGES: images or [], schema.IMAGE_REFS: [safe_text(r) for r in image_refs or []],
            schema.READ_ERROR: safe_text(read_error)}


def file_skip_row(rel: str, detail: str) -> dict:
    """The one row a read unit that cannot be read yields: its path and why (schema.SKIP_UNREADABLE_FILE)."""
    return raw_row(rel, read_error=error(schema.SKIP_UNREADABLE_FILE, f"{rel}: {detail}"))


def rows_to_table(rows: list[dict]) -> pa.Table:
    """RAW rows as an Arrow table with the fixed schema (empty image lists stay list<binary>)."""
    return pa.Table.from_pylist(rows, schema=RAW_ARROW_SCHEMA)


def error(reason: str, detail: str = "") -> str:
    """A READ_ERROR value (schema.skip_text)."""
    return schema.skip_text(reason, detail)


def sample_id(where: str, user_id=None) -> str:
    """The id scheme: ``where`` (file path relative to the dataset root + row / member key, unique by
    construction) and, when the data has its own id, "#" and that id, kept readable for reports."""
    if user_id is None or isinstance(user_id, bool) or not isinstance(user_id, (str, int)) or str(user_id) == "":
        return safe_text(where)
    return safe_text(f"{where}#{user_id}")


def _content_text(content, i: int) -> tuple[str | None, str]:
    """(text, error) of a message content: a string, or a list of {type: text|image} parts."""
    if isinstance(content, str):
        return content, ""
    if not isinstance(content, list):
        return None, f"turn {i} value is {type(content).__name__}"
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PART_TYPES:
            out.append(schema.IMAGE_PLACEHOLDER)
        elif kind in VIDEO_PART_TYPES:
            out.append(schema.VIDEO_PLACEHOLDER)
        elif kind in AUDIO_PART_TYPES:
            out.append(schema.AUDIO_PLACEHOLDER)
        elif kind == "text" and isinstance(part.get("text"), str):
            out.append(part["text"])
        else:
            return None, f"turn {i} part {k} is not a text, image, video or audio part"
    return "".join(out), ""


def conversations_to_json(value, max_chars: int = 0) -> tuple[str, str]:
    """(JSON string, read_error) for a conversation value; "[]" and a malformed_record error if invalid.

    ``max_chars`` > 0 (data.max_text_chars) cuts the text there, before anything tokenizes it: the turns
    after the cut are dropped, so the sample stays over the token budget and ``--oversize`` decides
    (truncate or skip) as for any long sample; a 50 MB cell never reaches the tokenizer whole."""
    if value is None:
        return "[]", error(schema.SKIP_MALFORMED_RECORD, "conversations missing")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return "[]", error(schema.SKIP_MALFORMED_RECORD, "conversations is str, not a list (nor JSON of one)")
    if not isinstance(value, list):
        return "[]", error(schema.SKIP_MALFORMED_RECORD, f"conversations is {type(value).__name__}, not a list")
    turns, budget = [], max_chars
    for i, turn in enumerate(value):
        if not isinstance(turn, dict):
            return "[]", error(schema.SKIP_MALFORMED_RECORD, f"turn {i} is not an object")
        role_key, text_key = ("from", "value") if "from" in turn else ("role", "content")
        role = schema.canonical_role(turn.get(role_key))
        if role is None:
            return "[]", error(schema.SKIP_MALFORMED_RECORD, f"turn {i} has role {safe_text(repr(turn.get(role_key)))}")
        text, err = _content_text(turn.get(text_key), i)
        if err:
            return "[]", error(schema.SKIP_MALFORMED_RECORD, err)
        if max_chars and budget < len(text):
            turns.append({"from": role, "value": text[:max(budget, 0)]})
            break
        budget -= len(text)
        turns.append({"from": role, "value": text})
    return _dumps(turns), ""


def _dumps(turns: list) -> str:
    out = json.dumps(turns, ensure_ascii=False)
    try:
        out.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogate: keep it, escaped, for the measure stage to report
        out = json.dumps(turns, ensure_ascii=True)
    return out


def media_slots(kinds) -> str:
    """The placeholders of media items of these kinds, in order: ``<image><image><video>``."""
    return "".join(PLACEHOLDERS[k] for k in kinds)


def media_order(texts: list[str], kinds: list[str]) -> list[int]:
    """The media items (their kinds in stored order) in the order the placeholders of ``texts`` (the human
    turns) name them: a ``<video>`` takes the next video, an ``<image>`` the next image; the items left over
    follow in stored order (so, once the images are used up, an ``<image>`` stands for the next video, as
    LLaVA-NeXT exports write it; a count mismatch is the measure stage's to report)."""
    queues = {kind: [k for k, x in enumerate(kinds) if x == kind] for kind in (IMAGE, VIDEO)}
    order: list[int] = []
    for slot in _SLOT.findall("".join(texts)):
        queue = queues[VIDEO if slot == schema.VIDEO_PLACEHOLDER else IMAGE]
        if queue:
            order.append(queue.pop(0))
    taken = set(order)
    return order + [k for k in range(len(kinds)) if k not in taken]


def place_media(conversations: str, kinds: list[str]) -> tuple[str, list[int]]:
    """(conversations JSON, order of the media) for a row whose media are of ``kinds`` (IMAGE / VIDEO, in
    stored order): the media in placeholder order (media_order); a row with a video and no placeholder at
    all gets one per item, first in the first human turn (a human turn of its own, after any system turn,
    when there is none), as the placeholder rule places images. Rows without a video: unchanged."""
    identity = list(range(len(kinds)))
    if VIDEO not in kinds:
        return conversations, identity
    try:
        turns = json.loads(conversations)
    except ValueError:
        return conversations, identity
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return conversations, identity
    human = [t.get("value") for t in turns if t.get("from") == "human" and isinstance(t.get("value"), str)]
    if any(_SLOT.search(text) for text in human):
        return conversations, media_order(human, kinds)
    slots = media_slots(kinds)
    first = next((i for i, t in enumerate(turns) if t.get("from") == "human"), None)
    if first is None:
        at = next((i for i, t in enumerate(turns) if t.get("from") != "system"), len(turns))
        turns.insert(at, {"from": "human", "value": slots})
    else:
        value = turns[first].get("value")
        turns[first] = dict(turns[first], value=slots + "\n" + (value if isinstance(value, str) else ""))
    return _dumps(turns), identity


def reorder(items: list, order: list[int]) -> list:
    return [items[k] for k in order]


def text_to_json(text, max_chars: int = 0) -> tuple[str, str]:
    """A plain text column value becomes one answer turn."""
    if not isinstance(text, str):
        return "[]", error(schema.SKIP_MALFORMED_RECORD, f"text is {type(text).__name__}")
    return conversations_to_json([{"from": "gpt", "value": text}], max_chars)
