"""WebDataset: tar shards (``.tar``, ``.tar.gz``, ``.tgz``) of ``KEY.json`` / ``KEY.txt`` + ``KEY.jpg``,
``KEY.1.png`` ... and videos ``KEY.mp4`` / ``.webm`` / ``.mkv`` / ``.mov`` / ``.avi`` (records.VIDEO_EXTS).

Read unit: one shard, streamed (``tarfile`` "r|*" over the filesystem's input stream: a
shard is never held whole, a gzip one is inflated as it goes). Members are grouped by
key; extra images ``KEY.<n>.<ext>`` follow ``KEY.<ext>`` in numeric order of n. The
record ``KEY.json`` is {"conversations" | "messages", "id"?} or {"text" | "caption"};
``KEY.txt`` is a caption. A caption (``KEY.txt``, a JSON text / caption) is a captioning sample:
the image(s) and ``--caption-prompt`` in the user turn, the caption the answer (layouts.Caption).
A video member is one media item like an image: ``<video>`` is its placeholder where an image gets
``<image>``; a sample holding a video has its media in the order of its ``<image>`` / ``<video>``
placeholders (records.place_media; a caption with no prompt gets a user turn of its placeholders).

img2dataset shards (``00000.tar`` beside ``00000.parquet`` and ``00000_stats.json``, which are
bookkeeping): ``KEY.jpg`` / ``.png`` / ``.webp``, ``KEY.txt`` the caption, ``KEY.json`` the
download metadata (url, key, status, sha256, width, original_width, exif...). Such a JSON (no
conversations / messages, download keys) is never the dialogue: the caption is ``KEY.txt``, or
the JSON's ``caption`` without one; its ``key`` is the member key already. Failed downloads are
absent from the tar, so nothing stands for them.

Checked from the tar header BEFORE a member is read: its size against
``data.max_file_bytes`` (a GNU sparse member claiming 8 GiB, a gzip bomb's 1 GiB of zeros:
file_too_large, never read), and its type: a symlink, hard link, device or FIFO member is
never followed (its sample is skipped as missing_file). A shard cut short keeps the
samples before the cut, skips the one being read (malformed_record) and ends with one
``<shard>:unreadable-tail`` row. A shard that cannot be opened (dangling link, FIFO,
no permission) is one skipped-file row. Member names that are not UTF-8 are escaped.

Id scheme: ``<shard relative to the dataset root>/<key>`` (keys that restart in every
shard stay apart; a key met again later in the same shard, not next to its first run of
members, is another sample: ``<key>~2``), plus ``#<id>`` when the JSON's id differs from the key.
Pure module: no ray.
"""
from __future__ import annotations

import json
import tarfile
import zlib

from ray_mmbatch import schema
from ray_mmbatch.formats import fs, layouts
from ray_mmbatch.formats.records import (
    IMAGE,
    VIDEO,
    VIDEO_EXTS,
    conversations_to_json,
    error,
    file_skip_row,
    media_slots,
    place_media,
    raw_row,
    reorder,
    safe_text,
    sample_id,
)

EXTS = (".tar", ".tar.gz", ".tgz")
RECORD_EXT, TEXT_EXT = "json", "txt"
METADATA_EXTS = frozenset({"cls", "cls2", "id", "index", "key", "__key__", "url"})
# img2dataset's KEY.json (downloader.py): these beside url / caption / the --save_additional_columns
DOWNLOAD_KEYS = frozenset({"key", "status", "error_message", "sha256", "original_width", "original_height", "exif"})
_TAR_ERRORS = (tarfile.TarError, OSError, EOFError, zlib.error, ValueError)


def split_member(name: str) -> tuple[str, int, str]:
    """'dir/KEY.2.png' -> ('dir/KEY', 2, 'png'); the key ends at the basename's first dot."""
    folder, _, base = name.rpartition("/")
    stem, _, suffix = base.partition(".")
    parts = suffix.split(".") if suffix else [""]
    index = int(parts[0]) if len(parts) == 2 and parts[0].isdigit() else 0
    return (f"{folder}/{stem}" if folder else stem), index, parts[-1].lower()


def list_units(files: list[str], root: str, data_cfg) -> list[dict]:
    return [{"path": f, "rel": fs.relative(f, root), "error": ""} for f in files]


def _member_kind(m: tarfile.TarInfo) -> str:
    return ("symlink" if m.issym() else "hard link" if m.islnk() else "device" if m.isdev()
            else "FIFO" if m.isfifo() else "non-regular member")


def scan(stream, rel: str, max_bytes: int, read: bool = True, mode: str = "r|*") -> tuple[dict, dict, str]:
    """Stream a tar: ({key: [(index, ext, name, bytes)]}, {key: read_error}, tail error or "").
    ``read=False`` with a seekable file and mode "r:*" reads the headers only (seeks over the data)."""
    groups: dict[str, list] = {}
    problems: dict[str, str] = {}
    current, tail, last, seen = None, "", None, {}
    try:
        with tarfile.open(fileobj=stream, mode=mode) as archive:
            for member in archive:
                if member.isdir():
                    continue
                name = safe_text(member.name)
                if name.rpartition("/")[2].startswith("."):  # hidden (macOS ._*): not data
                    continue
                key, index, ext = split_member(name)
                if key != last:  # a sample's members are consecutive; a key met again later is another
                    seen[key] = seen.get(key, 0) + 1  # sample (concatenated writers): "KEY~2", "KEY~3"
                    last = key
                key = key if seen[key] == 1 else f"{key}~{seen[key]}"
                members = groups.setdefault(key, [])
                if not member.isfile():
                    problems.setdefault(key, error(schema.SKIP_MISSING_FILE,
                                                   f"{name} is a {_member_kind(member)}, not a regular file"))
                    continue
                if max_bytes and member.size > max_bytes:
                    problems.setdefault(key, error(schema.SKIP_FILE_TOO_LARGE, f"{name}: {member.size:,} bytes "
                                                   f"(tar header) > data.max_file_bytes={max_bytes:,}"))
                    continue
                current = key
                data = archive.extractfile(member).read() if read else b""
                current = None
                members.append((index, ext, name, data))
    except _TAR_ERRORS as exc:
        if current is not None:
            problems.setdefault(current, error(schema.SKIP_MALFORMED_RECORD, f"cut off in tar {rel}: {exc}"))
        tail = error(schema.SKIP_MALFORMED_RECORD, f"tar {rel}: {exc}")
    return groups, problems, tail


def is_download_metadata(rec: dict) -> bool:
    """An img2dataset KEY.json: no dialogue, and its download bookkeeping (url with status / key / sha256...)."""
    return "conversations" not in rec and "messages" not in rec and \
        len(DOWNLOAD_KEYS.intersection(rec)) + ("url" in rec) >= 2


def _caption(text, media, prompt: str, max_chars: int, where: str) -> tuple[str, str]:
    """A caption as a captioning sample (layouts.Caption: the prompt and the media asked, the caption answered);
    ``media``: the number of images, or the media items' kinds (records.IMAGE / VIDEO)."""
    try:
        turns = layouts.Caption.turns(text, prompt, media if isinstance(media, int) else media_slots(media))
    except layouts.LayoutError as exc:
        return "[]", error(schema.SKIP_MALFORMED_RECORD, f"{where}: {exc}")
    return conversations_to_json(turns, max_chars)


def _record_conversation(rec: dict, n_images, prompt: str, max_chars: int, key: str) -> tuple[str, str]:
    for field in ("conversations", "messages"):
        if field in rec:
            return conversations_to_json(rec[field], max_chars)
    return _caption(rec.get("text", rec.get("caption")), n_images, prompt, max_chars, f"{key}.json text / caption")


def _txt_caption(member, n_images, prompt: str, max_chars: int, key: str) -> tuple[str, str]:
    try:
        text = member[3].decode("utf-8")
    except UnicodeDecodeError as exc:
        return "[]", error(schema.SKIP_TEXT_ENCODING, f"{key}.txt: {exc}")
    return _caption(text, n_images, prompt, max_chars, f"{key}.txt")


def _row(rel: str, key: str, members: list, problem: str, max_chars: int, prompt: str = "") -> dict:
    where = f"{rel}/{key}"
    record = [m for m in members if m[1] == RECORD_EXT]
    text = [m for m in members if m[1] == TEXT_EXT]
    images = sorted((m for m in members if m[1] not in (RECORD_EXT, TEXT_EXT) and m[1] not in METADATA_EXTS),
                    key=lambda m: (m[0], m[1]))
    refs = [f"{rel}/{m[2]}" for m in images]
    blobs = [m[3] for m in images]
    kinds = [VIDEO if m[1] in VIDEO_EXTS else IMAGE for m in images]
    media = kinds if VIDEO in kinds else len(blobs)  # images only: as ever
    sid, conv, err = sample_id(where), "[]", ""
    if record:
        try:
            rec = json.loads(record[0][3].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            err = error(schema.SKIP_MALFORMED_RECORD, f"{key}.json: {exc}")
        else:
            if not isinstance(rec, dict):
                err = error(schema.SKIP_MALFORMED_RECORD, f"{key}.json is not an object")
            else:
                uid = rec.get("id")
                sid = sample_id(where, None if str(uid) == key else uid)
                if not is_download_metadata(rec):
                    conv, err = _record_conversation(rec, media, prompt, max_chars, key)
                elif text:
                    conv, err = _txt_caption(text[0], media, prompt, max_chars, key)
                elif isinstance(rec.get("caption"), str):
                    conv, err = _caption(rec["caption"], media, prompt, max_chars, f"{key}.json caption")
                else:
                    err = error(schema.SKIP_MALFORMED_RECORD, f"no caption: {key}.json is download metadata "
                                "(img2dataset's url / status / sha256, not a dialogue) and there is no "
                                f"{key}.txt (img2dataset writes one when given --caption_col)")
    elif text:
        conv, err = _txt_caption(text[0], media, prompt, max_chars, key)
    elif not problem:
        err = error(schema.SKIP_MALFORMED_RECORD, f"no {key}.json or {key}.txt")
    err = problem or err
    if not err:
        conv, order = place_media(conv, kinds)
        refs, blobs = reorder(refs, order), reorder(blobs, order)
    return raw_row(sid, conv, [] if err else blobs, refs, err)


def rows_of_stream(stream, rel: str, data_cfg) -> list[dict]:
    """RAW rows of one tar stream, in member order."""
    groups, problems, tail = scan(stream, rel, getattr(data_cfg, "max_file_bytes", 0))
    max_chars = getattr(data_cfg, "max_text_chars", 0)
    prompt = getattr(data_cfg, "caption_prompt", "") or ""
    rows = [_row(rel, key, members, problems.get(key, ""), max_chars, prompt) for key, members in groups.items()]
    if tail:
        rows.append(raw_row(f"{rel}:unreadable-tail", read_error=tail))
    return rows


def read_unit(unit: dict, data_cfg) -> list[dict]:
    """RAW rows of one shard (or its one skipped-file row)."""
    rel = unit["rel"]
    if unit["error"]:
        return [file_skip_row(rel, unit["error"])]
    try:
        stream = fs.open_input(unit["path"])
    except (OSError, ValueError) as exc:
        return [file_skip_row(rel, f"cannot open: {exc}")]
    with stream:
        return rows_of_stream(stream, rel, data_cfg)


def count(units: list[dict], data_cfg) -> int:
    """Rows the units yield, from the tar headers: a local file is read header by header (seeking over
    the data); an object-store shard is streamed (a gzip one is inflated either way)."""
    total = 0
    for unit in units:
        local = not fs.is_uri(unit["path"])
        try:
            stream = None if unit["error"] else \
                fs.open_random_access(unit["path"]) if local else fs.open_input(unit["path"])
        except (OSError, ValueError):
            stream = None
        if stream is None:
            total += 1
            continue
        with stream:
            groups, _, tail = scan(stream, unit["rel"], 0, read=False, mode="r:*" if local else "r|*")
        total += len(groups) + bool(tail)
    return total
